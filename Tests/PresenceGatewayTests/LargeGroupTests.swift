import Foundation
import PresenceEngine
import RedisTestSupport
import Testing

@testable import PresenceGateway

/// Messages in a conversation of more than `PRESENCE_LARGE_GROUP` members (docs/API.md,
/// "Messages"): cursor moves are no `receipt` frames, and a node writes its sessions'
/// `delivered` moves together.
@Suite("Messages in a group above PRESENCE_LARGE_GROUP")
struct LargeGroupTests {
    /// The writes Redis makes to `key` (its keyspace notifications of `hset`), counted by a
    /// `redis-cli` subscribed until ``writes()`` (or the test process ends).
    final class KeyspaceWatch: Sendable {
        let process: Process
        let output = Pipe()

        init(port: Int, key: String) async throws {
            process = Process()
            process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
            process.arguments = ["redis-cli", "-p", "\(port)", "SUBSCRIBE", "__keyspace@0__:\(key)"]
            process.standardOutput = output
            try process.run()
            try await Task.sleep(for: .milliseconds(300))
        }

        deinit { if process.isRunning { kill(process.processIdentifier, SIGKILL) } }

        /// Stops the watch (SIGKILL: children of the test runner ignore SIGTERM); how many
        /// `hset`s it saw.
        func writes() -> Int {
            if process.isRunning { kill(process.processIdentifier, SIGKILL) }
            process.waitUntilExit()
            let text = String(decoding: output.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
            return text.split(whereSeparator: \.isNewline).count { $0 == "hset" }
        }
    }

    @Test("a group of 5 above a limit of 3: 10 messages each marked delivered by 3 members give no receipt frame, and the 30 moves are a few cursor writes, not 30")
    func cursorsWrittenTogether() async throws {
        let server = try RedisServerProcess()
        _ = try server.cli("CONFIG", "SET", "notify-keyspace-events", "Kh")
        let prefix = TestRedis.uniquePrefix("large")
        let keys = PresenceKeys(prefix: prefix)
        try await withNodes(1, prefix: prefix, configure: { $0.redisURL = server.url(); $0.largeGroup = 3 }) { ports in
            let port = ports[0]
            try await ConversationTests.setUp(port, ["alice", "bob", "carol", "dave", "erin"])
            let alice = try await MessageSessionTests.open(port, "alice", device: "laptop")
            var readers: [(user: String, socket: TestSocket)] = []
            for user in ["bob", "carol", "dave"] { readers.append((user, try await MessageSessionTests.open(port, user, device: "phone"))) }
            let watch = try await KeyspaceWatch(port: server.port, key: keys.cursors("room"))

            var frames: [String: [Frame]] = [:]
            for index in 1...10 {
                MessageSessionTests.send(alice, "m\(index)", "#\(index)")
                _ = try await alice.pick("message_ack")
            }
            for (user, socket) in readers {
                let received = await MessageSessionTests.messages(socket, count: 10)
                #expect(received.count == 10, "\(user) has every message")
            }
            for seq in 1...10 {
                for (_, socket) in readers { socket.send("delivered", ["conversation_id": "room", "seq": seq], id: "d\(seq)") }
            }
            for (user, socket) in readers {
                for _ in 1...10 { _ = try await socket.pick("ack") }
                frames[user] = await socket.drain(for: .milliseconds(200))
            }
            // Written within the flush interval (a second) of the last move.
            let written = await eventually(timeout: .seconds(4)) {
                let rows = (try? await call(port, "GET", "/api/conversations/room/receipts", token: try await token("alice")).json) as? [[String: Any]] ?? []
                let delivered = Dictionary(uniqueKeysWithValues: rows.compactMap { row in (row["user_id"] as? String).map { ($0, row["delivered_seq"] as? Int ?? -1) } })
                return ["bob", "carol", "dave"].allSatisfy { delivered[$0] == 10 }
            }
            #expect(written, "every reader's delivered cursor reaches 10")
            frames["alice"] = await alice.drain(for: .milliseconds(1_500))
            for (user, socket) in readers { frames[user, default: []] += await socket.drain(for: .milliseconds(100)) }

            for (user, seen) in frames.sorted(by: { $0.key < $1.key }) {
                let receipts = seen.filter { $0.type == "receipt" }
                #expect(receipts.isEmpty, "\(user) got \(receipts.count) receipt frames: \(receipts.prefix(3))")
            }
            // 10 sends (each moves the sender's cursors), each reader's first move (written at
            // once: it tells the node the group is large), then one write per flush.
            let writes = watch.writes()
            print("large group: \(writes) cursor writes for 10 sends and 30 delivered moves of 3 members")
            #expect(writes >= 13 && writes <= 10 + 3 + 4, "\(writes) cursor writes for 10 sends and 30 delivered moves")
        }
    }
}
