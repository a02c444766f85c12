import CMallocTrim
import Logging
import RedisTestSupport
import Testing

@testable import RedisClient

/// What the Redis Cluster client keeps while its nodes cannot be reached. Here, with the heavy
/// tests that run one at a time: the heap in use is the whole process's, which parallel suites
/// would move by more than what is measured.
@Suite("Redis Cluster client memory")
struct ClusterClientMemoryTests {
    /// A `CLUSTER SHARDS` reply: every slot on one primary at `port`.
    static func shard(_ port: Int) -> RESPValue {
        func bulk(_ text: String) -> RESPValue { .bulkString(Array(text.utf8)) }
        let node = RESPValue.array([
            bulk("id"), bulk("node\(port)"), bulk("port"), .integer(Int64(port)), bulk("ip"), bulk("127.0.0.1"),
            bulk("endpoint"), bulk("127.0.0.1"), bulk("role"), bulk("master"), bulk("health"), bulk("online"),
        ])
        return .array([.array([bulk("slots"), .array([.integer(0), .integer(16_383)]), bulk("nodes"), .array([node])])])
    }

    @Test("connects that fail for as long as the client runs give back what each took: the heap stays flat")
    func failedConnectsLeaveNothing() async throws {
        let port = try RefusingPort()
        let log = LogCounter()
        let router = try RedisClusterClient(
            seeds: [("127.0.0.1", port.port)], configuration: RedisConfiguration(),
            logger: Logger(label: "leak") { _ in LogCounter.Handler(counter: log) }
        )
        router.install(try ClusterSlotMap.parse(shards: Self.shard(port.port), tls: false, fallbackHost: "127.0.0.1"))
        let node = try #require(router.primaries.first)
        let refused = "cannot connect to a Redis cluster node"
        await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask { try await router.run() }
            defer { router.shutdown() }
            /// Asks for a connection to the refusing node until `count` more were refused.
            func refuse(_ count: Int) async {
                let target = log.count(refused) + count
                while log.count(refused) < target {
                    router.requestConnection(to: node)
                    await Task.yield()
                }
            }
            await refuse(1_000)
            let before = presence_malloc_in_use_bytes()
            await refuse(5_000)
            let grown = Int(presence_malloc_in_use_bytes()) - Int(before)
            print("failedConnectsLeaveNothing: the heap in use grew \(grown) bytes over 5,000 refused connects")
            // Each refused connect's finished task was kept: 36.8 MB over 5,000 before 83f35b4.
            #expect(grown < 8_000_000, "\(grown) bytes")
        }
    }
}
