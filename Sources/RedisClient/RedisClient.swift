import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import ServiceLifecycle

/// What happened to the client's connection; observers use it to repair state after an outage.
public enum RedisConnectionEvent: Sendable, Equatable {
    /// A connection is established. `reconnect` is false for the first one.
    case connected(reconnect: Bool)
    /// The connection was lost; commands fail until the next `connected`.
    case disconnected
    /// A server answered that it cannot serve commands now (a cluster's `CLUSTERDOWN`, a node
    /// still `LOADING` its data): commands wait for it within their time budget, and may still
    /// succeed. Whatever had to be renewed meanwhile (a lease) may have lapsed all the same.
    case refused
}

/// A Redis client that keeps a pipelined connection open per event loop of its group and
/// reconnects with backoff.
///
/// A command sent from one of the group's event loops (a session's work runs on its
/// connection's loop) goes out on that loop's connection, and its reply completes there: no
/// thread wakes for it. Commands from anywhere else take the first connection. The connections
/// are one unit: the first is made (through Sentinel when configured), the others to the same
/// server; when any of them closes, all are closed and made again, and observers hear one
/// ``RedisConnectionEvent/disconnected`` and one ``RedisConnectionEvent/connected(reconnect:)``.
/// A loop whose connection could not be made sends on the first one until the next reconnect.
///
/// Run it as a `Service` (or inside ``withClient(configuration:eventLoopGroup:logger:_:)``).
/// Commands sent while it is (re)connecting wait at most
/// ``RedisConfiguration/waitForConnection`` and then fail with ``RedisError/Code/unavailable``:
/// nothing ever hangs on a dead Redis.
public final class RedisClient: Service, Sendable {
    /// Where this client connects.
    public let configuration: RedisConfiguration
    private let eventLoopGroup: any EventLoopGroup
    private let logger: Logger
    private let state = NIOLockedValueBox(State())
    private let observers = ConnectionObservers()

    private struct State {
        var connection: RedisConnection?
        /// The connections of the other event loops, made beside `connection`.
        var loopConnections: [RedisConnection] = []
        var waiters: [Int: CheckedContinuation<RedisConnection, any Error>] = [:]
        var nextWaiterID = 0
        var lastError: RedisError?
        var shutdown = false
    }

    /// Makes a client; it connects once `run()` starts.
    public init(
        configuration: RedisConfiguration,
        eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton,
        logger: Logger
    ) {
        self.configuration = configuration
        self.eventLoopGroup = eventLoopGroup
        self.logger = logger
    }

    /// Runs a client for the duration of `body`, connected before `body` starts.
    ///
    /// Throws if the first connection fails, so a command line tool can report it and exit.
    public static func withClient<Result: Sendable>(
        configuration: RedisConfiguration,
        eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton,
        logger: Logger,
        _ body: (RedisClient) async throws -> Result
    ) async throws -> Result {
        let client = RedisClient(configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
        let first = try await RedisSentinel.connect(configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
        return try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask { try await client.run(startingWith: first) }
            defer {
                client.shutdown()
                group.cancelAll()
            }
            return try await body(client)
        }
    }

    /// Whether a connection is open right now.
    public var isConnected: Bool {
        state.withLockedValue { $0.connection?.isActive ?? false }
    }

    /// Registers `observer` for connection events; keep the token to remove it.
    @discardableResult
    public func addConnectionObserver(_ observer: @escaping @Sendable (RedisConnectionEvent) -> Void) -> Int {
        observers.add(observer)
    }

    /// Removes an observer added with ``addConnectionObserver(_:)``.
    public func removeConnectionObserver(_ token: Int) {
        observers.remove(token)
    }

    /// Connects, and reconnects with exponential backoff and jitter until shut down.
    public func run() async throws {
        try await run(startingWith: nil)
    }

    private func run(startingWith first: RedisConnection?) async throws {
        let backoff = Backoff(minimum: configuration.minimumBackoff, maximum: configuration.maximumBackoff)
        var pendingFirst = first
        var attempt = 0
        var everConnected = false
        await withGracefulShutdownHandler {
            while !Task.isCancelled, !state.withLockedValue({ $0.shutdown }) {
                do {
                    let connection: RedisConnection
                    if let first = pendingFirst {
                        connection = first
                        pendingFirst = nil
                    } else {
                        connection = try await connect()
                    }
                    attempt = 0
                    let event = RedisConnectionEvent.connected(reconnect: everConnected)
                    everConnected = true
                    install(connection)
                    logger.info("connected to Redis", metadata: ["redis.url": "\(configuration.redactedURL)", "redis.server": "\(connection.address)"])
                    observers.notify(event)
                    // The other loops' connections join as they open; until then, and for a
                    // loop whose connection fails, the first one serves.
                    let joining = Task { await self.connectLoops(beside: connection) }
                    await withTaskCancellationHandler {
                        await RedisSentinel.hold(connection, configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
                    } onCancel: {
                        Task { await connection.close() }
                    }
                    joining.cancel()
                    let loopConnections = state.withLockedValue { state in
                        state.connection = nil
                        defer { state.loopConnections = [] }
                        return state.loopConnections
                    }
                    for loopConnection in loopConnections { await loopConnection.close() }
                    guard !Task.isCancelled, !state.withLockedValue({ $0.shutdown }) else { break }
                    logger.warning("lost the connection to Redis; reconnecting", metadata: ["redis.url": "\(configuration.redactedURL)"])
                    observers.notify(.disconnected)
                } catch {
                    state.withLockedValue { $0.lastError = error as? RedisError }
                    let level: Logger.Level = attempt == 0 ? .warning : .debug
                    logger.log(level: level, "cannot reach Redis", metadata: ["redis.url": "\(configuration.redactedURL)", "error": "\(error)"])
                }
                let delay = backoff.delay(attempt: attempt)
                attempt += 1
                try? await Task.sleep(for: delay)
            }
        } onGracefulShutdown: {
            self.shutdown()
        }
        shutdown()
    }

    /// One connection, through Sentinel when configured; with a hedge interval, attempts overlap
    /// (see ``RedisConfiguration/connectHedgeInterval``): the first to connect wins at once, and
    /// those still under way close their connection when they get one. Throws the last failure
    /// once no attempt is under way.
    private func connect() async throws -> RedisConnection {
        let configuration = self.configuration
        let eventLoopGroup = self.eventLoopGroup
        let logger = self.logger
        let attempt: @Sendable () async throws -> RedisConnection = {
            try await RedisSentinel.connect(configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
        }
        guard let interval = configuration.connectHedgeInterval else { return try await attempt() }
        return try await ConnectRace().run(interval: interval, limit: 10, attempt)
    }

    /// Opens a connection to `first`'s server on each other event loop of the group and adds
    /// each to the client as it opens, while `first` is still the client's open connection (else
    /// closes it). Each closes `first` when it closes, so that all are made again together. A
    /// loop whose connection fails gets none: its commands take `first`.
    private func connectLoops(beside first: RedisConnection) async {
        let others = eventLoopGroup.makeIterator().filter { $0 !== first.channel.eventLoop }
        let configuration = first.configuration
        let logger = self.logger
        await withTaskGroup(of: Void.self) { group in
            for loop in others {
                group.addTask {
                    let connection: RedisConnection
                    do {
                        connection = try await RedisConnection.connect(configuration: configuration, eventLoopGroup: loop, logger: logger)
                        // A server at `maxclients` accepts, answers the first command with an
                        // error and closes: such a connection must not join (its close would
                        // drop the others, again and again).
                        do {
                            _ = try await connection.send(["PING"])
                        } catch {
                            await connection.close()
                            throw error
                        }
                    } catch {
                        logger.warning("cannot open an event loop's own connection to Redis; its commands take the first one", metadata: ["redis.server": "\(first.address)", "error": "\(error)"])
                        return
                    }
                    let joined = self.state.withLockedValue { state -> Bool in
                        guard state.connection === first, first.isActive, !Task.isCancelled else { return false }
                        state.loopConnections.append(connection)
                        return true
                    }
                    guard joined else {
                        await connection.close()
                        return
                    }
                    connection.channel.closeFuture.whenComplete { _ in first.channel.close(promise: nil) }
                }
            }
        }
    }

    /// How many event loops have a connection of their own open now (for tests).
    var loopConnectionCount: Int {
        state.withLockedValue { state in state.loopConnections.filter { $0.isActive }.count }
    }

    /// Stops reconnecting and closes the connections; waiting and later commands fail.
    public func shutdown() {
        let (connection, loopConnections, waiters) = state.withLockedValue { state in
            state.shutdown = true
            let waiters = state.waiters
            state.waiters = [:]
            return (state.connection, state.loopConnections, waiters)
        }
        for waiter in waiters.values {
            waiter.resume(throwing: RedisError(.unavailable, "the Redis client is shut down"))
        }
        if let connection {
            Task { await connection.close() }
        }
        for loopConnection in loopConnections {
            Task { await loopConnection.close() }
        }
    }

    private func install(_ connection: RedisConnection) {
        let waiters = state.withLockedValue { state in
            state.connection = connection
            state.lastError = nil
            let waiters = state.waiters
            state.waiters = [:]
            return waiters
        }
        for waiter in waiters.values { waiter.resume(returning: connection) }
    }


    /// The open connection of the calling event loop, else the first one, or the first one
    /// once it opens within ``RedisConfiguration/waitForConnection``.
    func connection() async throws(RedisError) -> RedisConnection {
        enum Lookup { case ready(RedisConnection), failed(RedisError), wait }
        let lookup: Lookup = state.withLockedValue { state in
            if let connection = state.connection, connection.isActive {
                for loopConnection in state.loopConnections where loopConnection.channel.eventLoop.inEventLoop {
                    return .ready(loopConnection.isActive ? loopConnection : connection)
                }
                return .ready(connection)
            }
            if state.shutdown { return .failed(RedisError(.unavailable, "the Redis client is shut down")) }
            return .wait
        }
        switch lookup {
        case .ready(let connection): return connection
        case .failed(let error): throw error
        case .wait: break
        }
        do {
            return try await waitForConnection()
        } catch let error as RedisError {
            throw error
        } catch {
            throw RedisError(.unavailable, "Redis is unreachable", underlying: error)
        }
    }

    private func waitForConnection() async throws -> RedisConnection {
        let limit = configuration.waitForConnection
        let loop = eventLoopGroup.any()
        return try await withCheckedThrowingContinuation { continuation in
            let id: Int? = state.withLockedValue { state in
                if let connection = state.connection, connection.isActive {
                    continuation.resume(returning: connection)
                    return nil
                }
                state.nextWaiterID += 1
                state.waiters[state.nextWaiterID] = continuation
                return state.nextWaiterID
            }
            guard let id else { return }
            loop.scheduleTask(in: TimeAmount(limit)) {
                let (waiter, cause) = self.state.withLockedValue { ($0.waiters.removeValue(forKey: id), $0.lastError) }
                waiter?.resume(throwing: RedisError(
                    .unavailable,
                    "Redis at \(self.configuration.redactedURL) is unreachable",
                    underlying: cause
                ))
            }
        }
    }

    /// Sends one command and returns its reply; an error reply throws ``RedisError/Code/server``.
    @discardableResult
    public func send(_ arguments: [RedisArgument]) async throws(RedisError) -> RESPValue {
        try await connection().send(arguments)
    }

    /// Sends one command given as words.
    @discardableResult
    public func send(_ arguments: RedisArgument...) async throws(RedisError) -> RESPValue {
        try await send(arguments)
    }

    /// `WAIT replicas timeout` on every open connection at once (a write may have gone out on any
    /// of them): the fewest replicas any of them counts. A connection that wrote nothing
    /// answers at once with every replica.
    func waitForReplicasOnEveryConnection(_ replicas: Int, timeoutMilliseconds: Int) async throws(RedisError) -> Int {
        // Waits for the first connection if there is none yet; a loop would get its own here.
        _ = try await connection()
        let all = state.withLockedValue { state in (state.connection.map { [$0] } ?? []) + state.loopConnections }.filter { $0.isActive }
        guard !all.isEmpty else { throw RedisError(.unavailable, "the connection to Redis closed while waiting for replicas") }
        let command: [RedisArgument] = ["WAIT", RedisArgument(replicas), RedisArgument(timeoutMilliseconds)]
        let counts = await withTaskGroup(of: Result<Int, RedisError>.self) { group in
            for connection in all {
                group.addTask {
                    do throws(RedisError) {
                        return .success(try await connection.send(command).int ?? 0)
                    } catch {
                        return .failure(error)
                    }
                }
            }
            var counts: [Result<Int, RedisError>] = []
            for await count in group { counts.append(count) }
            return counts
        }
        var fewest = Int.max
        for count in counts { fewest = min(fewest, try count.get()) }
        return fewest
    }

    /// Sends several commands in one write; each result is that command's reply or error.
    public func pipeline(_ commands: [[RedisArgument]]) async throws(RedisError) -> [Result<RESPValue, RedisError>] {
        guard !commands.isEmpty else { return [] }
        return try await connection().pipeline(commands)
    }
}
