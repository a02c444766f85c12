import Logging
import NIOConcurrencyHelpers

/// The `delivered` moves of one node's sessions in conversations above `PRESENCE_LARGE_GROUP`,
/// written to Redis together once a second (``PresenceEngine/flushDelivered()``): in a group of
/// thousands every message would otherwise be one cursor write per member, and Redis's work per
/// message would grow with the members, not the nodes.
///
/// A move is queued only for a conversation a direct write found large and a user it found a
/// member, in the last ``recheck``: the first move after that is written at once, and a user who
/// is not a member is refused there, as in any conversation.
struct DeliveredBatch: Sendable {
    static let recheck: Duration = .seconds(60)

    /// Large conversations, with the users a direct write found members, and when.
    private var known: [String: (members: Set<String>, since: ContinuousClock.Instant)] = [:]
    /// Each conversation's users and the highest seq each said it has, not yet written.
    private(set) var pending: [String: [String: Int64]] = [:]

    /// A direct write found `conversation` large and `member` one of its members.
    mutating func learn(_ conversation: String, member: String, at now: ContinuousClock.Instant) {
        if let entry = known[conversation], now - entry.since < Self.recheck {
            known[conversation]?.members.insert(member)
        } else {
            known[conversation] = ([member], now)
        }
    }

    /// Queues `user`'s move to `seq` when `conversation` is known large and `user` a member of
    /// it; returns whether it did (if not, the move is written at once).
    mutating func queue(_ conversation: String, user: String, seq: Int64, at now: ContinuousClock.Instant) -> Bool {
        guard let entry = known[conversation] else { return false }
        guard now - entry.since < Self.recheck else {
            known[conversation] = nil
            return false
        }
        guard entry.members.contains(user) else { return false }
        pending[conversation, default: [:]][user] = max(pending[conversation]?[user] ?? 0, seq)
        return true
    }

    /// Takes every move queued so far, and forgets the conversations not confirmed large within
    /// ``recheck`` (a quiet conversation's entry would otherwise stay for good).
    mutating func take(at now: ContinuousClock.Instant) -> [String: [String: Int64]] {
        known = known.filter { now - $0.value.since < Self.recheck }
        defer { pending = [:] }
        return pending
    }

    /// Puts back moves a write failed for; a move queued since keeps the higher seq.
    mutating func putBack(_ conversation: String, _ moves: [String: Int64]) {
        pending[conversation, default: [:]].merge(moves) { max($0, $1) }
    }
}

extension PresenceEngine {
    /// How often a node writes its sessions' `delivered` moves in large conversations.
    public static let deliveredFlushInterval: Duration = .seconds(1)

    /// A session's `delivered`: in a conversation above `PRESENCE_LARGE_GROUP` that this node
    /// knows as such, queued for the next ``flushDelivered()`` (within
    /// ``deliveredFlushInterval``); otherwise written at once, with its receipt.
    public func markDelivered(_ seq: Int64, of user: String, in conversation: String) async throws(PresenceError) {
        guard SeqBounds.range.contains(seq) else { throw PresenceError(.invalidRequest, "seq must be \(SeqBounds.rule)") }
        if deliveredBatch.withLockedValue({ $0.queue(conversation, user: user, seq: seq, at: .now) }) { return }
        _ = try await moveCursor(.delivered, of: user, in: conversation, to: seq)
    }

    /// Writes every queued `delivered` move: one script per conversation, whatever the number of
    /// members. A write that fails is queued again for the next flush. Returns how many cursors
    /// moved.
    @discardableResult
    public func flushDelivered() async -> Int {
        let pending = deliveredBatch.withLockedValue { $0.take(at: .now) }
        guard !pending.isEmpty else { return 0 }
        let conversations = Array(pending.keys)
        let calls = conversations.map { conversation in
            MoveDeliveredTogether(conversation: conversation, moves: (pending[conversation] ?? [:]).map { ($0.key, $0.value) })
        }
        var moved = 0
        do {
            for (conversation, result) in zip(conversations, try await evaluate(calls)) {
                switch result {
                case .success(let count): moved += count
                case .failure: deliveredBatch.withLockedValue { $0.putBack(conversation, pending[conversation] ?? [:]) }
                }
            }
        } catch {
            deliveredBatch.withLockedValue { batch in
                for (conversation, moves) in pending { batch.putBack(conversation, moves) }
            }
            logger.warning("cannot write the delivered cursors of large conversations; trying again", metadata: ["error": "\(error)"])
        }
        return moved
    }
}
