import ClientTestSupport
import Foundation
import RedisTestSupport
import Testing

/// Short runs of every `presence-bench` scenario, so the load generator cannot rot. The numbers
/// of a debug build on a busy machine mean nothing; what is checked is that each scenario runs
/// to the end and measures what it says.
@Suite("presence-bench scenarios, short runs", .serialized)
struct BenchmarkTests {
    static var binary: URL { GatewayProcess.binary.deletingLastPathComponent().appendingPathComponent("presence-bench") }

    /// Runs a scenario and returns its JSON results.
    func run(_ arguments: [String]) throws -> [String: Any] {
        let directory = FileManager.default.temporaryDirectory
        let json = directory.appendingPathComponent("bench-\(UUID().uuidString).json")
        let output = directory.appendingPathComponent("bench-\(UUID().uuidString).out")
        _ = FileManager.default.createFile(atPath: output.path, contents: nil)
        defer {
            try? FileManager.default.removeItem(at: json)
            try? FileManager.default.removeItem(at: output)
        }
        let process = Process()
        process.executableURL = Self.binary
        process.arguments = arguments + ["--redis-url", TestRedis.url, "--gateway-binary", GatewayProcess.binary.path, "--json", json.path]
        let handle = try FileHandle(forWritingTo: output)
        process.standardOutput = handle
        process.standardError = handle
        try process.run()
        process.waitUntilExit()
        try? handle.close()
        let printed = (try? String(contentsOf: output, encoding: .utf8)) ?? ""
        guard process.terminationStatus == 0 else { throw GatewayProcessError("presence-bench \(arguments.joined(separator: " ")) failed:\n\(printed)") }
        let data = try Data(contentsOf: json)
        return try JSONSerialization.jsonObject(with: data) as? [String: Any] ?? [:]
    }

    @Test("idle: sessions open and subscribe; memory per session and per user are measured")
    func idle() throws {
        let result = try run(["idle", "--sessions", "200", "--settle", "1"])
        #expect(result["subscribed"] as? Bool == true)
        #expect((result["redis_bytes_per_user"] as? Double ?? 0) > 0)
        #expect((result["node_rss_after_bytes"] as? Int ?? 0) > 0)
    }

    @Test("churn: every change reaches the watcher; the floor is measured beside it")
    func churn() throws {
        let result = try run(["churn", "--rate", "200", "--duration", "2", "--users", "50"])
        #expect(result["lost"] as? Int == 0)
        let latency = result["latency"] as? [String: Double] ?? [:]
        let floor = result["floor"] as? [String: Double] ?? [:]
        #expect(latency["count"] == 400)
        #expect((latency["p99_ms"] ?? 0) > 0 && (floor["p99_ms"] ?? 0) > 0 && (floor["count"] ?? 0) >= 300)
    }

    @Test("storm: every device is seen online")
    func storm() throws {
        let result = try run(["storm", "--devices", "300"])
        #expect(result["all_seen"] as? Bool == true)
        #expect((result["connects_per_second"] as? Double ?? 0) > 0)
    }

    @Test("fanout: every watcher gets every change")
    func fanout() throws {
        let result = try run(["fanout", "--watchers", "200", "--changes", "2"])
        #expect((result["completion_ms"] as? [Double])?.count == 2)
        #expect((result["deliveries_per_second"] as? Double ?? 0) > 0)
    }

    @Test("death: a killed node's sessions are all seen offline within the lease plus a little")
    func death() throws {
        let result = try run(["death", "--sessions", "100", "--lease", "2"])
        #expect(result["all_seen"] as? Bool == true)
        #expect((result["detected_seconds"] as? Double ?? 99) < 5)
    }

    @Test("cost: commands per idle device and per change are counted")
    func cost() throws {
        let result = try run(["cost", "--devices", "100", "--idle-seconds", "3", "--changes", "100"])
        #expect((result["commands_per_change"] as? Double ?? 0) > 0)
        #expect(result["commands_per_device_minute"] is Double)
    }
}
