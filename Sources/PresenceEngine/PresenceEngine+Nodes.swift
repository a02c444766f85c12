import Logging
import NIOConcurrencyHelpers
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
        let node = configuration.nodeID
        let now = clock.nowMilliseconds()
        let lease = configuration.leaseTTL.milliseconds
        let keep = RedisArgument(Int(configuration.deviceKeyTTL.milliseconds))
        let results = try await run {
            try await self.redis.pipeline([
                ["SET", RedisArgument(keys.lease(node)), RedisArgument(Int(now + lease)), "PX", RedisArgument(Int(lease))],
                ["ZADD", RedisArgument(keys.nodes), RedisArgument(Int(now + lease)), RedisArgument(node)],
                ["HSET", RedisArgument(keys.nodeInfo(node)), "renewed_at", RedisArgument(Int(now)), "sessions", RedisArgument(localDeviceCount)],
                ["PEXPIRE", RedisArgument(keys.nodeInfo(node)), keep],
                ["PEXPIRE", RedisArgument(keys.nodes), keep],
            ])
        }
        for result in results {
            if case .failure(let error) = result { throw Self.presenceError(error) }
        }
    }

    /// Before this process first registers: takes offline the devices an earlier process under
    /// the same node id left behind. That process was killed and this one started before its
    /// lease ran out, so no reaper would ever take them. Devices this process has written
    /// already are newer than its start and stay. Returns how many users' aggregates changed.
    @discardableResult
    public func reapPredecessor() async throws(PresenceError) -> Int {
        let node = configuration.nodeID
        let listed = try await run { try await self.redis.send("ZSCORE", RedisArgument(keys.nodes), RedisArgument(node)) }
        guard !listed.isNull else { return 0 }
        return try await reapNode(node, now: clock.nowMilliseconds(), leaseEnded: startedAt - 1, predecessor: true) ?? 0
    }

    /// Renews the lease. Returns `false` when the lease was gone: the node was reaped or Redis
    /// lost its data, and the caller must ``reregister()``.
    public func renewLease() async throws(PresenceError) -> Bool {
        let node = configuration.nodeID
        let now = clock.nowMilliseconds()
        let keep = RedisArgument(Int(configuration.deviceKeyTTL.milliseconds))
        let renewed = try await run {
            try await self.redis.evaluate(
                PresenceScripts.renewLease,
                keys: [keys.lease(node), keys.nodes],
                arguments: [RedisArgument(Int(now)), RedisArgument(Int(configuration.leaseTTL.milliseconds)), RedisArgument(node)]
            )
        }
        guard renewed.int == 1 else { return false }
        // The node's other keys follow the lease; their safety TTL is refreshed at the same time.
        _ = try await run {
            try await self.redis.pipeline([
                ["HSET", RedisArgument(keys.nodeInfo(node)), "renewed_at", RedisArgument(Int(now)), "sessions", RedisArgument(localDeviceCount)],
                ["PEXPIRE", RedisArgument(keys.nodeInfo(node)), keep],
                ["PEXPIRE", RedisArgument(keys.nodeDevices(node)), keep],
                ["PEXPIRE", RedisArgument(keys.nodes), keep],
                ["PEXPIRE", RedisArgument(keys.deadlines), keep],
                ["PEXPIRE", RedisArgument(keys.typingDeadlines), keep],
            ])
        }
        return true
    }

    /// Registers the node and every device its live sessions hold again, with their statuses.
    /// Watchers get events for every aggregate this brings back.
    @discardableResult
    public func reregister() async throws(PresenceError) -> Int {
        try await registerNode()
        let devices = local.withLockedValue { Array($0) }
        for (member, device) in devices {
            // A session that closed meanwhile is no longer in `local`, and is skipped. The status
            // written is the one the session holds as it is written, not the one listed above:
            // a `status` frame may have changed it since.
            try await writeCurrentStatus(member, session: device.session) { user, device, session, status throws(PresenceError) in
                _ = try await self.register(user: user, device: device, session: session, status: status)
            }
            // The session may have closed while this ran: its close must win.
            let closedMeanwhile = local.withLockedValue { $0[member]?.session != device.session }
            if closedMeanwhile {
                _ = try? await disconnect(user: device.user, device: device.device, session: device.session, clean: false)
            }
        }
        logger.info("re-registered this node's sessions", metadata: ["presence.node_id": "\(configuration.nodeID)", "presence.devices": "\(devices.count)"])
        return devices.count
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

    /// Gives up the lease on a graceful shutdown. The node stays in the registry as lapsed, so
    /// that a reaper takes offline any device a session still held (one whose close Redis did not
    /// take); devices whose sessions closed are lingering already and do not depend on it.
    public func deregisterNode() async throws(PresenceError) {
        let node = configuration.nodeID
        _ = try await run {
            try await self.redis.pipeline([
                ["DEL", RedisArgument(keys.lease(node))],
                ["ZADD", RedisArgument(keys.nodes), RedisArgument(Int(clock.nowMilliseconds())), RedisArgument(node)],
            ])
        }
    }

    /// How many devices this node's sessions hold.
    public var localDeviceCount: Int {
        local.withLockedValue { $0.count }
    }

    /// The registered nodes, live and lapsed-but-not-reaped.
    public func nodes() async throws(PresenceError) -> [NodeRecord] {
        let now = clock.nowMilliseconds()
        let reply = try await run { try await self.redis.send("ZRANGE", RedisArgument(keys.nodes), "0", "-1", "WITHSCORES") }
        let values = reply.array ?? []
        var pairs: [(String, Int64)] = []
        for index in stride(from: 0, to: values.count - 1, by: 2) {
            if let node = values[index].string, let score = values[index + 1].double { pairs.append((node, Int64(score))) }
        }
        let commands: [[RedisArgument]] = pairs.flatMap { pair -> [[RedisArgument]] in
            [["HMGET", RedisArgument(keys.nodeInfo(pair.0)), "sessions", "renewed_at"], ["EXISTS", RedisArgument(keys.lease(pair.0))]]
        }
        let replies = try await run { try await self.redis.pipeline(commands) }
        return pairs.enumerated().map { index, pair in
            let fields = (try? replies[2 * index].get())?.array ?? []
            let leaseExists = (try? replies[2 * index + 1].get())?.int == 1
            let renewed = fields.count == 2 ? Self.timestamp(fields[1]) : nil
            // A node being reaped has its registry score moved forward by the claim, but its
            // lease key has expired: it is lapsed either way.
            return NodeRecord(
                nodeID: pair.0,
                sessions: fields.first?.int ?? 0,
                leaseExpiresAt: leaseExists ? pair.1 : min(pair.1, (renewed ?? now) + configuration.leaseTTL.milliseconds),
                renewedAt: renewed,
                lapsed: pair.1 <= now || !leaseExists
            )
        }
    }

    /// One pass of the reaper: claims lapsed node leases and due device deadlines and takes those
    /// devices offline, with `last_seen` the last moment each was known alive.
    public func reapOnce(limit: Int = 500) async throws(PresenceError) -> ReapReport {
        var report = ReapReport()
        let now = clock.nowMilliseconds()
        let retry = RedisArgument(Int(now + Self.claimMilliseconds))
        // Just after Redis was unreachable, a lapsed lease says nothing: live nodes could not
        // renew either. They get the grace to come back before anyone is reaped.
        let recovering = lastRedisFailure.withLockedValue { $0 }.map { now - $0 < configuration.recoveryGrace.milliseconds } ?? false
        let nodes: RESPValue = recovering ? .array([]) : try await run {
            try await self.redis.evaluate(PresenceScripts.claimDue, keys: [keys.nodes], arguments: [RedisArgument(Int(now)), retry, 16])
        }
        for (node, leaseEnded) in Self.pairs(nodes) {
            if let changed = try await reapNode(node, now: now, leaseEnded: Int64(leaseEnded)) {
                report.changedUsers += changed
                report.nodes.append(node)
            }
            _ = try await run { try await self.redis.evaluate(PresenceScripts.removeIfScore, keys: [keys.nodes], arguments: [RedisArgument(node), retry]) }
        }
        let due = try await run {
            try await self.redis.evaluate(PresenceScripts.claimDue, keys: [keys.deadlines], arguments: [RedisArgument(Int(now)), retry, RedisArgument(limit)])
        }
        for (member, _) in Self.pairs(due) {
            guard let (user, device) = keys.splitDeviceMember(member) else {
                _ = try await run { try await self.redis.send("ZREM", RedisArgument(keys.deadlines), RedisArgument(member)) }
                continue
            }
            let reply = try await run {
                try await self.redis.evaluate(
                    PresenceScripts.removeDevice,
                    keys: [keys.devices(user), keys.state(user)],
                    arguments: [RedisArgument(Int(now)), RedisArgument(user), RedisArgument(device), "", "expire", "0",
                                RedisArgument(keys.userChannel(user)), deviceTTLArgument]
                )
            }
            let values = reply.array ?? []
            if let flag = values.first?.int, flag == -1, values.count == 2, let deadline = values[1].int, deadline > 0 {
                // Renewed since it was scheduled: keep it indexed at its real deadline.
                _ = try await run { try await self.redis.send("ZADD", RedisArgument(keys.deadlines), RedisArgument(deadline), RedisArgument(member)) }
                continue
            }
            _ = try await run { try await self.redis.evaluate(PresenceScripts.removeIfScore, keys: [keys.deadlines], arguments: [RedisArgument(member), retry]) }
            if let flag = values.first?.int, flag >= 0 {
                report.expiredDevices += 1
                if flag == 1 || values.count > 3 && values[3].int == 1 { report.changedUsers += 1 }
                if let change = try? Self.change(from: values, user: user) { await settle(change) }
            }
        }
        report.typingEnded = try await reapTyping(now: now, limit: limit)
        if !report.nodes.isEmpty || report.expiredDevices > 0 {
            logger.info("reaped", metadata: ["presence.nodes": "\(report.nodes)", "presence.devices": "\(report.expiredDevices)"])
        }
        return report
    }

    /// Takes offline every device a dead node held; returns how many users' aggregates changed,
    /// or `nil` when the node id holds a lease again (a restarted process took it back).
    ///
    /// - Important: A node id may be reused by the next process (fixed ids in a compose file or
    ///   a local cluster). Devices written after `leaseEnded` are that process's and are kept, and
    ///   its lease and index are never deleted.
    ///   With `predecessor`, this process reaps what the previous one under its own id left:
    ///   the lease is not checked and the index is kept (this process may have added to it).
    private func reapNode(_ node: String, now: Int64, leaseEnded: Int64, predecessor: Bool = false) async throws(PresenceError) -> Int? {
        let lapse = [RedisArgument(Int(leaseEnded))]
        if !predecessor {
            let renewed = try await run {
                try await self.redis.evaluate(PresenceScripts.leaseRenewedSince, keys: [keys.lease(node)], arguments: lapse)
            }
            guard renewed.int != 1 else {
                logger.info("a lapsed node is live again; not reaped", metadata: ["presence.node_id": "\(node)"])
                return nil
            }
        }
        let info = try await run { try await self.redis.send("HGET", RedisArgument(keys.nodeInfo(node)), "renewed_at") }
        // Without its info (lost with Redis data), the best known moment is a lease ago.
        let renewed = Self.timestamp(info) ?? (now - configuration.leaseTTL.milliseconds)
        var cursor = "0"
        var byUser: [String: Int] = [:]
        repeat {
            let page = try await run { try await self.redis.send("SSCAN", RedisArgument(keys.nodeDevices(node)), RedisArgument(cursor), "COUNT", "1000") }
            guard let parts = page.array, parts.count == 2, let next = parts[0].string else { break }
            cursor = next
            for member in parts[1].strings {
                if let (user, _) = keys.splitDeviceMember(member) { byUser[user, default: 0] += 1 }
            }
        } while cursor != "0"
        var changed = 0
        let users = Array(byUser.keys)
        for start in stride(from: 0, to: users.count, by: 200) {
            let batch = users[start..<min(start + 200, users.count)]
            let calls = batch.map { user in
                (keys: [keys.devices(user), keys.state(user)],
                 arguments: [RedisArgument(Int(now)), RedisArgument(user), RedisArgument(node), RedisArgument(Int(renewed)),
                             RedisArgument(keys.userChannel(user)), deviceTTLArgument, RedisArgument(Int(leaseEnded))])
            }
            let results = try await run { try await self.redis.evaluate(PresenceScripts.reapNode, calls: calls) }
            for (user, result) in zip(batch, results) {
                if case .success(let reply) = result, let values = reply.array, values.count >= 6, values[0].int == 1 || values[3].int == 1 {
                    changed += 1
                    if let change = try? Self.change(from: values, user: user) { await settle(change) }
                }
            }
        }
        if !predecessor {
            _ = try await run {
                try await self.redis.evaluate(PresenceScripts.dropNode, keys: [keys.lease(node), keys.nodeDevices(node), keys.nodeInfo(node)], arguments: lapse)
            }
        }
        logger.info("reaped a dead node", metadata: ["presence.node_id": "\(node)", "presence.users": "\(byUser.count)", "presence.last_renewal": "\(renewed)"])
        return changed
    }

    private static func pairs(_ reply: RESPValue) -> [(String, Double)] {
        let values = reply.array ?? []
        var pairs: [(String, Double)] = []
        for index in stride(from: 0, to: values.count - 1, by: 2) {
            if let member = values[index].string, let score = values[index + 1].double { pairs.append((member, score)) }
        }
        return pairs
    }
}
