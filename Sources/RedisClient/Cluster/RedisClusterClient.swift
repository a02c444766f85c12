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
/// a backoff of 50 ms doubling to 400 ms, until ``RedisConfiguration/waitForConnection`` plus
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

    private let eventLoopGroup: any EventLoopGroup
    private let logger: Logger
    private let state = NIOLockedValueBox(State())
    private let observers = ConnectionObservers()
    /// Connections to open and to close, handled by `run()`'s task group.
    private let work: AsyncStream<Work>
    private let workContinuation: AsyncStream<Work>.Continuation
    /// Refresh requests; holding at most one coalesces every request made during a refresh.
    private let refreshRequests: AsyncStream<Void>
    private let refreshContinuation: AsyncStream<Void>.Continuation

    /// The pause before sending a command again.
    private static let retryBackoff = Backoff(minimum: .milliseconds(50), maximum: .milliseconds(400))
    /// How many nodes are asked for the slot map at once.
    private static let discoveryFanOut = 3

    private enum Work: Sendable {
        case connect(ClusterNodeAddress)
        case retire(RedisConnection)
    }

    private struct Node {
        var connection: RedisConnection?
        var connecting = false
        var waiters: [Int: CheckedContinuation<RedisConnection, any Error>] = [:]
        var lastError: RedisError?
    }

    private struct State {
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

    /// Registers `observer` for connection events; keep the token to remove it.
    ///
    /// `connected(reconnect: false)` comes with the first node connection; `disconnected` when a
    /// primary's connection is lost (writes to its slots may have been missed or may fail for a
    /// while); `connected(reconnect: true)` with the next connection opened after that.
    @discardableResult
    public func addConnectionObserver(_ observer: @escaping @Sendable (RedisConnectionEvent) -> Void) -> Int {
        observers.add(observer)
    }

    /// Removes an observer added with ``addConnectionObserver(_:)``.
    public func removeConnectionObserver(_ token: Int) {
        observers.remove(token)
    }

    private func notify(_ event: RedisConnectionEvent?) {
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
            await withTaskGroup(of: Void.self) { group in
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

    private var isShutdown: Bool { state.withLockedValue { $0.shutdown } }

    /// Opens a connection to `address`, hands it to the commands waiting for it, and watches it
    /// until it closes.
    private func keepConnection(to address: ClusterNodeAddress) async {
        let connection: RedisConnection
        do {
            connection = try await RedisConnection.connect(configuration: nodeConfiguration(address), eventLoopGroup: eventLoopGroup, logger: logger)
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

    private func nodeConfiguration(_ address: ClusterNodeAddress) -> RedisConfiguration {
        var configuration = configuration
        configuration.host = address.host
        configuration.port = address.port
        return configuration
    }

    /// Starts connecting to `address` unless a connection is open or on its way.
    private func requestConnection(to address: ClusterNodeAddress) {
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

    // MARK: - The slot map

    /// Asks for a full refresh of the slot map; requests made while one runs share the next.
    private func requestRefresh() {
        refreshContinuation.yield()
    }

    private func refreshPeriodically() async {
        while !Task.isCancelled {
            do {
                try await Task.sleep(for: refreshInterval)
            } catch {
                return
            }
            requestRefresh()
        }
    }

    /// Runs one refresh per request, one at a time. A map that did not change slows the next
    /// refresh down (100 ms doubling to 400 ms), so a storm of redirections or a node that stays
    /// dead does not turn into a storm of `CLUSTER SHARDS`.
    private func refreshWhenAsked() async {
        var unchanged = 0
        var failures = 0
        for await _ in refreshRequests {
            let pause: Duration
            switch await discover() {
            case .success(let map):
                failures = 0
                unchanged = install(map) ? 0 : unchanged + 1
                pause = .milliseconds(100) * (1 << min(unchanged, 2))
            case .failure(let error):
                let known = state.withLockedValue { state in
                    state.lastDiscoveryError = error
                    return state.map != nil
                }
                logger.log(
                    level: failures == 0 ? .warning : .debug,
                    "cannot read the Redis cluster's slot map",
                    metadata: ["error": "\(error)"]
                )
                pause = Backoff(minimum: configuration.minimumBackoff, maximum: configuration.maximumBackoff).delay(attempt: failures)
                failures += 1
                // Until a map is known, keep trying on our own; afterwards commands and the
                // periodic refresh ask when needed.
                if !known { requestRefresh() }
            }
            do {
                try await Task.sleep(for: pause)
            } catch {
                return
            }
        }
    }

    /// Reads the slot map from up to ``discoveryFanOut`` nodes at once (known primaries first,
    /// then the seeds) and keeps an answer where every slot has a healthy primary, else the most
    /// complete one. Asks the next nodes only when none answered.
    private func discover() async -> Result<ClusterSlotMap, RedisError> {
        let known = state.withLockedValue { $0.map?.primaries ?? [] }.shuffled()
        var candidates: [ClusterNodeAddress] = []
        for address in known + seeds where !candidates.contains(address) { candidates.append(address) }
        var lastError = RedisError(.unavailable, "no Redis cluster node to ask for the slot map")
        var start = 0
        while start < candidates.count {
            let batch = candidates[start..<min(start + Self.discoveryFanOut, candidates.count)]
            start = batch.endIndex
            var best: ClusterSlotMap?
            await withTaskGroup(of: Result<ClusterSlotMap, RedisError>.self) { group in
                for address in batch {
                    group.addTask { await self.askSlotMap(address) }
                }
                for await answer in group {
                    switch answer {
                    case .success(let map):
                        if best.map({ ($0.healthySlots, $0.coveredSlots) < (map.healthySlots, map.coveredSlots) }) ?? true {
                            best = map
                        }
                    case .failure(let error):
                        lastError = error
                    }
                }
            }
            if let best { return .success(best) }
        }
        return .failure(lastError)
    }

    /// `CLUSTER SHARDS` from one node, on its open connection or a short-lived one.
    private func askSlotMap(_ address: ClusterNodeAddress) async -> Result<ClusterSlotMap, RedisError> {
        let open = state.withLockedValue { state in
            state.nodes[address]?.connection.flatMap { $0.isActive ? $0 : nil }
        }
        do {
            let reply: RESPValue
            if let open {
                reply = try await open.send(["CLUSTER", "SHARDS"])
            } else {
                let connection = try await RedisConnection.connect(configuration: nodeConfiguration(address), eventLoopGroup: eventLoopGroup, logger: logger)
                defer { connection.channel.close(promise: nil) }
                reply = try await connection.send(["CLUSTER", "SHARDS"])
            }
            let map = try ClusterSlotMap.parse(shards: reply, tls: configuration.tls != nil, fallbackHost: address.host)
            guard map.coveredSlots > 0 else {
                return .failure(RedisError(.unavailable, "Redis cluster node \(address) knows no slot owners yet"))
            }
            return .success(map)
        } catch {
            return .failure(RedisError(error.code, "cannot read the slot map from Redis cluster node \(address): \(error.message)", underlying: error.underlying))
        }
    }

    /// Makes `map` current: wakes the commands waiting for one, closes connections to nodes that
    /// are no longer primaries and opens those to new ones. Returns whether any slot changed.
    @discardableResult
    private func install(_ map: ClusterSlotMap) -> Bool {
        let primaries = Set(map.primaries)
        let (changed, waiters, retired, missing) = state.withLockedValue { state in
            let changed = state.map.map { !$0.sameAssignment(as: map) } ?? true
            state.map = map
            state.lastDiscoveryError = nil
            let waiters = Array(state.mapWaiters.values)
            state.mapWaiters = [:]
            var retired: [RedisConnection] = []
            for (address, node) in state.nodes where !primaries.contains(address) {
                if let connection = node.connection { retired.append(connection) }
                state.nodes[address]?.connection = nil
                if node.waiters.isEmpty, !node.connecting { state.nodes[address] = nil }
            }
            let missing = primaries.filter { address in
                let node = state.nodes[address]
                return !(node?.connecting ?? false) && !(node?.connection?.isActive ?? false)
            }
            return (changed, waiters, retired, missing)
        }
        if changed {
            logger.info("Redis cluster slot map", metadata: [
                "redis.primaries": "\(map.primaries.map(\.description).joined(separator: ","))",
                "redis.slots_covered": "\(map.coveredSlots)",
            ])
        }
        for waiter in waiters { waiter.resume() }
        for connection in retired { workContinuation.yield(.retire(connection)) }
        for address in missing { requestConnection(to: address) }
        return changed
    }

    // MARK: - Waiting

    /// Waits at most `timeout` for a continuation registered by `register` (which returns false
    /// when it resumed it at once); `expire` takes it back on timeout, with the error to throw.
    private func wait<Value: Sendable>(
        timeout: Duration,
        register: (inout State, Int, CheckedContinuation<Value, any Error>) -> Bool,
        expire: @escaping @Sendable (inout State, Int) -> (CheckedContinuation<Value, any Error>?, RedisError)
    ) async throws(RedisError) -> Value {
        do {
            return try await withCheckedThrowingContinuation { continuation in
                let id: Int? = state.withLockedValue { state in
                    state.nextWaiterID += 1
                    return register(&state, state.nextWaiterID, continuation) ? state.nextWaiterID : nil
                }
                guard let id else { return }
                eventLoopGroup.any().scheduleTask(in: TimeAmount(timeout)) {
                    let (waiter, error) = self.state.withLockedValue { expire(&$0, id) }
                    waiter?.resume(throwing: error)
                }
            }
        } catch let error as RedisError {
            throw error
        } catch {
            throw RedisError(.unavailable, "waiting for the Redis cluster failed", underlying: error)
        }
    }

    /// Returns once a slot map is known, waiting at most until `deadline` or
    /// ``RedisConfiguration/waitForConnection``, whichever comes first.
    private func waitForMap(until deadline: ContinuousClock.Instant) async throws(RedisError) {
        let timeout = min(configuration.waitForConnection, deadline - .now)
        try await wait(timeout: timeout) { (state, id, continuation: CheckedContinuation<Void, any Error>) in
            if state.map != nil {
                continuation.resume()
                return false
            }
            if state.shutdown {
                continuation.resume(throwing: RedisError(.unavailable, "the Redis cluster client is shut down"))
                return false
            }
            state.mapWaiters[id] = continuation
            return true
        } expire: { state, id in
            (
                state.mapWaiters.removeValue(forKey: id),
                RedisError(.unavailable, "the Redis cluster's slot map is not known yet: no node answered CLUSTER SHARDS", underlying: state.lastDiscoveryError)
            )
        }
    }

    /// The open connection to `address`, or one that opens in time.
    private func connection(to address: ClusterNodeAddress, until deadline: ContinuousClock.Instant) async throws(RedisError) -> RedisConnection {
        let ready: RedisConnection? = state.withLockedValue { state in
            state.nodes[address]?.connection.flatMap { $0.isActive ? $0 : nil }
        }
        if let ready { return ready }
        let timeout = min(configuration.waitForConnection, deadline - .now)
        return try await wait(timeout: timeout) { (state, id, continuation: CheckedContinuation<RedisConnection, any Error>) in
            if state.shutdown {
                continuation.resume(throwing: RedisError(.unavailable, "the Redis cluster client is shut down"))
                return false
            }
            var node = state.nodes[address] ?? Node()
            defer { state.nodes[address] = node }
            if let connection = node.connection, connection.isActive {
                continuation.resume(returning: connection)
                return false
            }
            node.waiters[id] = continuation
            if !node.connecting {
                node.connecting = true
                workContinuation.yield(.connect(address))
            }
            return true
        } expire: { state, id in
            (
                state.nodes[address]?.waiters.removeValue(forKey: id),
                RedisError(.unavailable, "Redis cluster node \(address) is unreachable", underlying: state.nodes[address]?.lastError)
            )
        }
    }

    // MARK: - Commands

    /// Where the next attempt of a command goes.
    enum Target: Sendable {
        /// The primary of the command's slot, or any primary for a command without a key.
        case slotOwner
        /// The node a `MOVED` or `NOSCRIPT` named; the slot's primary again after a retry.
        case node(ClusterNodeAddress)
        /// The node an `ASK` named, with `ASKING` written just before the command; once.
        case asking(ClusterNodeAddress)
        /// This node only, whatever it answers (`SCRIPT LOAD`, per-node commands).
        case pinned(ClusterNodeAddress)
    }

    /// What to do after a failed attempt.
    private enum NextStep {
        case moved(HashSlot, ClusterNodeAddress)
        case ask(ClusterNodeAddress)
        case retry
        case fail

        var isFail: Bool {
            if case .fail = self { return true }
            return false
        }
    }

    /// Commands that change the state of their connection, which the router shares between all
    /// callers: they cannot mean anything through it.
    private static let connectionStateCommands: Set<String> = [
        "MULTI", "EXEC", "DISCARD", "WATCH", "UNWATCH", "SELECT", "AUTH", "HELLO", "QUIT", "RESET",
        "SUBSCRIBE", "PSUBSCRIBE", "SSUBSCRIBE", "UNSUBSCRIBE", "PUNSUBSCRIBE", "SUNSUBSCRIBE",
        "MONITOR", "ASKING", "READONLY", "READWRITE",
    ]

    /// The slot `command` is routed by (nil: any primary), or the error that keeps it from being sent.
    static func route(_ command: [RedisArgument]) throws(RedisError) -> HashSlot? {
        guard let name = command.first else {
            throw RedisError(.server, "ERR an empty command cannot be sent")
        }
        let upper = HashSlot.uppercased(name.bytes)
        guard !connectionStateCommands.contains(upper) else {
            throw RedisError(.server, "ERR \(upper) changes the state of one connection, and the cluster client shares its connections; use a RedisClient or a RedisSubscriber on one node")
        }
        return try HashSlot.slot(of: command)
    }

    /// When a command sent now must have succeeded or failed.
    func commandDeadline() -> ContinuousClock.Instant {
        .now + configuration.waitForConnection + configuration.commandTimeout
    }

    /// Sends one command to the primary of its keys' slot (any primary when it has none) and
    /// returns its reply, following redirections and retrying as the type's documentation says.
    ///
    /// Throws `CROSSSLOT` without sending when the keys map to several slots.
    @discardableResult
    public func send(_ arguments: [RedisArgument]) async throws(RedisError) -> RESPValue {
        let slot = try Self.route(arguments)
        return try await execute(arguments, slot: slot, deadline: commandDeadline()).result.get()
    }

    /// Sends one command given as words.
    @discardableResult
    public func send(_ arguments: RedisArgument...) async throws(RedisError) -> RESPValue {
        try await send(arguments)
    }

    /// Sends `arguments` to every primary at once (`SCAN`, `INFO`, `DBSIZE`, `SCRIPT FLUSH` over
    /// the whole cluster); each primary's outcome, in the order of ``primaries``.
    ///
    /// A node that cannot be reached is retried like any command; redirections are not followed.
    public func sendToEachPrimary(_ arguments: [RedisArgument]) async throws(RedisError) -> [(node: ClusterNodeAddress, result: Result<RESPValue, RedisError>)] {
        let slot = try Self.route(arguments)
        let deadline = commandDeadline()
        try await waitForMap(until: deadline)
        let primaries = self.primaries
        return await withTaskGroup(of: (Int, Result<RESPValue, RedisError>).self) { group in
            for (index, node) in primaries.enumerated() {
                group.addTask { (index, await self.execute(arguments, slot: slot, deadline: deadline, target: .pinned(node)).result) }
            }
            var results = [Result<RESPValue, RedisError>?](repeating: nil, count: primaries.count)
            for await (index, result) in group { results[index] = result }
            return primaries.indices.map { (primaries[$0], results[$0]!) }
        }
    }

    /// Sends several commands, one pipeline per node, and returns each command's outcome in the
    /// order given.
    ///
    /// Commands answered with a redirection or a retryable error are sent again one by one, as
    /// `send` would; commands on different nodes run in no set order. Throws only when no slot
    /// map is known in time.
    public func pipeline(_ commands: [[RedisArgument]]) async throws(RedisError) -> [Result<RESPValue, RedisError>] {
        try await pipelineWithNodes(commands).map(\.result)
    }

    /// A pipeline's outcomes, each with the node that gave it.
    func pipelineWithNodes(_ commands: [[RedisArgument]]) async throws(RedisError) -> [(result: Result<RESPValue, RedisError>, node: ClusterNodeAddress?)] {
        guard !commands.isEmpty else { return [] }
        let deadline = commandDeadline()
        try await waitForMap(until: deadline)
        typealias Outcome = (result: Result<RESPValue, RedisError>, node: ClusterNodeAddress?)
        var outcomes = [Outcome?](repeating: nil, count: commands.count)
        var slots = [HashSlot?](repeating: nil, count: commands.count)
        for (index, command) in commands.enumerated() {
            do {
                slots[index] = try Self.route(command)
            } catch {
                outcomes[index] = (.failure(error), nil)
            }
        }
        // Group by primary; commands without a key all go to one primary chosen at random.
        var groups: [ClusterNodeAddress: [Int]] = [:]
        var unrouted: [Int] = []
        state.withLockedValue { state in
            let anyPrimary = state.map?.primaries.randomElement()
            for index in commands.indices where outcomes[index] == nil {
                if let owner = slots[index].map({ state.map?.primary(for: $0) }) ?? anyPrimary {
                    groups[owner, default: []].append(index)
                } else {
                    unrouted.append(index)
                }
            }
        }
        let unownedError = RedisError(.unavailable, "no primary serves the command's hash slot in the current slot map")
        // One pipeline per node. What failed in a way worth another attempt comes back with
        // its error, and goes on one by one from there.
        let firstRound = await withTaskGroup(of: [(Int, Outcome)].self) { group in
            for (node, indices) in groups {
                group.addTask {
                    let results = await self.sendPipeline(indices.map { commands[$0] }, to: node, until: deadline)
                    return zip(indices, results).map { ($0, ($1, node)) }
                }
            }
            var all: [(Int, Outcome)] = unrouted.map { ($0, (.failure(unownedError), nil)) }
            for await part in group { all += part }
            return all
        }
        var again: [(Int, RedisError, ClusterNodeAddress?)] = []
        for (index, outcome) in firstRound {
            if case .failure(let error) = outcome.result, !Self.nextStep(after: error, from: outcome.node).isFail {
                again.append((index, error, outcome.node))
            } else {
                outcomes[index] = outcome
            }
        }
        let routedSlots = slots
        let secondRound = await withTaskGroup(of: (Int, Outcome).self) { group in
            for (index, error, node) in again {
                group.addTask {
                    (index, await self.execute(commands[index], slot: routedSlots[index], deadline: deadline, after: (error, node)))
                }
            }
            var all: [(Int, Outcome)] = []
            for await part in group { all.append(part) }
            return all
        }
        for (index, outcome) in secondRound { outcomes[index] = outcome }
        return outcomes.map { $0! }
    }

    /// Sends `commands` as one pipeline on `node`'s connection. When there is no open
    /// connection in time, every command fails with ``RedisError/Code/unavailable`` (unsent).
    private func sendPipeline(_ commands: [[RedisArgument]], to node: ClusterNodeAddress, until deadline: ContinuousClock.Instant) async -> [Result<RESPValue, RedisError>] {
        do throws(RedisError) {
            let connection = try await connection(to: node, until: deadline)
            guard connection.isActive else {
                throw RedisError(.unavailable, "the connection to Redis cluster node \(node) closed before the commands were sent")
            }
            return try await connection.pipeline(commands)
        } catch {
            return commands.map { _ in .failure(error) }
        }
    }

    /// Sends one command and follows its redirections and retries until it succeeds, fails for
    /// good, or `deadline` leaves no time for another attempt. With `earlier`, the first attempt
    /// was already made (in a pipeline) and gave that error.
    func execute(
        _ command: [RedisArgument],
        slot: HashSlot?,
        deadline: ContinuousClock.Instant,
        target start: Target = .slotOwner,
        after earlier: (error: RedisError, node: ClusterNodeAddress?)? = nil
    ) async -> (result: Result<RESPValue, RedisError>, node: ClusterNodeAddress?) {
        var target = start
        var earlier = earlier
        var redirections = 0
        var attempt = 0
        while true {
            let failure: RedisError
            var node: ClusterNodeAddress?
            if let first = earlier {
                earlier = nil
                (failure, node) = first
            } else {
                do throws(RedisError) {
                    let address = try await self.address(for: target, slot: slot, until: deadline)
                    node = address
                    let connection = try await connection(to: address, until: deadline)
                    if case .asking = target {
                        return (.success(try await Self.sendAsking(command, on: connection, node: address)), address)
                    }
                    guard connection.isActive else {
                        throw RedisError(.unavailable, "the connection to Redis cluster node \(address) closed before the command was sent")
                    }
                    return (.success(try await connection.send(command)), address)
                } catch {
                    failure = error
                }
            }
            let pinned = if case .pinned = target { true } else { false }
            switch Self.nextStep(after: failure, from: node) {
            case .fail:
                return (.failure(failure), node)
            case .moved(let movedSlot, let address):
                redirections += 1
                guard !pinned else { return (.failure(failure), node) }
                guard redirections <= Self.maximumRedirections else { return (.failure(tooManyRedirections(command, failure)), node) }
                state.withLockedValue { $0.map?.assign(movedSlot, to: address) }
                logger.trace("MOVED", metadata: ["redis.command": "\(HashSlot.commandName(command))", "redis.slot": "\(movedSlot)", "redis.node": "\(address)"])
                requestRefresh()
                target = .node(address)
            case .ask(let address):
                redirections += 1
                guard !pinned else { return (.failure(failure), node) }
                guard redirections <= Self.maximumRedirections else { return (.failure(tooManyRedirections(command, failure)), node) }
                logger.trace("ASK", metadata: ["redis.command": "\(HashSlot.commandName(command))", "redis.node": "\(address)"])
                target = .asking(address)
            case .retry:
                guard !isShutdown else { return (.failure(failure), node) }
                if failure.code == .unavailable || failure.serverErrorPrefix == "CLUSTERDOWN" { requestRefresh() }
                let delay = Self.retryBackoff.delay(attempt: attempt)
                attempt += 1
                guard ContinuousClock.now + delay < deadline else { return (.failure(failure), node) }
                do {
                    try await Task.sleep(for: delay)
                } catch {
                    return (.failure(failure), node)
                }
                if !pinned { target = .slotOwner }
            }
        }
    }

    private func tooManyRedirections(_ command: [RedisArgument], _ last: RedisError) -> RedisError {
        RedisError(
            .unavailable,
            "\(HashSlot.commandName(command)) was redirected \(Self.maximumRedirections) times without reaching its slot's primary; the cluster's slots keep moving",
            underlying: last
        )
    }

    /// The node the next attempt goes to.
    private func address(for target: Target, slot: HashSlot?, until deadline: ContinuousClock.Instant) async throws(RedisError) -> ClusterNodeAddress {
        switch target {
        case .node(let address), .asking(let address), .pinned(let address):
            return address
        case .slotOwner:
            break
        }
        try await waitForMap(until: deadline)
        let owner: ClusterNodeAddress? = state.withLockedValue { state in
            guard let map = state.map else { return nil }
            if let slot { return map.primary(for: slot) }
            // Any primary will do: one with an open connection spares a connect.
            let primaries = map.primaries
            return primaries.filter { state.nodes[$0]?.connection?.isActive ?? false }.randomElement() ?? primaries.randomElement()
        }
        guard let owner else {
            throw RedisError(.unavailable, "no primary serves hash slot \(slot.map(String.init(describing:)) ?? "?") in the current slot map")
        }
        return owner
    }

    /// Classifies an error: a redirection to follow, a condition worth another attempt (the
    /// command did not run), or a failure to report.
    private static func nextStep(after error: RedisError, from node: ClusterNodeAddress?) -> NextStep {
        switch error.code {
        case .unavailable:
            return .retry
        case .server:
            break
        default:
            return .fail
        }
        switch error.serverErrorPrefix {
        case "MOVED", "ASK":
            let parts = error.message.split(separator: " ")
            guard parts.count >= 3, let number = Int(parts[1]), let slot = HashSlot(number),
                  let address = ClusterNodeAddress(redirection: parts[2], defaultHost: node?.host ?? "127.0.0.1")
            else { return .fail }
            return parts[0] == "MOVED" ? .moved(slot, address) : .ask(address)
        case "TRYAGAIN", "CLUSTERDOWN", "LOADING":
            return .retry
        default:
            return .fail
        }
    }

    /// Writes `ASKING` and `command` as one request, so that no other caller's command comes
    /// between them on the shared connection, and returns the command's reply.
    private static func sendAsking(_ command: [RedisArgument], on connection: RedisConnection, node: ClusterNodeAddress) async throws(RedisError) -> RESPValue {
        let channel = connection.channel
        var buffer = channel.allocator.buffer(capacity: 64)
        RESPEncoder.encode(["ASKING"], into: &buffer)
        RESPEncoder.encode(command, into: &buffer)
        let reply = channel.eventLoop.makePromise(of: RESPValue.self)
        let written = channel.eventLoop.makePromise(of: Void.self)
        // A write that fails never reaches the reply handler, which would fail `reply` itself.
        written.futureResult.whenFailure { error in
            reply.fail(RedisError(.connectionClosed, "the connection to Redis cluster node \(node) failed", underlying: error))
        }
        let request = RedisRequest(encoded: buffer, expectedReplies: 2, promise: reply)
        channel.eventLoop.execute {
            // Checked on the channel's loop, where it cannot change under us: not sent, so safe to retry.
            guard channel.isActive else {
                reply.fail(RedisError(.unavailable, "the connection to Redis cluster node \(node) closed before the command was sent"))
                return
            }
            channel.writeAndFlush(request, promise: written)
        }
        let replies: RESPValue
        do {
            replies = try await reply.futureResult.get()
        } catch let error as RedisError {
            throw error
        } catch {
            throw RedisError(.connectionClosed, "the connection to Redis cluster node \(node) failed", underlying: error)
        }
        guard case .array(let both) = replies, both.count == 2 else {
            throw RedisError(.protocolViolation, "Redis cluster node \(node) did not answer ASKING and the command with two replies")
        }
        for part in both {
            if case .error(let message) = part { throw RedisError(.server, message) }
        }
        return both[1]
    }
}
