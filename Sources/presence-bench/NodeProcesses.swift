import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import JWTKit
import NIOConcurrencyHelpers
import RedisTestSupport

/// Gateway nodes as real `presence-gateway` processes on loopback, for the scenarios that
/// measure a node from the outside (its memory, its death). They share one Redis and a fresh key
/// prefix; tokens are signed with a secret made up for the run. Each is a ``GatewayProcess``, the
/// launcher the tests use too.
final class NodeProcesses: Sendable {
    let ports: [Int]
    let prefix: String
    let secret: String
    let adminToken = "bench-admin-\(UInt32.random(in: 0...UInt32.max))"
    private let nodes: [GatewayProcess]
    private let keys: JWTKeyCollection

    private struct Claims: JWTPayload {
        var sub: SubjectClaim
        var exp: ExpirationClaim
        func verify(using algorithm: some JWTAlgorithm) async throws {}
    }

    /// Starts `count` nodes with `environment` added (`PRESENCE_*`), waiting until each is ready
    /// (at most `readyWithin`; under callgrind a node was ready after 5.4 s, against 0.09 s).
    init(count: Int, redisURL: String, binary: String?, environment: [String: String] = [:], readyWithin: Duration = .seconds(30)) async throws {
        let binary = binary ?? NodeProcesses.defaultBinary
        guard FileManager.default.isExecutableFile(atPath: binary) else {
            throw BenchError("no presence-gateway at \(binary): build it (swift build -c release --product presence-gateway) or pass --gateway-binary")
        }
        prefix = "bench-\(UInt32.random(in: 0...UInt32.max))"
        secret = (0..<4).map { _ in String(UInt64.random(in: 0...UInt64.max), radix: 16) }.joined() + "-bench-secret"
        keys = JWTKeyCollection()
        await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
        let settings = [
            "PRESENCE_REDIS_URL": redisURL, "PRESENCE_KEY_PREFIX": prefix, "PRESENCE_JWT_SECRET": secret,
            "PRESENCE_ADMIN_TOKEN": adminToken, "PRESENCE_VISIBILITY": "open", "PRESENCE_LOG_LEVEL": "error",
        ].merging(environment) { _, new in new }
        var nodes: [GatewayProcess] = []
        for index in 0..<count {
            nodes.append(try await GatewayProcess(
                nodeID: "bench-node-\(index)", environment: settings, binary: URL(fileURLWithPath: binary), startWithin: readyWithin
            ))
        }
        self.nodes = nodes
        ports = nodes.map(\.port)
        Interruption.track(ObjectIdentifier(self)) { [nodes] in for node in nodes { node.kill() } }
        for node in nodes {
            let ready = await eventually(timeout: readyWithin, poll: .milliseconds(50)) { GatewayProcess.httpStatus(port: node.port, path: "/readyz") == 200 }
            guard ready else {
                stop()
                throw BenchError("node on port \(node.port) not ready within \(readyWithin): \(node.output.suffix(2000))")
            }
        }
    }

    deinit {
        stop()
        Interruption.untrack(ObjectIdentifier(self))
    }

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
        nodes[index].kill()
    }

    /// Resident memory of node `index`, bytes.
    func residentBytes(_ index: Int) -> Int {
        nodes[index].residentBytes ?? 0
    }

    /// The CPU time all nodes have used, in seconds.
    var cpuSeconds: Double {
        nodes.reduce(0) { $0 + ($1.cpuSeconds ?? 0) }
    }

    /// The process ids of the nodes.
    var pids: [Int32] { nodes.map(\.pid) }

    /// Stops every node (SIGKILL: nothing of theirs needs to survive a benchmark).
    func stop() {
        for node in nodes { node.kill() }
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
    /// What node `index` has printed so far (its log).
    func output(node index: Int) -> String { nodes[index].output }

    /// The node ids, in the order of `ports`.
    var nodeIDs: [String] { nodes.map(\.nodeID) }

    func get(_ path: String, node index: Int) async -> String? {
        var request = URLRequest(url: URL(string: "http://127.0.0.1:\(ports[index])\(path)")!)
        request.timeoutInterval = 2
        guard let (data, _) = try? await URLSession.shared.data(for: request) else { return nil }
        return String(decoding: data, as: UTF8.self)
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

/// The nodes of this run that are up, stopped when the benchmark is interrupted (Ctrl-C, or
/// SIGTERM) rather than left running: a run ended that way skips its own clean-up.
private enum Interruption {
    private static let running = NIOLockedValueBox<[ObjectIdentifier: @Sendable () -> Void]>([:])
    /// Installed with the first nodes; kept for the life of the process.
    private nonisolated(unsafe) static var sources: [any DispatchSourceSignal] = []
    private static let installed = NIOLockedValueBox(false)

    static func track(_ id: ObjectIdentifier, stop: @escaping @Sendable () -> Void) {
        running.withLockedValue { $0[id] = stop }
        let first = installed.withLockedValue { installed in
            defer { installed = true }
            return !installed
        }
        if first { installSignalHandlers() }
    }

    static func untrack(_ id: ObjectIdentifier) {
        _ = running.withLockedValue { $0.removeValue(forKey: id) }
    }

    private static func installSignalHandlers() {
        sources = [SIGINT, SIGTERM].map { number in
            signal(number, SIG_IGN)
            let source = DispatchSource.makeSignalSource(signal: number, queue: .global())
            source.setEventHandler {
                for stop in running.withLockedValue({ Array($0.values) }) { stop() }
                FileHandle.standardError.write(Data("\ninterrupted: the gateway nodes of this run are stopped\n".utf8))
                exit(128 + number)
            }
            source.resume()
            return source
        }
    }
}
