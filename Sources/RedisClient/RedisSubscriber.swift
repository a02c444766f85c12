import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import ServiceLifecycle

/// Pub/sub on a dedicated connection that re-subscribes by itself after every reconnect.
///
/// The set of wanted channels lives here: ``subscribe(_:)`` and ``unsubscribe(_:)`` change it and
/// tell Redis. ``events`` delivers messages and connection changes to one consumer and finishes
/// when the subscriber stops.
public final class RedisSubscriber: RedisChannelSubscriber {
    /// Where this subscriber connects.
    public let configuration: RedisConfiguration
    /// Messages and connection changes, in order; finishes when `run()` returns.
    public let events: AsyncStream<RedisSubscriberEvent>
    private let continuation: AsyncStream<RedisSubscriberEvent>.Continuation
    private let outlet: MessageOutlet
    private let eventLoopGroup: any EventLoopGroup
    private let logger: Logger
    private let state = NIOLockedValueBox(State())
    /// Messages received so far: what the keep-alive counts as the connection being alive.
    private let received = NIOLockedValueBox(0)
    /// How many channels one SUBSCRIBE names when the whole set is re-sent after a reconnect.
    private static let batchSize = 512

    private struct State {
        var channels: Set<String> = []
        var patterns: Set<String> = []
        var references: [String: Int] = [:]
        /// SUBSCRIBEs sent and not yet confirmed, by channel: a second user of a channel waits for
        /// the first one's confirmation too, so that no one reads state before messages flow.
        var confirming: [String: EventLoopFuture<RESPValue>] = [:]
        var connection: RedisConnection?
        var shutdown = false
    }

    /// Makes a subscriber; it connects once `run()` starts.
    public init(
        configuration: RedisConfiguration,
        eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton,
        logger: Logger
    ) {
        self.configuration = configuration
        self.eventLoopGroup = eventLoopGroup
        self.logger = logger
        (events, continuation) = AsyncStream.makeStream(of: RedisSubscriberEvent.self)
        outlet = MessageOutlet(continuation)
    }

    public func handleMessages(_ handler: (@Sendable (_ channel: String, _ payload: [UInt8]) -> Bool)?) {
        outlet.set(handler)
    }

    /// Runs a subscriber for the duration of `body`; the first connection is up before `body` starts.
    public static func withSubscriber<Result: Sendable>(
        configuration: RedisConfiguration,
        eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton,
        logger: Logger,
        _ body: (RedisSubscriber) async throws -> Result
    ) async throws -> Result {
        let subscriber = RedisSubscriber(configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
        return try await subscriber.whileRunning { try await body(subscriber) }
    }

    /// The channels this subscriber wants, whether or not the connection is up.
    public var channels: Set<String> {
        state.withLockedValue { $0.channels }
    }

    /// Whether the subscriber connection is open.
    public var isConnected: Bool {
        state.withLockedValue { $0.connection?.isActive ?? false }
    }

    /// The same as ``isConnected``: one connection carries every channel.
    public var isAvailable: Bool { isConnected }

    /// Adds channels (not counted: one unsubscribe removes them) and waits until Redis confirms them.
    ///
    /// The channels are wanted from this call on: if the connection is down this throws
    /// ``RedisError/Code/unavailable``, and they are subscribed on the next connection, which is
    /// announced with ``RedisSubscriberEvent/subscribed(reconnect:)``.
    public func subscribe(_ channels: [String]) async throws(RedisError) {
        try await change(channels, subscribing: true) { state in
            let added = channels.filter { !state.channels.contains($0) }
            for channel in added { state.references[channel] = 1 }
            return added
        }
    }

    /// Removes channels; no message of theirs is delivered once this returns.
    public func unsubscribe(_ channels: [String]) async throws(RedisError) {
        try await change(channels, subscribing: false) { state in
            let removed = channels.filter { state.channels.contains($0) }
            for channel in removed { state.references[channel] = nil }
            return removed
        }
    }

    /// Counts one more user of each channel, subscribing those that had none; waits for Redis.
    ///
    /// Reference counting happens under the same lock as the commands' order on the wire, so a
    /// retain and a release of one channel from two tasks always leave Redis matching the counts.
    /// If the connection is down this throws ``RedisError/Code/unavailable``; the channels are
    /// subscribed on reconnect, announced by ``RedisSubscriberEvent/subscribed(reconnect:)``.
    public func retain(_ channels: [String]) async throws(RedisError) {
        try await change(channels, subscribing: true) { state in
            channels.filter { channel in
                state.references[channel, default: 0] += 1
                return state.references[channel] == 1
            }
        }
    }

    /// Counts one user less of each channel, unsubscribing those that have none left.
    public func release(_ channels: [String]) async throws(RedisError) {
        try await change(channels, subscribing: false) { state in
            channels.filter { channel in
                guard let count = state.references[channel] else { return false }
                if count <= 1 {
                    state.references[channel] = nil
                    return true
                }
                state.references[channel] = count - 1
                return false
            }
        }
    }

    private func change(_ channels: [String], subscribing: Bool, update: (inout State) -> [String]) async throws(RedisError) {
        guard !channels.isEmpty else { return }
        // The wanted set and the order of commands on the wire change under one lock, so that a
        // subscribe and an unsubscribe of the same channel from two tasks cannot cross over.
        let pending: [EventLoopFuture<RESPValue>]? = state.withLockedValue { state in
            let effective = update(&state)
            if subscribing { state.channels.formUnion(effective) } else { state.channels.subtract(effective) }
            // Channels already wanted by someone else may still be on their way to Redis.
            var waits = subscribing ? Set(channels).subtracting(effective).compactMap { state.confirming[$0] } : []
            if !subscribing { for channel in effective { state.confirming[channel] = nil } }
            guard !effective.isEmpty else { return waits }
            guard let connection = state.connection, connection.isActive else { return nil }
            let future = subscribing ? Self.subscribe(effective, on: connection, pubSub: configuration.pubSub) : Self.unsubscribe(effective, on: connection, pubSub: configuration.pubSub)
            if subscribing {
                for channel in effective { state.confirming[channel] = future }
                future.whenComplete { [state = self.state] _ in
                    state.withLockedValue { state in
                        for channel in effective where state.confirming[channel] === future { state.confirming[channel] = nil }
                    }
                }
            }
            waits.append(future)
            return waits
        }
        guard let pending else {
            throw RedisError(.unavailable, "the subscriber is not connected to Redis; the change applies on reconnect")
        }
        for future in pending {
            let reply: RESPValue
            do {
                reply = try await future.get()
            } catch let error as RedisError {
                throw error
            } catch {
                throw RedisError(.connectionClosed, "the subscriber connection failed", underlying: error)
            }
            if case .error(let message) = reply { throw RedisError(.server, message) }
        }
    }

    /// Queues the subscribe command of `pubSub` for `channels`: one confirmation per channel
    /// (`SSUBSCRIBE` answers a refusal once).
    private static func subscribe(_ channels: [String], on connection: RedisConnection, pubSub: RedisPubSub) -> EventLoopFuture<RESPValue> {
        let counting: RedisRequest.Counting = pubSub == .sharded ? .confirmationsOrError : .replies
        return connection.enqueue([pubSub.subscribeCommand] + channels.map { RedisArgument($0) }, expectedReplies: channels.count, counting: counting)
    }

    /// Queues the unsubscribe command of `pubSub` for `channels`. `UNSUBSCRIBE` is answered once
    /// per channel; `SUNSUBSCRIBE`'s answers are the same arrays Redis pushes unasked, so they
    /// go by as pushes, and the PING written after it tells when Redis is done with it.
    private static func unsubscribe(_ channels: [String], on connection: RedisConnection, pubSub: RedisPubSub) -> EventLoopFuture<RESPValue> {
        let arguments = channels.map { RedisArgument($0) }
        switch pubSub {
        case .classic:
            return connection.enqueue(["UNSUBSCRIBE"] + arguments, expectedReplies: channels.count)
        case .sharded:
            let done = connection.enqueue(["SUNSUBSCRIBE"] + arguments, expectedReplies: 1, counting: .pushesOnly)
            _ = connection.enqueue(["PING"], expectedReplies: 1)
            return done
        }
    }

    /// Subscribes to channels matching a glob `pattern` (PSUBSCRIBE), kept across reconnects.
    /// Classic pub/sub only: sharded channels have no patterns.
    public func subscribe(pattern: String) async throws(RedisError) {
        guard configuration.pubSub == .classic else {
            throw RedisError(.unsupported, "pattern subscriptions need classic pub/sub; sharded channels (SSUBSCRIBE) have no patterns")
        }
        let pending: EventLoopFuture<RESPValue>? = state.withLockedValue { state in
            guard state.patterns.insert(pattern).inserted, let connection = state.connection, connection.isActive else { return nil }
            return connection.enqueue(["PSUBSCRIBE", RedisArgument(pattern)], expectedReplies: 1)
        }
        guard let pending else { return }
        do {
            _ = try await pending.get()
        } catch {
            throw RedisError(.connectionClosed, "the subscriber connection failed", underlying: error)
        }
    }

    /// Waits until the first connection is established (or fails after the connect timeout).
    public func waitUntilConnected() async throws {
        let deadline = ContinuousClock.now + configuration.connectTimeout + configuration.waitForConnection
        while !isConnected {
            if ContinuousClock.now > deadline || state.withLockedValue({ $0.shutdown }) {
                throw RedisError(.unavailable, "the subscriber could not connect to Redis at \(configuration.redactedURL)")
            }
            try await Task.sleep(for: .milliseconds(10))
        }
    }

    /// Connects, subscribes to the wanted channels and keeps doing so after every disconnect.
    public func run() async throws {
        let backoff = Backoff(minimum: configuration.minimumBackoff, maximum: configuration.maximumBackoff)
        var attempt = 0
        var everConnected = false
        let continuation = self.continuation
        await withGracefulShutdownHandler {
            while !Task.isCancelled, !state.withLockedValue({ $0.shutdown }) {
                do {
                    let connection = try await RedisSentinel.connect(
                        configuration: configuration,
                        eventLoopGroup: eventLoopGroup,
                        logger: logger,
                        onPush: { [received, outlet] push in
                            received.withLockedValue { $0 &+= 1 }
                            // A `sunsubscribe` here answers this subscriber's own SUNSUBSCRIBE:
                            // one server moves no slots.
                            guard push.kind == .message else { return }
                            outlet.deliver(channel: push.channel, payload: push.payload)
                        }
                    )
                    try await resubscribe(on: connection)
                    attempt = 0
                    continuation.yield(.subscribed(reconnect: everConnected))
                    everConnected = true
                    let keepAlive = Task { await self.keepAlive(connection) }
                    await withTaskCancellationHandler {
                        await RedisSentinel.hold(connection, configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
                    } onCancel: {
                        Task { await connection.close() }
                    }
                    keepAlive.cancel()
                    state.withLockedValue { $0.connection = nil }
                    guard !Task.isCancelled, !state.withLockedValue({ $0.shutdown }) else { break }
                    logger.warning("lost the pub/sub connection to Redis; reconnecting")
                    continuation.yield(.disconnected)
                } catch {
                    let level: Logger.Level = attempt == 0 ? .warning : .debug
                    logger.log(level: level, "cannot subscribe on Redis", metadata: ["redis.url": "\(configuration.redactedURL)", "error": "\(error)"])
                }
                let delay = backoff.delay(attempt: attempt)
                attempt += 1
                try? await Task.sleep(for: delay)
            }
        } onGracefulShutdown: {
            self.shutdown()
        }
        shutdown()
        continuation.finish()
    }

    /// PINGs the connection every ``RedisConfiguration/subscriberPingInterval`` (RESP2 allows
    /// PING in subscribed mode) and closes it when, for ``RedisConfiguration/commandTimeout``
    /// (as long as any command may take), neither the answer nor any message came: a subscriber
    /// that only listens would otherwise never notice a connection that died without a FIN, and
    /// the node would stay deaf while it looked ready. Messages arriving count as life: under a
    /// flood the answer waits behind them, and dropping a busy connection would lose the very
    /// events it is delivering.
    private func keepAlive(_ connection: RedisConnection) async {
        let interval = configuration.subscriberPingInterval
        let silence = configuration.commandTimeout
        let received = self.received
        while connection.isActive {
            guard (try? await Task.sleep(for: interval)) != nil else { return }
            let answered = await withTaskGroup(of: Bool.self) { group in
                group.addTask { (try? await connection.sendRaw(["PING"], expectedReplies: 1)) != nil }
                group.addTask {
                    // Silent for a whole interval: dead. Otherwise wait on.
                    while true {
                        let before = received.withLockedValue { $0 }
                        guard (try? await Task.sleep(for: silence)) != nil else { return true }
                        if received.withLockedValue({ $0 }) == before { return false }
                    }
                }
                let first = await group.next() ?? false
                if !first { await connection.close() }
                group.cancelAll()
                return first
            }
            guard answered else {
                if !Task.isCancelled {
                    logger.warning("the pub/sub connection did not answer PING; making a new one", metadata: ["redis.url": "\(configuration.redactedURL)"])
                }
                return
            }
        }
    }

    /// Subscribes every wanted channel, then publishes the connection for changes.
    ///
    /// Channels added while this runs are caught by the loop: the connection becomes visible to
    /// ``subscribe(_:)`` only once the set it subscribed equals the wanted set.
    private func resubscribe(on connection: RedisConnection) async throws(RedisError) {
        let patterns = state.withLockedValue { Array($0.patterns) }
        if !patterns.isEmpty {
            let reply = try await connection.sendRaw(["PSUBSCRIBE"] + patterns.map { RedisArgument($0) }, expectedReplies: patterns.count)
            if case .error(let message) = reply { throw RedisError(.server, message) }
        }
        var done: Set<String> = []
        while true {
            let missing: [String]? = state.withLockedValue { state in
                let missing = state.channels.subtracting(done)
                if missing.isEmpty {
                    state.connection = connection
                    // Released while this ran: unsubscribe them, in order with later changes.
                    let stale = done.subtracting(state.channels)
                    if !stale.isEmpty {
                        _ = Self.unsubscribe(Array(stale), on: connection, pubSub: configuration.pubSub)
                    }
                    return nil
                }
                return Array(missing)
            }
            guard let missing else { return }
            for start in stride(from: 0, to: missing.count, by: Self.batchSize) {
                let batch = Array(missing[start..<min(start + Self.batchSize, missing.count)])
                let reply: RESPValue
                do {
                    reply = try await Self.subscribe(batch, on: connection, pubSub: configuration.pubSub).get()
                } catch let error as RedisError {
                    throw error
                } catch {
                    throw RedisError(.connectionClosed, "the subscriber connection failed", underlying: error)
                }
                if case .error(let message) = reply { throw RedisError(.server, message) }
            }
            done.formUnion(missing)
        }
    }

    /// Stops the subscriber and closes its connection.
    public func shutdown() {
        let connection = state.withLockedValue { state in
            state.shutdown = true
            return state.connection
        }
        if let connection { Task { await connection.close() } }
    }
}
