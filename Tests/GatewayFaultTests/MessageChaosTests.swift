import ClientTestSupport
import Foundation
import PresenceProtocol
import RedisTestSupport
import Testing

/// Random faults while members send messages: devices dropped and back on another node (syncing
/// from where they were, resending what was not acknowledged with the same client id), nodes
/// killed with -9 while sends are under way and restarted under the same id, a node's pub/sub
/// connection killed, and Redis going back in time: restarted from a snapshot taken some steps
/// before, or failed over to a replica that had fallen behind (frozen some steps before; the
/// nodes reach Redis through endpoints that move to the promoted replica), and partitions
/// between a node and Redis (bytes held, connections open) shorter and longer than the lease. At quiet
/// checkpoints, after every device has synced (as an app does when it comes to the foreground),
/// every connected device of every member must hold its conversations' histories exactly (each
/// message once, in order, less what `synced` named truncated), every acknowledged message must
/// be in the history once at its acknowledged seq unless Redis lost it, no message may be stored
/// twice, no id or `(epoch, seq)` may name two messages, and every message Redis lost that a
/// device held must have been named to it in `truncated` (docs/API.md, "Forks").
///
/// The seed is printed; `PRESENCE_CHAOS_SEED` replays one, `PRESENCE_CHAOS_OPS` sets the length.
@Suite("Message chaos over three nodes", .serialized)
struct MessageChaosTests {
    static let seed = UInt64(ProcessInfo.processInfo.environment["PRESENCE_CHAOS_SEED"] ?? "") ?? 20_261_127
    static let operations = Int(ProcessInfo.processInfo.environment["PRESENCE_CHAOS_OPS"] ?? "") ?? 240

    /// Who is in which conversation: two that overlap, so a node routes both to some sessions.
    static let conversations = ["c0": (0..<6).map { "u\($0)" }, "c1": (3..<9).map { "u\($0)" }]

    @Test("random drops, kill -9, pub/sub kills, partitions, snapshot restarts and failovers to a lagging replica while members send: nothing acknowledged is lost but what Redis lost, and that named in truncated; nothing stored or delivered twice; no id reused; every device holds the history in order")
    func messageChaos() async throws {
        print("message chaos: seed \(Self.seed), \(Self.operations) operations (PRESENCE_CHAOS_SEED, PRESENCE_CHAOS_OPS)")
        var random = SeededRandom(seed: Self.seed)
        // Each node reaches the primary through an endpoint of its own, which a failover moves
        // to the replica and a partition cuts.
        var redis = try RedisServerProcess()
        var replica = try Self.replica(of: redis)
        let endpoints = try (0..<3).map { _ in try RedisProxy(upstreamPort: redis.port) }
        let environment = nodeEnvironment(prefix: TestRedis.uniquePrefix("msgchaos"), extra: ["PRESENCE_VISIBILITY": "open"])
        func node(_ index: Int, port: Int? = nil) async throws -> GatewayProcess {
            try await GatewayProcess(nodeID: "node\(index)", environment: environment.merging(["PRESENCE_REDIS_URL": endpoints[index].url]) { $1 }, port: port)
        }
        var nodes: [GatewayProcess?] = []
        var ports: [Int] = []
        for index in 0..<3 {
            let node = try await node(index)
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
            // Read-only (EVAL_RO), so that it also reads while writes are paused.
            let raw = try redis.cli("EVAL_RO", script, "1", "\(environment["PRESENCE_KEY_PREFIX"]!):{c:\(conversation)}:history")
            return raw.split(whereSeparator: { $0 == " " || $0 == "\n" }).compactMap { line in
                let parts = line.split(separator: "|").map(String.init)
                guard parts.count == 3, let seq = parts[0].split(separator: "-").first.flatMap({ Int($0) }) else { return nil }
                return (seq, parts[1], parts[2])
            }
        }

        /// Ids of the messages `server` holds, each conversation's.
        func storedIDs(_ server: RedisServerProcess) throws -> Set<String> {
            let script = """
                local out = {}
                for _, entry in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
                  for i = 1, #entry[2], 2 do if entry[2][i] == 'i' then table.insert(out, entry[2][i + 1]) end end
                end
                return table.concat(out, ' ')
                """
            var ids: Set<String> = []
            for conversation in Self.conversations.keys {
                let raw = try server.cli("EVAL_RO", script, "1", "\(environment["PRESENCE_KEY_PREFIX"]!):{c:\(conversation)}:history")
                ids.formUnion(raw.split(whereSeparator: { $0 == " " || $0 == "\n" }).map(String.init))
            }
            return ids
        }

        // Redis going back in time. `lost`: ids of messages Redis held and then lost.
        var lost: Set<String> = []
        var snapshotTaken = false
        var replicaFrozen = false
        /// Pauses writes and reads what Redis holds, runs `rollback` (which kills it and returns
        /// the server that takes over), and counts what that one does not hold. A message is
        /// sent and acknowledged first (if a node answers within 3 s), so that the rollback has
        /// something to lose: one acknowledged, and received by the members connected.
        func goBack(_ rollback: () throws -> RedisServerProcess) async throws {
            if let device = devices.first(where: \.isConnected) {
                sent += 1
                let clientID = "\(device.device)-\(sent)"
                device.send("\(device.user) says \(sent), to be lost", to: device.conversations[0], clientID: clientID)
                _ = await eventually(timeout: .seconds(3)) { device.acknowledged[clientID] != nil }
            }
            _ = try redis.cli("CLIENT", "PAUSE", "3000", "WRITE")
            let before = try storedIDs(redis)
            let after = try storedIDs(try rollback())
            let gone = before.subtracting(after)
            lost.formUnion(gone)
            counts["messages Redis lost", default: 0] += gone.count
        }

        func checkpoint() async throws {
            checkpoints += 1
            // Every live node up; every device back, its outbox drained.
            for index in nodes.indices where nodes[index] == nil {
                nodes[index] = try await node(index, port: ports[index])
            }
            for device in devices where !device.isConnected { try await device.connect(port: livePort()) }
            if replicaFrozen {
                replica.thaw()
                replicaFrozen = false
            }
            // Every device syncs: one that held messages Redis has since lost is told now. One
            // whose sends were refused while its node could not reach Redis sends them again, now
            // and every 2 s, as the SDKs retry.
            for device in devices { device.resync() }
            var problems: [String] = []
            var polls = 0
            let settled = await eventually(timeout: .seconds(20), poll: .milliseconds(250)) {
                if polls % 8 == 0 {
                    for device in devices where device.unacknowledged > 0 { device.resend() }
                    // A session refused while its node could not reach Redis: back, as the SDKs come back.
                    for device in devices where !device.isConnected { try? await device.connect(port: livePort()) }
                }
                polls += 1
                problems = []
                guard let current = try? Dictionary(uniqueKeysWithValues: Self.conversations.keys.map { ($0, try history($0)) }) else { return false }
                for device in devices {
                    if device.unacknowledged > 0 { problems.append("\(device.user)/\(device.device): \(device.unacknowledged) not acknowledged") }
                    for conversation in device.conversations {
                        let want = current[conversation]?.map { "\($0.seq) \($0.sender)/\($0.clientID)" } ?? []
                        let got = device.received(conversation).map { "\($0.seq) \($0.senderID)/\($0.clientMessageID)" }
                        if got != want {
                            let from = zip(got, want).prefix { $0 == $1 }.count
                            problems.append("\(device.user)/\(device.device) \(conversation): has \(got.count), stream \(want.count); from \(from): has \(got.dropFirst(from).prefix(4)), stream \(want.dropFirst(from).prefix(4))")
                        }
                    }
                }
                return problems.isEmpty
            }
            #expect(settled, "checkpoint \(checkpoints): \(problems.prefix(10))")
            if !settled {
                // What the devices behind and the nodes saw, for the report.
                for device in devices where problems.contains(where: { $0.hasPrefix("\(device.user)/\(device.device)") }) {
                    print("message chaos: \(device.user)/\(device.device), \(device.whereabouts); errors \(device.errors.suffix(5))")
                    for conversation in device.conversations where problems.contains(where: { $0.hasPrefix("\(device.user)/\(device.device) \(conversation)") }) {
                        print("message chaos: \(device.user)/\(device.device) \(conversation), its last frames:\n" + device.trace(conversation).suffix(60).joined(separator: "\n"))
                    }
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
                        // One Redis lost (and nobody sent again) is the only one allowed to be missing.
                        let matches = entries.filter { $0.clientID == clientID && $0.sender == device.user }
                        guard !(matches.isEmpty && lost.contains(ack.id)) else { continue }
                        #expect(matches.count == 1 && matches.first?.seq == Int(ack.seq),
                                "\(device.user) \(clientID): acknowledged at \(ack.seq), stored at \(matches.map(\.seq))")
                    }
                }
            }
            // No id and no (epoch, seq) names two messages, whoever received them.
            var byID: [String: String] = [:]
            var byPosition: [String: String] = [:]
            var named: [String] = []
            for device in devices {
                for conversation in device.conversations {
                    for message in device.everyReceived(conversation) {
                        let what = "\(message.senderID)/\(message.clientMessageID)/\(message.text)"
                        if let earlier = byID.updateValue(what, forKey: message.id), earlier != what { named.append("\(message.id): \(earlier) and \(what)") }
                        let position = "\(conversation) \(message.epoch ?? "-") \(message.seq)"
                        if let earlier = byPosition.updateValue(message.id, forKey: position), earlier != message.id { named.append("\(position): \(earlier) and \(message.id)") }
                    }
                }
            }
            #expect(named.isEmpty, "one name for two messages: \(named.prefix(5))")
            for device in devices {
                #expect(device.repeats.isEmpty, "\(device.repeats.prefix(5))")
                #expect(device.syncedAnswers.allSatisfy { $0.complete }, "\(device.user): a sync answered incomplete: \(device.syncedAnswers.filter { !$0.complete }.prefix(3))")
                // What the device received and no longer holds is what Redis lost, named to it.
                let truncated = device.truncatedIDs
                #expect(truncated.isSubset(of: lost), "\(device.user)/\(device.device): named truncated but not lost: \(truncated.subtracting(lost).prefix(5))")
            }
        }

        for step in 1...Self.operations {
            // Every 60 steps (at the top: a step that does nothing goes straight to the next).
            if step > 1, (step - 1) % 60 == 0 { try await checkpoint() }
            let roll = random.below(104)
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
                nodes[index] = try await node(index, port: ports[index])
                counts["restart", default: 0] += 1
            case 82..<86:
                _ = try redis.cli("CLIENT", "KILL", "TYPE", "pubsub")
                counts["pub/sub killed", default: 0] += 1
            case 86..<88:
                guard !snapshotTaken else { continue }
                _ = try redis.cli("SAVE")
                snapshotTaken = true
                counts["snapshot", default: 0] += 1
            case 88..<91:
                // Killed, and back on its port from the snapshot: what came after it is gone. A
                // frozen replica runs again first, so that it syncs with the new life.
                guard snapshotTaken else { continue }
                if replicaFrozen {
                    replica.thaw()
                    replicaFrozen = false
                }
                try await goBack {
                    redis.stop()
                    try redis.start()
                    return redis
                }
                snapshotTaken = false
                try Self.waitForReplica(of: redis)
                counts["restart from a snapshot", default: 0] += 1
            case 91..<93:
                // The replica stops taking the primary's writes for a while.
                guard !replicaFrozen, Self.hasReplica(redis) else { continue }
                replica.freeze()
                replicaFrozen = true
                counts["replica falls behind", default: 0] += 1
            case 93..<96:
                // The primary dies; the replica, behind or not, is promoted and the endpoint moves
                // to it; a new replica follows it. A replica still syncing would hold the old
                // life, before a restart: only one that has synced this one (or froze in it).
                guard replicaFrozen || Self.hasReplica(redis) else { continue }
                try await goBack {
                    redis.stop()
                    if replicaFrozen { replica.thaw() }
                    _ = try replica.cli("REPLICAOF", "NO", "ONE")
                    return replica
                }
                replicaFrozen = false
                swap(&redis, &replica)
                for endpoint in endpoints { endpoint.redirect(to: redis.port) }
                replica = try Self.replica(of: redis)
                snapshotTaken = false
                counts["failover to a lagging replica", default: 0] += 1
            case 96..<98:
                // A partition between a node and Redis shorter than the lease: nothing is lost.
                endpoints[random.below(3)].cut(for: .milliseconds(1200))
                counts["short cut", default: 0] += 1
            case 98..<100:
                // One past the lease: the node's sends and syncs fail meanwhile (answered
                // `unavailable`, sent again by the devices), and its lease lapses.
                endpoints[random.below(3)].cut(for: .seconds(5))
                counts["long cut", default: 0] += 1
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
        let named = Set(devices.flatMap(\.truncatedIDs))
        print("message chaos: \(counts.sorted { $0.key < $1.key }.map { "\($0.key) \($0.value)" }.joined(separator: ", ")); \(checkpoints) checkpoints; \(acknowledged) acknowledged (\(duplicates) as duplicates of a send whose answer was lost); \(named.count) of the \(lost.count) messages Redis lost were named truncated to a device that held them")
        #expect(["send", "drop and back", "kill -9", "pub/sub killed", "restart from a snapshot", "failover to a lagging replica", "short cut", "long cut"].allSatisfy { counts[$0, default: 0] > 0 }, "\(counts)")
        #expect(!lost.isEmpty, "the rollbacks lost something: the run tested a fork with truncated messages")
    }

    /// A server that follows `primary`, once it has synced.
    static func replica(of primary: RedisServerProcess) throws -> RedisServerProcess {
        let replica = try RedisServerProcess()
        _ = try replica.cli("REPLICAOF", "127.0.0.1", "\(primary.port)")
        try waitForReplica(of: primary)
        return replica
    }

    /// Whether a replica has synced with this life of `primary` (its own list says `online`).
    static func hasReplica(_ primary: RedisServerProcess) -> Bool {
        (try? primary.cli("INFO", "replication"))?.contains("state=online") == true
    }

    static func waitForReplica(of primary: RedisServerProcess) throws {
        for _ in 0..<500 {
            if hasReplica(primary) { return }
            usleep(10_000)
        }
        throw GatewayProcessError("no replica synced with the server on \(primary.port) within 5 s")
    }
}
