import ArgumentParser
import Foundation
import NIOConcurrencyHelpers
import PresenceEngine
import PresenceGateway
import PresenceProtocol
import RedisClient

/// Messages between two nodes: send on node A → `message` on node B beside the Redis floor,
/// what one node sustains into one conversation and spread over many, Redis bytes per stored
/// message, and what idle members with history cost the node.
struct MessageBench: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "messages",
        abstract: "Send → receive latency across two nodes beside the Redis floor; messages a second into one conversation and over many; Redis bytes per message; idle members with history."
    )

    @OptionGroup var common: CommonOptions
    @Option(help: "Messages a second in the latency phase (one session, as a bot would send).") var rate = 50
    @Option(help: "Seconds of the latency phase.") var duration = 10
    @Option(help: "Messages sent as fast as they are acknowledged, in each throughput phase.") var burst = 5_000
    @Option(help: "Conversations the spread phase sends over.") var conversations = 1_000
    @Option(help: "Bytes of text per message.") var size = 100
    @Option(help: "Members with a session on node B in the idle phase, each in conversations of their own with history.") var idleMembers = 2_000
    @Option(help: "Conversations with history each idle member is in (each with the sender, so each is a channel of its own).") var conversationsPerMember = 1
    @Option(help: "Seconds the idle phase's CPU is measured, once every session is open.") var idleWindow = 10
    @Option(help: "Write the figures as JSON to this file.") var json: String?

    func run() async throws {
        // Both ends of every session are in this process; past the open-file limit, libdispatch's
        // worker monitor (which opens /proc files) traps.
        let files = raiseFileLimit()
        guard idleMembers * 2 + 2_000 <= files else {
            throw BenchError("--idle-members \(idleMembers) needs \(idleMembers * 2 + 2_000) open files (both ends of each session are in this process); the limit is \(files)")
        }
        let nodes = try await TwoNodes.start(redisURL: common.redisURL, statusRate: 100, maxIDs: 500) { configuration in
            // The throughput phases measure the node, not the per-user limits.
            configuration.messageRate = 1_000_000
            configuration.frameRate = 1_000_000
        }
        let setup = try await BenchEngine.make(redisURL: common.redisURL, prefix: nodes.prefix)
        let rooms = (0..<conversations).map { "bench-room-\($0)" }
        try await setup.use { engine in
            for room in ["bench-room"] + rooms { _ = try await engine.setMembers(of: room, to: ["bench-sender", "bench-reader"]) }
        }
        let text = String(repeating: "m", count: max(1, size))

        // The reader on node B records each message's arrival by its client id; the sender on
        // node A records each acknowledgement.
        let sentAt = NIOLockedValueBox<[String: ContinuousClock.Instant]>([:])
        let latency = LatencyRecorder()
        let timing = NIOLockedValueBox(true)
        let received = NIOLockedValueBox(0)
        let acknowledged = NIOLockedValueBox(0)
        let opened = NIOLockedValueBox(0)
        let (_, readerTask) = try await nodes.connect(node: 1, user: "bench-reader", device: "r") { text in
            switch serverFrame(text) {
            case .initialState: opened.withLockedValue { $0 += 1 }
            case .message(let message):
                let now = ContinuousClock.now
                if let at = sentAt.withLockedValue({ $0.removeValue(forKey: message.clientMessageID) }), timing.withLockedValue({ $0 }) {
                    latency.record(now - at)
                }
                received.withLockedValue { $0 += 1 }
            default: break
            }
        }
        let (sender, senderTask) = try await nodes.connect(node: 0, user: "bench-sender", device: "s") { text in
            switch serverFrame(text) {
            case .initialState: opened.withLockedValue { $0 += 1 }
            case .messageAck: acknowledged.withLockedValue { $0 += 1 }
            default: break
            }
        }
        while opened.withLockedValue({ $0 }) < 2 { try await Task.sleep(for: .milliseconds(10)) }
        // Past the opening hold, so that the first messages are not held for a sync.
        try await Task.sleep(for: .seconds(2.5))
        let coder = FrameCoder()
        func send(_ id: String, to room: String) {
            sentAt.withLockedValue { $0[id] = .now }
            sender.yield(coder.text(ClientMessage(.send(MessageDraft(conversationID: room, clientMessageID: id, text: text)), id: id)))
        }

        // 1. Latency at a steady rate.
        let total = rate * duration
        let interval = Duration.seconds(1) / rate
        let start = ContinuousClock.now
        for index in 0..<total {
            send("l\(index)", to: "bench-room")
            if index % rate == 0 { progress("latency: \(index)/\(total)") }
            try await Task.sleep(until: start + interval * (index + 1))
        }
        try await Task.sleep(for: .seconds(1))
        endProgress()
        let lostLive = sentAt.withLockedValue { $0.count }
        let floor = try await publishFloor(redisURL: common.redisURL, rate: rate, count: min(total, 10_000))
        let ratio = latency.milliseconds(99) / max(floor.milliseconds(99), 0.001)
        timing.withLockedValue { $0 = false }

        // 2 and 3. As fast as the node takes them: into one conversation, then over many.
        func throughput(_ label: String, _ room: (Int) -> String) async throws -> (perSecond: Double, delivered: Double) {
            acknowledged.withLockedValue { $0 = 0 }
            received.withLockedValue { $0 = 0 }
            sentAt.withLockedValue { $0 = [:] }
            let begin = ContinuousClock.now
            // At most 200 unacknowledged at once: a client's window, not an unbounded flood.
            for index in 0..<burst {
                while index - acknowledged.withLockedValue({ $0 }) >= 200 { try await Task.sleep(for: .microseconds(200)) }
                send("\(label)\(index)", to: room(index))
                if index % 1_000 == 0 { progress("\(label): \(index)/\(burst)") }
            }
            while acknowledged.withLockedValue({ $0 }) < burst, ContinuousClock.now - begin < .seconds(120) { try await Task.sleep(for: .milliseconds(1)) }
            let stored = seconds(ContinuousClock.now - begin)
            while received.withLockedValue({ $0 }) < burst, ContinuousClock.now - begin < .seconds(120) { try await Task.sleep(for: .milliseconds(1)) }
            let delivered = seconds(ContinuousClock.now - begin)
            endProgress()
            return (Double(burst) / stored, Double(burst) / delivered)
        }
        let one = try await throughput("one", { _ in "bench-room" })
        let spread = try await throughput("spread", { rooms[$0 % rooms.count] })

        // Redis bytes per stored message: the one conversation's stream over its entries.
        let perMessage = try await withRedis(common.redisURL) { redis -> Double in
            let key = "\(nodes.prefix):{c:bench-room}:history"
            let bytes = try await redis.execute(MEMORYUSAGE(key: key, samples: 0)) ?? 0
            let entries = try await redis.execute(XLEN(key: key))
            return Double(bytes) / Double(max(1, entries))
        }
        senderTask.cancel()
        readerTask.cancel()

        // 4. Idle members with history: each in a conversation of their own that has messages.
        let perMemberRooms = max(1, conversationsPerMember)
        let idleRooms = (0..<idleMembers * perMemberRooms).map { "bench-idle-\($0)" }
        try await setup.use { engine in
            for (index, room) in idleRooms.enumerated() {
                _ = try await engine.setMembers(of: room, to: ["bench-idle-\(index % idleMembers)", "bench-sender"])
                _ = try await engine.send(OutgoingMessage(clientMessageID: "seed", text: text), to: room, from: "bench-sender")
                if index % 500 == 0 { progress("idle: conversations \(index)/\(idleRooms.count)") }
            }
        }
        let residentBefore = residentBytes()
        let idleOpened = NIOLockedValueBox(0)
        var idleTasks: [Task<Void, any Error>] = []
        for index in 0..<idleMembers {
            let (_, task) = try await nodes.connect(node: 1, user: "bench-idle-\(index)", device: "i") { text in
                if case .initialState = serverFrame(text) { idleOpened.withLockedValue { $0 += 1 } }
            }
            idleTasks.append(task)
            if index % 500 == 0 { progress("idle: sessions \(index)/\(idleMembers)") }
        }
        let idleStart = ContinuousClock.now
        while idleOpened.withLockedValue({ $0 }) < idleMembers, ContinuousClock.now - idleStart < .seconds(120) { try await Task.sleep(for: .milliseconds(20)) }
        try await Task.sleep(for: .seconds(3))
        endProgress()
        let residentAfter = residentBytes()
        // Idle CPU of the process (both nodes and every client) over a quiet window.
        let cpuBefore = cpuSeconds()
        try await Task.sleep(for: .seconds(idleWindow))
        let idleCPU = (cpuSeconds() - cpuBefore) / Double(max(1, idleWindow))
        let perMember = Double(residentAfter - residentBefore) / Double(max(1, idleOpened.withLockedValue { $0 }))
        for task in idleTasks { task.cancel() }

        try report("messages: \(size)-byte texts, sender on node A, reader on node B (both nodes in this process)", [
            ("send → message, \(rate)/s for \(duration) s", latency.line),
            ("Redis PUBLISH → SUBSCRIBE floor", floor.line),
            ("p99 over the floor's p99", String(format: "%.1f×", ratio)),
            ("messages not delivered", "\(lostLive) of \(total)"),
            ("one conversation, \(burst) messages", String(format: "%.0f acknowledged/s, %.0f delivered/s", one.perSecond, one.delivered)),
            ("over \(conversations) conversations, \(burst) messages", String(format: "%.0f acknowledged/s, %.0f delivered/s", spread.perSecond, spread.delivered)),
            ("Redis bytes per stored message", String(format: "%.0f (stream MEMORY USAGE / XLEN, %d-byte text)", perMessage, size)),
            ("idle members with history, memory each", String(format: "%.1f KiB (%d sessions, each in %d conversation(s) of its own: %d channels; resident memory of this process)",
                                                              perMember / 1024, idleOpened.withLockedValue { $0 }, perMemberRooms, idleRooms.count)),
            ("idle CPU of the process", String(format: "%.1f%% of a core over %d s", idleCPU * 100, idleWindow)),
        ], json: ["scenario": "messages", "rate": rate, "duration": duration, "latency": latency.summary, "floor": floor.summary, "p99_ratio": ratio,
                  "lost": lostLive, "one_conversation_per_second": one.perSecond, "one_conversation_delivered_per_second": one.delivered,
                  "spread_per_second": spread.perSecond, "spread_delivered_per_second": spread.delivered, "conversations": conversations,
                  "redis_bytes_per_message": perMessage, "idle_member_bytes": perMember, "idle_members": idleMembers,
                  "conversations_per_member": perMemberRooms, "idle_cpu_cores": idleCPU], to: json)
        try await setup.use { engine in
            for room in ["bench-room"] + rooms + idleRooms { _ = try await engine.deleteConversation(room) }
        }
        await nodes.stop()
    }

    /// CPU seconds this process used so far (user and system).
    private func cpuSeconds() -> Double {
        var usage = rusage()
        getrusage(RUSAGE_SELF.rawValue, &usage)
        return Double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) + Double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6
    }

    /// This process's resident memory (both nodes live here).
    private func residentBytes() -> Int {
        guard let status = try? String(contentsOfFile: "/proc/self/status", encoding: .utf8),
              let line = status.split(separator: "\n").first(where: { $0.hasPrefix("VmRSS:") }),
              let kib = line.split(separator: " ").dropFirst().first.flatMap({ Int($0) }) else { return 0 }
        return kib * 1024
    }
}
