import Logging
import NIOConcurrencyHelpers
import RedisClient

/// The deadline sets a reaper goes by: a device's linger or heartbeat deadline, a typing state's
/// expiry. An entry is written in two steps around the script that gives the deadline, which
/// lives in another slot:
///
/// - before it, scored at the deadline as estimated here, less a slack: a crash after the
///   script must not leave a deadline no reaper looks at;
/// - after it, at the deadline the script wrote (``reindex(_:)``): a reaper may have looked at
///   the first entry while the script was still on its way (a stalled connection, a starved
///   process, a deadline no longer than the slack), found nothing due yet (the device still held
///   by its session, no typing state) and dropped it.
extension PresenceEngine {
    /// An entry of a deadline set.
    struct DeadlineEntry: Sendable {
        var set: String
        var member: String
        var score: Int64

        /// The entry's `ZADD` alone.
        var command: ZADD { ZADD(key: set, entries: [(score, member)]) }
    }

    /// How much earlier than a deadline's estimate its index entry is scored: the error allowed
    /// for ``estimatedStoreNow()`` (a round trip, drift since the last renewal, a primary whose
    /// clock is a little ahead of the one the lease measured).
    static let indexSlackMilliseconds: Int64 = 1000

    /// Indexes devices of `user` in their bucket of the deadline sets, before a script gives them
    /// a deadline `after` from now: scored at that deadline as estimated here, less
    /// ``indexSlackMilliseconds``, so that the reaper looks no later than the deadline (if early,
    /// it finds the device not due and scores it at its real deadline). After the script, the
    /// caller writes the entries again at the deadlines it wrote (``reindex(_:)``).
    func indexDeadline(of user: String, devices: [String], after duration: Duration) async throws(PresenceError) {
        try await indexDeadlines([(user, devices)], after: duration)
    }

    /// ``indexDeadline(of:devices:after:)`` for several users, in one pipeline.
    func indexDeadlines(_ entries: [(user: String, devices: [String])], after duration: Duration) async throws(PresenceError) {
        let score = indexScore(after: duration)
        let commands = Self.deadlineCommands(entries.flatMap { entry in
            entry.devices.map { deviceDeadline(of: entry.user, device: $0, at: score) }
        })
        guard !commands.isEmpty else { return }
        for result in try await run({ try await self.redis.pipeline(commands) }) {
            if case .failure(let error) = result { throw Self.presenceError(error) }
        }
    }

    /// The score of an index entry for a deadline `after` from now (see ``indexDeadline(of:devices:after:)``).
    func indexScore(after duration: Duration) -> Int64 {
        if let fixed = clock.scriptTime { return fixed + duration.milliseconds }
        return estimatedStoreNow() + duration.milliseconds - Self.indexSlackMilliseconds
    }

    /// The entry of a device's deadline.
    func deviceDeadline(of user: String, device: String, at deadline: Int64) -> DeadlineEntry {
        DeadlineEntry(set: keys.deadlines(ofUser: user), member: keys.deviceMember(user: user, device: device), score: deadline)
    }

    /// One `ZADD` per set, for `entries`; `onlyNew` adds none that is there already (`NX`).
    static func deadlineCommands(_ entries: [DeadlineEntry], onlyNew: Bool = false) -> [ZADD] {
        var bySet: [String: [(score: Int64, member: String)]] = [:]
        for entry in entries { bySet[entry.set, default: []].append((entry.score, entry.member)) }
        return bySet.map { ZADD(key: $0.key, entries: $0.value, onlyNew: onlyNew) }
    }

    /// Writes `entries` again after the script that gave their deadlines, at those deadlines (see
    /// the extension's comment). An entry a reaper is working on meanwhile takes the new score, so
    /// that the reaper's resolution of its claim leaves it be. What Redis does not take is kept
    /// for the next upkeep tick (``retryPendingIndexEntries()``).
    func reindex(_ entries: [DeadlineEntry]) async {
        guard !entries.isEmpty else { return }
        await writeOrKeep(Self.deadlineCommands(entries))
    }

    /// Sends `commands` in one pipeline; those Redis does not take are kept (``keepPending(_:)``).
    private func writeOrKeep(_ commands: [ZADD]) async {
        do {
            let results = try await run { try await self.redis.pipeline(commands) }
            keepPending(zip(commands, results).filter { if case .failure = $1 { true } else { false } }.map(\.0))
        } catch {
            keepPending(commands)
        }
    }

    /// Keeps the entries of `commands` for ``retryPendingIndexEntries()``.
    func keepPending(_ commands: [ZADD]) {
        guard !commands.isEmpty else { return }
        logger.warning("Redis did not take a deadline's entry; written again on the next upkeep tick", metadata: ["presence.entries": "\(commands.reduce(0) { $0 + $1.entries.count })"])
        pendingIndexEntries.withLockedValue { pending in
            for command in commands {
                for (score, member) in command.entries { pending[command.key, default: [:]][member] = score }
            }
        }
    }

    /// Writes the deadline entries Redis did not take (``reindex(_:)``); called on every upkeep
    /// tick. Only entries that are missing are added: one there by now is newer, or a reaper's.
    public func retryPendingIndexEntries() async {
        let pending = pendingIndexEntries.withLockedValue { pending in
            defer { pending = [:] }
            return pending
        }
        let entries = pending.flatMap { set, members in members.map { DeadlineEntry(set: set, member: $0.key, score: $0.value) } }
        guard !entries.isEmpty else { return }
        await writeOrKeep(Self.deadlineCommands(entries, onlyNew: true))
    }
}
