import Logging
import NIOConcurrencyHelpers
import PresenceProtocol
import RedisClient

/// A gateway node as the registry knows it.
public struct NodeRecord: Sendable, Equatable, Codable {
    /// The node id.
    public var nodeID: String
    /// Live sessions it reported at its last renewal.
    public var sessions: Int
    /// When its lease runs out unless renewed (ms).
    public var leaseExpiresAt: Int64
    /// Its last renewal (ms), if known.
    public var renewedAt: Int64?
    /// Whether the lease has run out (the node is dead but not reaped yet).
    public var lapsed: Bool
    /// The pub/sub it publishes with, as its renewals record it; nil from a node of a version
    /// that records none.
    public var pubSub: RedisPubSub?
}

/// Live nodes publish with another pub/sub than this one: they would not hear each other's
/// events.
public struct PubSubMismatch: Error, CustomStringConvertible {
    /// This node's pub/sub.
    public var own: RedisPubSub
    /// The live nodes that differ, with theirs.
    public var others: [String: RedisPubSub]

    public var description: String {
        let nodes = others.sorted { $0.key < $1.key }.map { "\($0.key) (\($0.value.rawValue))" }.joined(separator: ", ")
        return "live nodes use another pub/sub than this node's \(own.rawValue): \(nodes); they would not hear each other's events. Give every node the same PRESENCE_REDIS_PUBSUB, and stop the others before changing it"
    }
}

/// What one pass of the reaper did.
public struct ReapReport: Sendable, Equatable {
    /// Dead nodes whose devices were taken offline.
    public var nodes: [String] = []
    /// Devices whose linger or heartbeat deadline passed and which were taken offline.
    public var expiredDevices = 0
    /// Users whose aggregate changed.
    public var changedUsers = 0
    /// Typing states that expired.
    public var typingEnded = 0
}

extension PresenceEngine {
    /// How long a claim on a piece of reaper work lasts before another node may retry it.
    static let claimMilliseconds: Int64 = 30_000

    /// Registers this node: lease, registry entry and info, as after a start or a lost lease.
    public func registerNode() async throws(PresenceError) {
        _ = try await leaseScript(register: true)
        registered.withLockedValue { $0 = true }
    }

    /// Runs the lease script; returns whether the lease was renewed (or taken, with
    /// `register`), not found gone. An index holding fewer devices than this node's sessions
    /// asks for an audit: Redis lost part of it, and a node that died now could not be reaped.
    ///
    /// The registry follows the lease: before a lease is taken, the node is listed at the
    /// estimated end (a process that dies right after taking it is still found); after each
    /// renewal, at the end the script set.
    private func leaseScript(register: Bool) async throws(PresenceError) -> Bool {
        let sessions = localDeviceCount
        let node = configuration.nodeID
        do {
            if register { try await list(node, until: indexScore(after: configuration.leaseTTL)) }
            let sent = clock.nowMilliseconds()
            let sentAt = ContinuousClock.now
            let outcome = try await evaluate(RenewLease(node: node, register: register, sessions: sessions))
            guard case .renewed(let storeNow, let ends, let indexed) = outcome else { return false }
            leaseHeldUntil.withLockedValue { $0 = max($0 ?? sentAt, sentAt + configuration.leaseTTL) }
            let local = (sent + clock.nowMilliseconds()) / 2
            storeClockOffset.withLockedValue { $0 = storeNow - local }
            do {
                try await list(node, until: ends)
            } catch {
                // The lease is renewed; the registry (on another primary of a cluster) keeps the
                // earlier end, where a reaper finds the node alive and moves it on.
                logger.warning("renewed the lease but cannot move the node's registry entry", metadata: ["presence.node_id": "\(node)", "error": "\(error)"])
            }
            if indexed < sessions { requestAudit() }
            return true
        } catch where error.code == .unavailable {
            noteRedisFailure()
            throw error
        }
    }

    /// Whether what Redis says of this node's own sessions is current: the node holds its lease
    /// (renewed less than a lease ago) and has written every session again since it last found
    /// the lease gone. Otherwise reapers may have taken its users offline, and a read would
    /// answer "offline" for a user connected here.
    public var holdsCurrentState: Bool {
        guard registered.withLockedValue({ $0 }), !restoreOwed,
              let until = leaseHeldUntil.withLockedValue({ $0 }) else { return false }
        return ContinuousClock.now < until
    }

    /// Waits until this process has taken its lease, at most `timeout`; returns whether it has.
    /// A session is written only after that: until then, what an earlier process under this node
    /// id left may still be reaped as its predecessor's.
    public func waitUntilRegistered(timeout: Duration) async -> Bool {
        let deadline = ContinuousClock.now + timeout
        while !registered.withLockedValue({ $0 }) {
            guard ContinuousClock.now < deadline, (try? await Task.sleep(for: .milliseconds(10))) != nil else { return false }
        }
        return true
    }

    /// Before this process first registers: the devices an earlier process under the same node
    /// id left behind linger, as after a drop, and go offline unless their clients reconnect
    /// within the linger (they are reconnecting just now, to this node or another). That process
    /// was killed and this one started before its lease ran out, so no reaper would ever take
    /// them. This process writes no device before it has registered, so every device of this
    /// node id is the earlier one's. Returns how many users' aggregates changed.
    @discardableResult
    public func reapPredecessor() async throws(PresenceError) -> Int {
        let node = configuration.nodeID
        let listed = try await run { try await self.redis.send("ZSCORE", RedisArgument(keys.nodes), RedisArgument(node)) }
        guard !listed.isNull else { return 0 }
        guard case .reaped(let changed) = try await reapNode(node, leaseEnded: try await storeNow(), predecessor: true) else { return 0 }
        return changed
    }

    /// Lists `node` in the registry, to be looked at by a reaper at `until` (with the registry's
    /// safety TTL).
    private func list(_ node: String, until: Int64) async throws(PresenceError) {
        let keep = RedisArgument(Int(configuration.deviceKeyTTL.milliseconds))
        let results = try await run {
            try await self.redis.pipeline([
                ["ZADD", RedisArgument(keys.nodes), RedisArgument(Int(until)), RedisArgument(node)],
                ["PEXPIRE", RedisArgument(keys.nodes), keep],
            ])
        }
        if case .failure(let error) = results[0] { throw Self.presenceError(error) }
    }

    /// Renews the lease. Returns `false` when the lease was gone: the node was reaped or Redis
    /// lost its data, and the caller must ``reregister()``.
    public func renewLease() async throws(PresenceError) -> Bool {
        guard try await leaseScript(register: false) else { return false }
        // The node's other keys follow the lease; their safety TTL is refreshed at the same time.
        // The deadline sets every node shares are kept by whichever node's turn comes first, an
        // eighth of their TTL after the last time this node did it.
        let node = configuration.nodeID
        let keep = RedisArgument(Int(configuration.deviceKeyTTL.milliseconds))
        var sets = [keys.nodeDevices(node)]
        let now = ContinuousClock.now
        let shared = sharedKeysKept.withLockedValue { last in
            guard last.map({ now - $0 >= configuration.deviceKeyTTL / 8 }) ?? true else { return false }
            last = now
            return true
        }
        if shared { sets += keys.allDeadlines + keys.allTypingDeadlines }
        _ = try await run { try await self.redis.pipeline(sets.map { ["PEXPIRE", RedisArgument($0), keep] }) }
        return true
    }

    /// Refreshes the safety TTL of the devices hash of every user this node holds a device of.
    public func refreshDeviceKeys() async throws(PresenceError) {
        let users = Set(local.withLockedValue { $0.values.map(\.user) })
        let ttl = deviceTTLArgument
        let commands = users.map { ["PEXPIRE", RedisArgument(keys.devices($0)), ttl] as [RedisArgument] }
        for start in stride(from: 0, to: commands.count, by: 1000) {
            _ = try await run { try await self.redis.pipeline(Array(commands[start..<min(start + 1000, commands.count)])) }
        }
    }

    /// Gives up the lease on a graceful shutdown. Devices whose sessions closed are lingering
    /// already. A device a session still holds (the drain gave up on it: its close is still queued,
    /// or its client never answered) is made to linger first, as after a drop: reaped with the
    /// node, it would go offline at once, without the linger its client has to reconnect
    /// elsewhere. The node stays in the registry as lapsed, so that a reaper takes offline any
    /// device whose linger Redis did not take.
    public func deregisterNode() async throws(PresenceError) {
        let held = local.withLockedValue { Array($0.values) }
        for device in held {
            do {
                try await disconnect(user: device.user, device: device.device, session: device.session, clean: false)
            } catch where error.code == .unavailable {
                break
            } catch {
                logger.warning("cannot let a device linger before giving up the lease", metadata: ["presence.user_id": "\(device.user)", "error": "\(error)"])
            }
        }
        let released = try await evaluate(ReleaseLease(node: configuration.nodeID))
        try await list(configuration.nodeID, until: released)
    }

    /// How many devices this node's sessions hold.
    public var localDeviceCount: Int {
        local.withLockedValue { $0.count }
    }

    /// The registered nodes, live and lapsed-but-not-reaped.
    public func nodes() async throws(PresenceError) -> [NodeRecord] {
        let now = try await storeNow()
        let reply = try await run { try await self.redis.send("ZRANGE", RedisArgument(keys.nodes), "0", "-1", "WITHSCORES") }
        let values = reply.array ?? []
        var pairs: [(String, Int64)] = []
        for index in stride(from: 0, to: values.count - 1, by: 2) {
            if let node = values[index].string, let score = values[index + 1].double { pairs.append((node, Int64(score))) }
        }
        let commands: [[RedisArgument]] = pairs.flatMap { pair -> [[RedisArgument]] in
            [["HMGET", RedisArgument(keys.nodeInfo(pair.0)), "sessions", "renewed_at", "pubsub"], ["EXISTS", RedisArgument(keys.lease(pair.0))]]
        }
        let replies = try await run { try await self.redis.pipeline(commands) }
        return pairs.enumerated().map { index, pair in
            let fields = (try? replies[2 * index].get())?.array ?? []
            let leaseExists = (try? replies[2 * index + 1].get())?.int == 1
            let renewed = fields.count == 3 ? ScriptLua.timestamp(fields[1]) : nil
            // A node being reaped has its registry score moved forward by the claim, but its
            // lease key has expired: it is lapsed either way.
            return NodeRecord(
                nodeID: pair.0,
                sessions: fields.first?.int ?? 0,
                leaseExpiresAt: leaseExists ? pair.1 : min(pair.1, (renewed ?? now) + configuration.leaseTTL.milliseconds),
                renewedAt: renewed,
                lapsed: !leaseExists,
                pubSub: fields.count == 3 ? fields[2].string.flatMap(RedisPubSub.init(rawValue:)) : nil
            )
        }
    }

    /// The pub/sub of every live node but this one, as its lease renewals record it. Nodes that
    /// publish differently do not hear each other: a classic subscriber gets no `SPUBLISH`, a
    /// sharded one no `PUBLISH`.
    public func otherNodesPubSub() async throws(PresenceError) -> [String: RedisPubSub] {
        let live = try await nodes().filter { !$0.lapsed && $0.nodeID != configuration.nodeID }
        // A node of a version that records none used sharded pub/sub on a cluster, classic elsewhere.
        let unrecorded: RedisPubSub = redis is RedisClusterClient ? .sharded : .classic
        return Dictionary(uniqueKeysWithValues: live.map { ($0.nodeID, $0.pubSub ?? unrecorded) })
    }

    /// Throws ``PubSubMismatch`` when a live node publishes differently from this one.
    public func checkPubSubAgreement() async throws {
        let others = try await otherNodesPubSub().filter { $0.value != redis.pubSub }
        guard others.isEmpty else { throw PubSubMismatch(own: redis.pubSub, others: others) }
    }

    /// Whether lapsed leases say nothing now: within the recovery grace after this node failed
    /// for want of Redis, or heard the cluster refuse commands.
    func isRecovering() -> Bool {
        let now = clock.nowMilliseconds()
        return lastRedisFailure.withLockedValue { $0 }.map { now - $0 < configuration.recoveryGrace.milliseconds } ?? false
    }

    /// One pass of the reaper: claims lapsed node leases and due device deadlines and takes those
    /// devices offline, with `last_seen` the last moment each was known alive.
    public func reapOnce(limit: Int = 500) async throws(PresenceError) -> ReapReport {
        var report = ReapReport()
        // Just after Redis was unreachable, a lapsed lease says nothing: live nodes could not
        // renew either. They get the grace to come back before anyone is reaped. (A local
        // timer: this node's clock measures only its own waiting.)
        if !isRecovering() {
            let nodes = try await claim(keys.nodes, limit: 16)
            try await forEachClaimed(keys.nodes, nodes) { node, leaseEnded throws(PresenceError) in
                // This node is alive: a lapsed lease of its own is registered again by its
                // renewal (its upkeep may be stuck behind commands to a shard that stopped
                // answering, never failing a renewal, while its lease ran out).
                guard node != configuration.nodeID else {
                    _ = try await evaluate(ResolveClaim(key: keys.nodes, member: node, score: nodes.retry, next: Int64(leaseEnded)))
                    return
                }
                switch try await reapNode(node, leaseEnded: Int64(leaseEnded)) {
                case .reaped(let changed):
                    report.changedUsers += changed
                    report.nodes.append(node)
                    _ = try await evaluate(ResolveClaim(key: keys.nodes, member: node, score: nodes.retry))
                case .live(let until):
                    _ = try await evaluate(ResolveClaim(key: keys.nodes, member: node, score: nodes.retry, next: until))
                }
            }
        }
        try await forEachClaimed(try await claim(keys.allDeadlines, limit: limit)) { key, due, member throws(PresenceError) in
            guard let (user, device) = keys.splitDeviceMember(member) else {
                _ = try await run { try await self.redis.send("ZREM", RedisArgument(key), RedisArgument(member)) }
                return
            }
            var next: Int64?
            switch try await evaluate(RemoveDevice(user: user, device: device, mode: .expire)) {
            case .removed(let change):
                report.expiredDevices += 1
                if change.changed || change.shownChanged { report.changedUsers += 1 }
                await settle(change)
            case .live(let deadline):
                // Not due yet (the index was early, or the device was written again): looked
                // at again at its deadline. Held by a session: no deadline, out of the index.
                next = deadline
            case .heldByAnother, .staleStatus:
                break
            }
            _ = try await evaluate(ResolveClaim(key: key, member: member, score: due.retry, next: next))
        }
        report.typingEnded = try await reapTyping(limit: limit)
        if !report.nodes.isEmpty || report.expiredDevices > 0 {
            logger.info("reaped", metadata: ["presence.nodes": "\(report.nodes)", "presence.devices": "\(report.expiredDevices)"])
        }
        return report
    }

    /// What a reaper found of a node it claimed.
    private enum NodeReaping {
        /// Its devices were taken offline; this many users' aggregates changed.
        case reaped(changedUsers: Int)
        /// It holds its lease (again: a restarted process took it back), until then.
        case live(until: Int64)
    }

    /// Takes offline every device a dead node held (see ``NodeReaping``).
    ///
    /// - Important: A node id may be reused by the next process (fixed ids in a compose file or
    ///   a local cluster). Devices written after `leaseEnded` are that process's and are kept, and
    ///   its lease and index are never deleted.
    ///   With `predecessor`, this process reaps what the previous one under its own id left:
    ///   the lease is not checked and the index is kept (this process may have added to it).
    /// - Throws: when Redis refused to reap some user (after the others are reaped): the node
    ///   stays registered, and the whole of it is reaped again after the claim.
    private func reapNode(_ node: String, leaseEnded: Int64, predecessor: Bool = false) async throws(PresenceError) -> NodeReaping {
        if !predecessor, case .live(let until) = try await evaluate(LeaseLive(node: node)) {
            logger.info("a node claimed as lapsed holds its lease; not reaped", metadata: ["presence.node_id": "\(node)"])
            return .live(until: until)
        }
        let info = try await run { try await self.redis.send("HMGET", RedisArgument(keys.nodeInfo(node)), "renewed_at", "sessions") }.array ?? []
        // Without its info (lost with Redis data), the best known moment is a lease before the
        // lease's end.
        let renewed = info.first.flatMap(ScriptLua.timestamp) ?? (leaseEnded - configuration.leaseTTL.milliseconds)
        let sessions = info.count == 2 ? info[1].int ?? 0 : 0
        var cursor = "0"
        var byUser: [String: [String]] = [:]
        repeat {
            let page = try await run { try await self.redis.send("SSCAN", RedisArgument(keys.nodeDevices(node)), RedisArgument(cursor), "COUNT", "1000") }
            guard let parts = page.array, parts.count == 2, let next = parts[0].string else { break }
            cursor = next
            for member in parts[1].strings {
                if let (user, device) = keys.splitDeviceMember(member) { byUser[user, default: []].append(device) }
            }
        } while cursor != "0"
        // An index smaller than the sessions the node last reported lost entries (a partial data
        // loss its audit had not repaired yet): every user's devices are looked at, or devices of
        // the dead node could stay live for good. Rare, and a scan of every user.
        if byUser.values.reduce(0, { $0 + $1.count }) < sessions {
            logger.warning("a dead node's device index is short of its sessions; scanning every user", metadata: ["presence.node_id": "\(node)"])
            for user in try await allDeviceHolders() { byUser[user, default: []] += [] }
        }
        var changed = 0
        // A user Redis refused to reap keeps the node registered, so that it is reaped again.
        var failure: PresenceError?
        let users = Array(byUser.keys)
        let linger = predecessor ? configuration.linger : .zero
        for start in stride(from: 0, to: users.count, by: 200) {
            let batch = users[start..<min(start + 200, users.count)]
            if linger > .zero {
                try await indexDeadlines(batch.map { ($0, byUser[$0] ?? []) }, after: linger)
            }
            let calls = batch.map { user in
                ReapNode(user: user, node: node, renewed: renewed, leaseEnded: leaseEnded, linger: linger)
            }
            var settling: [PresenceChange] = []
            for (user, result) in zip(batch, try await evaluate(calls)) {
                if case .failure(let error) = result { failure = failure ?? error }
                guard case .success(.reaped(let change, let lingering, let until)) = result else { continue }
                // Devices the index did not name linger too: indexed now, at their deadline.
                let unindexed = lingering.filter { !(byUser[user] ?? []).contains($0) }
                if !unindexed.isEmpty {
                    let members = unindexed.flatMap { [RedisArgument(Int(until)), RedisArgument(keys.deviceMember(user: user, device: $0))] }
                    try await run { try await self.redis.send([RedisArgument("ZADD"), RedisArgument(self.keys.deadlines(ofUser: user))] + members) }
                }
                if change.changed || change.shownChanged {
                    changed += 1
                    settling.append(change)
                }
            }
            await settle(settling)
        }
        if let failure { throw failure }
        if !predecessor {
            _ = try await evaluate(DropNode(node: node))
        }
        logger.info("reaped a dead node", metadata: ["presence.node_id": "\(node)", "presence.users": "\(byUser.count)", "presence.last_renewal": "\(renewed)"])
        return .reaped(changedUsers: changed)
    }

    /// Every user with a devices hash, by a SCAN of the key space (every primary of a cluster).
    private func allDeviceHolders() async throws(PresenceError) -> Set<String> {
        let found = try await run { try await self.redis.allKeys(matching: self.keys.allDevicesPattern) }
        return Set(found.compactMap { keys.user(fromKey: $0, suffix: "devices") })
    }

    /// Runs `body` on each claimed entry. An entry whose work Redis refuses (a script error) stays
    /// claimed, so that it is retried only after the claim and does not hold up the rest; when
    /// Redis cannot be reached, the entries not done yet are given back at once (best effort), so
    /// that one timeout does not park a whole page of them for a claim's 30 s.
    func forEachClaimed(_ key: String, _ claim: ClaimDue.Claim, _ body: (String, Double) async throws(PresenceError) -> Void) async throws(PresenceError) {
        for (index, (member, score)) in claim.entries.enumerated() {
            do {
                try await body(member, score)
            } catch where error.code == .unavailable {
                _ = try? await evaluate(Unclaim(key: key, retry: claim.retry, entries: Array(claim.entries[index...])))
                throw error
            } catch {
                logger.warning("reaper work refused; retried after the claim", metadata: ["presence.key": "\(key)", "presence.member": "\(member)", "error": "\(error)"])
            }
        }
    }

    /// Runs `body` on each claimed entry of each set in turn (see the one-set form). When Redis
    /// cannot be reached, the entries not done yet are given back: the rest of the set it happened
    /// in and every set after it. Given back only in the set at hand, one timeout parked the
    /// other buckets' claims, and the users and typing states in them, for a claim's 30 s.
    func forEachClaimed(
        _ claimed: [(key: String, claim: ClaimDue.Claim)],
        _ body: (_ key: String, _ claim: ClaimDue.Claim, _ member: String) async throws(PresenceError) -> Void
    ) async throws(PresenceError) {
        for (index, (key, due)) in claimed.enumerated() {
            do {
                try await forEachClaimed(key, due) { member, _ throws(PresenceError) in try await body(key, due, member) }
            } catch where error.code == .unavailable {
                let later = claimed[(index + 1)...].map { Unclaim(key: $0.key, retry: $0.claim.retry, entries: $0.claim.entries) }
                _ = try? await evaluate(later)
                throw error
            }
        }
    }

    /// Claims up to `limit` due entries of a deadline sorted set (see ``ClaimDue``).
    func claim(_ key: String, limit: Int) async throws(PresenceError) -> ClaimDue.Claim {
        try await evaluate(ClaimDue(key: key, claimFor: .milliseconds(Self.claimMilliseconds), limit: limit))
    }

    /// Claims up to `limit` due entries of each of several sets, in one pipeline (the buckets of a
    /// deadline set, each in its own slot); the sets with something claimed, with their claims.
    /// A set Redis refused to claim from (its primary failing over) is left for the next pass.
    func claim(_ sets: [String], limit: Int) async throws(PresenceError) -> [(key: String, claim: ClaimDue.Claim)] {
        let calls = sets.map { ClaimDue(key: $0, claimFor: .milliseconds(Self.claimMilliseconds), limit: limit) }
        var claimed: [(key: String, claim: ClaimDue.Claim)] = []
        var failure: PresenceError?
        for (key, result) in zip(sets, try await evaluate(calls)) {
            switch result {
            case .success(let claim) where !claim.entries.isEmpty: claimed.append((key, claim))
            case .success: break
            case .failure(let error): failure = error
            }
        }
        if let failure {
            if claimed.isEmpty { throw failure }
            logger.warning("cannot claim from a deadline set; it is tried again on the next pass", metadata: ["error": "\(failure)"])
        }
        return claimed
    }
}
