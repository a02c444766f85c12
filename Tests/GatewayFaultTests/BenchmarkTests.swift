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
    /// The valgrind `scripts/fetch-valgrind` unpacks, in the package's `.tools`.
    static let valgrind: String = {
        var root = URL(fileURLWithPath: #filePath)
        for _ in 0..<3 { root.deleteLastPathComponent() }
        return root.appendingPathComponent(".tools/valgrind").path
    }()

    /// Runs a scenario and returns its JSON results.
    /// `nodes` false for a scenario that starts no node and uses no Redis.
    func run(_ arguments: [String], nodes: Bool = true) throws -> [String: Any] {
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
        process.arguments = arguments + (nodes ? ["--redis-url", TestRedis.url, "--gateway-binary", GatewayProcess.binary.path] : []) + ["--json", json.path]
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
        #expect((result["floor_cpu_us_per_delivery"] as? Double ?? 0) > 0, "the kernel's floor is measured beside the nodes")
    }

    @Test("floor: every reader gets every frame, and the writer's CPU per write is measured, with write(2) and through NIO", arguments: ["syscall", "nio"])
    func floor(writer: String) throws {
        let result = try run(["floor", "--connections", "200", "--rounds", "5", "--pause", "5", "--writer", writer], nodes: false)
        #expect(result["connections"] as? Int == 200)
        #expect(result["writer"] as? String == writer)
        #expect((result["cpu_us_per_delivery"] as? Double ?? 0) > 0)
    }

    @Test("death: a killed node's sessions are all seen offline within the lease plus a little")
    func death() throws {
        let result = try run(["death", "--sessions", "100", "--lease", "2"])
        #expect(result["all_seen"] as? Bool == true)
        #expect((result["detected_seconds"] as? Double ?? 99) < 5)
    }

    @Test("group-messages: every member gets every message once and in order; a large group's delivered moves cost fewer Redis commands and no receipts")
    func groupMessages() throws {
        let result = try run(["group-messages", "--members", "60", "--connected", "30", "--large-group", "20", "--messages", "5", "--rate", "5",
                              "--uncoalesced-messages", "1", "--idle-window", "1"])
        #expect(result["delivered"] as? Int == 150 && result["expected"] as? Int == 150 && result["misordered"] as? Int == 0)
        #expect(result["receipts_per_member"] as? Double == 0)
        let small = result["uncoalesced"] as? [String: Any] ?? [:]
        #expect(small["delivered"] as? Int == 30, "\(small)")
        #expect((small["receipts_per_member"] as? Double ?? 0) >= 29, "a receipt of each member's delivered to each member: \(small)")
        let large = result["redis_commands_per_message"] as? Double ?? .nan
        let alone = small["redis_commands_per_message"] as? Double ?? .nan
        #expect(large < alone, "written together \(large) commands a message, one by one \(alone)")
    }

    @Test("reconnect-storm: a node killed under 300 devices in 5 conversations each: every one back elsewhere and caught up, nothing lost or repeated, nobody offline")
    func reconnectStorm() throws {
        let result = try run(["reconnect-storm", "--sessions", "300", "--conversations", "5", "--members", "10", "--rate", "100", "--lease", "10"])
        #expect(result["caught_up"] as? Int == 300)
        #expect(result["lost"] as? Int == 0 && result["repeated"] as? Int == 0 && result["closed_1008"] as? Int == 0, "\(result)")
        #expect(result["flickers"] as? Int == 0)
        #expect((result["messages_sent"] as? Int ?? 0) > 500)
    }

    /// Needs valgrind unpacked by `scripts/fetch-valgrind` (`make instructions` does it): not in
    /// CI, which does not download it.
    @Test(
        "instructions: the node runs under callgrind and its instructions are read for each stretch",
        .enabled(if: FileManager.default.isExecutableFile(atPath: "\(valgrind)/usr/bin/valgrind.bin")
            && FileManager.default.isExecutableFile(atPath: "/usr/bin/vgdb"), "needs scripts/fetch-valgrind")
    )
    func instructions() throws {
        let profile = FileManager.default.temporaryDirectory.appendingPathComponent("instructions-\(UUID().uuidString)")
        defer { try? FileManager.default.removeItem(at: profile) }
        let result = try run(["instructions", "--users", "2", "--watchers", "10", "--changes", "5", "--valgrind", Self.valgrind, "--profile", profile.path])
        let series = result["series"] as? [String: [String: Double]] ?? [:]
        let instructions = { (name: String) in series[name]?["instructions"] ?? 0 }
        // Ten deliveries a change against one: the second series cannot cost less; nor can a
        // message to eleven members' sessions cost less than one to two.
        #expect(instructions("solo") > 0 && instructions("idle") > 0 && instructions("star") > instructions("solo"), "\(series)")
        #expect(instructions("members-idle") > 0 && instructions("room") > instructions("pair"), "\(series)")
        for name in ["instructions_per_delivery", "instructions_per_message_sent", "instructions_per_message_delivery"] {
            #expect((result[name] as? Double)?.isFinite == true, "\(name)")
        }
        // Each stretch's dump kept for callgrind_annotate, its total the one printed.
        let kept = Set((try? FileManager.default.contentsOfDirectory(atPath: profile.path)) ?? [])
        #expect(kept == ["solo.callgrind", "star.callgrind", "idle.callgrind", "pair.callgrind", "room.callgrind", "members-idle.callgrind"], "\(kept)")
        let soloDump = (try? String(contentsOf: profile.appendingPathComponent("solo.callgrind"), encoding: .utf8)) ?? ""
        #expect(soloDump.split(separator: "\n").contains("summary: \(Int(instructions("solo")))"))
    }

    @Test("cost: commands per idle device and per change are counted")
    func cost() throws {
        let result = try run(["cost", "--devices", "100", "--idle-seconds", "3", "--changes", "100"])
        #expect((result["commands_per_change"] as? Double ?? 0) > 0)
        #expect(result["commands_per_device_minute"] is Double)
    }
}
