import Foundation
import NIOConcurrencyHelpers
import PresenceEngine
import PresenceProtocol
import RedisClient
import RedisTestSupport
import Testing

@testable import PresenceGateway

/// Messages where real users are: a device in many conversations, seqs of 15 and more digits,
/// text that JSON-escapes to six bytes a character, the sender's own receipt, and an opening
/// read that fails (docs/API.md, "Messages").
@Suite("Messages at the edges of real use")
struct MessageEdgeTests {
    typealias Sessions = MessageSessionTests

    @Test("sync has a budget of its own: 12 subscribes in a row leave a sync answered, not rate_limited")
    func syncBudgetApart() async throws {
        try await withNodes(1) { ports in
            for index in 0..<12 { try await ConversationTests.setUp(ports[0], ["alice", "bob"], conversation: "g\(index)") }
            let bob = try await Sessions.open(ports[0], "bob", device: "phone")
            for index in 0..<12 { bob.send("subscribe", ["conversation_id": "g\(index)"], id: "s\(index)") }
            bob.send("sync", ["positions": (0..<12).map { ["conversation_id": "g\($0)", "after_seq": 0] }], id: "sync")
            var synced: Set<String> = []
            var refusals: [String] = []
            let deadline = ContinuousClock.now + .seconds(10)
            while synced.count < 12, ContinuousClock.now < deadline, let frame = try? await bob.next(timeout: deadline - .now) {
                if frame.type == "synced", frame.id == "sync", let conversation = frame.data["conversation_id"] as? String { synced.insert(conversation) }
                if frame.type == "error", frame.id == "sync" { refusals.append("\(frame.data)") }
            }
            #expect(refusals.isEmpty, "\(refusals)")
            #expect(synced.count == 12)
        }
    }

    @Test("budgets count a frame when it arrives: subscribes that keep to theirs are not refused because a slow sync held them up")
    func budgetsAtArrival() async throws {
        try await withGateway { port, gateway in
            for index in 0..<15 { try await ConversationTests.setUp(port, ["alice", "bob"], conversation: "g\(index)") }
            let bob = try await Sessions.open(port, "bob", device: "phone")
            // The sync's read takes 1.5 s: everything after it waits to be handled.
            gateway.hub.beforeSyncRead.withLockedValue { $0 = { _ in try? await Task.sleep(for: .milliseconds(1_500)) } }
            bob.send("sync", ["positions": [["conversation_id": "g0", "after_seq": 0]]], id: "slow")
            // The burst of 10 at once, then 5 a second later, when 5 tokens are back.
            for index in 0..<10 { bob.send("subscribe", ["conversation_id": "g\(index)"], id: "s\(index)") }
            try await Task.sleep(for: .milliseconds(1_050))
            for index in 10..<15 { bob.send("subscribe", ["conversation_id": "g\(index)"], id: "s\(index)") }
            var answered: Set<String> = []
            var refused: [String] = []
            let deadline = ContinuousClock.now + .seconds(10)
            while answered.count + refused.count < 15, ContinuousClock.now < deadline, let frame = try? await bob.next(timeout: deadline - .now) {
                guard let id = frame.id, id.hasPrefix("s") else { continue }
                if frame.type == "group_presence" { answered.insert(id) }
                if frame.type == "error" { refused.append("\(id): \(frame.data["message"] ?? "")") }
            }
            gateway.hub.beforeSyncRead.withLockedValue { $0 = nil }
            #expect(refused.isEmpty, "\(refused)")
            #expect(answered.count == 15)
        }
    }

    @Test("seqs of 15 digits are stored, read, synced and moved to like any other; past 2^53 - 1 they are refused with 422")
    func longSeqs() async throws {
        try await withGateway { port, gateway in
            try await ConversationTests.setUp(port, ["alice", "bob"])
            let keys = gateway.engine.keys
            let start: Int64 = 123_456_789_012_345
            let alice = try await token("alice"), bob = try await token("bob")
            let path = "/api/conversations/room/messages"
            // A history that has come this far: its meta says so (the send reads the last seq there).
            #expect(try await call(port, "GET", path, token: bob).status == 200)
            _ = try await gateway.engine.redis.send("HSET", RedisArgument(keys.historyMeta("room")), "seq", RedisArgument(Int(start)))
            let sent = try await call(port, "POST", path, token: alice, body: MessageRESTTests.body(["client_message_id": "big", "text": "far along"]))
            #expect(sent.status == 201, "\(String(describing: sent.json))")
            let message = sent.json as? [String: Any] ?? [:]
            #expect((message["seq"] as? NSNumber)?.int64Value == start + 1, "\(message)")
            #expect((message["id"] as? String)?.hasSuffix("-\(start + 1)") == true, "\(message)")
            for query in ["?after_seq=\(start)", "?before_seq=\(start + 2)", ""] {
                let read = try await call(port, "GET", path + query, token: bob)
                let seqs = ((read.json as? [String: Any])?["messages"] as? [[String: Any]] ?? []).compactMap { ($0["seq"] as? NSNumber)?.int64Value }
                #expect(read.status == 200 && seqs == [start + 1], "\(query): \(read.status) \(String(describing: read.json))")
            }
            let cursors = try await call(port, "POST", "/api/conversations/room/read", token: bob, body: #"{"seq": 9007199254740991}"#)
            #expect(cursors.status == 200 && ((cursors.json as? [String: Any])?["read_seq"] as? NSNumber)?.int64Value == start + 1)
            for query in ["?after_seq=9007199254740992", "?before_seq=99999999999999999"] {
                let refused = try await call(port, "GET", path + query, token: bob)
                #expect(refused.status == 422 && MessageRESTTests.errorCode(refused.json) == "invalid_request", "\(query)")
            }
            let socket = try await Sessions.open(port, "bob", device: "phone")
            socket.send("sync", ["positions": [["conversation_id": "room", "after_seq": Int(start)]]], id: "s")
            let got = try await socket.next("message")
            #expect((got.data["seq"] as? NSNumber)?.int64Value == start + 1)
            let synced = try await socket.next("synced")
            #expect(synced.id == "s" && (synced.data["last_seq"] as? NSNumber)?.int64Value == start + 1 && synced.data["complete"] as? Bool == true)
            socket.send("sync", ["positions": [["conversation_id": "room", "after_seq": 9_007_199_254_740_992 as Int64]]], id: "far")
            let refused = try await socket.next("error")
            #expect(refused.id == "far" && refused.data["code"] as? String == "invalid_request", "\(refused.data)")
            socket.send("delivered", ["conversation_id": "room", "seq": 9_007_199_254_740_992 as Int64], id: "d")
            #expect(try await socket.next("error").id == "d")
        }
    }

    @Test("text that escapes to six bytes a character syncs at full size in parts, and the reader is never closed")
    func escapedTextSync() async throws {
        try await withNodes(1) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            let alice = try await Sessions.open(ports[0], "alice", device: "laptop")
            // 16,384 bytes of control characters: 98,304 bytes once JSON escapes them.
            let escaping = String(repeating: "\u{1}", count: 16_384)
            // One at a time: twelve at once are more than a session may have waiting (1 MiB).
            for number in 1...12 {
                Sessions.send(alice, "m\(number)", escaping)
                _ = try await alice.pick("message_ack")
            }
            let bob = try await Sessions.open(ports[0], "bob", device: "phone")
            var seqs: [Int] = []
            var epoch: Any = NSNull()
            var rounds = 0
            var refused = 0
            // Each part holds one of these messages (two are more than 128 KiB): a sync a message.
            // Past the sync budget's burst a client waits and asks again, as the SDKs do.
            while rounds < 20, refused < 20 {
                bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": seqs.last ?? 0, "epoch": epoch]]], id: "p\(rounds)-\(refused)")
                var frame = try await bob.next(timeout: .seconds(10))
                if frame.type == "error", frame.data["code"] as? String == "rate_limited" {
                    refused += 1
                    try await Task.sleep(for: .milliseconds(250))
                    continue
                }
                rounds += 1
                while frame.type == "message" {
                    #expect((frame.data["text"] as? String)?.utf8.count == 16_384)
                    seqs.append(frame.data["seq"] as? Int ?? -1)
                    frame = try await bob.next(timeout: .seconds(10))
                }
                #expect(frame.type == "synced", "\(frame.type) \(frame.data)")
                epoch = frame.data["epoch"] ?? NSNull()
                if frame.data["more"] as? Bool == false { break }
            }
            #expect(seqs == Array(1...12) && rounds >= 2, "\(seqs) in \(rounds) rounds (\(refused) syncs refused for the budget)")
            #expect(await bob.closed(timeout: .milliseconds(200)) == nil)
        }
    }

    @Test("a session whose opening read of its conversations fails reads them again until it succeeds, and gets live messages then")
    func failedOpeningRead() async throws {
        try await withGateway(configure: { $0.visibility = .open }) { port, gateway in
            try await ConversationTests.setUp(port, ["alice", "bob"])
            let redis = gateway.engine.redis
            let key = RedisArgument(gateway.engine.keys.conversationsOf("bob"))
            // Bob's list of conversations cannot be read (a key of the wrong type): the opening's read fails.
            _ = try await redis.send("DEL", key)
            _ = try await redis.send("SET", key, "not a set")
            let bob = try await Sessions.open(port, "bob", device: "phone")
            bob.send("sync", ["positions": []], id: "none")
            try await Task.sleep(for: .milliseconds(300))
            // Readable again, without a membership event that would make the node read it anyway.
            _ = try await redis.send("DEL", key)
            _ = try await redis.send("SADD", key, "room")
            // The reads again back off (100 ms doubling to 5 s): wait until one has succeeded,
            // bounded, rather than a fixed time that a loaded machine outlasts.
            let session = try #require(gateway.hub.allSessions.first { $0.userID == "bob" })
            let deadline = ContinuousClock.now + .seconds(10)
            while gateway.hub.messages.conversations(of: session).isEmpty, ContinuousClock.now < deadline {
                try await Task.sleep(for: .milliseconds(50))
            }
            #expect(gateway.hub.messages.conversations(of: session) == ["room"], "the session read its conversations again")
            let sent = try await MessageRollbackTests.send(port, "alice", "m1", "after the failed read")
            #expect(sent.status == 201)
            let live = await Sessions.messages(bob, count: 1, timeout: .seconds(5))
            #expect(Sessions.seqs(live) == [1], "the session reads its conversations again and gets the message live")
        }
    }

    /// The frames up to the next `synced`: the seqs of its messages, and the `synced`.
    static func syncAnswer(_ socket: TestSocket) async throws -> (seqs: [Int], synced: Frame) {
        var seqs: [Int] = []
        while true {
            let frame = try await socket.next(timeout: .seconds(10))
            if frame.type == "message" { seqs.append(frame.data["seq"] as? Int ?? -1) }
            if frame.type == "synced" { return (seqs, frame) }
        }
    }

    /// A probe that holds bob's session at its point until `release` is called, and says when it got there.
    final class Gate: Sendable {
        let entered = AsyncStream<Void>.makeStream()
        let released = AsyncStream<Void>.makeStream()
        @Sendable func hold(_ session: Session) async {
            guard session.userID == "bob" else { return }
            entered.continuation.yield()
            for await _ in released.stream { break }
        }
        func reached() async { for await _ in entered.stream { break } }
        func release() { released.continuation.yield() }
    }

    @Test("a node slow to open a session (held from its registration to its initial_state past the hold's 2 s) holds live messages for its first sync all the same")
    func slowOpeningHolds() async throws {
        try await withGateway(configure: { $0.visibility = .open }) { port, gateway in
            try await ConversationTests.setUp(port, ["alice", "bob"])
            _ = try await MessageRollbackTests.send(port, "alice", "m1", "before bob")
            let gate = Gate()
            gateway.beforeInitialState.withLockedValue { $0 = gate.hold }
            let opening = Task { try await Sessions.open(port, "bob", device: "phone") }
            await gate.reached()
            // Past a hold counted from the registration; m2 is stored, and live on its way to
            // bob's node, before bob hears that his session is open.
            try await Task.sleep(for: SessionHub.messageOpeningHold + .milliseconds(300))
            #expect(try await MessageRollbackTests.send(port, "alice", "m2", "while bob opens").status == 201)
            try await Task.sleep(for: .milliseconds(300))
            gate.release()
            let bob = try await opening.value
            bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": 0]]], id: "s")
            let answer = try await Self.syncAnswer(bob)
            #expect(answer.seqs == [1, 2], "what bob missed, in order, from his sync")
            #expect(answer.synced.data["complete"] as? Bool == true && (answer.synced.data["missing"] as? [Any])?.isEmpty == true, "\(answer.synced.data)")
        }
    }

    @Test("a sync still waiting to be read when the opening hold's time is up (the node slow at a frame before it) is answered before live messages")
    func holdWaitsForAQueuedSync() async throws {
        try await withGateway(configure: { $0.visibility = .open }) { port, gateway in
            try await ConversationTests.setUp(port, ["alice", "bob"])
            _ = try await MessageRollbackTests.send(port, "alice", "m1", "before bob")
            let bob = try await Sessions.open(port, "bob", device: "phone")
            let gate = Gate()
            gateway.afterMessageHandled.withLockedValue { $0 = gate.hold }
            // The ping's turn is held; the sync waits behind it past the hold's 2 s, and m2 is
            // stored, and live on its way to bob's node, meanwhile.
            bob.send("ping", [:], id: "p")
            bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": 0]]], id: "s")
            await gate.reached()
            gateway.afterMessageHandled.withLockedValue { $0 = nil }
            try await Task.sleep(for: SessionHub.messageOpeningHold + .milliseconds(300))
            #expect(try await MessageRollbackTests.send(port, "alice", "m2", "while bob's sync waits").status == 201)
            try await Task.sleep(for: .milliseconds(300))
            gate.release()
            _ = try await bob.next("pong", timeout: .seconds(5))
            let answer = try await Self.syncAnswer(bob)
            #expect(answer.seqs == [1, 2], "what bob missed, in order, from his sync")
            #expect(answer.synced.data["complete"] as? Bool == true && (answer.synced.data["missing"] as? [Any])?.isEmpty == true, "\(answer.synced.data)")
        }
    }

    @Test("a send moves the sender's cursors and every member's sessions, the sender's own, get its receipt")
    func sendersReceipt() async throws {
        try await withNodes(2) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            let alice = try await Sessions.open(ports[0], "alice", device: "laptop")
            let bob = try await Sessions.open(ports[1], "bob", device: "phone")
            Sessions.send(alice, "m1", "hello")
            _ = try await alice.pick("message_ack")
            for socket in [alice, bob] {
                let receipt = try await socket.next("receipt")
                #expect(receipt.data["user_id"] as? String == "alice" && receipt.data["conversation_id"] as? String == "room")
                #expect(receipt.data["delivered_seq"] as? Int == 1 && receipt.data["read_seq"] as? Int == 1, "\(receipt.data)")
            }
            // A retry moves nothing and tells nothing.
            Sessions.send(alice, "m1", "hello", id: "retry")
            #expect(try await alice.pick("message_ack").data["duplicate"] as? Bool == true)
            #expect(await bob.staysQuiet(for: .milliseconds(500)))
        }
    }
}
