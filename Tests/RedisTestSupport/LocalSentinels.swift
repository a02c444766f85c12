import Foundation
import RedisClient

/// A primary, its replica and three Sentinels (quorum 2) on loopback ports of their own, for
/// tests of failover. Everything is killed when the value goes away.
///
/// Sentinels take 1 s of silence to call a primary down and wait 3 s between failovers of the
/// same primary (`failover-timeout`): a test that fails over twice waits for ``waitHealthy()``.
public final class LocalSentinels: @unchecked Sendable {
    // Safe: used by one test at a time, as RedisServerProcess is.
    /// The name the Sentinels know the primary by.
    public let name = "presence-primary"
    /// The two data servers: the first starts as the primary.
    public let servers: [RedisServerProcess]
    public private(set) var sentinels: [RedisServerProcess] = []
    private let directory: URL

    /// Starts everything and returns once the replica has synced and the Sentinels know each
    /// other (10 s at most; about 7 s for the Sentinels here).
    public init() async throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("sentinels-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        let primary = try RedisServerProcess()
        let replica = try RedisServerProcess(arguments: ["--replicaof", "127.0.0.1", "\(primary.port)"])
        servers = [primary, replica]
        for index in 0..<3 {
            let file = directory.appendingPathComponent("sentinel-\(index).conf")
            let config = """
                sentinel monitor \(name) 127.0.0.1 \(primary.port) 2
                sentinel down-after-milliseconds \(name) 1000
                sentinel failover-timeout \(name) 3000
                sentinel parallel-syncs \(name) 1
                dir \(directory.path)

                """
            try config.write(to: file, atomically: true, encoding: .utf8)
            sentinels.append(try RedisServerProcess(arguments: ["--sentinel"], configFile: file.path))
        }
        guard await waitHealthy(timeout: .seconds(15)) else {
            throw RedisError(.unavailable, "the Sentinels did not settle within 15 s: \(try sentinelCLI(0, "SENTINEL", "CKQUORUM", name))")
        }
    }

    deinit {
        for process in sentinels + servers { process.stop() }
        try? FileManager.default.removeItem(at: directory)
    }

    /// `redis+sentinel://` naming every Sentinel (or those given).
    public func url(sentinels indices: [Int]? = nil, credentials: String? = nil) -> String {
        let ports = (indices ?? Array(sentinels.indices)).map { "127.0.0.1:\(sentinels[$0].port)" }
        return "redis+sentinel://\(credentials.map { $0 + "@" } ?? "")\(ports.joined(separator: ","))/\(name)/0"
    }

    /// The port of the primary the first live Sentinel names.
    public func primaryPort() throws -> Int? {
        for index in sentinels.indices {
            let words = try sentinelCLI(index, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", name).split(whereSeparator: \.isNewline)
            if words.count == 2, let port = Int(words[1]) { return port }
        }
        return nil
    }

    /// The data server on `port`.
    public func server(port: Int) -> RedisServerProcess? { servers.first { $0.port == port } }

    /// Runs `redis-cli` against Sentinel `index`.
    @discardableResult
    public func sentinelCLI(_ index: Int, _ arguments: String...) throws -> String {
        try RedisServerProcess.cli(port: sentinels[index].port, arguments)
    }

    /// Waits until the primary has a synced replica, every Sentinel agrees on it, the quorum can
    /// authorize a failover, and the last failover is past its timeout.
    @discardableResult
    public func waitHealthy(timeout: Duration = .seconds(20)) async -> Bool {
        await eventually(timeout: timeout, poll: .milliseconds(200)) {
            guard let port = try? primaryPort(), let primary = server(port: port),
                  let replication = try? primary.cli("INFO", "replication"),
                  replication.contains("role:master"), replication.contains("connected_slaves:1"),
                  let replica = servers.first(where: { $0.port != port }),
                  (try? replica.cli("INFO", "replication"))?.contains("master_link_status:up") == true
            else { return false }
            for index in sentinels.indices where sentinels[index].pid != nil {
                guard let quorum = try? sentinelCLI(index, "SENTINEL", "CKQUORUM", name), quorum.hasPrefix("OK"),
                      let named = try? sentinelCLI(index, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", name), named.contains("\(port)")
                else { return false }
                // A Sentinel refuses a new failover of the same primary for 2 × failover-timeout.
                if let state = try? sentinelCLI(index, "SENTINEL", "MASTER", name), state.contains("failover_in_progress") { return false }
            }
            return true
        }
    }
}
