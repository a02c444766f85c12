import Foundation

/// A `presence-gateway` process from the build folder, on a loopback port of its own, for tests
/// that kill nodes.
public final class GatewayProcess: @unchecked Sendable {
    // Safe: `process` is only touched by the owning test, one call at a time.
    public let port: Int
    public let nodeID: String
    private let process: Process
    private let log: URL

    /// The built binary: `PRESENCE_GATEWAY_BIN`, else `.build/debug/presence-gateway`.
    public static var binary: URL {
        if let path = ProcessInfo.processInfo.environment["PRESENCE_GATEWAY_BIN"] { return URL(fileURLWithPath: path) }
        var root = URL(fileURLWithPath: #filePath)
        for _ in 0..<3 { root.deleteLastPathComponent() }
        return root.appendingPathComponent(".build/debug/presence-gateway")
    }

    /// Starts a node with `environment` (`PRESENCE_*` values) over `port` (a free one when nil:
    /// pass a killed node's to restart it where its clients look) and the node id, and waits
    /// until it answers `/healthz`. `binary` replaces ``binary`` (a release build, say). With
    /// `group`, the node runs with that group id (through `setpriv`), so that iptables can tell
    /// its packets from every other process's by their owner (`-m owner --gid-owner`).
    /// `startWithin` bounds the wait for `/healthz` (longer for a node run under valgrind).
    public init(
        nodeID: String, environment: [String: String], port: Int? = nil, binary: URL? = nil, group: UInt32? = nil,
        startWithin: Duration = .seconds(20)
    ) async throws {
        self.port = try port ?? RedisServerProcess.freePort()
        self.nodeID = nodeID
        log = FileManager.default.temporaryDirectory.appendingPathComponent("gateway-\(nodeID)-\(UUID().uuidString).log")
        _ = FileManager.default.createFile(atPath: log.path, contents: nil)
        process = Process()
        if let group {
            process.executableURL = URL(fileURLWithPath: "/usr/bin/setpriv")
            process.arguments = ["--regid", "\(group)", "--clear-groups", (binary ?? Self.binary).path]
        } else {
            process.executableURL = binary ?? Self.binary
        }
        var variables = ProcessInfo.processInfo.environment.filter { !$0.key.hasPrefix("PRESENCE_") }
        variables.merge(environment) { _, new in new }
        if variables["PRESENCE_REDIS_PUBSUB"] == nil, let pubSub = TestRedis.pubSub { variables["PRESENCE_REDIS_PUBSUB"] = pubSub }
        variables["PRESENCE_PORT"] = "\(self.port)"
        variables["PRESENCE_HOST"] = "127.0.0.1"
        variables["PRESENCE_NODE_ID"] = nodeID
        variables["PRESENCE_LOG_LEVEL"] = variables["PRESENCE_LOG_LEVEL"] ?? "warning"
        process.environment = variables
        process.standardOutput = try FileHandle(forWritingTo: log)
        process.standardError = try FileHandle(forWritingTo: log)
        try process.run()
        let healthy = await eventually(timeout: startWithin, poll: .milliseconds(50)) { Self.httpStatus(port: self.port, path: "/healthz") == 200 }
        guard healthy else {
            kill()
            throw GatewayProcessError("presence-gateway \(nodeID) did not answer /healthz within \(startWithin): \(output)")
        }
    }

    deinit {
        kill()
        try? FileManager.default.removeItem(at: log)
    }

    /// The process id of the node (or of what runs it: `setpriv`, a wrapper that execs).
    public var pid: Int32 { process.processIdentifier }

    /// The node's resident memory (VmRSS of /proc), or nil once it is gone.
    public var residentBytes: Int? {
        guard let status = try? String(contentsOfFile: "/proc/\(process.processIdentifier)/status", encoding: .utf8),
              let line = status.split(separator: "\n").first(where: { $0.hasPrefix("VmRSS:") }),
              let kilobytes = Int(line.split(separator: " ").dropFirst().first ?? "") else { return nil }
        return kilobytes * 1024
    }

    /// The CPU time the node has used (user and system, from /proc), or nil once it is gone.
    public var cpuSeconds: Double? {
        processorSeconds(pid: process.processIdentifier)
    }

    /// What the node printed.
    public var output: String { (try? String(contentsOf: log, encoding: .utf8)) ?? "" }

    /// SIGKILL, as a crash or an OOM kill would; returns once the process is gone.
    public func kill() {
        guard process.isRunning else { return }
        Foundation.kill(process.processIdentifier, SIGKILL)
        process.waitUntilExit()
    }

    /// SIGSTOP: the node is frozen, as a paused VM or a long stall is; its connections stay
    /// open and nothing on it runs until ``resume()``.
    public func pause() {
        guard process.isRunning else { return }
        Foundation.kill(process.processIdentifier, SIGSTOP)
    }

    /// SIGCONT after ``pause()``.
    public func resume() {
        guard process.isRunning else { return }
        Foundation.kill(process.processIdentifier, SIGCONT)
    }

    /// SIGTERM, as an orchestrator's stop is: the node drains its sessions, then exits. Returns
    /// at once.
    public func terminate() {
        guard process.isRunning else { return }
        process.terminate()
    }

    /// Whether the process has exited by `timeout` from now.
    public func exited(within timeout: Duration) async -> Bool {
        await eventually(timeout: timeout, poll: .milliseconds(20)) { !self.process.isRunning }
    }

    /// The status of a GET of `path` on a loopback port, or `nil` when nothing answers.
    public static func httpStatus(port: Int, path: String, headers: [String: String] = [:]) -> Int? {
        httpGet(port: port, path: path, headers: headers)?.status
    }

    /// A GET on a loopback port: the status and the body.
    public static func httpGet(port: Int, path: String, headers: [String: String] = [:]) -> (status: Int, body: String)? {
        http(port: port, method: "GET", path: path, headers: headers)
    }

    /// A request on a loopback port with a plain socket (no URLSession state between tests):
    /// the status and the body, or `nil` when nothing answers.
    public static func http(port: Int, method: String, path: String, headers: [String: String] = [:], body: String? = nil) -> (status: Int, body: String)? {
        guard let text = exchange(port: port, method: method, path: path, headers: headers, body: body),
              let status = Int(text.dropFirst(9).prefix(3)) else { return nil }
        let body = text.range(of: "\r\n\r\n").map { String(text[$0.upperBound...]) } ?? ""
        return (status, body)
    }

    /// The node's wall clock as its `Date` header gives it (whole seconds), from a GET of `/healthz`.
    public static func wallClock(port: Int) -> Date? {
        guard let text = exchange(port: port, method: "GET", path: "/healthz", headers: [:], body: nil),
              let head = text.range(of: "\r\n\r\n").map({ text[..<$0.lowerBound] }),
              let line = head.split(separator: "\r\n").first(where: { $0.lowercased().hasPrefix("date:") }) else { return nil }
        let formatter = DateFormatter()
        formatter.locale = Locale(identifier: "en_US_POSIX")
        formatter.timeZone = TimeZone(identifier: "GMT")
        formatter.dateFormat = "EEE, dd MMM yyyy HH:mm:ss zzz"
        return formatter.date(from: line.dropFirst(5).trimmingCharacters(in: .whitespaces))
    }

    /// One request and the whole response as text, or `nil` when nothing answers.
    private static func exchange(port: Int, method: String, path: String, headers: [String: String], body: String?) -> String? {
        guard let fd = connectLoopback(port: port) else { return nil }
        defer { close(fd) }
        var timeout = timeval(tv_sec: 5, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        // `Connection: close` unless the caller sets its own (an upgrade).
        var request = "\(method) \(path) HTTP/1.1\r\nHost: 127.0.0.1:\(port)\r\n" + (headers["Connection"] == nil ? "Connection: close\r\n" : "")
        for (name, value) in headers { request += "\(name): \(value)\r\n" }
        if let body { request += "Content-Type: application/json\r\nContent-Length: \(body.utf8.count)\r\n" }
        request += "\r\n" + (body ?? "")
        let bytes = Array(request.utf8)
        guard write(fd, bytes, bytes.count) == bytes.count else { return nil }
        var response: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 65_536)
        while true {
            let count = read(fd, &buffer, buffer.count)
            if count <= 0 { break }
            response += buffer[..<count]
        }
        let text = String(decoding: response, as: UTF8.self)
        return text.hasPrefix("HTTP/1.1 ") ? text : nil
    }
}

/// A gateway process that did not start.
public struct GatewayProcessError: Error, CustomStringConvertible {
    public let description: String
    public init(_ description: String) { self.description = description }
}

/// The user and system CPU time of process `pid` in seconds (/proc/PID/stat), or nil if it is gone.
public func processorSeconds(pid: Int32) -> Double? {
    guard let stat = try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8),
          let end = stat.lastIndex(of: ")") else { return nil }
    // After the command's ")": state is field 3 of the line, utime and stime fields 14 and 15.
    let fields = stat[stat.index(after: end)...].split(separator: " ")
    guard fields.count > 12, let user = Double(fields[11]), let system = Double(fields[12]) else { return nil }
    return (user + system) / Double(sysconf(Int32(_SC_CLK_TCK)))
}
