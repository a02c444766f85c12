import Foundation
import RedisClient

/// A small Redis Cluster of its own on plain ports: three primaries, no replicas. A node stopped
/// and started again (``RedisServerProcess/stop()``, ``RedisServerProcess/start()``) comes back
/// on its port with its place in the cluster and the data of its last `SAVE`: a primary restarted
/// from an older snapshot, which no replica takes over from.
public final class LocalRedisCluster: Sendable {
    public let servers: [RedisServerProcess]
    private let directory: URL

    /// Starts the servers and joins them; returns once every node says `cluster_state:ok`.
    public init() async throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("redis-cluster-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        var servers: [RedisServerProcess] = []
        for index in 0..<3 {
            servers.append(try RedisServerProcess(arguments: [
                "--cluster-enabled", "yes", "--cluster-config-file", directory.appendingPathComponent("nodes-\(index).conf").path,
                // A bus port of its own: the default, the port plus 10,000, is past 65,535 for a
                // high port the kernel handed out.
                "--cluster-port", "\(try RedisServerProcess.freePort())",
            ]))
        }
        self.servers = servers
        try await Self.join(servers)
    }

    deinit {
        for server in servers { server.stop() }
        try? FileManager.default.removeItem(at: directory)
    }

    /// `redis+cluster://` naming the first node.
    public var url: String { "redis+cluster://127.0.0.1:\(servers[0].port)" }

    /// The server whose primary serves `key`'s slot.
    public func server(holding key: String) throws -> RedisServerProcess {
        let slot = Int(HashSlot(of: key).value)
        guard let owner = try TestRedisCluster.owner(of: slot, askingPort: servers[0].port),
              let server = servers.first(where: { $0.port == owner.port }) else {
            throw RedisError(.unavailable, "no primary of the cluster serves slot \(slot)")
        }
        return server
    }

    /// Makes `servers` one cluster (`redis-cli --cluster create`, slots split evenly) and waits
    /// until every one of them says `cluster_state:ok`.
    static func join(_ servers: [RedisServerProcess]) async throws {
        let create = try runProcess("/usr/bin/env", ["redis-cli", "--cluster", "create"] + servers.map { "127.0.0.1:\($0.port)" } + ["--cluster-yes"])
        guard create.status == 0 else { throw RedisError(.unavailable, "redis-cli --cluster create failed: \(create.output.suffix(400))") }
        let whole = await eventually(timeout: .seconds(20), poll: .milliseconds(100)) {
            servers.allSatisfy { ((try? $0.cli("CLUSTER", "INFO")) ?? "").contains("cluster_state:ok") }
        }
        guard whole else { throw RedisError(.unavailable, "the cluster did not reach cluster_state:ok in 20 s") }
    }
}
