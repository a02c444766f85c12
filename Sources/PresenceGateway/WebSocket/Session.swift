import Foundation
import NIOConcurrencyHelpers
import NIOCore
import PresenceEngine
import PresenceProtocol

/// One WebSocket session: who it is, what it watches, and its connection.
///
/// Frames for the client go through ``send(_:)`` from any task, onto the connection's event
/// loop in the order they were sent; a client that does not read fast enough is closed by its
/// connection handler, without holding up anyone else.
final class Session: Sendable {
    /// Unique per connection; the device record in Redis names it. 64 random bits in 16 hex
    /// digits (see ``newID()``).
    let id: String
    let userID: String
    let deviceID: String
    /// Writes this session's frames.
    let frames: FrameCoder
    /// The connection, on its event loop.
    let connection: SessionConnection
    private let state = NIOLockedValueBox(State())
    /// What this session was sent of each conversation's messages (Session+Messages.swift).
    let messageState = NIOLockedValueBox(MessageState())

    struct State {
        /// Users whose presence this session receives, with what it was last told of each.
        var watched: [String: Presence?] = [:]
        /// The close code and reason chosen by the server, once it decided to close.
        var close: (code: CloseCode?, reason: String)?
        var status: PresenceStatus = .online
        var saidOffline = false
        /// Subscribed conversations: their members and counts.
        var conversations: [String: GroupView] = [:]
        /// User → the followed conversations they are a member of.
        var memberOf: [String: Set<String>] = [:]
        /// Users watched only for a large group's counts: no `presence_update` for them.
        var quiet: Set<String> = []
        /// Users whose presence is being read for this session: how many reads are under way,
        /// and how many events about them arrived meanwhile (a read that an event crossed may be
        /// older than what the event said). Reads overlap (a watch, a catch-up, a resync): events
        /// stay held back until the last one ends.
        var reading: [String: Reading] = [:]
        /// Re-checks of whom the session may see (after membership changes): begun and ended.
        var visibilityChecks = (begun: 0, ended: 0)

        /// Counts a conversation's members from what is known of them (on follow and membership
        /// changes only; presence changes adjust the counts in O(1)).
        mutating func recount(_ conversation: String) {
            guard var view = conversations[conversation] else { return }
            view.counts = GroupCounts(view.members.map { watched[$0]??.status ?? .offline })
            conversations[conversation] = view
        }
    }

    /// Reads of one user under way for a session, and how many events about the user were held
    /// back since the first of them began.
    struct Reading {
        var count = 0
        var events = 0
    }

    /// Where a read began: for each user, how many events had been held back by then.
    struct ReadMark: Sendable {
        fileprivate var heldBefore: [String: Int]
    }

    /// A subscribed conversation as this session knows it.
    struct GroupView {
        var members: Set<String>
        var counts = GroupCounts([])
        /// The counts last sent, so that a change that leaves them as they were sends nothing.
        var sent: GroupCounts?
    }

    /// A session's id: 16 hex digits of a random 64-bit number, enough that no two sessions of
    /// one device ever share one. Short, so that a live device's record
    /// (`status|node|session|since|deadline|alive`) stays within the 64 bytes up to which Redis
    /// keeps a hash's values in a listpack (`hash-max-listpack-value`) for node ids of up to
    /// 10 characters. With a UUID, every online user's devices hash was a hashtable: 272 bytes
    /// (`MEMORY USAGE`, one device, node id `ours-a`) against 152 as a listpack.
    static func newID() -> String {
        let hex = String(UInt64.random(in: .min ... .max), radix: 16)
        return String(repeating: "0", count: 16 - hex.count) + hex
    }

    init(userID: String, deviceID: String, frames: FrameCoder, connection: SessionConnection) {
        self.id = Self.newID()
        self.userID = userID
        self.deviceID = deviceID
        self.frames = frames
        self.connection = connection
    }

    /// Sends a frame, unless the session is closing.
    func send(_ text: String) {
        send(TextFrame(text))
    }

    /// Sends a frame, answering the client frame `id` if given.
    func send(_ frame: ServerFrame, id: String? = nil) {
        send(TextFrame(frames.bytes(frame, id: id)))
    }

    /// Sends a ready frame: one can go to every session with the same view (its buffer is
    /// copy-on-write, and nothing writes to it).
    func send(_ frame: TextFrame) {
        connection.send(frame)
        GatewayMetrics.frameSent()
    }

    /// Closes the session with `code` once the frames sent before are written; `nil` records
    /// that it is over without a close of the server's (the connection already ended).
    func close(_ code: CloseCode?, reason: String) {
        let first = state.withLockedValue { state -> Bool in
            guard state.close == nil else { return false }
            state.close = (code, reason)
            return true
        }
        if first, let code { connection.close(code.rawValue, reason: reason) }
    }

    /// The close the server asked for, if any.
    var closeRequest: (code: CloseCode?, reason: String)? { state.withLockedValue { $0.close } }

    var isClosing: Bool { closeRequest != nil }

    /// The users this session watches.
    var watched: Set<String> { state.withLockedValue { Set($0.watched.keys) } }

    var watchedCount: Int { state.withLockedValue { $0.watched.count } }

    /// The status this session was last told of a watched user (offline before any).
    func lastTold(_ user: String) -> PresenceStatus {
        state.withLockedValue { $0.watched[user]??.status ?? .offline }
    }

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

    /// What a newly known presence means for this session.
    struct Remembered {
        /// Send the client a `presence_update`.
        var tell: Bool
        /// The status changed: group counts may have moved.
        var statusChanged: Bool
    }

    /// Records the latest presence of a watched user. The client is told when the status changes,
    /// or an offline user's `last_seen` does (an online user's `last_seen` moves all the time and
    /// is not news), unless the user is watched only for a large group's counts.
    /// Marks `users` as being read: events about them are held back until the last `endRead`.
    func beginRead(_ users: [String]) -> ReadMark {
        state.withLockedValue { state in
            var held: [String: Int] = [:]
            for user in users {
                state.reading[user, default: Reading()].count += 1
                held[user] = state.reading[user]?.events
            }
            return ReadMark(heldBefore: held)
        }
    }

    /// An event about a watched user: remembered, and `frame` queued when the client must be
    /// told, in one step so that no snapshot can be queued in between. Held back (neither
    /// remembered nor told) while a read of that user is under way, since the read's answer may
    /// be older than the event.
    func rememberEvent(_ presence: Presence, frame: () -> TextFrame) -> Remembered {
        state.withLockedValue { state -> Remembered in
            // The sets consulted per event are looked up only when not empty: most sessions
            // have no read under way, no quiet member and no conversation, and each lookup
            // hashes the user id again.
            if !state.reading.isEmpty, state.reading[presence.userID] != nil {
                state.reading[presence.userID]?.events += 1
                return Remembered(tell: false, statusChanged: false)
            }
            let result = Self.remember(presence, in: &state)
            if result.tell { send(frame()) }
            return result
        }
    }

    /// Counts re-checks of whom this session may see: one begins (see
    /// ``SessionHub/refreshVisibility(_:)``), or ends.
    func visibilityCheck(ended: Bool) {
        state.withLockedValue { state in
            if ended { state.visibilityChecks.ended += 1 } else { state.visibilityChecks.begun += 1 }
        }
    }

    /// Re-checks of whom this session may see, begun and ended so far.
    var visibilityChecks: (begun: Int, ended: Int) { state.withLockedValue { $0.visibilityChecks } }

    /// How many events about `user` reads under way have held back (tests wait on it).
    func heldEvents(_ user: String) -> Int {
        state.withLockedValue { $0.reading[user]?.events ?? 0 }
    }

    /// How many users the storage for reads under way has room for (tests check that it is
    /// given back once none is).
    var readingCapacity: Int { state.withLockedValue { $0.reading.capacity } }

    /// Ends the read of `users`: remembers `snapshot` (what was read) and queues the frames
    /// `frames` makes from what each entry changed, in one step, so that no event about them can
    /// be queued before the snapshot. Returns the users an event arrived for during the read (or
    /// during an overlapping one): they must be read again, after that event. Events stay held
    /// back until the last overlapping read of a user ends. `frames` runs under the session's lock.
    /// With `answering`, the answer to a conversation subscribe (its `group_presence`, with the
    /// frame's id) is queued first.
    func endRead(
        _ users: [String], _ mark: ReadMark, snapshot: [Presence], answering: (conversation: String, id: String?)? = nil,
        frames: ([Remembered]) -> [String] = { _ in [] }
    ) -> [String] {
        state.withLockedValue { state in
            let dirty = users.filter { user in
                guard var reading = state.reading[user], let before = mark.heldBefore[user] else { return false }
                reading.count -= 1
                state.reading[user] = reading.count > 0 ? reading : nil
                return reading.events > before
            }
            // A dictionary keeps its storage when emptied: the reads of a session's opening left
            // one sized for every user it watched (some 600 bytes for ten), for good.
            if state.reading.isEmpty { state.reading = [:] }
            let remembered = snapshot.map { Self.remember($0, in: &state) }
            let answer = answering.map { Self.groupFrames([$0.conversation], id: $0.id, frames: self.frames, in: &state) } ?? []
            for frame in answer + frames(remembered) { send(frame) }
            return dirty
        }
    }

    private static func remember(_ presence: Presence, in state: inout State) -> Remembered {
        guard let index = state.watched.index(forKey: presence.userID) else { return Remembered(tell: false, statusChanged: false) }
        let entry = state.watched.values[index]
        let old = entry?.status ?? .offline
        if let known = entry, known.status == presence.status, known.status != .offline || known.lastSeen == presence.lastSeen {
            return Remembered(tell: false, statusChanged: false)
        }
        state.watched.values[index] = presence
        let changed = old != presence.status
        if changed, !state.memberOf.isEmpty {
            for conversation in state.memberOf[presence.userID] ?? [] {
                state.conversations[conversation]?.counts.count(old, -1)
                state.conversations[conversation]?.counts.count(presence.status, +1)
            }
        }
        let quiet = !state.quiet.isEmpty && state.quiet.contains(presence.userID)
        return Remembered(tell: !quiet, statusChanged: changed)
    }

    /// Starts following a conversation. Members of a large one are watched for its counts only
    /// (`quiet`): the client gets `group_presence`, not each member's updates.
    func follow(_ conversation: String, members: Set<String>, large: Bool, quiet newlyWatched: [String]) {
        state.withLockedValue { state in
            if large { state.quiet.formUnion(newlyWatched) }
            state.conversations[conversation] = GroupView(members: members)
            for member in members { state.memberOf[member, default: []].insert(conversation) }
            state.recount(conversation)
        }
    }

    /// Stops following a conversation; returns the quiet members no other followed conversation
    /// needs (to stop watching), or `nil` if it did not follow it.
    func unfollow(_ conversation: String) -> [String]? {
        state.withLockedValue { state in
            guard let view = state.conversations.removeValue(forKey: conversation) else { return nil }
            var unneeded: [String] = []
            for member in view.members {
                state.memberOf[member]?.remove(conversation)
                if state.memberOf[member]?.isEmpty == true {
                    state.memberOf[member] = nil
                    if state.quiet.remove(member) != nil { unneeded.append(member) }
                }
            }
            return unneeded
        }
    }

    /// Replaces the members of a followed conversation (after a membership change).
    func updateMembers(_ conversation: String, _ members: Set<String>, large: Bool, quiet newlyWatched: [String]) {
        state.withLockedValue { state in
            guard let old = state.conversations[conversation]?.members else { return }
            for member in old.subtracting(members) { state.memberOf[member]?.remove(conversation) }
            for member in members.subtracting(old) { state.memberOf[member, default: []].insert(conversation) }
            if large { state.quiet.formUnion(newlyWatched) }
            state.conversations[conversation]?.members = members
            state.recount(conversation)
        }
    }

    /// Users watched only for counts are no longer quiet once subscribed to explicitly.
    func unquiet(_ users: [String]) {
        state.withLockedValue { state in for user in users { state.quiet.remove(user) } }
    }

    /// Whether `user` is a member of a conversation this session follows.
    func isMemberOfFollowed(_ user: String) -> Bool { state.withLockedValue { $0.memberOf[user] != nil } }

    /// Keeps watching `users` for group counts only.
    func markQuiet(_ users: [String]) {
        state.withLockedValue { state in state.quiet.formUnion(users.filter { state.watched[$0] != nil }) }
    }

    /// Whether `user` is watched only for a large group's counts.
    func isQuiet(_ user: String) -> Bool { state.withLockedValue { $0.quiet.contains(user) } }

    var followed: [String] { state.withLockedValue { Array($0.conversations.keys) } }

    /// Sends `group_presence` for each followed conversation (those containing `user`, or all)
    /// whose counts changed since last sent; with an `id`, sends them regardless (an answer).
    func sendGroupCounts(involving user: String? = nil, id: String? = nil) {
        let texts: [String] = state.withLockedValue { state in
            guard !state.conversations.isEmpty else { return [] }
            let conversations = user.map { state.memberOf[$0].map(Array.init) ?? [] } ?? Array(state.conversations.keys)
            return Self.groupFrames(conversations, id: id, frames: frames, in: &state)
        }
        for text in texts { send(text) }
    }

    /// `group_presence` frames for the conversations whose counts changed since last sent; with
    /// an `id`, for all of them regardless (an answer).
    private static func groupFrames(_ conversations: [String], id: String?, frames: FrameCoder, in state: inout State) -> [String] {
        var texts: [String] = []
        for conversation in conversations {
            guard let view = state.conversations[conversation] else { continue }
            let counts = view.counts
            guard counts != view.sent || id != nil else { continue }
            state.conversations[conversation]?.sent = counts
            texts.append(frames.text(.groupPresence(counts.payload(conversation)), id: id))
        }
        return texts
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
