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
    /// Messages stored through it since it started, as of its last renewal (0 from a node of a
    /// version that records none).
    public var messagesStored: Int = 0
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

extension PresenceEngine {
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
            let outcome = try await evaluate(RenewLease(node: node, register: register, sessions: sessions, messages: messagesStored.withLockedValue { $0 }))
            guard case .renewed(let storeNow, let ends, let indexed, let newLife) = outcome else { return false }
            if newLife { noteNewLife() }
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
            await checkPrimaryLives()
            return true
        } catch where error.code == .unavailable {
            noteRedisFailure()
            throw error
        }
    }

    /// Whether this process has taken its lease.
    var isRegistered: Bool { registered.withLockedValue { $0 } }

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
    ///
    /// A node id the registry does not list may still have devices in its index: Redis lost the
    /// registry, and the earlier process wrote a session before its renewal found the lease gone.
    @discardableResult
    public func reapPredecessor() async throws(PresenceError) -> Int {
        let node = configuration.nodeID
        let (listed, indexed) = try await run {
            try await self.redis.pipeline(ZSCORE(key: keys.nodes, member: node), SCARD(key: keys.nodeDevices(node)))
        }
        switch (listed, indexed) {
        case (.failure(let error), _), (_, .failure(let error)): throw Self.presenceError(error)
        case (.success(nil), .success(0)): return 0
        default: break
        }
        guard case .reaped(let changed) = try await reapNode(node, predecessor: true) else { return 0 }
        return changed
    }

    /// Lists `node` in the registry, to be looked at by a reaper at `until` (with the registry's
    /// safety TTL); with `unlessListed`, an entry already there keeps its time.
    func list(_ node: String, until: Int64, unlessListed: Bool = false) async throws(PresenceError) {
        let (listed, _) = try await run {
            try await self.redis.pipeline(
                ZADD(key: keys.nodes, entries: [(until, node)], onlyNew: unlessListed),
                PEXPIRE(key: keys.nodes, milliseconds: configuration.deviceKeyTTL.milliseconds)
            )
        }
        if case .failure(let error) = listed { throw Self.presenceError(error) }
    }

    /// Renews the lease. Returns `false` when the lease was gone: the node was reaped or Redis
    /// lost its data, and the caller must ``reregister()``.
    public func renewLease() async throws(PresenceError) -> Bool {
        guard try await leaseScript(register: false) else { return false }
        // The node's other keys follow the lease; their safety TTL is refreshed at the same time.
        // The deadline sets every node shares are kept by whichever node's turn comes first, an
        // eighth of their TTL after the last time this node did it.
        let node = configuration.nodeID
        let keep = configuration.deviceKeyTTL.milliseconds
        var sets = [keys.nodeDevices(node)]
        let now = ContinuousClock.now
        let shared = sharedKeysKept.withLockedValue { last in
            guard last.map({ now - $0 >= configuration.deviceKeyTTL / 8 }) ?? true else { return false }
            last = now
            return true
        }
        if shared { sets += keys.allDeadlines + keys.allTypingDeadlines }
        _ = try await run { try await self.redis.pipeline(sets.map { PEXPIRE(key: $0, milliseconds: keep) }) }
        return true
    }

    /// Refreshes the safety TTL of the devices hash of every user this node holds a device of.
    public func refreshDeviceKeys() async throws(PresenceError) {
        let users = Set(local.withLockedValue { $0.values.map(\.user) })
        let ttl = configuration.deviceKeyTTL.milliseconds
        let commands = users.map { PEXPIRE(key: keys.devices($0), milliseconds: ttl) }
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
        let pairs = try await run { try await self.redis.execute(ZRANGE.WithScores(key: keys.nodes)) }.map { ($0.member, Int64($0.score)) }
        // Leases first: a node's lease and info are written by one script, so a lease seen here
        // has its info by the time it is read. The other order, a round trip apart, sees a node
        // that registers in between as live with no info, taken for one of classic pub/sub:
        // beside sharded nodes, that made the reader refuse to start.
        let leases = try await run { try await self.redis.pipeline(pairs.map { EXISTS(keys: [keys.lease($0.0)]) }) }
        let infos = try await run { try await self.redis.pipeline(pairs.map { HMGET(key: keys.nodeInfo($0.0), fields: ["sessions", "renewed_at", "pubsub", "messages"]) }) }
        return pairs.enumerated().map { index, pair in
            let fields = (try? infos[index].get()) ?? []
            let leaseExists = (try? leases[index].get()) == 1
            let renewed = fields.count == 4 ? ScriptLua.timestamp(fields[1]) : nil
            // A node being reaped has its registry score moved forward by the claim, but its
            // lease key has expired: it is lapsed either way.
            return NodeRecord(
                nodeID: pair.0,
                sessions: fields.count == 4 ? fields[0].flatMap { Int($0) } ?? 0 : 0,
                leaseExpiresAt: leaseExists ? pair.1 : min(pair.1, (renewed ?? now) + configuration.leaseTTL.milliseconds),
                renewedAt: renewed,
                lapsed: !leaseExists,
                pubSub: fields.count == 4 ? fields[2].flatMap(RedisPubSub.init(rawValue:)) : nil,
                messagesStored: fields.count == 4 ? fields[3].flatMap { Int($0) } ?? 0 : 0
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
}
