import ArgumentParser
import Foundation
import Logging
import PresenceEngine
import RedisClient

/// A clock running `offset` behind the system clock: a node that "died" that long ago.
struct OffsetClock: PresenceClock {
    let offset: Int64
    func nowMilliseconds() -> Int64 { SystemPresenceClock().nowMilliseconds() - offset }
}

/// Connects and disconnects per second, reaping a dead node, and the idle Redis cost.
struct EngineBench: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "engine",
        abstract: "Connects/s and disconnects/s through the engine, reaping a dead node, and Redis commands per idle device per minute."
    )

    @OptionGroup var common: CommonOptions
    @Option(help: "Devices to connect.") var devices = 10_000
    @Option(help: "Concurrent engine calls (pipelined on one connection).") var concurrency = 64
    @Option(help: "Seconds to watch an idle node's Redis commands; 0 skips it.") var idleSeconds = 60

    func run() async throws {
        var logger = Logger(label: "presence-bench")
        logger.logLevel = .warning
        let prefix = "bench-\(UUID().uuidString.prefix(8).lowercased())"
        let redisConfiguration = try RedisConfiguration(url: common.redisURL)
        try await withRedisCommands(configuration: redisConfiguration, logger: logger) { redis in
            let before = try await commandsPerServer(redis)
            let live = PresenceEngine(redis: redis, configuration: PresenceConfiguration(keyPrefix: prefix, nodeID: "live"), logger: logger)
            try await live.registerNode()
            let ids = (0..<devices).map { "user\($0)" }

            let connectTime = try await timed("connect") { index in
                _ = try await live.connect(user: ids[index], device: "phone", session: "s\(index)")
            }
            let disconnectTime = try await timed("disconnect") { index in
                _ = try await live.disconnect(user: ids[index], device: "phone", session: "s\(index)", clean: true)
            }
            let after = try await commandsPerServer(redis)

            // A node whose clock is a minute behind registered its lease a minute ago: lapsed.
            let dead = PresenceEngine(redis: redis, configuration: PresenceConfiguration(keyPrefix: prefix, nodeID: "dead"), clock: OffsetClock(offset: 60_000), logger: logger)
            try await dead.registerNode()
            _ = try await timed("connect on the dying node") { index in
                _ = try await dead.connect(user: ids[index], device: "tablet", session: "d\(index)")
            }
            // Its lease key has run out as a killed node's does (the key's own TTL is real time,
            // which the offset clock does not move): without it, the reaper finds the node alive.
            try await redis.execute(DEL(keys: [dead.keys.lease("dead")]))
            let reapStart = ContinuousClock.now
            let report = try await live.reapOnce()
            let reapTime = ContinuousClock.now - reapStart
            let stillOnline = try await live.views(of: ids).filter { $0.real.status != .offline }.count

            var idleRate: Double?
            if idleSeconds > 0 {
                _ = try await timed("connect for the idle test") { index in
                    _ = try await live.connect(user: ids[index], device: "phone", session: "i\(index)")
                }
                idleRate = try await idleCost(redis: redis, engine: live)
            }

            print("")
            print("presence engine, \(devices) devices, \(concurrency) concurrent calls on one Redis connection per primary (\(redisConfiguration.redactedURL))")
            print(String(format: "  connect                 %10.0f devices/s", Double(devices) / seconds(connectTime)))
            print(String(format: "  disconnect (clean)      %10.0f devices/s", Double(devices) / seconds(disconnectTime)))
            print(String(format: "  reap a dead node        %10.3f s for %d devices, %d users changed, %d still online afterwards",
                         seconds(reapTime), devices, report.changedUsers, stillOnline))
            let spread = after.keys.sorted().map { "\($0) \((after[$0] ?? 0) - (before[$0] ?? 0))" }.joined(separator: ", ")
            print("  commands per primary during connect and disconnect: \(spread)")
            if let idleRate {
                print(String(format: "  idle Redis cost         %10.4f commands per device per minute (%d s observed)", idleRate, idleSeconds))
            }
            try await cleanup(redis: redis, prefix: prefix)
        }
    }

    private func timed(_ label: String, _ body: @escaping @Sendable (Int) async throws -> Void) async throws -> Duration {
        let start = ContinuousClock.now
        let counter = Counter()
        try await withThrowingTaskGroup(of: Void.self) { group in
            for worker in 0..<concurrency {
                group.addTask {
                    var index = worker
                    while index < devices {
                        try await body(index)
                        if counter.increment() % 1000 == 0 { progress("\(label): \(counter.value)/\(devices)") }
                        index += concurrency
                    }
                }
            }
            try await group.waitForAll()
        }
        endProgress()
        return ContinuousClock.now - start
    }

    /// Commands Redis ran per idle device per minute while only the lease service ran.
    private func idleCost(redis: any RedisCommands, engine: PresenceEngine) async throws -> Double {
        let lease = PresenceLeaseService(engine: engine)
        let before = try await totalCommands(redis)
        let task = Task { try await lease.run() }
        for elapsed in 0..<idleSeconds {
            progress("idle: \(elapsed)/\(idleSeconds) s")
            try await Task.sleep(for: .seconds(1))
        }
        task.cancel()
        endProgress()
        // Our own INFO calls are 2 commands; the rest is the lease (and anything else on this Redis).
        let servers = try await commandsPerServer(redis).count
        let after = try await totalCommands(redis) - 2 * servers
        return Double(after - before) / Double(devices) / (Double(idleSeconds) / 60)
    }

    private func totalCommands(_ redis: any RedisCommands) async throws -> Int {
        try await commandsPerServer(redis).values.reduce(0, +)
    }

    /// `total_commands_processed` of each server: the one, or each primary of a cluster.
    private func commandsPerServer(_ redis: any RedisCommands) async throws -> [String: Int] {
        func processed(_ text: String) -> Int {
            for line in text.split(whereSeparator: \.isNewline) where line.hasPrefix("total_commands_processed:") {
                return Int(line.split(separator: ":")[1]) ?? 0
            }
            return 0
        }
        guard let cluster = redis as? RedisClusterClient else {
            return ["\(redis.configuration.host):\(redis.configuration.port)": processed(try await redis.execute(INFO(section: "stats")))]
        }
        var counts: [String: Int] = [:]
        let info = INFO(section: "stats")
        for (node, result) in try await cluster.sendToEachPrimary(info.arguments) { counts[node.description] = processed(try info.decode(try result.get())) }
        return counts
    }

    private func cleanup(redis: any RedisCommands, prefix: String) async throws {
        _ = try await redis.pipeline(redis.allKeys(matching: prefix + ":*").map { UNLINK(keys: [$0]) })
    }
}

/// A thread-safe counter for progress lines.
final class Counter: @unchecked Sendable {
    // Safe: every access holds the lock.
    private let lock = NSLock()
    private var count = 0
    func increment() -> Int { lock.withLock { count += 1; return count } }
    var value: Int { lock.withLock { count } }
}
