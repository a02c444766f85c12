import Foundation
import Logging
import NIOConcurrencyHelpers
import PresenceEngine
import RedisClient
import RedisTestSupport

/// A clock the test moves by hand.
final class ManualClock: PresenceClock {
    private let now = NIOLockedValueBox<Int64>(1_800_000_000_000)
    func nowMilliseconds() -> Int64 { now.withLockedValue { $0 } }
    func advance(_ duration: Duration) {
        let step = duration.components.seconds * 1000 + duration.components.attoseconds / 1_000_000_000_000_000
        now.withLockedValue { $0 += step }
    }
}

/// A node's own clock, `offset` milliseconds off the shared one, whose scripts still take the
/// shared time as now (`base` stands in for Redis's clock): a node with a wrong wall clock.
struct OffsetClock: PresenceClock {
    let base: ManualClock
    let offset: Int64
    func nowMilliseconds() -> Int64 { base.nowMilliseconds() + offset }
    var scriptTime: Int64? { base.nowMilliseconds() }
}

/// Engines for several simulated nodes sharing one Redis client and one key prefix.
struct EngineCluster {
    let redis: any RedisCommands
    let clock = ManualClock()
    let prefix = TestRedis.uniquePrefix("engine")
    var prefixKeys: PresenceKeys { PresenceKeys(prefix: prefix) }

    /// An engine for `node`; with `skew`, its own clock is that many milliseconds off (see
    /// ``OffsetClock``).
    func engine(node: String, visibility: Visibility = .conversations, maxDevices: Int = 32, lease: Duration = .seconds(10), skew: Int64 = 0,
                largeGroup: Int = 1_000, messageHistory: Int = 10_000, messageMaxBytes: Int = 16_384) -> PresenceEngine {
        PresenceEngine(
            redis: redis,
            configuration: PresenceConfiguration(keyPrefix: prefix, nodeID: node, visibility: visibility, leaseTTL: lease, maxDevicesPerUser: maxDevices,
                                                 largeGroup: largeGroup, messageHistory: messageHistory, messageMaxBytes: messageMaxBytes),
            clock: skew == 0 ? clock : OffsetClock(base: clock, offset: skew),
            logger: TestRedis.logger()
        )
    }

    /// Deletes every key under the prefix, as a Redis that lost its data would.
    func wipe() async throws {
        _ = try await redis.pipeline(redis.allKeys(matching: prefix + ":*").map { ["DEL", RedisArgument($0)] })
    }

    /// A cluster on a redis-server of its own that keeps its data across a stop and a start (an
    /// append-only file synced on every write), for tests of Redis going away and coming back.
    static func withRestartableRedis(_ body: (EngineCluster, RedisServerProcess) async throws -> Void) async throws {
        let directory = NSTemporaryDirectory() + "presence-engine-" + UUID().uuidString.prefix(8).lowercased()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        let server = try RedisServerProcess(arguments: ["--appendonly", "yes", "--appendfsync", "always", "--dir", directory])
        try await RedisClient.withClient(configuration: RedisConfiguration(url: server.url()), logger: TestRedis.logger()) { redis in
            try await body(EngineCluster(redis: redis), server)
        }
    }

    /// On the shared test server, or the cluster `PRESENCE_TEST_REDIS_URL` names.
    static func with(_ body: (EngineCluster) async throws -> Void) async throws {
        try await withRedisCommands(configuration: TestRedis.configuration(), logger: TestRedis.logger()) { redis in
            let cluster = EngineCluster(redis: redis)
            do {
                try await body(cluster)
            } catch {
                try? await cluster.wipe()
                throw error
            }
            try? await cluster.wipe()
        }
    }
}

/// Collects the presence events published on some users' channels.
final class EventRecorder: Sendable {
    private let received = NIOLockedValueBox<[PresenceEvent]>([])
    var events: [PresenceEvent] { received.withLockedValue { $0 } }
    func append(_ event: PresenceEvent) { received.withLockedValue { $0.append(event) } }
}

func withRecorder(_ engine: PresenceEngine, users: [String], _ body: (EventRecorder) async throws -> Void) async throws {
    try await withRedisSubscriber(for: engine.redis, logger: TestRedis.logger()) { subscriber in
        try await subscriber.subscribe(users.map { engine.keys.userChannel($0) })
        let recorder = EventRecorder()
        let listener = Task {
            for await event in subscriber.events {
                if case .message(_, let payload) = event, let decoded = engine.decodeEvent(payload) { recorder.append(decoded) }
            }
        }
        defer { listener.cancel() }
        try await body(recorder)
    }
}
