import ArgumentParser
import Foundation
import Logging
import NIOConcurrencyHelpers
import PresenceEngine
import PresenceProtocol
import RedisClient

/// An engine on its own Redis connection, for setting up data beside running nodes.
struct BenchEngine {
    let configuration: RedisConfiguration
    let prefix: String

    static func make(redisURL: String, prefix: String) async throws -> BenchEngine {
        BenchEngine(configuration: try RedisConfiguration(url: redisURL), prefix: prefix)
    }

    func use<T: Sendable>(_ body: (PresenceEngine) async throws -> T) async throws -> T {
        var logger = Logger(label: "presence-bench")
        logger.logLevel = .warning
        return try await withRedisCommands(configuration: configuration, logger: logger) { redis in
            try await body(PresenceEngine(redis: redis, configuration: PresenceConfiguration(keyPrefix: prefix, nodeID: "bench-setup"), logger: logger))
        }
    }
}

/// The cost of a count change in a large group: a member's status change to the watcher's
/// `group_presence`, with the group's members watched for counts only.
struct GroupBench: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "group",
        abstract: "A watcher on node B follows a conversation of N members; members change status through the engine; time to each group_presence."
    )

    @OptionGroup var common: CommonOptions
    @Option(help: "Members of the conversation.") var members = 10_000
    @Option(help: "Status changes to time.") var changes = 500
    @Option(help: "Changes per second.") var rate = 50

    func run() async throws {
        let nodes = try await TwoNodes.start(redisURL: common.redisURL, statusRate: 100, maxIDs: 500)
        let names = (0..<members).map { "bench-member-\($0)" }
        let setup = try await BenchEngine.make(redisURL: common.redisURL, prefix: nodes.prefix)
        _ = try await setup.use { try await $0.setMembers(of: "bench-big", to: names + ["bench-watcher"]) }
        let sent = NIOLockedValueBox<[ContinuousClock.Instant]>([])
        let latencies = NIOLockedValueBox<[Double]>([])
        let followed = NIOLockedValueBox(false)
        let (watcher, task) = try await nodes.connect(node: 1, user: "bench-watcher", device: "w") { text in
            switch serverFrame(text) {
            case .error(let error):
                FileHandle.standardError.write(Data("the node refused: \(error.code.rawValue): \(error.message)\n".utf8))
                Foundation.exit(1)
            case .groupPresence:
                break
            default:
                return
            }
            if !followed.withLockedValue({ $0 }) {
                followed.withLockedValue { $0 = true }
                return
            }
            let now = ContinuousClock.now
            if let start = sent.withLockedValue({ $0.isEmpty ? nil : $0.removeFirst() }) {
                latencies.withLockedValue { $0.append(seconds(now - start) * 1000) }
            }
        }
        try await Task.sleep(for: .milliseconds(500))
        let subscribeStart = ContinuousClock.now
        watcher.yield(clientText(.subscribe(.conversation("bench-big")), id: "big"))
        while !followed.withLockedValue({ $0 }) { try await Task.sleep(for: .milliseconds(5)) }
        let subscribeTime = seconds(ContinuousClock.now - subscribeStart) * 1000
        try await Task.sleep(for: .seconds(1))
        try await setup.use { engine in
            for step in 0..<changes {
                // Each change brings one more member online: the online count moves every time.
                sent.withLockedValue { $0.append(.now) }
                _ = try await engine.post(user: names[step % members], device: "web", status: .online)
                if step % rate == 0 { progress("group: \(step)/\(changes)") }
                try await Task.sleep(for: .nanoseconds(1_000_000_000 / Int64(rate)))
            }
        }
        try await Task.sleep(for: .seconds(1))
        endProgress()
        print("")
        print("a conversation of \(members + 1) members followed by one session on node B (counts only)")
        print(String(format: "  subscribe → first group_presence: %.1f ms (one pipelined read of every member)", subscribeTime))
        print("  member's status change → group_presence, \(latencies.withLockedValue { $0.count }) of \(changes) timed at \(rate)/s:")
        print("  " + latencyLine(latencies.withLockedValue { $0 }))
        task.cancel()
        try await setup.use { _ = try await $0.deleteConversation("bench-big") }
        await nodes.stop()
    }
}
