import Logging
import Metrics
import NIOCore
import NIOPosix

/// One TCP connection to Redis with automatic pipelining: any number of tasks may send at once,
/// and each gets its own reply.
///
/// Most code uses ``RedisClient``, which reconnects; a connection is the single attempt.
public final class RedisConnection: Sendable {
    let channel: any Channel
    let configuration: RedisConfiguration
    private let logger: Logger

    private init(channel: any Channel, configuration: RedisConfiguration, logger: Logger) {
        self.channel = channel
        self.configuration = configuration
        self.logger = logger
    }

    /// Opens a connection and runs the handshake: AUTH, SELECT and CLIENT SETNAME as configured.
    ///
    /// - Parameter onPush: set for a subscriber connection; receives every pub/sub message.
    static func connect(
        configuration: RedisConfiguration,
        eventLoopGroup: any EventLoopGroup,
        logger: Logger,
        onPush: (@Sendable (RedisPush) -> Void)? = nil
    ) async throws(RedisError) -> RedisConnection {
        let channel: any Channel
        do {
            channel = try await ClientBootstrap(group: eventLoopGroup)
                .connectTimeout(TimeAmount(configuration.connectTimeout))
                .channelOption(.socketOption(.tcp_nodelay), value: 1)
                .channelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture {
                        let handler = RedisChannelHandler(
                            maxReplyBytes: configuration.maxReplyBytes,
                            commandTimeout: configuration.commandTimeout,
                            onPush: onPush
                        )
                        try channel.pipeline.syncOperations.addHandler(handler)
                    }
                }
                .connect(host: configuration.host, port: configuration.port)
                .get()
        } catch {
            throw RedisError(.unavailable, "cannot connect to Redis at \(configuration.host):\(configuration.port)", underlying: error)
        }
        let connection = RedisConnection(channel: channel, configuration: configuration, logger: logger)
        do {
            try await connection.handshake()
        } catch {
            try? await channel.close()
            throw error
        }
        return connection
    }

    private func handshake() async throws(RedisError) {
        if let password = configuration.password {
            var arguments: [RedisArgument] = ["AUTH"]
            if let username = configuration.username { arguments.append(RedisArgument(username)) }
            arguments.append(RedisArgument(password))
            do {
                _ = try await send(arguments)
            } catch where error.code == .server {
                let who = configuration.username.map { "user '\($0)'" } ?? "the default user"
                throw RedisError(.authentication, "Redis refused the credentials for \(who): \(error.message)")
            }
        }
        if configuration.database != 0 {
            _ = try await send(["SELECT", RedisArgument(configuration.database)])
        }
        if let name = configuration.clientName {
            _ = try await send(["CLIENT", "SETNAME", RedisArgument(name)])
        }
    }

    /// Whether the socket is still open.
    public var isActive: Bool { channel.isActive }

    /// Sends one command and waits for its reply.
    ///
    /// An error reply throws ``RedisError/Code/server`` and fails this command only.
    @discardableResult
    public func send(_ arguments: [RedisArgument]) async throws(RedisError) -> RESPValue {
        let started = ContinuousClock.now
        defer { Self.latency.recordNanoseconds(Backoff.nanoseconds(ContinuousClock.now - started)) }
        let reply = try await sendRaw(arguments, expectedReplies: 1)
        if case .error(let message) = reply { throw RedisError(.server, message) }
        return reply
    }

    /// Sends several commands in one write and returns each one's outcome, in order.
    public func pipeline(_ commands: [[RedisArgument]]) async throws(RedisError) -> [Result<RESPValue, RedisError>] {
        let futures = commands.map { enqueue($0, expectedReplies: 1, flush: false) }
        channel.flush()
        var results: [Result<RESPValue, RedisError>] = []
        results.reserveCapacity(futures.count)
        for future in futures {
            do {
                let reply = try await future.get()
                if case .error(let message) = reply {
                    results.append(.failure(RedisError(.server, message)))
                } else {
                    results.append(.success(reply))
                }
            } catch {
                results.append(.failure(Self.redisError(error)))
            }
        }
        return results
    }

    /// Sends a command answered by `expectedReplies` replies; error replies come back as values.
    func sendRaw(_ arguments: [RedisArgument], expectedReplies: Int) async throws(RedisError) -> RESPValue {
        do {
            return try await enqueue(arguments, expectedReplies: expectedReplies, flush: true).get()
        } catch {
            throw Self.redisError(error)
        }
    }

    func enqueue(_ arguments: [RedisArgument], expectedReplies: Int, flush: Bool) -> EventLoopFuture<RESPValue> {
        var buffer = channel.allocator.buffer(capacity: 64)
        RESPEncoder.encode(arguments, into: &buffer)
        let promise = channel.eventLoop.makePromise(of: RESPValue.self)
        let request = RedisRequest(encoded: buffer, expectedReplies: expectedReplies, promise: promise)
        // On a channel that is already closed the handler is gone and nobody would complete the
        // reply promise; the write's own failure does it (a second completion is ignored).
        let written = channel.eventLoop.makePromise(of: Void.self)
        written.futureResult.whenFailure { error in
            promise.fail(RedisError(.connectionClosed, "the connection to Redis is closed", underlying: error))
        }
        if flush {
            channel.writeAndFlush(request, promise: written)
        } else {
            channel.write(request, promise: written)
        }
        if logger.logLevel <= .trace {
            // Only the command name: arguments can hold secrets.
            logger.trace("redis command", metadata: ["redis.command": "\(arguments.first.map { String(decoding: $0.bytes, as: UTF8.self) } ?? "")"])
        }
        return promise.futureResult
    }

    /// Closes the connection; pending commands fail with ``RedisError/Code/connectionClosed``.
    public func close() async {
        try? await channel.close()
    }

    /// Completes when the connection is closed, by either side.
    func closed() async {
        try? await channel.closeFuture.get()
    }

    /// Time from sending a command to its reply, through swift-metrics (`/metrics` on a node).
    static let latency = Metrics.Timer(label: "redis_command_duration_seconds")

    private static func redisError(_ error: any Error) -> RedisError {
        if let error = error as? RedisError { return error }
        return RedisError(.connectionClosed, "the connection to Redis failed", underlying: error)
    }
}
