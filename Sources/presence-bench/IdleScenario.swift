import ArgumentParser
import Foundation
import Logging
import NIOConcurrencyHelpers
import PresenceProtocol
import RedisClient
import RedisTestSupport

// MARK: - 1. idle

struct IdleScenario: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "idle",
        abstract: "N idle sessions on one node, each watching 10 users: the node's memory per session and Redis memory per online user."
    )
    @OptionGroup var options: ScenarioOptions
    @Option(help: "Sessions.") var sessions = 10_000
    @Option(help: "Users each session watches.") var watch = 10
    @Option(help: "Seconds to let the node settle before measuring.") var settle = 5
    @Option(help: "Seconds over which to measure the node's CPU while every session is idle (its pings and their pongs only); 0 to skip.") var cpuWindow = 0

    func run() async throws {
        let limit = raiseFileLimit()
        // The load generator and the node each hold one socket per session.
        guard limit > sessions + 500 else {
            throw BenchError("the open-file limit is \(limit) and cannot be raised further here; \(sessions) sessions need about \(sessions + 500) in this process and in the node")
        }
        let nodes = try await NodeProcesses(count: 1, redisURL: options.common.redisURL, binary: options.gatewayBinary)
        defer { nodes.stop() }
        let fleet = Fleet(nodes: nodes, threads: options.threads)
        let (memoryBefore, keysBefore) = try await withRedis(options.common.redisURL) { redis in
            (try await redisInfo(redis, "memory", "used_memory"), try await redis.execute(DBSIZE()))
        }
        try await Task.sleep(for: .seconds(1))
        let rssBefore = nodes.residentBytes(0)
        let answers = FrameCounter()
        let sockets = try await fleet.connect((0..<sessions).map { ("idle-\($0)", "d", 0) }, label: "idle") { index, text in
            if case .initialState = serverFrame(text) { answers.add(index) }
        }
        for (index, socket) in sockets.enumerated() {
            socket.send(clientText(.subscribe(.users((1...watch).map { "idle-\((index + $0) % sessions)" })), id: "w"))
            if index % 500 == 499 { try await Task.sleep(for: .milliseconds(10)) }
        }
        let subscribed = await answers.wait(for: sessions * 2, timeout: .seconds(Int64(60 + sessions / 500)), label: "idle: snapshots")
        try await Task.sleep(for: .seconds(settle))
        let rssAfter = nodes.residentBytes(0)
        let (memoryAfter, keysAfter) = try await withRedis(options.common.redisURL) { redis in
            (try await redisInfo(redis, "memory", "used_memory"), try await redis.execute(DBSIZE()))
        }
        let perSession = Double(rssAfter - rssBefore) / Double(sessions)
        let perUser = (memoryAfter - memoryBefore) / Double(sessions)
        // The cost of idle sessions: nothing changes, so the node only pings each session after
        // each ping interval of silence (10 s) and takes its pong.
        var idleCPU: [(String, String)] = []
        var idleJSON: [String: Any] = [:]
        if cpuWindow > 0 {
            let cpuBefore = nodes.cpuSeconds
            try await Task.sleep(for: .seconds(cpuWindow))
            let used = nodes.cpuSeconds - cpuBefore
            let perSessionMinute = used / Double(sessions) / (Double(cpuWindow) / 60)
            idleCPU = [("node CPU while idle", String(format: "%.3f s in %d s: %.2f%% of a core, %.1f µs per session per minute", used, cpuWindow,
                                                        used / Double(cpuWindow) * 100, perSessionMinute * 1e6))]
            idleJSON = ["idle_cpu_seconds": used, "idle_cpu_window_seconds": cpuWindow, "idle_cpu_us_per_session_minute": perSessionMinute * 1e6]
        }
        try report("idle: \(sessions) sessions on one node, each watching \(watch) users", [
            ("all sessions open and subscribed", subscribed ? "yes" : "NO (\(answers.count) of \(sessions * 2) snapshots)"),
            ("node RSS before / after", "\(rssBefore / 1_048_576) MiB / \(rssAfter / 1_048_576) MiB"),
            ("node memory per session", String(format: "%.1f KiB", perSession / 1024)),
            ("Redis memory per online user", String(format: "%.0f bytes (%d keys added)", perUser, keysAfter - keysBefore)),
        ] + idleCPU, json: ["scenario": "idle", "sessions": sessions, "watch": watch, "subscribed": subscribed,
                  "node_rss_before_bytes": rssBefore, "node_rss_after_bytes": rssAfter, "node_bytes_per_session": perSession,
                  "redis_bytes_per_user": perUser, "redis_keys_added": keysAfter - keysBefore].merging(idleJSON) { $1 }, to: options.json)
        await fleet.shutdown()
    }
}
