import ArgumentParser
import Foundation
import NIOConcurrencyHelpers
import PresenceEngine
import PresenceProtocol
import RedisTestSupport

/// Messages in one big group over node processes: every connected member's `message` timed from
/// the send, checked once and in order, and answered with `delivered` as the SDK does; the Redis
/// commands each message costs, with the group above `PRESENCE_LARGE_GROUP` (its `delivered`
/// moves written by each node together, no `receipt` frames) and, on fresh nodes, below it (one
/// cursor write and one receipt per member's `delivered`).
struct GroupMessagesScenario: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "group-messages",
        abstract: "A group of N members, M of them connected over several nodes: send → every member's message (p99), and Redis commands per message with delivered moves written together and one by one."
    )
    @OptionGroup var options: ScenarioOptions
    @Option(help: "Members of the group.") var members = 5_000
    @Option(help: "Members with a session (spread over the nodes in turn).") var connected = 2_500
    @Option(help: "Node processes.") var nodes = 3
    @Option(help: "Messages sent into the group, as a large group.") var messages = 30
    @Option(help: "Messages a second.") var rate = 1
    @Flag(inversion: .prefixedNo, help: "Whether members answer each message with `delivered`, as the SDK does.") var delivered = true
    @Option(help: "Seconds the idle nodes' Redis commands are counted before the messages, to take from theirs.") var idleWindow = 3.0
    @Option(help: "PRESENCE_LARGE_GROUP of the nodes in the first pass: a group above it is a large one.") var largeGroup = 1_000
    @Option(help: "Messages sent again on nodes that take the group as a small one (each member's delivered written alone, a receipt to every member); 0 skips that pass.")
    var uncoalescedMessages = 1

    func validate() throws {
        guard members >= 2, (1...members).contains(connected) else { throw ValidationError("--connected must be 1…--members, and --members at least 2") }
        guard (2..<members).contains(largeGroup), members <= 100_000 else {
            throw ValidationError("--large-group must be 2…--members − 1 (the group is a large one), and --members at most 100,000 (PRESENCE_LARGE_GROUP's largest, for the small pass)")
        }
        guard nodes >= 1, messages >= 1, rate >= 1, uncoalescedMessages >= 0, idleWindow > 0 else { throw ValidationError("--nodes, --messages and --rate must be at least 1, --uncoalesced-messages at least 0, --idle-window above 0") }
    }

    func run() async throws {
        let limit = raiseFileLimit()
        guard limit > connected + 1_000 else {
            throw BenchError("the open-file limit is \(limit); \(connected) sessions need about \(connected + 1_000)")
        }
        let large = try await pass(messages: messages, largeGroupSetting: largeGroup)
        let small = uncoalescedMessages > 0 ? try await pass(messages: uncoalescedMessages, largeGroupSetting: 100_000) : nil
        var rows: [(String, String)] = [
            ("send → message, every member", large.latency.line),
            ("deliveries", "\(large.delivered) of \(large.expected); \(large.misordered) out of order or repeated, \(large.closed) sessions closed"),
            ("receipt frames per member per message", String(format: "%.2f", large.receiptsPerMember)),
            ("Redis commands per message", String(format: "%.1f (%.0f calls in %.1f s less %.1f/s measured idle before)", large.commandsPerMessage, large.calls, large.seconds, large.idleRate)),
            ("  of which", Self.top(large.byCommand)),
            ("node CPU per message", String(format: "%.1f ms (all nodes); the load generator's %.1f ms", large.nodeCPU / Double(messages) * 1000,
                                             large.generatorCPU / Double(messages) * 1000)),
        ]
        var json: [String: Any] = [
            "scenario": "group-messages", "members": members, "connected": connected, "nodes": nodes, "messages": messages, "rate": rate,
            "latency": large.latency.summary, "delivered": large.delivered, "expected": large.expected, "misordered": large.misordered,
            "closed": large.closed, "receipts_per_member": large.receiptsPerMember, "redis_commands_per_message": large.commandsPerMessage, "redis_commands_by_name": large.byCommand,
            "node_cpu_ms_per_message": large.nodeCPU / Double(messages) * 1000,
            "generator_cpu_ms_per_message": large.generatorCPU / Double(messages) * 1000,
        ]
        if let small {
            rows += [
                ("as a small group: send → message", small.latency.line),
                ("as a small group: deliveries", "\(small.delivered) of \(small.expected); \(small.closed) sessions closed"),
                ("as a small group: receipt frames per member per message", String(format: "%.1f", small.receiptsPerMember)),
                ("as a small group: Redis commands per message", String(format: "%.1f (%.0f calls in %.1f s)", small.commandsPerMessage, small.calls, small.seconds)),
                ("  of which", Self.top(small.byCommand)),
            ]
            json["uncoalesced"] = ["messages": uncoalescedMessages, "latency": small.latency.summary, "delivered": small.delivered,
                                   "closed": small.closed, "receipts_per_member": small.receiptsPerMember,
                                   "redis_commands_per_message": small.commandsPerMessage, "redis_commands_by_name": small.byCommand]
        }
        try report("group-messages: \(members) members, \(connected) connected over \(nodes) nodes, \(messages) messages at \(rate)/s", rows, json: json, to: options.json)
        let ok = large.delivered == large.expected && large.misordered == 0 && large.closed == 0 && large.receiptsPerMember == 0
        guard ok else { throw BenchError("group-messages: a message was lost, repeated or out of order, a session was closed, or a large group got receipts") }
    }

    /// What one pass measured.
    struct Pass {
        let latency: LatencyRecorder
        let delivered: Int
        let expected: Int
        let misordered: Int
        let closed: Int
        let receiptsPerMember: Double
        let commandsPerMessage: Double
        let byCommand: [String: Double]
        let calls: Double
        let seconds: Double
        let idleRate: Double
        let nodeCPU: Double
        let generatorCPU: Double
    }

    /// Per member session: the last seq it got, and what went wrong.
    private struct Tally {
        var lastSeq: [Int64]
        var delivered = 0
        var misordered = 0
        var receipts = 0
        var closed = 0
        var snapshots = 0
    }

    /// Fresh nodes with `PRESENCE_LARGE_GROUP` at `largeGroupSetting`, the group, the sessions,
    /// then `messages` sends from a session of the first member at `rate`.
    private func pass(messages: Int, largeGroupSetting: Int) async throws -> Pass {
        // A lease of 60 s puts the nodes' audit of every device (every three leases: two Redis
        // reads a device) three minutes apart, outside the measured window: its commands are an
        // idle device's (the cost scenario's), not a message's.
        let environment = ["PRESENCE_LARGE_GROUP": "\(largeGroupSetting)", "PRESENCE_LEASE_TTL": "60"]
        let processes = try await NodeProcesses(count: nodes, redisURL: options.common.redisURL, binary: options.gatewayBinary, environment: environment)
        defer { processes.stop() }
        let users = (0..<members).map { "gm-\($0)" }
        let setup = try await BenchEngine.make(redisURL: options.common.redisURL, prefix: processes.prefix)
        _ = try await setup.use { try await $0.setMembers(of: "big", to: users) }
        let fleet = Fleet(nodes: processes, threads: options.threads)
        let tally = NIOLockedValueBox(Tally(lastSeq: Array(repeating: 0, count: connected)))
        let sentAt = NIOLockedValueBox<[String: ContinuousClock.Instant]>([:])
        let latency = LatencyRecorder()
        let sockets = NIOLockedValueBox<[BenchSocket]>([])
        let label = largeGroupSetting < members ? "group-messages" : "group-messages (small)"
        let opened = try await fleet.connect((0..<connected).map { (users[$0], "d", $0 % nodes) }, label: label) { index, text in
            // Messages and receipts are read by a look at their fields, not decoded, and the
            // `delivered` written by hand: 2,500 members a message, the load generator's JSON
            // coding took most of a core and showed in the latency as its own queue.
            if text.contains("\"type\":\"receipt\"") {
                tally.withLockedValue { $0.receipts += 1 }
                return
            }
            if text.contains("\"type\":\"message\""), let seq = jsonNumber(text, "seq"), let id = jsonString(text, "client_message_id") {
                if let sent = sentAt.withLockedValue({ $0[String(id)] }) { latency.record(ContinuousClock.now - sent) }
                tally.withLockedValue { tally in
                    if seq != tally.lastSeq[index] + 1 { tally.misordered += 1 }
                    tally.lastSeq[index] = max(tally.lastSeq[index], seq)
                    tally.delivered += 1
                }
                // As the SDK does: each message received is said delivered.
                guard delivered else { return }
                sockets.withLockedValue { $0.indices.contains(index) ? $0[index] : nil }?
                    .send("{\"type\":\"delivered\",\"data\":{\"conversation_id\":\"big\",\"seq\":\(seq)}}")
                return
            }
            switch serverFrame(text) {
            case .initialState: tally.withLockedValue { $0.snapshots += 1 }
            default: break
            }
        } onClose: { _, _ in
            tally.withLockedValue { $0.closed += 1 }
        }
        sockets.withLockedValue { $0 = opened }
        guard await eventually(timeout: .seconds(120), { tally.withLockedValue { $0.snapshots } >= connected }) else {
            throw BenchError("\(label): not every session got its snapshot")
        }
        let acknowledged = NIOLockedValueBox(0)
        let sender = try await fleet.connect([(users[0], "sender", 0)], label: label) { _, text in
            if case .messageAck = serverFrame(text) { acknowledged.withLockedValue { $0 += 1 } }
        }[0]
        // Past the opening hold of the last sessions; in a large group one message not measured
        // (each node learns from its members' first `delivered` that the group is a large one);
        // then the Redis commands of the idle nodes.
        try await Task.sleep(for: .seconds(2.5))
        let warmUp = largeGroupSetting < members ? connected : 0
        if warmUp > 0 {
            sender.send(clientText(.send(MessageDraft(conversationID: "big", clientMessageID: "warm-up", text: "warm-up")), id: "warm-up"))
            guard await eventually(timeout: .seconds(60), { tally.withLockedValue { $0.delivered } >= warmUp }) else {
                throw BenchError("\(label): the first message did not reach every member within 60 s")
            }
            try await Task.sleep(for: .seconds(1.5))
        }
        let idle = try await withRedis(options.common.redisURL) { redis in
            let before = try await callsByCommand(redis)
            try await Task.sleep(for: .seconds(idleWindow))
            return Self.difference(try await callsByCommand(redis), before)
        }
        let cpuBefore = processes.cpuSeconds
        let generatorBefore = processorSeconds(pid: getpid()) ?? 0
        tally.withLockedValue { $0.receipts = 0 }
        let (callsBefore, started) = (try await withRedis(options.common.redisURL) { try await callsByCommand($0) }, ContinuousClock.now)
        let interval = Duration.seconds(1) / rate
        for number in 0..<messages {
            let id = "g\(number)"
            sentAt.withLockedValue { $0[id] = .now }
            sender.send(clientText(.send(MessageDraft(conversationID: "big", clientMessageID: id, text: "message \(number)")), id: id))
            progress("\(label): sent \(number + 1)/\(messages), \(tally.withLockedValue { $0.delivered }) delivered")
            try await Task.sleep(until: started + interval * (number + 1))
        }
        let expected = messages * connected
        _ = await eventually(timeout: .seconds(120)) { tally.withLockedValue { $0.delivered } >= expected + warmUp }
        // The nodes write the delivered moves of a large group once a second: past the last one.
        try await Task.sleep(for: .seconds(2))
        endProgress()
        let elapsed = seconds(ContinuousClock.now - started)
        let calls = Self.difference(try await withRedis(options.common.redisURL) { try await callsByCommand($0) }, callsBefore)
        // Each command's calls in the pass, less what the nodes spent at the idle rate meanwhile.
        var perMessage: [String: Double] = [:]
        for (command, count) in calls {
            perMessage[command] = (count - (idle[command] ?? 0) / idleWindow * elapsed) / Double(messages)
        }
        let nodeCPU = processes.cpuSeconds - cpuBefore
        let generatorCPU = (processorSeconds(pid: getpid()) ?? 0) - generatorBefore
        let final = tally.withLockedValue { $0 }
        await fleet.shutdown()
        _ = try? await setup.use { try await $0.deleteConversation("big") }
        return Pass(
            latency: latency, delivered: final.delivered - warmUp, expected: expected, misordered: final.misordered, closed: final.closed,
            receiptsPerMember: Double(final.receipts) / Double(connected * messages),
            commandsPerMessage: perMessage.values.reduce(0, +), byCommand: perMessage, calls: calls.values.reduce(0, +), seconds: elapsed,
            idleRate: idle.values.reduce(0, +) / idleWindow, nodeCPU: nodeCPU, generatorCPU: generatorCPU
        )
    }

    /// `after` less `before`, command by command.
    private static func difference(_ after: [String: Double], _ before: [String: Double]) -> [String: Double] {
        after.reduce(into: [:]) { result, entry in result[entry.key] = entry.value - (before[entry.key] ?? 0) }
    }

    /// The commands that cost a message most, as "evalsha 2.0, publish 1.0".
    static func top(_ byCommand: [String: Double]) -> String {
        byCommand.filter { $0.value >= 0.05 }.sorted { $0.value > $1.value }.prefix(6)
            .map { String(format: "%@ %.1f", $0.key, $0.value) }.joined(separator: ", ")
    }
}

/// The number after `"name":` in a JSON text (the first such field), without decoding it.
func jsonNumber(_ text: String, _ name: String) -> Int64? {
    guard let start = text.range(of: "\"\(name)\":")?.upperBound else { return nil }
    let digits = text[start...].prefix { $0.isNumber || $0 == "-" }
    return Int64(digits)
}

/// The string after `"name":"` in a JSON text (the first such field, no escapes in it).
func jsonString(_ text: String, _ name: String) -> Substring? {
    guard let start = text.range(of: "\"\(name)\":\"")?.upperBound, let end = text[start...].firstIndex(of: "\"") else { return nil }
    return text[start..<end]
}
