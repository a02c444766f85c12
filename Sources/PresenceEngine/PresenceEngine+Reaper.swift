import Logging
import NIOConcurrencyHelpers
import PresenceProtocol
import RedisClient

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

/// The reaper: lapsed node leases and due device deadlines, claimed in Redis so that one node
/// works each, and the devices they cover taken offline.
extension PresenceEngine {
    /// How long a claim on a piece of reaper work lasts before another node may retry it: one
    /// lease, at most 30 s. A reaper killed or cut off from Redis with claims in hand holds them
    /// no longer than the others take to find it gone, so what it claimed is done at most a lease
    /// late (with a fixed 30 s, a reaper killed between a claim and its work kept a device online
    /// 30 s past its linger, whatever the lease). A reaper still working when its claims run out
    /// has some work done twice, which the scripts allow: each checks the device's deadline, the
    /// typing state's expiry or the node's lease before it changes anything, and a claim is
    /// settled only by its holder. A node's entry claimed again carries the first claim's retry
    /// time as its lease end; no device is taken for the dead process's by that, since a process
    /// that writes devices under the node id lists it in the registry first, replacing the score.
    var claimDuration: Duration { min(configuration.leaseTTL, .seconds(30)) }

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
                _ = try await run { try await self.redis.execute(ZREM(key: key, members: [member])) }
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
    enum NodeReaping {
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
    ///
    /// On a Redis Cluster, the lease (its end, its last renewal) and each user's devices sit on
    /// different primaries, whose clocks may differ by seconds. Moments of the lease are passed to
    /// the users' scripts as how long ago they were, by the lease's own server; each script
    /// turns that into a moment of its own clock (see ``ReapNode``).
    func reapNode(_ node: String, leaseEnded: Int64? = nil, predecessor: Bool = false) async throws(PresenceError) -> NodeReaping {
        let lease = try await evaluate(LeaseLive(node: node))
        if !predecessor, let until = lease.until {
            logger.info("a node claimed as lapsed holds its lease; not reaped", metadata: ["presence.node_id": "\(node)"])
            return .live(until: until)
        }
        let leaseNow = lease.now
        // Ages are sent as of each batch, not of this check: a reap takes a while, and an age
        // taken here would put the lease's end later by that while on each user's clock, and
        // devices a restarted process wrote meanwhile would be taken as the dead one's.
        let checkedAt = clock.nowMilliseconds()
        if let probe = afterLeaseChecked.withLockedValue({ $0 }) { await probe() }
        // A predecessor's lease may still run: everything written under the node id up to now
        // is its.
        let leaseEnded = leaseEnded ?? leaseNow
        let info = try await run { try await self.redis.execute(HMGET(key: keys.nodeInfo(node), fields: ["renewed_at", "sessions"])) }
        // Without its info (lost with Redis data), the best known moment is a lease before the
        // lease's end.
        let renewed = ScriptLua.timestamp(info[0]) ?? (leaseEnded - configuration.leaseTTL.milliseconds)
        let sessions = info[1].flatMap { Int($0) } ?? 0
        var cursor = "0"
        var byUser: [String: [String]] = [:]
        repeat {
            let page = try await run { try await self.redis.execute(SSCAN(key: keys.nodeDevices(node), cursor: cursor, count: 1000)) }
            cursor = page.cursor
            for member in page.members {
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
                if let probe = afterDeadlineIndexed.withLockedValue({ $0 }) { await probe() }
            }
            let since = clock.nowMilliseconds() - checkedAt
            let calls = batch.map { user in
                ReapNode(user: user, node: node, renewedAgo: leaseNow - renewed + since, endedAgo: leaseNow - leaseEnded + since, linger: linger)
            }
            var settling: [PresenceChange] = []
            var lingeringUntil: [DeadlineEntry] = []
            for (user, result) in zip(batch, try await evaluate(calls)) {
                if case .failure(let error) = result { failure = failure ?? error }
                guard case .success(.reaped(let change, let lingering, let until)) = result else { continue }
                // Every lingering device is indexed again at its deadline: the index did not name
                // some, and a reaper may have dropped the others' entries before they lingered.
                lingeringUntil += lingering.map { deviceDeadline(of: user, device: $0, at: until) }
                if change.changed || change.shownChanged {
                    changed += 1
                    settling.append(change)
                }
            }
            await reindex(lingeringUntil)
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
    /// that one timeout does not park a whole page of them for a claim's length.
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
    /// other buckets' claims, and the users and typing states in them, for a claim's length.
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
        try await evaluate(ClaimDue(key: key, claimFor: claimDuration, limit: limit))
    }

    /// Claims up to `limit` due entries of each of several sets, in one pipeline (the buckets of a
    /// deadline set, each in its own slot); the sets with something claimed, with their claims.
    /// A set Redis refused to claim from (its primary failing over) is left for the next pass.
    func claim(_ sets: [String], limit: Int) async throws(PresenceError) -> [(key: String, claim: ClaimDue.Claim)] {
        let calls = sets.map { ClaimDue(key: $0, claimFor: claimDuration, limit: limit) }
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
