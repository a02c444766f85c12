import Foundation
import Logging
import NIOConcurrencyHelpers
import PresenceProtocol
import RedisClient

/// The presence engine: devices, aggregates, privacy and reads, over Redis, knowing nothing of HTTP.
///
/// Every change goes through one Lua script on the user's keys, which says whether the aggregate
/// changed and publishes on the user's channel only then. This node's live sessions are tracked
/// here too, so that they can be registered again after the lease is lost.
public final class PresenceEngine: Sendable {
    /// How the engine behaves.
    public let configuration: PresenceConfiguration
    /// The key layout.
    public let keys: PresenceKeys
    /// The store: one Redis server, or a cluster.
    public let redis: any RedisCommands
    /// Where messages are stored when acknowledgements wait for replicas (see ``init``).
    let sendRedis: any RedisCommands
    /// Messages stored through this engine (retries' duplicates not counted), for the node's info.
    let messagesStored = NIOLockedValueBox(0)
    /// Where time comes from.
    public let clock: any PresenceClock
    let logger: Logger
    let local = NIOLockedValueBox([String: LocalDevice]())
    let pendingReleases = NIOLockedValueBox([String: PendingRelease]())
    /// Deadline-set entries Redis did not take after the script that gave their deadline: set →
    /// member → score (``reindex(_:)``).
    let pendingIndexEntries = NIOLockedValueBox([String: [String: Int64]]())
    /// When this node last failed to renew or take its lease for want of Redis, or last heard a
    /// cluster refuse a command (`CLUSTERDOWN`, `LOADING`: ``RedisConnectionEvent/refused``), by
    /// the local clock in ms: the start of the reaper's ``PresenceConfiguration/recoveryGrace``.
    /// Only an outage that stops renewals can let live nodes' leases lapse (three renewals in a
    /// row must fail, or wait): one that long fails this node's renewals too, or on a cluster
    /// makes it answer `CLUSTERDOWN`, which the client retries until the shard is back, so
    /// that a renewal may wait the outage out without failing. A timeout of some other call now
    /// and then does not stop the reaper.
    let lastRedisFailure = NIOLockedValueBox<Int64?>(nil)
    /// The token of this engine's observer of `redis` (which marks a refusal as a failure).
    private let refusalObserver = NIOLockedValueBox<Int?>(nil)
    /// Whether this process has taken its lease: sessions wait for it (``waitUntilRegistered(timeout:)``),
    /// so that none is written before what an earlier process under this node id left is reaped.
    let registered = NIOLockedValueBox(false)
    /// Until when this node's lease surely lives (by the local monotonic clock): a TTL from the
    /// moment its last renewal was sent. Past it, reapers may have taken this node's devices.
    let leaseHeldUntil = NIOLockedValueBox<ContinuousClock.Instant?>(nil)
    /// Devices of this node's sessions still to be written again since Redis was found to have
    /// lost them (``restorePending()``): what is left when a re-registration was cut short.
    let unrestored = NIOLockedValueBox(RestoreQueue())
    /// Redis's clock minus this process's (ms), as the last lease renewal measured it.
    let storeClockOffset = NIOLockedValueBox<Int64>(0)
    /// When this node last refreshed the safety TTL of the deadline sets (``renewLease()``).
    let sharedKeysKept = NIOLockedValueBox<ContinuousClock.Instant?>(nil)
    /// The last device the scheduled audit checked: the next one goes on after it.
    let auditCursor = NIOLockedValueBox("")
    /// What this node knows of Redis's lives: whether a new one is to be settled, each cluster
    /// primary's run id, and the devices it let go of lately (``NewLifeWatch``).
    let newLife = NIOLockedValueBox(NewLifeWatch())
    /// `delivered` moves in large conversations, to be written together (``flushDelivered()``).
    let deliveredBatch = NIOLockedValueBox(DeliveredBatch())
    /// When the audits asked for outside the schedule are due (``requestAudit(after:)``).
    let auditsRequested = NIOLockedValueBox<[ContinuousClock.Instant]>([])
    /// Runs at the start of every audit, when set: tests make an audit slow there.
    let beforeAudit = NIOLockedValueBox<(@Sendable () async -> Void)?>(nil)
    /// Runs in a reap of a dead node between its lease check and the reading of its devices,
    /// when set: tests let time pass and sessions arrive there.
    let afterLeaseChecked = NIOLockedValueBox<(@Sendable () async -> Void)?>(nil)
    /// Runs between a device's index entry in the deadline sets and the script that gives the
    /// device its deadline (a linger, a REST heartbeat, a predecessor's linger), when set: tests
    /// let a reaper look at the entry there, as a script delayed past the entry's score lets it.
    let afterDeadlineIndexed = NIOLockedValueBox<(@Sendable () async -> Void)?>(nil)
    /// What the node's upkeep found (``UpkeepEvent``), for the gateway to act on.
    public let upkeepEvents: AsyncStream<UpkeepEvent>
    let upkeep: AsyncStream<UpkeepEvent>.Continuation

    /// A disconnect Redis could not take yet; one per session, by ``key``.
    struct PendingRelease: Sendable {
        var user: String
        var device: String
        var session: String
        var clean: Bool

        var key: String { "\(user)|\(device)|\(session)" }
    }

    /// A device held by one of this node's sessions.
    struct LocalDevice: Sendable {
        var user: String
        var device: String
        var session: String
        var status: PresenceStatus
        /// Redis has not taken `status` yet: the write failed, or is still under way.
        var statusOwed = false
        /// When the session opened by Redis's clock (ms): the moment its device was written, or
        /// the node's estimate until that write returns. After Redis went back in time, a record
        /// of another node's session last written before then is older than this session
        /// (``SettleNewLife``).
        var opened: Int64 = 0
    }

    /// Makes an engine; `configuration` must pass ``PresenceConfiguration/validate()``.
    ///
    /// - Parameter replicatedSends: with `messageReplicas`, the client that stores messages and
    ///   then waits for replicas (`WAIT` blocks its connection for up to a second, so it must not
    ///   be `redis`, which every other command shares); `redis` when not given.
    public init(redis: any RedisCommands, replicatedSends: (any RedisCommands)? = nil, configuration: PresenceConfiguration,
                clock: any PresenceClock = SystemPresenceClock(), logger: Logger) {
        self.redis = redis
        self.sendRedis = replicatedSends ?? redis
        self.configuration = configuration
        self.keys = PresenceKeys(prefix: configuration.keyPrefix)
        self.clock = clock
        self.logger = logger
        (upkeepEvents, upkeep) = AsyncStream.makeStream(bufferingPolicy: .bufferingNewest(1024))
        let token = redis.addConnectionObserver { [weak self] event in
            if event == .refused { self?.noteRedisFailure() }
        }
        refusalObserver.withLockedValue { $0 = token }
    }

    deinit {
        if let token = refusalObserver.withLockedValue({ $0 }) { redis.removeConnectionObserver(token) }
    }

    /// Starts the reaper's recovery grace now (see ``lastRedisFailure``).
    func noteRedisFailure() {
        let now = clock.nowMilliseconds()
        lastRedisFailure.withLockedValue { $0 = now }
    }

    /// The outcome of opening a session.
    public struct SessionOpened: Sendable {
        /// The aggregate change it caused.
        public var change: PresenceChange
        /// The session that held this device before, on which node, if it was another session:
        /// that session has been taken over and should be closed.
        public var replaced: (node: String, session: String)?
    }

    // MARK: REST devices

    /// A status post from a client without a WebSocket: a heartbeat that keeps the device live
    /// for the heartbeat TTL; `offline` takes it away at once.
    public func post(user: String, device: String, status: PresenceStatus) async throws(PresenceError) -> PresenceChange {
        if status == .offline {
            if case .removed(let change) = try await evaluate(RemoveDevice(user: user, device: device, mode: .clean)) {
                await settle(change)
                return change
            }
            return PresenceChange(changed: false, shownChanged: false, views: try await views(of: user))
        }
        try await indexDeadline(of: user, devices: [device], after: configuration.heartbeatTTL)
        if let probe = afterDeadlineIndexed.withLockedValue({ $0 }) { await probe() }
        guard case .written(let change, _, let deadline, _) = try await evaluate(UpsertDevice(user: user, device: device, status: status, mode: .rest)) else {
            throw PresenceError(.internal, "unexpected reply from the device script")
        }
        // No deadline: a live session holds the device, and the post changed its status only.
        if let deadline { await reindex([deviceDeadline(of: user, device: device, at: deadline)]) }
        return change
    }

    // MARK: Privacy

    /// Turns `show_online_status` on or off. Others see `offline` with the `last_seen` of this
    /// moment while it is off; the user's own devices see the truth.
    public func setPrivacy(user: String, showOnlineStatus: Bool) async throws(PresenceError) -> PresenceChange {
        let change = try await evaluate(SetPrivacy(user: user, showOnlineStatus: showOnlineStatus))
        await settle(change)
        return change
    }

    // MARK: Reads

    /// The real and shown presence of one user.
    public func views(of user: String) async throws(PresenceError) -> PresenceViews {
        try await views(of: [user])[0]
    }

    /// The presence of many users, read in one pipeline, in the order given.
    public func views(of users: [String]) async throws(PresenceError) -> [PresenceViews] {
        try await reads(of: users).map(\.views)
    }

    /// The presence of many users and whether Redis holds any record of each, in one pipeline.
    public func reads(of users: [String]) async throws(PresenceError) -> [UserRead] {
        try await evaluate(users.map { ReadUser(user: $0) }).map { (result) throws(PresenceError) in try result.get() }
    }

    /// The devices of a user, as stored.
    public func devices(of user: String) async throws(PresenceError) -> [DeviceRecord] {
        let stored = try await run { try await self.redis.execute(HGETALL(key: self.keys.devices(user))) }
        return stored.compactMap { DeviceRecord(id: $0.field, stored: $0.value) }.sorted { $0.deviceID < $1.deviceID }
    }

    /// Decodes an event published on a user's channel; `nil` for other message types.
    public func decodeEvent(_ payload: [UInt8]) -> PresenceEvent? {
        (PublishedPresence(direct: payload) ?? (try? JSONDecoder().decode(PublishedPresence.self, from: Data(payload))))?.event
    }

    // MARK: Helpers

    /// Every script's ARGV[1]: empty, so that it reads Redis's clock, or a test clock's time.
    var nowArgument: RedisArgument { clock.scriptTime.map { RedisArgument(Int($0)) } ?? "" }

    /// Now by Redis's clock without asking it: this process's clock plus the offset the last
    /// lease renewal measured. For metrics that compare with moments Redis stamped (an event's
    /// `at`): a node whose own clock is off would otherwise record its skew as latency.
    public func estimatedStoreNow() -> Int64 {
        clock.nowMilliseconds() + storeClockOffset.withLockedValue { $0 }
    }

    /// Now by the clock the scripts use: Redis's (one `TIME`), or a test clock's.
    func storeNow() async throws(PresenceError) -> Int64 {
        if let fixed = clock.scriptTime { return fixed }
        return try await run { try await self.redis.execute(TIME()) } / 1000
    }

    /// Runs a Redis call, mapping its errors to presence errors.
    @discardableResult
    func run<T>(_ body: () async throws -> T) async throws(PresenceError) -> T {
        do {
            return try await body()
        } catch let error as RedisError {
            throw Self.presenceError(error)
        } catch let error as PresenceError {
            throw error
        } catch {
            throw PresenceError(.internal, "unexpected failure", underlying: error)
        }
    }

    /// Server errors that mean "not now" rather than "never": the command may pass once the
    /// server is ready.
    static let serverBusyPrefixes: Set<Substring> = ["LOADING", "MASTERDOWN", "BUSY", "TRYAGAIN", "CLUSTERDOWN"]

    static func presenceError(_ error: RedisError) -> PresenceError {
        switch error.code {
        case .server where error.serverErrorPrefix == "TOO_MANY_DEVICES":
            return PresenceError(.limitReached, String(error.message.drop { $0 != " " }.dropFirst()), underlying: error)
        case .server where error.serverErrorPrefix == "FORBIDDEN":
            return PresenceError(.forbidden, "not allowed", underlying: error)
        case .server where serverBusyPrefixes.contains(error.serverErrorPrefix ?? ""):
            // The server is there but cannot answer yet (loading its data after a restart, a
            // replica with no primary, a script running long): unreachable for now, so that the
            // lease's recovery grace holds and nodes do not reap each other meanwhile.
            return PresenceError(.unavailable, "the presence store is not ready (\(error.serverErrorPrefix ?? ""))", underlying: error)
        case .server, .protocolViolation:
            return PresenceError(.internal, "the presence store failed a command", underlying: error)
        default:
            return PresenceError(.unavailable, "the presence store is unreachable", underlying: error)
        }
    }
}
