import ClientTestSupport
import Foundation
import RedisTestSupport
import Testing

/// The cuts of ``PartitionTests`` on the Redis Cluster of `scripts/with-redis-cluster`: node a
/// runs under a group id of its own, and iptables drops every packet between it and any node of
/// the cluster (the cluster announces 127.0.0.1 for all of them, so the node's packets are found
/// by their owner, not by an address). Node b and the test reach the cluster as before.
///
/// Needs root, iptables and the cluster; skipped otherwise (`make test` runs it with the cluster
/// faults).
@Suite("Partitions between a node and a Redis Cluster", .serialized,
       .enabled(if: TestRedisCluster.isAvailable && Partition.available, "needs the test cluster, root and a working /usr/sbin/iptables"))
struct ClusterPartitionTests {
    /// Node a's group id: one no other process of the machine runs with.
    static let group: UInt32 = 47_123

    /// Runs `body` with nodes a and b on the cluster and the partition between a and the
    /// cluster, whose rules are removed afterwards.
    static func withCut(_ body: (GatewayProcess, GatewayProcess, Partition) async throws -> Void) async throws {
        let partition = Partition(group: group, ports: TestRedisCluster.ports)
        defer { partition.remove() }
        let (a, b) = try await start(partition)
        try await body(a, b, partition)
    }

    /// Node a, cut off by `partition` when asked, and node b, both on the cluster.
    static func start(_ partition: Partition) async throws -> (a: GatewayProcess, b: GatewayProcess) {
        let url = try #require(TestRedisCluster.url)
        let environment = nodeEnvironment(prefix: TestRedis.uniquePrefix("cluster-cut"), redisURL: url, extra: ["PRESENCE_VISIBILITY": "open", "PRESENCE_LEASE_TTL": "3"])
        try partition.prepare()
        let a = try await GatewayProcess(nodeID: "a", environment: environment, group: group)
        let b = try await GatewayProcess(nodeID: "b", environment: environment)
        return (a, b)
    }

    @Test("cuts of 1.7 s between a node and every primary and replica (a 3 s lease, renewed every second): nobody is shown offline, on either node")
    func shortCuts() async throws {
        try await Self.withCut { a, b, partition in try await PartitionTests.shortCuts(a, b, partition, label: "clusterShortCuts") }
    }

    @Test("a cut of 8 s between a node and the cluster: REST on the node answers 503 within a second, /readyz follows within a second, and after it never says offline for a user connected there")
    func longCut() async throws {
        try await Self.withCut { a, b, partition in try await PartitionTests.longCut(a, b, partition, label: "clusterLongCut") }
    }

    /// The same on a cluster (see ``PartitionTests/dropDuringCut()``).
    @Test("a connection that drops during a long cut from the cluster is let go of: when the node reaches the cluster again, the user does not come back online")
    func dropDuringCut() async throws {
        try await Self.withCut { a, b, partition in try await PartitionTests.dropDuringCut(a, b, partition, label: "clusterDropDuringCut") }
    }
}
