import Logging
import NIOConcurrencyHelpers
import Metrics
import NIOCore
import NIOPosix
import NIOSSL

/// One TCP connection to Redis with automatic pipelining: any number of tasks may send at once,
/// and each gets its own reply.
///
/// Most code uses ``RedisClient``, which reconnects; a connection is the single attempt.
public final class RedisConnection: Sendable {
    let channel: any Channel
    let configuration: RedisConfiguration
    private let logger: Logger
    private let outbox = NIOLockedValueBox(Outbox())
    /// A `READONLY` reply came: the server is a replica now, and the connection is closing.
    private let demoted = NIOLockedValueBox(false)
    /// Why the connection failed, once it has (set by its channel handler).
    private let closedBy: NIOLockedValueBox<RedisError?>

    private struct Outbox {
        var requests: [RedisRequest] = []
        var scheduled = false
    }

    private init(channel: any Channel, configuration: RedisConfiguration, logger: Logger, closedBy: NIOLockedValueBox<RedisError?>) {
        self.closedBy = closedBy
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
        let tlsContext: NIOSSLContext?
        do {
            tlsContext = try configuration.tls.map(Self.tlsContext)
        } catch {
            throw RedisError(.unavailable, "cannot set up TLS for Redis: \(error)", underlying: error)
        }
        let closedBy = NIOLockedValueBox<RedisError?>(nil)
        let channel: any Channel
        do {
            channel = try await ClientBootstrap(group: eventLoopGroup)
                .connectTimeout(TimeAmount(configuration.connectTimeout))
                // A TCP option: `.socketOption(.tcp_nodelay)` would set SOL_SOCKET's option 1,
                // SO_DEBUG, which only a privileged process may set (every connection of a node
                // run as a plain user failed with EACCES).
                .channelOption(.tcpOption(.tcp_nodelay), value: 1)
                .channelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture {
                        if let tlsContext {
                            // SNI takes a name only; an IP address is verified against the certificate's IP SANs.
                            let name = (try? SocketAddress(ipAddress: configuration.host, port: 0)) == nil ? configuration.host : nil
                            try channel.pipeline.syncOperations.addHandler(NIOSSLClientHandler(context: tlsContext, serverHostname: name))
                        }
                        let handler = RedisChannelHandler(
                            maxReplyBytes: configuration.maxReplyBytes,
                            stallTimeout: configuration.stallTimeout,
                            heartbeat: onPush == nil ? configuration.heartbeatInterval : nil,
                            closedBy: closedBy,
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
        let connection = RedisConnection(channel: channel, configuration: configuration, logger: logger, closedBy: closedBy)
        do {
            try await connection.handshake()
        } catch {
            try? await channel.close()
            throw error
        }
        return connection
    }

    private static func tlsContext(_ tls: RedisConfiguration.TLS) throws -> NIOSSLContext {
        var settings = TLSConfiguration.makeClientConfiguration()
        settings.certificateVerification = .fullVerification
        if let caFile = tls.caFile { settings.trustRoots = .file(caFile) }
        if let certificateFile = tls.certificateFile, let keyFile = tls.keyFile {
            settings.certificateChain = try NIOSSLCertificate.fromPEMFile(certificateFile).map { .certificate($0) }
            settings.privateKey = .privateKey(try NIOSSLPrivateKey(file: keyFile, format: .pem))
        }
        return try NIOSSLContext(configuration: settings)
    }

    private func handshake() async throws(RedisError) {
        do {
            try await authenticateAndSelect()
        } catch where configuration.tls != nil && (error.code == .connectionClosed || error.code == .timeout) {
            // Over TLS, a connection closed during the handshake is a refused certificate (ours
            // or the server's); no answer at all is most likely a port that does not speak TLS.
            let reason = error.code == .timeout
                ? "no answer to the TLS handshake (is \(configuration.port) Redis's tls-port?)"
                : error.underlying.map { "\($0)" } ?? error.message
            throw RedisError(.unavailable, "TLS connection to Redis at \(configuration.host):\(configuration.port) failed: \(reason)", underlying: error)
        }
    }

    private func authenticateAndSelect() async throws(RedisError) {
        if configuration.tls != nil && configuration.password == nil {
            // The first reply proves the TLS handshake, so a bad certificate fails the connect
            // instead of the first command later.
            _ = try await send(["PING"])
        }
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

    /// Whether the connection takes commands: its socket is open and no `READONLY` reply has
    /// closed it. The close that reply starts runs on the event loop, a moment later; a command
    /// handed this connection meanwhile would fail as closed rather than wait for the next one.
    public var isActive: Bool { channel.isActive && !demoted.withLockedValue { $0 } }

    /// The server this connection reached.
    public var address: RedisConfiguration.Address { RedisConfiguration.Address(host: configuration.host, port: configuration.port) }

    /// The error a command gets when its reply is an error; a `READONLY` reply also closes the
    /// connection. That reply means the server was demoted to a replica (a failover moved the
    /// primary, or a managed endpoint's name now points elsewhere): the command did not run, and
    /// the next connection is made to wherever the primary is now.
    private func failure(_ message: String) -> RedisError {
        guard message.hasPrefix("READONLY") else { return RedisError(.server, message) }
        // A pipeline can bring many such replies: the first one closes.
        let first = demoted.withLockedValue { seen in
            defer { seen = true }
            return !seen
        }
        if first {
            logger.warning("Redis answered READONLY: it is a replica now; reconnecting to the primary", metadata: ["redis.server": "\(address)"])
            channel.close(promise: nil)
        }
        return RedisError(.unavailable, "Redis at \(address) is a replica now (\(message)); reconnecting to the primary")
    }

    /// Sends one command and waits for its reply.
    ///
    /// An error reply throws ``RedisError/Code/server`` and fails this command only; `READONLY`
    /// throws ``RedisError/Code/unavailable`` and closes the connection.
    @discardableResult
    public func send(_ arguments: [RedisArgument]) async throws(RedisError) -> RESPValue {
        let started = ContinuousClock.now
        defer { Self.latency.recordNanoseconds(Backoff.nanoseconds(ContinuousClock.now - started)) }
        let reply = try await sendRaw(arguments, expectedReplies: 1)
        if case .error(let message) = reply { throw failure(message) }
        return reply
    }

    /// Sends several commands in one write and returns each one's outcome, in order.
    ///
    /// The commands go into the outbox together and are waited for together: queued one at a
    /// time, each could be written on its own, as the loop woken by the first took the outbox
    /// before the next was in it (on two cores the woken loop preempts the task at once), and
    /// each reply awaited on its own resumed the task once per command.
    public func pipeline(_ commands: [[RedisArgument]]) async throws(RedisError) -> [Result<RESPValue, RedisError>] {
        let futures = enqueue(commands)
        let replies: [Result<RESPValue, any Error>]
        do {
            replies = try await EventLoopFuture.whenAllComplete(futures, on: channel.eventLoop).get()
        } catch {
            throw Self.redisError(error)
        }
        return replies.map { reply in
            switch reply {
            case .success(.error(let message)): .failure(failure(message))
            case .success(let value): .success(value)
            case .failure(let error): .failure(Self.redisError(error))
            }
        }
    }

    /// Sends a command answered by `expectedReplies` replies (counted as `counting` says);
    /// error replies come back as values.
    func sendRaw(_ arguments: [RedisArgument], expectedReplies: Int, counting: RedisRequest.Counting = .replies) async throws(RedisError) -> RESPValue {
        do {
            return try await enqueue(arguments, expectedReplies: expectedReplies, counting: counting).get()
        } catch {
            throw Self.redisError(error)
        }
    }

    /// Queues a command; the returned future completes with its reply (error replies included).
    ///
    /// Commands from every task go into one outbox; the first one into an empty outbox schedules
    /// a single event-loop task that writes everything queued by then and flushes once. That is
    /// the automatic pipelining: one loop hop and one syscall for a whole burst of commands.
    func enqueue(_ arguments: [RedisArgument], expectedReplies: Int, counting: RedisRequest.Counting = .replies) -> EventLoopFuture<RESPValue> {
        let request = request(arguments, expectedReplies: expectedReplies, counting: counting)
        queue { $0.append(request) }
        return request.promise.futureResult
    }

    /// Queues commands of one reply each, all at once (see ``pipeline(_:)``).
    func enqueue(_ commands: [[RedisArgument]]) -> [EventLoopFuture<RESPValue>] {
        let requests = commands.map { request($0, expectedReplies: 1, counting: .replies) }
        queue { $0.append(contentsOf: requests) }
        return requests.map(\.promise.futureResult)
    }

    private func request(_ arguments: [RedisArgument], expectedReplies: Int, counting: RedisRequest.Counting) -> RedisRequest {
        var buffer = channel.allocator.buffer(capacity: 64)
        RESPEncoder.encode(arguments, into: &buffer)
        if logger.logLevel <= .trace {
            // Only the command name: arguments can hold secrets.
            logger.trace("redis command", metadata: ["redis.command": "\(arguments.first.map { String(decoding: $0.bytes, as: UTF8.self) } ?? "")"])
        }
        return RedisRequest(encoded: buffer, expectedReplies: expectedReplies, promise: channel.eventLoop.makePromise(of: RESPValue.self), counting: counting)
    }

    /// Adds to the outbox; the first addition to an empty one schedules its drain.
    private func queue(_ add: (inout [RedisRequest]) -> Void) {
        let schedule = outbox.withLockedValue { outbox -> Bool in
            add(&outbox.requests)
            guard !outbox.scheduled else { return false }
            outbox.scheduled = true
            return true
        }
        if schedule {
            channel.eventLoop.execute { self.drainOutbox() }
        }
    }

    /// Writes every queued command and flushes once; runs on the channel's event loop.
    private func drainOutbox() {
        let batch = outbox.withLockedValue { outbox -> [RedisRequest] in
            let batch = outbox.requests
            outbox.requests.removeAll(keepingCapacity: true)
            outbox.scheduled = false
            return batch
        }
        guard channel.isActive else {
            let error = closedBy.withLockedValue { $0 } ?? RedisError(.connectionClosed, "the connection to Redis is closed")
            for request in batch { request.promise.fail(error) }
            return
        }
        for request in batch { channel.write(request, promise: nil) }
        channel.flush()
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
