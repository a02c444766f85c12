import ClientTestSupport
import Foundation
import PresenceProtocol
import RedisTestSupport
import Testing

/// Random faults while members send messages: devices dropped and back on another node (syncing
/// from where they were, resending what was not acknowledged with the same client id), nodes
/// killed with -9 while sends are under way and restarted under the same id, a node's pub/sub
/// connection killed. At quiet checkpoints every connected device of every member must hold its
/// conversations' histories exactly (each seq once, in order), every acknowledged message must be
/// in the history once at its acknowledged seq, and no message may be stored twice.
///
/// The seed is printed; `PRESENCE_CHAOS_SEED` replays one, `PRESENCE_CHAOS_OPS` sets the length.
@Suite("Message chaos over three nodes", .serialized)
struct MessageChaosTests {
    static let seed = UInt64(ProcessInfo.processInfo.environment["PRESENCE_CHAOS_SEED"] ?? "") ?? 20_261_127
    static let operations = Int(ProcessInfo.processInfo.environment["PRESENCE_CHAOS_OPS"] ?? "") ?? 240

    /// Who is in which conversation: two that overlap, so a node routes both to some sessions.
    static let conversations = ["c0": (0..<6).map { "u\($0)" }, "c1": (3..<9).map { "u\($0)" }]

    @Test("random drops, kill -9 and pub/sub kills while members send: nothing acknowledged is lost, nothing is stored or delivered twice, every device holds the history in order")
    func messageChaos() async throws {
        print("message chaos: seed \(Self.seed), \(Self.operations) operations (PRESENCE_CHAOS_SEED, PRESENCE_CHAOS_OPS)")
        var random = SeededRandom(seed: Self.seed)
        let redis = try RedisServerProcess()
        let environment = nodeEnvironment(prefix: TestRedis.uniquePrefix("msgchaos"), redisURL: redis.url(), extra: ["PRESENCE_VISIBILITY": "open"])
        var nodes: [GatewayProcess?] = []
        var ports: [Int] = []
        for index in 0..<3 {
            let node = try await GatewayProcess(nodeID: "node\(index)", environment: environment)
            nodes.append(node)
            ports.append(node.port)
        }
        for (conversation, members) in Self.conversations.sorted(by: { $0.key < $1.key }) {
            let body = #"{"member_ids":["# + members.map { "\"\($0)\"" }.joined(separator: ",") + "]}"
            #expect(admin(nodes[0]!, "PUT", "/api/admin/conversations/\(conversation)", body)?.status == 200)
        }
        // Two devices for u0 and u4 (u4 is in both conversations): one user, two histories to keep.
        var devices: [MessageDevice] = []
        for user in (0..<9).map({ "u\($0)" }) {
            let mine = Self.conversations.filter { $0.value.contains(user) }.keys.sorted()
            devices.append(MessageDevice(user: user, device: "phone", conversations: mine))
            if user == "u0" || user == "u4" { devices.append(MessageDevice(user: user, device: "laptop", conversations: mine)) }
        }
        func livePort() -> Int {
            let live = nodes.indices.filter { nodes[$0] != nil }
            return ports[live[random.below(live.count)]]
        }
        for device in devices { try await device.connect(port: livePort()) }

        var counts: [String: Int] = [:]
        var sent = 0
        var checkpoints = 0

        func history(_ conversation: String) throws -> [(seq: Int, sender: String, clientID: String)] {
            // The stream as Redis holds it, one `seq-0|sender|client id` line per entry.
            let script = """
                local out = {}
                for _, entry in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
                  local fields = {}
                  for i = 1, #entry[2], 2 do fields[entry[2][i]] = entry[2][i + 1] end
                  table.insert(out, entry[1] .. '|' .. fields['u'] .. '|' .. fields['c'])
                end
                return table.concat(out, ' ')
                """
            let raw = try redis.cli("EVAL", script, "1", "\(environment["PRESENCE_KEY_PREFIX"]!):{c:\(conversation)}:history")
            return raw.split(whereSeparator: { $0 == " " || $0 == "\n" }).compactMap { line in
                let parts = line.split(separator: "|").map(String.init)
                guard parts.count == 3, let seq = parts[0].split(separator: "-").first.flatMap({ Int($0) }) else { return nil }
                return (seq, parts[1], parts[2])
            }
        }

        func checkpoint() async throws {
            checkpoints += 1
            // Every live node up; every device back, its outbox drained.
            for index in nodes.indices where nodes[index] == nil {
                nodes[index] = try await GatewayProcess(nodeID: "node\(index)", environment: environment, port: ports[index])
            }
            for device in devices where !device.isConnected { try await device.connect(port: livePort()) }
            var problems: [String] = []
            let settled = await eventually(timeout: .seconds(20), poll: .milliseconds(250)) {
                problems = []
                guard let current = try? Dictionary(uniqueKeysWithValues: Self.conversations.keys.map { ($0, try history($0)) }) else { return false }
                for device in devices {
                    if device.unacknowledged > 0 { problems.append("\(device.user)/\(device.device): \(device.unacknowledged) not acknowledged") }
                    for conversation in device.conversations {
                        let want = current[conversation]?.map(\.seq) ?? []
                        let got = device.received(conversation).map { Int($0.seq) }
                        if got != want { problems.append("\(device.user)/\(device.device) \(conversation): has \(got.count) (last \(got.last ?? 0)), stream \(want.count) (last \(want.last ?? 0))") }
                    }
                }
                return problems.isEmpty
            }
            #expect(settled, "checkpoint \(checkpoints): \(problems.prefix(10))")
            if !settled {
                // What the devices behind and the nodes saw, for the report.
                for device in devices where problems.contains(where: { $0.hasPrefix("\(device.user)/\(device.device)") }) {
                    print("message chaos: \(device.user)/\(device.device), \(device.whereabouts); errors \(device.errors.suffix(5))")
                }
                for (index, node) in nodes.enumerated() {
                    guard let node else { continue }
                    print("message chaos: node\(index) (port \(node.port)), its last warnings:\n" + node.output.split(separator: "\n").suffix(30).joined(separator: "\n"))
                }
            }
            for conversation in Self.conversations.keys.sorted() {
                let entries = try history(conversation)
                #expect(entries.map(\.seq) == Array(0..<entries.count).map { $0 + 1 }, "\(conversation): the stream's seqs have a gap")
                let keys = entries.map { "\($0.sender)/\($0.clientID)" }
                #expect(Set(keys).count == keys.count, "\(conversation): a message stored twice")
                for device in devices {
                    for (clientID, ack) in device.acknowledged where ack.conversation == conversation {
                        let matches = entries.filter { $0.clientID == clientID && $0.sender == device.user }
                        #expect(matches.count == 1 && matches.first?.seq == Int(ack.seq),
                                "\(device.user) \(clientID): acknowledged at \(ack.seq), stored at \(matches.map(\.seq))")
                    }
                }
            }
            for device in devices {
                #expect(device.repeats.isEmpty, "\(device.repeats.prefix(5))")
                #expect(device.syncedAnswers.allSatisfy { $0.complete }, "\(device.user): a sync answered incomplete: \(device.syncedAnswers.filter { !$0.complete }.prefix(3))")
            }
        }

        for step in 1...Self.operations {
            // Every 60 steps (at the top: a step that does nothing goes straight to the next).
            if step > 1, (step - 1) % 60 == 0 { try await checkpoint() }
            let roll = random.below(100)
            let device = devices[random.below(devices.count)]
            switch roll {
            case 0..<60:
                let conversation = device.conversations[random.below(device.conversations.count)]
                sent += 1
                device.send("\(device.user) says \(sent)", to: conversation, clientID: "\(device.device)-\(sent)")
                counts["send", default: 0] += 1
            case 60..<66:
                // Sent, and the connection gone before the answer could come back: the retry on
                // the next session (same client id) must find the message, not store it again.
                let conversation = device.conversations[random.below(device.conversations.count)]
                sent += 1
                device.send("\(device.user) says \(sent)", to: conversation, clientID: "\(device.device)-\(sent)")
                try await Task.sleep(for: .milliseconds(UInt64(random.below(8))))
                device.drop()
                try await Task.sleep(for: .milliseconds(200))
                try await device.connect(port: livePort())
                counts["send, then drop before the answer", default: 0] += 1
            case 66..<72:
                // Dropped, and back on another node a moment later (sync, then the outbox again).
                device.drop()
                try await Task.sleep(for: .milliseconds(UInt64(random.below(400))))
                try await device.connect(port: livePort())
                counts["drop and back", default: 0] += 1
            case 72..<76:
                guard nodes.compactMap({ $0 }).count == 3 else { continue }
                let index = random.below(3)
                nodes[index]?.kill()
                nodes[index] = nil
                counts["kill -9", default: 0] += 1
                // Its devices find out when their connection ends; they come back elsewhere.
                for device in devices where random.below(2) == 0 { try await device.connect(port: livePort()) }
            case 76..<82:
                guard let index = nodes.firstIndex(where: { $0 == nil }) else { continue }
                nodes[index] = try await GatewayProcess(nodeID: "node\(index)", environment: environment, port: ports[index])
                counts["restart", default: 0] += 1
            case 82..<86:
                _ = try redis.cli("CLIENT", "KILL", "TYPE", "pubsub")
                counts["pub/sub killed", default: 0] += 1
            default:
                try await Task.sleep(for: .milliseconds(150))
                counts["pause", default: 0] += 1
            }
            try await Task.sleep(for: .milliseconds(UInt64(random.below(60))))
        }
        try await checkpoint()
        let acknowledged = devices.reduce(0) { $0 + $1.acknowledged.count }
        let duplicates = devices.reduce(0) { $0 + $1.acknowledged.values.count { $0.duplicate } }
        let stored = try Self.conversations.keys.sorted().map { "\($0) \(try history($0).count)" }.joined(separator: ", ")
        print("message chaos: stored \(stored)")
        print("message chaos: \(counts.sorted { $0.key < $1.key }.map { "\($0.key) \($0.value)" }.joined(separator: ", ")); \(checkpoints) checkpoints; \(acknowledged) acknowledged (\(duplicates) as duplicates of a send whose answer was lost)")
        #expect(["send", "drop and back", "kill -9", "pub/sub killed"].allSatisfy { counts[$0, default: 0] > 0 }, "\(counts)")
    }
}
