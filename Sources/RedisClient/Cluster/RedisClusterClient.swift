import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import ServiceLifecycle

/// A Redis Cluster client: one pipelined connection per primary, each command sent to the
/// primary serving its keys' hash slot.
///
/// It learns the slot map with `CLUSTER SHARDS` and keeps it current: at once for a slot that
/// answers `MOVED`, and by a full refresh after a `MOVED`, after losing a primary, and every
/// `refreshInterval`. Refreshes never overlap; requests made during one are served by one more.
///
/// A command follows `MOVED` and `ASK` redirections (at most ``maximumRedirections``), and is
/// sent again after `TRYAGAIN`, `CLUSTERDOWN`, `LOADING` or when its node cannot be reached, with
/// a backoff of 50 ms doubling to 400 ms (cut short when the unreachable node's connection
/// opens), until ``RedisConfiguration/waitForConnection`` plus
/// ``RedisConfiguration/commandTimeout`` have passed since it was sent; then the last error is
/// thrown. A command whose connection broke after it was written is never sent again (it may
/// have run): its ``RedisError/Code/connectionClosed`` error is thrown at once.
///
/// Run it as a `Service` (or inside ``withClient(seeds:configuration:eventLoopGroup:logger:_:)``):
/// `run()` discovers the cluster and opens and repairs connections; nothing hangs on a dead node.
public final class RedisClusterClient: Service, Sendable {
    /// The nodes asked for the slot map before any is known.
    public let seeds: [ClusterNodeAddress]
    /// The template of every node connection: credentials, TLS, timeouts and client name; its
    /// host and port are replaced by each node's.
    public let configuration: RedisConfiguration
    /// How often the slot map is read again when nothing else prompts it.
    public let refreshInterval: Duration
    /// Most `MOVED` and `ASK` redirections one command follows before failing.
    public static let maximumRedirections = 16

    let eventLoopGroup: any EventLoopGroup
    let logger: Logger
    let state = NIOLockedValueBox(State())
    private let observers = ConnectionObservers()
    /// Connections to open and to close, handled by `run()`'s task group.
    private let work: AsyncStream<Work>
    let workContinuation: AsyncStream<Work>.Continuation
    /// Refresh requests; holding at most one coalesces every request made during a refresh.
    let refreshRequests: AsyncStream<Void>
    let refreshContinuation: AsyncStream<Void>.Continuation

    /// The pause before sending a command again.
    static let retryBackoff = Backoff(minimum: .milliseconds(50), maximum: .milliseconds(400))
    /// How many nodes are asked for the slot map at once.
    static let discoveryFanOut = 3

    enum Work: Sendable {
        case connect(ClusterNodeAddress)
        case retire(RedisConnection)
    }

    struct Node {
        var connection: RedisConnection?
        var connecting = false
        var waiters: [Int: CheckedContinuation<RedisConnection, any Error>] = [:]
        var lastError: RedisError?
    }

    struct State {
        var map: ClusterSlotMap?
        var nodes: [ClusterNodeAddress: Node] = [:]
        var mapWaiters: [Int: CheckedContinuation<Void, any Error>] = [:]
        var nextWaiterID = 0
        var lastDiscoveryError: RedisError?
        var everConnected = false
        /// A primary's connection was lost and no connection has opened since.
        var degraded = false
        var running = false
        var shutdown = false
    }

    /// Makes a client for the cluster that `seeds` belong to; it connects once `run()` starts.
    ///
    /// - Parameters:
    ///   - seeds: some nodes of the cluster; one reachable node is enough.
    ///   - configuration: the template of every node connection; its `database` must be 0, the
    ///     only one a cluster has.
    ///   - refreshInterval: how often the slot map is read again when nothing else prompts it.
    public init(
        seeds: [(host: String, port: Int)],
        configuration: RedisConfiguration,
        refreshInterval: Duration = .seconds(10),
        eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton,
        logger: Logger
    ) throws(RedisError) {
        guard !seeds.isEmpty else {
            throw RedisError(.invalidURL, "a Redis cluster needs at least one seed node")
        }
        guard configuration.database == 0 else {
            throw RedisError(.invalidURL, "a Redis cluster has only database 0, not \(configuration.database)")
        }
        guard refreshInterval > .zero else {
            throw RedisError(.invalidURL, "the cluster's refresh interval must be positive")
        }
        self.seeds = seeds.map { ClusterNodeAddress(host: $0.host, port: $0.port) }
        self.configuration = configuration
        self.refreshInterval = refreshInterval
        self.eventLoopGroup = eventLoopGroup
        self.logger = logger
        (work, workContinuation) = AsyncStream.makeStream(of: Work.self)
        (refreshRequests, refreshContinuation) = AsyncStream.makeStream(of: Void.self, bufferingPolicy: .bufferingNewest(1))
    }

    /// Runs a client for the duration of `body`, with the slot map known before `body` starts.
    ///
    /// Throws if no seed answers `CLUSTER SHARDS`, so a command line tool can report it and exit.
    public static func withClient<Result: Sendable>(
        seeds: [(host: String, port: Int)],
        configuration: RedisConfiguration,
        eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton,
        logger: Logger,
        _ body: (RedisClusterClient) async throws -> Result
    ) async throws -> Result {
        let client = try RedisClusterClient(seeds: seeds, configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
        try await client.install(client.discover().get())
        return try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask { try await client.run() }
            defer {
                client.shutdown()
                group.cancelAll()
            }
            await client.connectToPrimaries()
            return try await body(client)
        }
    }

    /// Returns once every primary's connection is open, or failed, or
    /// ``RedisConfiguration/waitForConnection`` has passed.
    private func connectToPrimaries() async {
        let deadline = ContinuousClock.now + configuration.waitForConnection
        await withTaskGroup(of: Void.self) { group in
            for primary in primaries {
                group.addTask { _ = try? await self.connection(to: primary, until: deadline) }
            }
        }
    }

    // MARK: - State seen from outside

    /// The primaries of the current slot map, sorted; empty before the cluster is discovered.
    public var primaries: [ClusterNodeAddress] {
        state.withLockedValue { $0.map?.primaries ?? [] }
    }

    /// The primary the router sends `slot`'s commands to, if the slot map names one.
    public func primary(for slot: HashSlot) -> ClusterNodeAddress? {
        state.withLockedValue { $0.map?.primary(for: slot) }
    }

    /// Whether the slot map is known and every primary's connection is open.
    public var isConnected: Bool {
        state.withLockedValue { state in
            guard let map = state.map else { return false }
            return map.primaries.allSatisfy { state.nodes[$0]?.connection?.isActive ?? false }
        }
    }

    /// Whether the slot map is known and at least one primary's connection is open: some slots
    /// can be served.
    public var isAvailable: Bool {
        state.withLockedValue { state in
            guard let map = state.map else { return false }
            return map.primaries.contains { state.nodes[$0]?.connection?.isActive ?? false }
        }
    }

    /// Registers `observer` for connection events; keep the token to remove it.
    ///
    /// `connected(reconnect: false)` comes with the first node connection; `disconnected` when a
    /// primary's connection is lost (writes to its slots may have been missed or may fail for a
    /// while); `connected(reconnect: true)` with the next connection opened after that;
    /// `refused` each time a node answers `CLUSTERDOWN` or `LOADING` (the command is retried).
    @discardableResult
    public func addConnectionObserver(_ observer: @escaping @Sendable (RedisConnectionEvent) -> Void) -> Int {
        observers.add(observer)
    }

    /// Removes an observer added with ``addConnectionObserver(_:)``.
    public func removeConnectionObserver(_ token: Int) {
        observers.remove(token)
    }

    func notify(_ event: RedisConnectionEvent?) {
        if let event { observers.notify(event) }
    }

    // MARK: - Running

    /// Discovers the cluster (unless ``withClient(seeds:configuration:eventLoopGroup:logger:_:)``
    /// already did), then keeps the slot map and the connections current until cancelled or shut
    /// down gracefully.
    public func run() async throws {
        let alreadyRunning = state.withLockedValue { state in
            defer { state.running = true }
            return state.running
        }
        guard !alreadyRunning else {
            throw RedisError(.unavailable, "this Redis cluster client is already running")
        }
        if state.withLockedValue({ $0.map == nil }) { requestRefresh() }
        await withGracefulShutdownHandler {
            // Discarding: a task group keeps each finished child until it is awaited, and this
            // one starts a child per connect for as long as the client runs (with its cluster
            // gone, a node grew 360 KB a second, about 7 KB per refused connect).
            await withDiscardingTaskGroup { group in
                group.addTask { await self.refreshWhenAsked() }
                group.addTask { await self.refreshPeriodically() }
                // Ends at shutdown, or when this task is cancelled.
                for await item in self.work {
                    switch item {
                    case .connect(let address):
                        group.addTask { await self.keepConnection(to: address) }
                    case .retire(let connection):
                        group.addTask {
                            // Commands already sent on it get their replies first.
                            try? await Task.sleep(for: self.configuration.commandTimeout)
                            await connection.close()
                        }
                    }
                }
                self.shutdown()
                group.cancelAll()
            }
        } onGracefulShutdown: {
            self.shutdown()
        }
        shutdown()
    }

    /// Stops refreshing and closes every connection; waiting and later commands fail.
    public func shutdown() {
        let (connections, waiters, mapWaiters) = state.withLockedValue { state in
            state.shutdown = true
            var connections: [RedisConnection] = []
            var waiters: [CheckedContinuation<RedisConnection, any Error>] = []
            for (address, node) in state.nodes {
                if let connection = node.connection { connections.append(connection) }
                waiters += node.waiters.values
                state.nodes[address]?.waiters = [:]
                state.nodes[address]?.connection = nil
            }
            let mapWaiters = Array(state.mapWaiters.values)
            state.mapWaiters = [:]
            return (connections, waiters, mapWaiters)
        }
        workContinuation.finish()
        refreshContinuation.finish()
        let error = RedisError(.unavailable, "the Redis cluster client is shut down")
        for waiter in waiters { waiter.resume(throwing: error) }
        for waiter in mapWaiters { waiter.resume(throwing: error) }
        for connection in connections {
            connection.channel.close(promise: nil)
        }
    }

    var isShutdown: Bool { state.withLockedValue { $0.shutdown } }

    /// Opens a connection to `address`, hands it to the commands waiting for it, and watches it
    /// until it closes.
    private func keepConnection(to address: ClusterNodeAddress) async {
        let connection: RedisConnection
        do {
            connection = try await connect(to: address)
        } catch {
            let failure = RedisError(.unavailable, "cannot connect to Redis cluster node \(address)", underlying: error)
            let waiters = state.withLockedValue { state in
                state.nodes[address]?.connecting = false
                state.nodes[address]?.lastError = failure
                let waiters = state.nodes[address]?.waiters ?? [:]
                state.nodes[address]?.waiters = [:]
                return waiters
            }
            logger.debug("cannot connect to a Redis cluster node", metadata: ["redis.node": "\(address)", "error": "\(error)"])
            for waiter in waiters.values { waiter.resume(throwing: failure) }
            // A command needed this node: its slots may have moved (a failover), so look again.
            if !waiters.isEmpty { requestRefresh() }
            return
        }
        let installed: (waiters: [CheckedContinuation<RedisConnection, any Error>], event: RedisConnectionEvent?)? = state.withLockedValue { state in
            guard !state.shutdown else { return nil }
            var node = state.nodes[address] ?? Node()
            node.connection = connection
            node.connecting = false
            node.lastError = nil
            let waiters = Array(node.waiters.values)
            node.waiters = [:]
            state.nodes[address] = node
            var event: RedisConnectionEvent?
            if !state.everConnected {
                state.everConnected = true
                event = .connected(reconnect: false)
            } else if state.degraded {
                state.degraded = false
                event = .connected(reconnect: true)
            }
            return (waiters, event)
        }
        guard let installed else {
            await connection.close()
            return
        }
        logger.debug("connected to a Redis cluster node", metadata: ["redis.node": "\(address)"])
        for waiter in installed.waiters { waiter.resume(returning: connection) }
        notify(installed.event)

        await connection.closed()
        let lostPrimary: Bool = state.withLockedValue { state in
            if state.nodes[address]?.connection === connection { state.nodes[address]?.connection = nil }
            guard !state.shutdown, state.map?.primaries.contains(address) ?? false else { return false }
            state.degraded = true
            return true
        }
        guard lostPrimary else { return }
        logger.warning("lost the connection to a Redis cluster primary", metadata: ["redis.node": "\(address)"])
        notify(.disconnected)
        // A dead primary is about to be replaced by its replica: the map tells when.
        requestRefresh()
        requestConnection(to: address)
    }

    /// A new connection to `address`. With a hedge interval, attempts overlap (see
    /// ``RedisConfiguration/connectHedgeInterval``) for at most ``RedisConfiguration/commandTimeout``:
    /// a node whose network came back is reached within the interval, not at TCP's next resend.
    func connect(to address: ClusterNodeAddress) async throws -> RedisConnection {
        let configuration = nodeConfiguration(address)
        let eventLoopGroup = self.eventLoopGroup
        let logger = self.logger
        let attempt: @Sendable () async throws -> RedisConnection = {
            try await RedisConnection.connect(configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
        }
        guard let interval = configuration.connectHedgeInterval else { return try await attempt() }
        return try await ConnectRace().run(interval: interval, limit: 10, until: .now + configuration.commandTimeout, attempt)
    }

    func nodeConfiguration(_ address: ClusterNodeAddress) -> RedisConfiguration {
        var configuration = configuration
        configuration.host = address.host
        configuration.port = address.port
        return configuration
    }

    /// Starts connecting to `address` unless a connection is open or on its way.
    func requestConnection(to address: ClusterNodeAddress) {
        let start = state.withLockedValue { state -> Bool in
            guard !state.shutdown else { return false }
            var node = state.nodes[address] ?? Node()
            defer { state.nodes[address] = node }
            guard !node.connecting, !(node.connection?.isActive ?? false) else { return false }
            node.connecting = true
            return true
        }
        if start { workContinuation.yield(.connect(address)) }
    }
}
