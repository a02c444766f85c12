import Foundation
import Logging
import RedisClient

#if canImport(Glibc)
import Glibc
#endif

/// Where the integration tests find Redis, and how they make private servers of their own.
public enum TestRedis {
    /// The shared test server: `PRESENCE_TEST_REDIS_URL`, as `make test` sets it.
    public static var url: String {
        ProcessInfo.processInfo.environment["PRESENCE_TEST_REDIS_URL"] ?? "redis://127.0.0.1:6379/0"
    }

    /// The pub/sub the tests and their gateway nodes use on the shared server:
    /// `PRESENCE_TEST_REDIS_PUBSUB` (`classic` or `sharded`); nil for the default of the URL's mode.
    public static var pubSub: String? {
        ProcessInfo.processInfo.environment["PRESENCE_TEST_REDIS_PUBSUB"].flatMap { $0.isEmpty ? nil : $0 }
    }

    /// Whether messages go out on sharded channels (a cluster, or `PRESENCE_TEST_REDIS_PUBSUB=sharded`):
    /// no pattern subscriptions then.
    public static var isSharded: Bool { configuration().pubSub == .sharded }

    /// The shared test server's configuration. A command waits up to 5 s for the connection
    /// (500 ms by default): every test of a run starts at once, and on 2 cores a first connect
    /// then took longer than 500 ms. Tests of failing fast use a server of their own.
    public static func configuration() -> RedisConfiguration {
        do {
            var configuration = try RedisConfiguration(url: url)
            if let pubSub { configuration.pubSub = try RedisPubSub(setting: pubSub, topology: configuration.topology) }
            configuration.waitForConnection = .seconds(5)
            return configuration
        } catch {
            fatalError("PRESENCE_TEST_REDIS_URL or PRESENCE_TEST_REDIS_PUBSUB is not usable: \(error)")
        }
    }

    /// A key prefix no other test uses, so tests run in parallel without FLUSHALL.
    public static func uniquePrefix(_ name: String = "t") -> String {
        "test-\(name)-\(UUID().uuidString.prefix(8).lowercased())"
    }

    /// The id of the connection named `name` (CLIENT SETNAME), to kill exactly that one.
    public static func clientID(_ admin: RedisClient, name: String) async throws -> Int {
        guard let id = try await clientIDs(admin, name: name).first else { throw RedisError(.server, "no client named \(name)") }
        return id
    }

    /// The ids of every connection named `name`: a client that raced two connects may show a
    /// second one for a moment, the one it is closing.
    public static func clientIDs(_ admin: RedisClient, name: String) async throws -> [Int] {
        let list = try await admin.send("CLIENT", "LIST").string ?? ""
        return list.split(separator: "\n").filter { $0.contains("name=\(name) ") }.compactMap { line in
            line.split(separator: " ").first(where: { $0.hasPrefix("id=") }).flatMap { Int($0.dropFirst(3)) }
        }
    }

    /// A logger for tests: warnings and above, unless `PRESENCE_TEST_LOG_LEVEL` says otherwise.
    public static func logger(_ label: String = "test") -> Logger {
        var logger = Logger(label: label)
        let level = ProcessInfo.processInfo.environment["PRESENCE_TEST_LOG_LEVEL"].flatMap(Logger.Level.init(rawValue:))
        logger.logLevel = level ?? .critical
        return logger
    }
}

/// A `redis-server` process owned by one test, on a loopback port of its own.
///
/// Stopped with SIGKILL: children started from the test runner ignore SIGTERM.
public final class RedisServerProcess: @unchecked Sendable {
    // Safe: `process` is only touched by the owning test, one call at a time, and `port` is
    // set only in init.
    public private(set) var port: Int
    private let extraArguments: [String]
    private let configFile: String?
    private var process: Process?

    /// Starts a server with `--save '' --appendonly no` plus `arguments`, on a free port (or
    /// `port`), reading `configFile` first when given (a Sentinel's, which it rewrites).
    public init(arguments: [String] = [], configFile: String? = nil, port: Int? = nil) throws {
        self.extraArguments = arguments
        self.configFile = configFile
        self.port = try port ?? Self.freePort()
        // A port handed out free is free only until something else takes it (a parallel test's
        // connection gets it as its source port), and then the server exits at once: a port
        // chosen here is chosen again, up to three times.
        var attempt = 1
        while true {
            do {
                try start()
                return
            } catch where port == nil && attempt < 3 && process?.isRunning == false {
                attempt += 1
                self.process = nil
                self.port = try Self.freePort()
            }
        }
    }

    /// The server's process id, while it runs.
    public var pid: Int32? { process?.processIdentifier }

    deinit {
        stop()
        try? FileManager.default.removeItem(at: dataFile)
    }

    /// The file a replica writes at a full sync and then loads (even with `--save ''`): one per
    /// server, in the temporary directory. With Redis's default, `dump.rdb` in the working
    /// directory (the package root under `swift test`), two replicas syncing at once in
    /// parallel tests wrote the same file, one could load the other's copy, and a
    /// `redis-server` started by hand in the package root later loaded test keys.
    public var dataFile: URL {
        FileManager.default.temporaryDirectory.appendingPathComponent("redis-test-\(port).rdb")
    }

    /// A URL for this server, with optional credentials.
    public func url(credentials: String? = nil, database: Int = 0) -> String {
        "redis://\(credentials.map { $0 + "@" } ?? "")127.0.0.1:\(port)/\(database)"
    }

    /// Starts the server again on the same port (after ``stop()``), with empty data.
    public func start() throws {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: Self.redisServerPath)
        process.arguments = (configFile.map { [$0] } ?? []) + ["--port", "\(port)", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--dir", dataFile.deletingLastPathComponent().path, "--dbfilename", dataFile.lastPathComponent] + extraArguments
        process.standardOutput = FileHandle.nullDevice
        process.standardError = FileHandle.nullDevice
        try process.run()
        self.process = process
        try waitUntilListening()
    }

    /// Kills the server at once, as a crash would.
    public func stop() {
        guard let process else { return }
        kill(process.processIdentifier, SIGKILL)
        process.waitUntilExit()
        self.process = nil
    }

    /// Runs `redis-cli` against this server; its output.
    @discardableResult
    public func cli(_ arguments: String...) throws -> String {
        try Self.cli(port: port, arguments)
    }

    /// Runs `redis-cli` against a loopback port; its output.
    @discardableResult
    public static func cli(port: Int, _ arguments: [String]) throws -> String {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        process.arguments = ["redis-cli", "-p", "\(port)"] + arguments
        let output = Pipe()
        process.standardOutput = output
        try process.run()
        process.waitUntilExit()
        return String(decoding: output.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
    }

    /// Stops the server without closing anything (SIGSTOP): connections stay open and the
    /// kernel still takes bytes, but nothing answers, as with a hung server or a half-open path.
    public func freeze() {
        if let process { kill(process.processIdentifier, SIGSTOP) }
    }

    /// Lets a frozen server run again (SIGCONT).
    public func thaw() {
        if let process { kill(process.processIdentifier, SIGCONT) }
    }

    private func waitUntilListening() throws {
        for _ in 0..<200 {
            guard process?.isRunning == true else { break }
            if Self.answersPing(port: port) { return }
            usleep(10_000)
        }
        throw RedisError(.unavailable, "redis-server did not start on port \(port)")
    }

    private static var redisServerPath: String {
        for path in ["/usr/bin/redis-server", "/usr/local/bin/redis-server"] where FileManager.default.isExecutableFile(atPath: path) {
            return path
        }
        return "/usr/bin/redis-server"
    }

    /// A port the kernel just handed out, so nothing else is on it.
    public static func freePort() throws -> Int {
        try RefusingPort().port
    }

    /// Whether a server on `port` answers PING (with PONG, or with NOAUTH when it wants a password).
    static func answersPing(port: Int) -> Bool {
        guard let fd = connectLoopback(port: port) else { return false }
        defer { close(fd) }
        let ping = Array("PING\r\n".utf8)
        guard write(fd, ping, ping.count) == ping.count else { return false }
        var reply = [UInt8](repeating: 0, count: 64)
        let count = read(fd, &reply, reply.count)
        guard count > 0 else { return false }
        let text = String(decoding: reply[..<count], as: UTF8.self)
        return text.hasPrefix("+PONG") || text.hasPrefix("-NOAUTH")
    }
}

/// A loopback port that refuses connections for as long as this value lives: a socket is bound
/// to it but never listens, so no other test can take the port meanwhile.
public final class RefusingPort: @unchecked Sendable {
    // Safe: the descriptor is only closed once, in deinit.
    public let port: Int
    private let fd: Int32

    public init() throws {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        self.fd = fd
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = 0
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let bound = withUnsafeMutablePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, length) == 0 && getsockname(fd, $0, &length) == 0 }
        }
        guard fd >= 0, bound else { throw RedisError(.unavailable, "could not reserve a port") }
        port = Int(UInt16(bigEndian: address.sin_port))
    }

    deinit { close(fd) }
}

/// Polls `condition` until it holds or `timeout` passes; returns whether it held.
public func eventually(timeout: Duration = .seconds(5), poll: Duration = .milliseconds(20), _ condition: () async throws -> Bool) async rethrows -> Bool {
    let deadline = ContinuousClock.now + timeout
    while ContinuousClock.now < deadline {
        if try await condition() { return true }
        try? await Task.sleep(for: poll)
    }
    return try await condition()
}

/// Runs `body`, which blocks its thread (it waits for a process, or reads a socket), on a thread
/// of its own. On the cooperative pool (two threads on two cores) it would stall every task of
/// the test process meanwhile, the in-process nodes' lease renewals among them: a node whose 3 s
/// lease then lapsed was reaped by its neighbour, and a test of another suite failed.
public func offThePool<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
    try await withCheckedThrowingContinuation { continuation in
        Thread { continuation.resume(with: Result { try body() }) }.start()
    }
}

/// Runs `path` with `arguments` to its end: its exit status, and what it printed (both streams).
public func runProcess(_ path: String, _ arguments: [String]) throws -> (status: Int32, output: String) {
    let process = Process()
    process.executableURL = URL(fileURLWithPath: path)
    process.arguments = arguments
    let output = Pipe()
    process.standardOutput = output
    process.standardError = output
    try process.run()
    let data = output.fileHandleForReading.readDataToEndOfFile()
    process.waitUntilExit()
    return (process.terminationStatus, String(decoding: data, as: UTF8.self))
}

/// The outcome of a Redis call as a value, for tests that expect some calls to fail.
public func outcome(_ body: () async throws -> RESPValue) async -> Result<RESPValue, RedisError> {
    do {
        return .success(try await body())
    } catch let error as RedisError {
        return .failure(error)
    } catch {
        return .failure(RedisError(.connectionClosed, "unexpected error", underlying: error))
    }
}

/// A TCP socket connected to 127.0.0.1:`port`, or `nil` when nothing listens; the caller closes it.
/// `receiveBuffer` sets `SO_RCVBUF` before connecting (the kernel doubles it, with a floor).
/// `source` binds the socket's own address and port first; `timeout` bounds the connect (else the
/// kernel's SYN retries, some two minutes when every SYN is dropped).
public func connectLoopback(
    port: Int, receiveBuffer: Int32? = nil, source: (address: String, port: Int)? = nil, timeout: Duration? = nil
) -> Int32? {
    let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
    guard fd >= 0 else { return nil }
    if var size = receiveBuffer {
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, socklen_t(MemoryLayout<Int32>.size))
    }
    if let timeout {
        // Linux bounds a blocking connect by the send timeout.
        let (seconds, attoseconds) = timeout.components
        var limit = timeval(tv_sec: Int(seconds), tv_usec: Int(attoseconds / 1_000_000_000_000))
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, socklen_t(MemoryLayout<timeval>.size))
    }
    func address(_ host: String, _ port: Int) -> sockaddr_in {
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr(host)
        address.sin_port = UInt16(port).bigEndian
        return address
    }
    if let source {
        var reuse: Int32 = 1
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &reuse, socklen_t(MemoryLayout<Int32>.size))
        var own = address(source.address, source.port)
        let bound = withUnsafePointer(to: &own) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) == 0 }
        }
        guard bound else {
            close(fd)
            return nil
        }
    }
    var peer = address("127.0.0.1", port)
    let connected = withUnsafePointer(to: &peer) { pointer in
        pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) == 0 }
    }
    guard connected else {
        close(fd)
        return nil
    }
    return fd
}
