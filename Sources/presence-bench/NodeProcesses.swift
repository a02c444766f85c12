import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import JWTKit
import NIOCore
import NIOPosix

/// Gateway nodes as real `presence-gateway` processes on loopback, for the scenarios that
/// measure a node from the outside (its memory, its death). They share one Redis and a fresh key
/// prefix; tokens are signed with a secret made up for the run.
final class NodeProcesses: @unchecked Sendable {
    // Safe: built once, then only read; the processes are only signalled.
    let ports: [Int]
    let prefix: String
    let secret: String
    let adminToken = "bench-admin-\(UInt32.random(in: 0...UInt32.max))"
    private var processes: [Process]
    private let keys: JWTKeyCollection

    private struct Claims: JWTPayload {
        var sub: SubjectClaim
        var exp: ExpirationClaim
        func verify(using algorithm: some JWTAlgorithm) async throws {}
    }

    /// Starts `count` nodes with `environment` added (`PRESENCE_*`), waiting until each is ready.
    init(count: Int, redisURL: String, binary: String?, environment: [String: String] = [:]) async throws {
        let binary = binary ?? NodeProcesses.defaultBinary
        guard FileManager.default.isExecutableFile(atPath: binary) else {
            throw BenchError("no presence-gateway at \(binary): build it (swift build -c release --product presence-gateway) or pass --gateway-binary")
        }
        prefix = "bench-\(UInt32.random(in: 0...UInt32.max))"
        secret = (0..<4).map { _ in String(UInt64.random(in: 0...UInt64.max), radix: 16) }.joined() + "-bench-secret"
        keys = JWTKeyCollection()
        await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
        var ports: [Int] = []
        processes = []
        for index in 0..<count {
            let port = try await NodeProcesses.freePort()
            let process = Process()
            process.executableURL = URL(fileURLWithPath: binary)
            var variables = ProcessInfo.processInfo.environment.filter { !$0.key.hasPrefix("PRESENCE_") }
            variables.merge([
                "PRESENCE_PORT": "\(port)", "PRESENCE_HOST": "127.0.0.1", "PRESENCE_REDIS_URL": redisURL,
                "PRESENCE_KEY_PREFIX": prefix, "PRESENCE_NODE_ID": "bench-node-\(index)", "PRESENCE_JWT_SECRET": secret,
                "PRESENCE_ADMIN_TOKEN": adminToken, "PRESENCE_VISIBILITY": "open", "PRESENCE_LOG_LEVEL": "error",
            ]) { _, new in new }
            variables.merge(environment) { _, new in new }
            process.environment = variables
            process.standardOutput = FileHandle.nullDevice
            process.standardError = FileHandle.nullDevice
            try process.run()
            processes.append(process)
            ports.append(port)
        }
        self.ports = ports
        for port in ports {
            let deadline = ContinuousClock.now + .seconds(30)
            while await NodeProcesses.status(port: port, path: "/readyz") != 200 {
                guard ContinuousClock.now < deadline else { stop(); throw BenchError("node on port \(port) not ready within 30 s") }
                try await Task.sleep(for: .milliseconds(50))
            }
        }
    }

    deinit { stop() }

    /// `presence-gateway` beside this executable.
    static var defaultBinary: String {
        URL(fileURLWithPath: CommandLine.arguments[0]).deletingLastPathComponent().appendingPathComponent("presence-gateway").path
    }

    /// A token for `user`, valid for a day.
    func token(_ user: String) async throws -> String {
        try await keys.sign(Claims(sub: .init(value: user), exp: .init(value: Date(timeIntervalSinceNow: 86_400))))
    }

    /// The WebSocket path of a session of `user` on `device`.
    func path(user: String, device: String) async throws -> String {
        "/api/presence/subscribe?token=\(try await token(user))&device_id=\(device)"
    }

    /// SIGKILL node `index`, as a crash would.
    func kill(_ index: Int) {
        guard processes[index].isRunning else { return }
        Foundation.kill(processes[index].processIdentifier, SIGKILL)
        processes[index].waitUntilExit()
    }

    /// Resident memory of node `index`, bytes.
    func residentBytes(_ index: Int) -> Int {
        guard let status = try? String(contentsOfFile: "/proc/\(processes[index].processIdentifier)/status", encoding: .utf8),
              let line = status.split(separator: "\n").first(where: { $0.hasPrefix("VmRSS:") }),
              let kib = Int(line.split(separator: " ").dropFirst().first ?? "") else { return 0 }
        return kib * 1024
    }

    /// Stops every node (SIGKILL: nothing of theirs needs to survive a benchmark).
    func stop() {
        for index in processes.indices { kill(index) }
    }

    /// A free loopback port (bound by the kernel, then released).
    static func freePort() async throws -> Int {
        let channel = try await ServerBootstrap(group: MultiThreadedEventLoopGroup.singleton).bind(host: "127.0.0.1", port: 0).get()
        defer { channel.close(promise: nil) }
        guard let port = channel.localAddress?.port else { throw BenchError("no free port") }
        return port
    }

    /// An admin call on node `index`; throws unless it answers 200.
    func admin(_ method: String, _ path: String, body: String, node index: Int = 0) async throws {
        var request = URLRequest(url: URL(string: "http://127.0.0.1:\(ports[index])\(path)")!)
        request.httpMethod = method
        request.httpBody = Data(body.utf8)
        request.setValue("Bearer \(adminToken)", forHTTPHeaderField: "Authorization")
        request.timeoutInterval = 5
        let (_, response) = try await URLSession.shared.data(for: request)
        guard (response as? HTTPURLResponse)?.statusCode == 200 else { throw BenchError("\(method) \(path) answered \(String(describing: (response as? HTTPURLResponse)?.statusCode))") }
    }

    /// The body of a GET on node `index`, or nil when it does not answer.
    func get(_ path: String, node index: Int) async -> String? {
        var request = URLRequest(url: URL(string: "http://127.0.0.1:\(ports[index])\(path)")!)
        request.timeoutInterval = 2
        guard let (data, _) = try? await URLSession.shared.data(for: request) else { return nil }
        return String(decoding: data, as: UTF8.self)
    }

    /// The HTTP status of a GET on a loopback port, or nil when nothing answers.
    static func status(port: Int, path: String) async -> Int? {
        var request = URLRequest(url: URL(string: "http://127.0.0.1:\(port)\(path)")!)
        request.timeoutInterval = 2
        guard let (_, response) = try? await URLSession.shared.data(for: request) else { return nil }
        return (response as? HTTPURLResponse)?.statusCode
    }
}

/// A benchmark that cannot run, with the reason.
struct BenchError: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
}

/// Raises the open-file limit as far as allowed (each session is a socket on both ends); the
/// nodes started afterwards inherit it. As root the hard limit goes up to `fs.nr_open` too.
func raiseFileLimit() -> Int {
    var limit = rlimit()
    getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit)
    let ceiling = (try? String(contentsOfFile: "/proc/sys/fs/nr_open", encoding: .utf8))
        .flatMap { rlim_t($0.trimmingCharacters(in: .whitespacesAndNewlines)) }
    if let ceiling, ceiling > limit.rlim_max {
        var raised = rlimit(rlim_cur: ceiling, rlim_max: ceiling)
        if setrlimit(Int32(RLIMIT_NOFILE.rawValue), &raised) == 0 { return Int(ceiling) }
    }
    limit.rlim_cur = limit.rlim_max
    setrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit)
    getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit)
    return Int(limit.rlim_cur)
}
