import Foundation
import NIOConcurrencyHelpers
import PresenceEngine

/// One WebSocket session: who it is, what it watches, and its bounded outbound queue.
///
/// Frames for the client go through ``send(_:)`` from any task; a client that does not read fast
/// enough fills the queue and is closed, without holding up anyone else.
final class Session: Sendable {
    /// A frame on its way to the client.
    enum Outbound: Sendable {
        case text(String)
    }

    /// Unique per connection; the device record in Redis names it.
    let id: String
    let userID: String
    let deviceID: String
    let outbound: AsyncStream<Outbound>
    private let continuation: AsyncStream<Outbound>.Continuation
    private let state = NIOLockedValueBox(State())

    struct State {
        /// Users whose presence this session receives, with what it was last told of each.
        var watched: [String: Presence?] = [:]
        /// The close code and reason chosen by the server, once it decided to close.
        var close: (code: UInt16, reason: String)?
        var status: PresenceStatus = .online
        var saidOffline = false
        /// Subscribed conversations: their members and the counts last sent.
        var conversations: [String: GroupView] = [:]
    }

    /// A subscribed conversation as this session knows it.
    struct GroupView {
        var members: Set<String>
        var sent: GroupCounts?
    }

    /// "3 of 5 online".
    struct GroupCounts: Equatable {
        var total: Int
        var online: Int
        var away: Int
    }

    init(userID: String, deviceID: String, queueLimit: Int) {
        self.id = UUID().uuidString.lowercased()
        self.userID = userID
        self.deviceID = deviceID
        (outbound, continuation) = AsyncStream.makeStream(of: Outbound.self, bufferingPolicy: .bufferingOldest(queueLimit))
    }

    /// Queues a frame; a full queue closes the session as too slow.
    func send(_ text: String) {
        if case .dropped = continuation.yield(.text(text)) {
            close(code: 1008, reason: "the client does not read fast enough")
        } else {
            GatewayMetrics.frameSent()
        }
    }

    /// Asks for the session to be closed with `code` once queued frames are written.
    func close(code: UInt16, reason: String) {
        let first = state.withLockedValue { state -> Bool in
            guard state.close == nil else { return false }
            state.close = (code, reason)
            return true
        }
        if first { continuation.finish() }
    }

    /// The close the server asked for, if any.
    var closeRequest: (code: UInt16, reason: String)? { state.withLockedValue { $0.close } }

    var isClosing: Bool { closeRequest != nil }

    /// The users this session watches.
    var watched: Set<String> { state.withLockedValue { Set($0.watched.keys) } }

    var watchedCount: Int { state.withLockedValue { $0.watched.count } }

    func isWatching(_ user: String) -> Bool { state.withLockedValue { $0.watched[user] != nil } }

    /// Adds users; returns those that were not watched yet.
    func addWatched(_ users: [String]) -> [String] {
        state.withLockedValue { state in
            users.filter { user in
                guard state.watched[user] == nil else { return false }
                state.watched[user] = .some(nil)
                return true
            }
        }
    }

    /// Removes users; returns those that were watched.
    func removeWatched(_ users: [String]) -> [String] {
        state.withLockedValue { state in users.filter { state.watched.removeValue(forKey: $0) != nil } }
    }

    /// Records what the client was told of `presence.userID`; `false` if nothing it should be
    /// told changed: the status, or `last_seen` of an offline user (an online user's `last_seen`
    /// moves all the time and is not news).
    func remember(_ presence: Presence) -> Bool {
        state.withLockedValue { state in
            guard let entry = state.watched[presence.userID] else { return false }
            if let known = entry, known.status == presence.status, known.status != .offline || known.lastSeen == presence.lastSeen {
                return false
            }
            state.watched[presence.userID] = presence
            return true
        }
    }

    /// Starts following a conversation with these members.
    func follow(_ conversation: String, members: Set<String>) {
        state.withLockedValue { $0.conversations[conversation] = GroupView(members: members, sent: nil) }
    }

    /// Stops following a conversation; `false` if it did not follow it.
    func unfollow(_ conversation: String) -> Bool {
        state.withLockedValue { $0.conversations.removeValue(forKey: conversation) != nil }
    }

    /// Replaces the members of a followed conversation.
    func updateMembers(_ conversation: String, _ members: Set<String>) {
        state.withLockedValue { $0.conversations[conversation]?.members = members }
    }

    var followed: [String] { state.withLockedValue { Array($0.conversations.keys) } }

    func follows(_ conversation: String) -> Bool { state.withLockedValue { $0.conversations[conversation] != nil } }

    /// Sends `group_presence` for each followed conversation (those containing `user`, or all)
    /// whose counts, from what this session knows of its members, changed.
    func sendGroupCounts(involving user: String? = nil, id: String? = nil) {
        let frames: [String] = state.withLockedValue { state in
            var frames: [String] = []
            for (conversation, view) in state.conversations where user == nil || view.members.contains(user!) {
                var counts = GroupCounts(total: view.members.count, online: 0, away: 0)
                for member in view.members {
                    switch state.watched[member]??.status {
                    case .online: counts.online += 1
                    case .away: counts.away += 1
                    default: break
                    }
                }
                guard counts != view.sent || id != nil else { continue }
                state.conversations[conversation]?.sent = counts
                frames.append(Wire.frame("group_presence", ["conversation_id": conversation, "total": counts.total, "online": counts.online, "away": counts.away], id: id))
            }
            return frames
        }
        for frame in frames { send(frame) }
    }

    /// The status this session's device has, and whether the client said `offline`.
    var deviceStatus: (status: PresenceStatus, saidOffline: Bool) {
        state.withLockedValue { ($0.status, $0.saidOffline) }
    }

    func setDeviceStatus(_ status: PresenceStatus) {
        state.withLockedValue { state in
            state.status = status
            state.saidOffline = status == .offline
        }
    }
}

/// A token bucket: `rate` tokens a second, holding at most `burst`.
struct TokenBucket: Sendable {
    let rate: Double
    let burst: Double
    private var tokens: Double
    private var updated: ContinuousClock.Instant

    init(rate: Double, burst: Double) {
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.updated = .now
    }

    /// Takes a token; on refusal, the seconds until one is available.
    mutating func take(now: ContinuousClock.Instant = .now) -> Int? {
        let elapsed = now - updated
        let seconds = Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18
        tokens = min(burst, tokens + seconds * rate)
        updated = now
        guard tokens >= 1 else { return max(1, Int(((1 - tokens) / rate).rounded(.up))) }
        tokens -= 1
        return nil
    }
}

/// Token buckets by key (a user id), for REST routes; old entries are dropped as it grows.
final class RateLimiter: Sendable {
    private let buckets = NIOLockedValueBox([String: TokenBucket]())
    let rate: Double

    init(rate: Double) { self.rate = rate }

    /// Takes a token for `key`; on refusal, the seconds to wait.
    func take(_ key: String) -> Int? {
        buckets.withLockedValue { buckets in
            if buckets.count > 100_000 { buckets.removeAll(keepingCapacity: true) }
            var bucket = buckets[key] ?? TokenBucket(rate: rate, burst: rate * 2)
            let wait = bucket.take()
            buckets[key] = bucket
            return wait
        }
    }
}
