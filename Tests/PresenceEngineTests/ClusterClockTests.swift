import Foundation
import PresenceEngine
import RedisClient
import RedisTestSupport
import Testing

/// The primary whose clock is off, when `scripts/with-redis-cluster` made one.
private let skewedPrimaryPort = ProcessInfo.processInfo.environment["PRESENCE_TEST_REDIS_CLUSTER_SKEWED_PORT"].flatMap { Int($0) }

/// The reaper on a Redis Cluster whose primaries' clocks differ: one primary's wall clock runs
/// `PRESENCE_TEST_REDIS_CLUSTER_SKEWED_MS` ahead (`scripts/with-redis-cluster` with
/// `PRESENCE_TEST_CLUSTER_CLOCK_OFFSET_MS`, a preloaded shim that shifts only that server's wall
/// clock). A node's lease and a user's devices are picked on purpose to sit on primaries with
/// different clocks. The engines run on Redis's clocks (no test clock), so leases lapse in real time.
@Suite("The reaper across cluster primaries whose clocks differ", .enabled(if: skewedPrimaryPort != nil))
struct ClusterClockTests {
    static var skewedPort: Int? { skewedPrimaryPort }

    static let lease = Duration.seconds(2)

    /// Whether the key with hash tag `tag` lies on the primary whose clock is ahead.
    static func onSkewed(_ tag: String) throws -> Bool {
        guard let port = skewedPort, let owner = try TestRedisCluster.owner(of: HashSlot(of: tag).value, askingPort: port) else { return false }
        return owner.port == port
    }

    /// The first of `name-0`, `name-1`, ... whose `{prefix:id}` tag lies on (or off) the skewed primary.
    static func pick(_ name: String, tag prefix: String, skewed: Bool) throws -> String {
        for index in 0..<1000 where try onSkewed("\(prefix):\(name)-\(index)") == skewed { return "\(name)-\(index)" }
        throw GatewayProcessError("no id for \(name) found \(skewed ? "on" : "off") the skewed primary")
    }

    /// A key prefix whose registry (`prefix:nodes`, no hash tag) sits on the skewed primary or not,
    /// so that claims of a lease are made by the same clock as the lease's end.
    static func prefix(registrySkewed: Bool) throws -> String {
        for _ in 0..<1000 {
            let prefix = TestRedis.uniquePrefix("clock")
            if try onSkewed(prefix + ":nodes") == registrySkewed { return prefix }
        }
        throw GatewayProcessError("no prefix found")
    }

    func withEngines(prefix: String, _ body: (_ engine: (String) -> PresenceEngine) async throws -> Void) async throws {
        var configuration = try RedisConfiguration(url: try #require(TestRedisCluster.url))
        configuration.waitForConnection = .seconds(5)
        try await withRedisCommands(configuration: configuration, logger: TestRedis.logger()) { redis in
            try await body { node in
                PresenceEngine(
                    redis: redis,
                    configuration: PresenceConfiguration(keyPrefix: prefix, nodeID: node, leaseTTL: Self.lease),
                    clock: SystemPresenceClock(),
                    logger: TestRedis.logger()
                )
            }
            _ = try? await redis.pipeline(try await redis.allKeys(matching: prefix + ":*").map { ["DEL", RedisArgument($0)] })
        }
    }

    /// Reaps until `node` is reaped, at most 10 s.
    func reap(_ node: String, by reaper: PresenceEngine) async throws -> Bool {
        let deadline = ContinuousClock.now + .seconds(10)
        while ContinuousClock.now < deadline {
            if try await reaper.reapOnce().nodes.contains(node) { return true }
            try await Task.sleep(for: .milliseconds(100))
        }
        return false
    }

    @Test("a dead node's device on a primary whose clock is ahead of the lease's is reaped, not kept as a successor's")
    func userPrimaryAhead() async throws {
        let prefix = try Self.prefix(registrySkewed: false)
        let node = try Self.pick("dead", tag: "n", skewed: false)
        let user = try Self.pick("ann", tag: "u", skewed: true)
        try await withEngines(prefix: prefix) { engine in
            let dying = engine(node)
            let survivor = engine(try Self.pick("survivor", tag: "n", skewed: false))
            try await dying.registerNode()
            try await survivor.registerNode()
            _ = try await dying.connect(user: user, device: "phone", session: "s1")
            #expect(try await survivor.views(of: user).real.status == .online)
            // The dying node renews no more; its lease lapses after 2 s.
            #expect(try await reap(node, by: survivor), "the lapsed node is reaped")
            #expect(try await survivor.views(of: user).real.status == .offline, "the dead node's device went with it")
        }
    }

    @Test("a new process's device on a primary whose clock is behind the old lease's is kept, not reaped as the old one's")
    func userPrimaryBehind() async throws {
        let prefix = try Self.prefix(registrySkewed: true)
        let node = try Self.pick("reused", tag: "n", skewed: true)
        let user = try Self.pick("bo", tag: "u", skewed: false)
        let gone = try Self.pick("cy", tag: "u", skewed: false)
        try await withEngines(prefix: prefix) { engine in
            let old = engine(node)
            let survivor = engine(try Self.pick("survivor", tag: "n", skewed: false))
            try await old.registerNode()
            try await survivor.registerNode()
            _ = try await old.connect(user: gone, device: "phone", session: "old-1")
            // The old process dies; its lease lapses. A new process under the same id takes a
            // session before any reaper works through the lapsed node (it has not registered yet).
            try await Task.sleep(for: Self.lease + .milliseconds(300))
            let restarted = engine(node)
            _ = try await restarted.connect(user: user, device: "phone", session: "new-1")
            #expect(try await reap(node, by: survivor), "the lapsed node is reaped")
            #expect(try await survivor.views(of: gone).real.status == .offline, "the old process's device went")
            #expect(try await survivor.views(of: user).real.status == .online, "a device written after the lease ended is the new process's")
        }
    }
}
