import Foundation
import NIOConcurrencyHelpers
import PresenceEngine
import RedisTestSupport
import Testing

@testable import PresenceGateway

/// Messages over WebSocket sessions of live nodes: `send`, live `message` frames to every
/// member's sessions, `sync`, receipts (docs/API.md, "Messages").
@Suite("Messages over sessions of live nodes")
struct MessageSessionTests {
    static func send(_ socket: TestSocket, _ clientID: String, _ text: String, conversation: String = "room", id: String? = nil) {
        socket.send("send", ["conversation_id": conversation, "client_message_id": clientID, "text": text], id: id ?? clientID)
    }

    /// The `message` frames `socket` receives until it has `count` of them (or `timeout` passes),
    /// skipping other frames.
    static func messages(_ socket: TestSocket, count: Int, timeout: Duration = .seconds(5)) async -> [Frame] {
        let deadline = ContinuousClock.now + timeout
        var found: [Frame] = []
        while found.count < count, ContinuousClock.now < deadline, let frame = try? await socket.next(timeout: deadline - .now) {
            if frame.type == "message" { found.append(frame) }
        }
        return found
    }

    static func seqs(_ frames: [Frame]) -> [Int] { frames.compactMap { $0.data["seq"] as? Int } }

    /// The next `receipt` of `user`'s cursors, skipping others (the sender's own, after a send).
    static func receipt(of user: String, on socket: TestSocket) async throws -> Frame {
        while true {
            let frame = try await socket.next("receipt")
            if frame.data["user_id"].map({ "\($0)" }) == user { return frame }
        }
    }

    /// Message `#number` (client id `m<number>`) sent to conversation `room` over REST with
    /// `token`, expected stored (201).
    static func restSend(_ port: Int, _ token: String, _ number: Int) async throws {
        let body = MessageRESTTests.body(["client_message_id": "m\(number)", "text": "#\(number)"])
        #expect(try await call(port, "POST", "/api/conversations/room/messages", token: token, body: body).status == 201)
    }

    /// An open session that got its `initial_state` and whose opening hold is over (or `sync`ed).
    static func open(_ port: Int, _ user: String, device: String) async throws -> TestSocket {
        let socket = TestSocket(port: port, token: try await token(user), device: device)
        _ = try await socket.next("initial_state")
        return socket
    }

    @Test("a message sent on one node reaches every member's sessions on both nodes once, the sender's too; a retry is a duplicate and delivers nothing")
    func liveAcrossNodes() async throws {
        try await withNodes(2) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            let alice = try await Self.open(ports[0], "alice", device: "laptop")
            let bobPhone = try await Self.open(ports[1], "bob", device: "phone")
            let bobTablet = try await Self.open(ports[0], "bob", device: "tablet")
            // Past the opening hold: live messages go straight out.
            try await Task.sleep(for: SessionHub.messageOpeningHold + .milliseconds(200))
            Self.send(alice, "local-1", "hello")
            let ack = try await alice.pick("message_ack")
            #expect(ack.id == "local-1" && ack.data["seq"] as? Int == 1 && ack.data["duplicate"] as? Bool == false)
            #expect(ack.data["client_message_id"] as? String == "local-1" && ack.data["conversation_id"] as? String == "room")
            for socket in [alice, bobPhone, bobTablet] {
                let got = await Self.messages(socket, count: 1)
                #expect(Self.seqs(got) == [1], "\(socket.frames.map(\.type))")
                #expect(got.first?.data["text"] as? String == "hello" && got.first?.data["sender_id"] as? String == "alice")
                #expect(got.first?.data["id"] as? String == ack.data["id"] as? String)
            }
            // The send moved alice's cursors: its receipt follows the message.
            #expect(try await Self.receipt(of: "alice", on: bobPhone).data["read_seq"] as? Int == 1)
            Self.send(alice, "local-1", "hello again", id: "retry")
            let again = try await alice.pick("message_ack")
            #expect(again.id == "retry" && again.data["seq"] as? Int == 1 && again.data["duplicate"] as? Bool == true)
            #expect(await bobPhone.staysQuiet(for: .milliseconds(500)))
        }
    }

    @Test("the first message of a history arriving while the node reads it (found empty: no epoch yet) is delivered, not taken for an older life")
    func firstMessageDuringRead() async throws {
        try await withGateway { port, gateway in
            try await ConversationTests.setUp(port, ["alice", "bob"])
            let alice = try await Self.open(port, "alice", device: "laptop")
            let bob = try await Self.open(port, "bob", device: "phone")
            try await Task.sleep(for: SessionHub.messageOpeningHold + .milliseconds(200))
            let routes = gateway.hub.messages
            let entered = AsyncStream<Void>.makeStream()
            let release = AsyncStream<Void>.makeStream()
            routes.afterDeliveryRead.withLockedValue { probe in
                probe = { _ in
                    entered.continuation.yield()
                    for await _ in release.stream { break }
                }
            }
            // A read as after a pub/sub reconnect; the history is still empty when it reads.
            routes.readAgain()
            for await _ in entered.stream { break }
            routes.afterDeliveryRead.withLockedValue { $0 = nil }
            Self.send(alice, "m1", "first")
            _ = try await alice.pick("message_ack")
            #expect(await eventually(timeout: .seconds(5)) { routes.waitingCount("room") == 1 })
            release.continuation.yield()
            for socket in [alice, bob] {
                #expect(Self.seqs(await Self.messages(socket, count: 1)) == [1])
            }
        }
    }

    @Test("3 senders × 30 messages on two nodes: every member's session gets seq 1…90 once, in order, each sender's own order kept")
    func concurrentSenders() async throws {
        try await withNodes(2) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob", "carol", "dave"])
            let senders = [
                try await Self.open(ports[0], "alice", device: "a"), try await Self.open(ports[1], "bob", device: "b"),
                try await Self.open(ports[0], "carol", device: "c"),
            ]
            let reader = try await Self.open(ports[1], "dave", device: "d")
            try await Task.sleep(for: SessionHub.messageOpeningHold + .milliseconds(200))
            await withTaskGroup(of: Void.self) { group in
                for (index, socket) in senders.enumerated() {
                    group.addTask {
                        for number in 1...30 { Self.send(socket, "s\(index)-\(number)", "\(index):\(number)") }
                    }
                }
            }
            for socket in senders + [reader] {
                let got = await Self.messages(socket, count: 90, timeout: .seconds(15))
                #expect(Self.seqs(got) == Array(1...90))
                for index in 0..<3 {
                    let own = got.compactMap { $0.data["text"] as? String }.filter { $0.hasPrefix("\(index):") }
                    #expect(own == (1...30).map { "\(index):\($0)" })
                }
            }
        }
    }

    @Test("a live message nothing can be owed before passes the opening hold: a new history's seq 1 and the next; one after history not sent waits for the sync")
    func openingHoldPassesWhatNothingPrecedes() async throws {
        try await withGateway { port, _ in
            try await ConversationTests.setUp(port, ["alice", "bob", "carol"])
            let aliceToken = try await token("alice")
            // Bob's session is in its opening hold (no sync) when the history's first two arrive.
            let bob = try await Self.open(port, "bob", device: "phone")
            let sent = ContinuousClock.now
            for number in 1...2 { try await Self.restSend(port, aliceToken, number) }
            #expect(Self.seqs(await Self.messages(bob, count: 2, timeout: .milliseconds(1500))) == [1, 2])
            #expect(ContinuousClock.now - sent < SessionHub.messageOpeningHold, "not held for the opening")
            // Carol opens after them: 3 may owe her 1 and 2, so it waits for her sync.
            let carol = try await Self.open(port, "carol", device: "tablet")
            try await Self.restSend(port, aliceToken, 3)
            #expect(Self.seqs(await Self.messages(bob, count: 1)) == [3])
            #expect(await Self.messages(carol, count: 1, timeout: .milliseconds(500)).isEmpty, "held until her sync")
            carol.send("sync", ["positions": [["conversation_id": "room", "after_seq": 0]]], id: "s")
            #expect(Self.seqs(await Self.messages(carol, count: 3)) == [1, 2, 3])
            #expect(await Self.messages(carol, count: 1, timeout: .milliseconds(500)).isEmpty, "nothing twice")
        }
    }

    @Test("sync gives exactly what was missed, then synced, then the live messages that came meanwhile (held), without repeat or gap")
    func syncThenLive() async throws {
        try await withGateway { port, gateway in
            try await ConversationTests.setUp(port, ["alice", "bob"])
            let alice = try await Self.open(port, "alice", device: "laptop")
            let aliceToken = try await token("alice")
            for number in 1...5 { try await Self.restSend(port, aliceToken, number) }
            let epoch = try #require(await Self.messages(alice, count: 5).last?.data["id"] as? String).split(separator: "-").first.map(String.init)
            // Bob comes back with 1 and 2. Alice's 6 and 7 reach this node while his session is
            // opening (before its sync), her 8 and 9 while the sync runs (before its read).
            let bob = try await Self.open(port, "bob", device: "phone")
            for number in 6...7 { try await Self.restSend(port, aliceToken, number) }
            #expect(Self.seqs(await Self.messages(alice, count: 2)) == [6, 7])
            gateway.hub.beforeSyncRead.withLockedValue { probe in
                probe = { _ in
                    for number in 8...9 { try? await Self.restSend(port, aliceToken, number) }
                    _ = await Self.messages(alice, count: 2)
                }
            }
            bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": 2, "epoch": epoch as Any]]], id: "s1")
            var seen: [Int] = []
            var synced: Frame?
            let deadline = ContinuousClock.now + .seconds(5)
            while seen.last != 9 || synced == nil, ContinuousClock.now < deadline, let frame = try? await bob.next(timeout: .seconds(5)) {
                if frame.type == "message" { seen.append(frame.data["seq"] as? Int ?? -1) }
                if frame.type == "synced" {
                    synced = frame
                    // Everything up to the synced frame's last seq came before it.
                    #expect(seen == Array(3...(frame.data["last_seq"] as? Int ?? 0)), "\(seen)")
                }
            }
            gateway.hub.beforeSyncRead.withLockedValue { $0 = nil }
            #expect(seen == Array(3...9))
            let answer = try #require(synced)
            #expect(answer.id == "s1" && answer.data["complete"] as? Bool == true && answer.data["more"] as? Bool == false)
            #expect((answer.data["missing"] as? [Any])?.isEmpty == true && answer.data["epoch"] as? String == epoch)
            try await Self.restSend(port, aliceToken, 10)
            #expect(Self.seqs(await Self.messages(bob, count: 1)) == [10])
            #expect(await Self.messages(bob, count: 1, timeout: .milliseconds(500)).isEmpty)

            // A sync from an older position (one that crossed 7…10 on the wire): nothing is sent
            // twice, and nothing is named missing, as this session was sent 3…10 unbroken.
            bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": 6, "epoch": epoch as Any]]], id: "s2")
            let second = try await bob.next("synced")
            #expect(second.data["complete"] as? Bool == true && (second.data["missing"] as? [Any])?.isEmpty == true, "\(second.data)")
            #expect(await Self.messages(bob, count: 1, timeout: .milliseconds(500)).isEmpty)
        }
    }

    @Test("a sync after live messages names missing only what the session was not sent: none after a history's first message, the start before a later one")
    func syncCrossingLiveMessages() async throws {
        try await withGateway { port, _ in
            try await ConversationTests.setUp(port, ["alice", "bob", "carol"])
            let aliceToken = try await token("alice")
            // A history's first message passes Bob's opening hold; his sync from 0 (as a client
            // first hearing of a conversation sends) then owes him nothing.
            let bob = try await Self.open(port, "bob", device: "phone")
            try await Self.restSend(port, aliceToken, 1)
            #expect(Self.seqs(await Self.messages(bob, count: 1)) == [1])
            bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": 0]]], id: "b")
            let bobs = try await bob.next("synced")
            #expect(bobs.data["complete"] as? Bool == true && (bobs.data["missing"] as? [Any])?.isEmpty == true, "\(bobs.data)")
            // Carol ends her opening hold with an empty sync, is sent 2 live, then syncs from 0:
            // 1 cannot be sent after 2, and is all that is missing.
            let carol = try await Self.open(port, "carol", device: "tablet")
            carol.send("sync", ["positions": []], id: "c0")
            try await Task.sleep(for: .milliseconds(200))
            try await Self.restSend(port, aliceToken, 2)
            #expect(Self.seqs(await Self.messages(carol, count: 1)) == [2])
            carol.send("sync", ["positions": [["conversation_id": "room", "after_seq": 0]]], id: "c1")
            var carols: [Frame] = []
            while let frame = try? await carol.next(timeout: .seconds(5)) {
                carols.append(frame)
                if frame.type == "synced" { break }
            }
            #expect(carols.filter { $0.type == "message" }.isEmpty, "nothing at or below 2 again")
            let synced = try #require(carols.last { $0.type == "synced" })
            let missing = synced.data["missing"] as? [[String: Any]] ?? []
            #expect(synced.data["complete"] as? Bool == false)
            #expect(missing.count == 1 && missing.first?["from_seq"] as? Int == 1 && missing.first?["to_seq"] as? Int == 1, "\(missing)")
        }
    }

    @Test("a sync answer is cut at 128 KiB with more: true; live messages wait in the history until the client has synced to the end")
    func syncInParts() async throws {
        try await withNodes(1) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            let alice = try await Self.open(ports[0], "alice", device: "laptop")
            let large = String(repeating: "é", count: 8_000)
            for number in 1...20 { Self.send(alice, "m\(number)", large) }
            for _ in 1...20 { _ = try await alice.pick("message_ack") }
            let bob = try await Self.open(ports[0], "bob", device: "phone")
            bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": 0]]], id: "p1")
            var first: [Frame] = []
            var cut = try await bob.next()
            while cut.type == "message" {
                first.append(cut)
                cut = try await bob.next()
            }
            #expect(cut.data["more"] as? Bool == true && cut.data["complete"] as? Bool == true && cut.data["last_seq"] as? Int == 20)
            #expect(!first.isEmpty && first.count < 20 && Self.seqs(first) == Array(1...first.count), "\(Self.seqs(first))")
            // Behind: a live message is not sent past the gap, it waits in the history.
            Self.send(alice, "m21", "short")
            _ = try await alice.pick("message_ack")
            #expect(await Self.messages(bob, count: 1, timeout: .milliseconds(500)).isEmpty)
            var seqs = Self.seqs(first)
            var rounds = 0
            while rounds < 10 {
                rounds += 1
                bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": seqs.last ?? 0, "epoch": cut.data["epoch"] as Any]]], id: "p\(rounds + 1)")
                var frame = try await bob.next()
                while frame.type == "message" {
                    seqs.append(frame.data["seq"] as? Int ?? -1)
                    frame = try await bob.next()
                }
                #expect(frame.type == "synced")
                if frame.data["more"] as? Bool == false { break }
            }
            #expect(seqs == Array(1...21) && rounds >= 2)
            Self.send(alice, "m22", "live again")
            #expect(Self.seqs(await Self.messages(bob, count: 1)) == [22])
        }
    }

    @Test("a lost epoch and a trimmed history are answered with the exact missing ranges")
    func missingRanges() async throws {
        try await withNodes(1, configure: { $0.messageHistory = 3 }) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            let alice = try await Self.open(ports[0], "alice", device: "laptop")
            for number in 1...6 { Self.send(alice, "m\(number)", "#\(number)") }
            for _ in 1...6 { _ = try await alice.pick("message_ack") }
            let bob = try await Self.open(ports[0], "bob", device: "phone")
            bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": 1]]], id: "trimmed")
            let kept = await Self.messages(bob, count: 3)
            #expect(Self.seqs(kept) == [4, 5, 6])
            let trimmed = try await bob.next("synced")
            let epoch = trimmed.data["epoch"] as? String
            #expect(trimmed.data["complete"] as? Bool == false && trimmed.data["last_seq"] as? Int == 6)
            let ranges = trimmed.data["missing"] as? [[String: Any]] ?? []
            #expect(ranges.count == 1 && ranges.first?["epoch"] as? String == epoch && ranges.first?["from_seq"] as? Int == 2 && ranges.first?["to_seq"] as? Int == 3)

            let phone = try await Self.open(ports[0], "bob", device: "old-phone")
            phone.send("sync", ["positions": [["conversation_id": "room", "after_seq": 9, "epoch": "gone"]]], id: "lost")
            #expect(Self.seqs(await Self.messages(phone, count: 3)) == [4, 5, 6])
            let lost = try await phone.next("synced")
            let lostRanges = lost.data["missing"] as? [[String: Any]] ?? []
            #expect(lostRanges.count == 2, "\(lost)")
            #expect(lostRanges.first?["epoch"] as? String == "gone" && lostRanges.first?["from_seq"] as? Int == 10 && lostRanges.first?["to_seq"] is NSNull)
            #expect(lostRanges.last?["epoch"] as? String == epoch && lostRanges.last?["from_seq"] as? Int == 1 && lostRanges.last?["to_seq"] as? Int == 3)
        }
    }

    @Test("non-members are refused on send and sync (the sync's other conversations go on); a removed member hears nothing more within a second")
    func refusals() async throws {
        try await withNodes(2, configure: { $0.messageMaxBytes = 100 }) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            try await ConversationTests.setUp(ports[0], ["mallory"], conversation: "other")
            let alice = try await Self.open(ports[0], "alice", device: "laptop")
            let bob = try await Self.open(ports[1], "bob", device: "phone")
            let mallory = try await Self.open(ports[1], "mallory", device: "m")
            Self.send(mallory, "x", "let me in", id: "bad")
            let refused = try await mallory.next("error")
            #expect(refused.id == "bad" && refused.data["code"] as? String == "forbidden")
            mallory.send("sync", ["positions": [["conversation_id": "room", "after_seq": 0], ["conversation_id": "other", "after_seq": 0]]], id: "s")
            let syncRefused = try await mallory.next("error")
            #expect(syncRefused.id == "s" && syncRefused.data["code"] as? String == "forbidden" && syncRefused.data["conversation_id"] as? String == "room")
            let otherSynced = try await mallory.next("synced")
            #expect(otherSynced.data["conversation_id"] as? String == "other" && otherSynced.data["complete"] as? Bool == true)

            Self.send(alice, "big", String(repeating: "x", count: 101), id: "big")
            let tooLarge = try await alice.next("error")
            #expect(tooLarge.id == "big" && tooLarge.data["code"] as? String == "payload_too_large")
            alice.send("sync", ["positions": (0...100).map { ["conversation_id": "c\($0)", "after_seq": 0] }], id: "many")
            #expect(try await alice.next("error").data["code"] as? String == "invalid_request")
            alice.send("sync", ["positions": [["conversation_id": "room", "after_seq": -1]]], id: "negative")
            #expect(try await alice.next("error").data["code"] as? String == "invalid_request")

            try await Task.sleep(for: SessionHub.messageOpeningHold + .milliseconds(200))
            Self.send(alice, "before", "still here")
            #expect(Self.seqs(await Self.messages(bob, count: 1)) == [1])
            #expect(try await call(ports[0], "DELETE", "/api/admin/conversations/room/members/bob", token: adminToken).status == 200)
            try await Task.sleep(for: .seconds(1))
            Self.send(alice, "after", "bob is gone")
            _ = try await alice.pick("message_ack")
            #expect(await Self.messages(bob, count: 1, timeout: .seconds(1)).isEmpty)
            Self.send(bob, "late", "hello?", id: "late")
            #expect(try await bob.next("error").data["code"] as? String == "forbidden")
        }
    }

    @Test("delivered and read move the user's cursors, answered by ack; members' sessions get receipt frames")
    func receipts() async throws {
        try await withNodes(2) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            let alice = try await Self.open(ports[0], "alice", device: "laptop")
            let bob = try await Self.open(ports[1], "bob", device: "phone")
            for number in 1...3 { Self.send(alice, "m\(number)", "#\(number)") }
            for _ in 1...3 { _ = try await alice.pick("message_ack") }
            bob.send("delivered", ["conversation_id": "room", "seq": 3], id: "d")
            #expect(try await bob.next("ack").id == "d")
            let delivered = try await Self.receipt(of: "bob", on: alice)
            #expect(delivered.data["user_id"] as? String == "bob" && delivered.data["delivered_seq"] as? Int == 3 && delivered.data["read_seq"] as? Int == 0)
            bob.send("read", ["conversation_id": "room", "seq": 99], id: "r")
            #expect(try await bob.next("ack").id == "r")
            let read = try await Self.receipt(of: "bob", on: alice)
            #expect(read.data["conversation_id"] as? String == "room" && read.data["read_seq"] as? Int == 3 && read.data["delivered_seq"] as? Int == 3)
            bob.send("read", ["conversation_id": "room", "seq": 1], id: "back")
            #expect(try await bob.next("ack").id == "back")
            #expect(await alice.staysQuiet(for: .milliseconds(500)))
            // A `synced` carries every member's cursors: the sender's moved with its send.
            alice.send("sync", ["positions": [["conversation_id": "room", "after_seq": 3]]], id: "s")
            let synced = try await alice.next("synced")
            let rows = (synced.data["receipts"] as? [[String: Any]] ?? []).map {
                "\($0["user_id"] as? String ?? "?") \($0["delivered_seq"] as? Int ?? -1) \($0["read_seq"] as? Int ?? -1)"
            }
            #expect(rows.sorted() == ["alice 3 3", "bob 3 3"], "\(synced.data)")
        }
    }

    @Test("synced carries receipts for up to 100 members and leaves them out past that")
    func receiptsLimit() async throws {
        try await withNodes(1) { ports in
            try await ConversationTests.setUp(ports[0], ["alice"] + (1...99).map { "m\($0)" }, conversation: "hundred")
            try await ConversationTests.setUp(ports[0], ["alice"] + (1...100).map { "m\($0)" }, conversation: "more")
            let alice = try await Self.open(ports[0], "alice", device: "laptop")
            alice.send("sync", ["positions": [["conversation_id": "hundred", "after_seq": 0], ["conversation_id": "more", "after_seq": 0]]], id: "s")
            let first = try await alice.next("synced")
            let second = try await alice.next("synced")
            #expect(first.data["conversation_id"] as? String == "hundred" && (first.data["receipts"] as? [Any])?.count == 100)
            #expect(second.data["conversation_id"] as? String == "more" && second.data["receipts"] == nil, "\(second.data.keys.sorted())")
        }
    }

    @Test("with numeric ids, send, message, sync, synced and receipt write ids as numbers and take them as numbers or strings")
    func numericIDs() async throws {
        try await withNodes(2, configure: { $0.idFormat = .numeric }) { ports in
            let body = #"{"member_ids":[1,2]}"#
            #expect(try await call(ports[0], "PUT", "/api/admin/conversations/77", token: adminToken, body: body).status == 200)
            let one = try await Self.open(ports[0], "1", device: "a")
            let two = try await Self.open(ports[1], "2", device: "b")
            try await Task.sleep(for: SessionHub.messageOpeningHold + .milliseconds(200))
            one.send("send", ["conversation_id": 77, "client_message_id": "n1", "text": "numbers"], id: "n1")
            let ack = try await one.pick("message_ack")
            #expect(ack.data["conversation_id"] as? Int == 77 && ack.data["seq"] as? Int == 1)
            let live = try #require(await Self.messages(two, count: 1).first)
            #expect(live.data["conversation_id"] as? Int == 77 && live.data["sender_id"] as? Int == 1)
            two.send("sync", ["positions": [["conversation_id": "077", "after_seq": 0]]], id: "s")
            let synced = try await two.next("synced")
            #expect(synced.data["conversation_id"] as? Int == 77 && synced.data["last_seq"] as? Int == 1 && synced.id == "s")
            two.send("read", ["conversation_id": 77, "seq": 1], id: "r")
            #expect(try await two.next("ack").id == "r")
            let receipt = try await Self.receipt(of: "2", on: one)
            #expect(receipt.data["user_id"] as? Int == 2 && receipt.data["conversation_id"] as? Int == 77 && receipt.data["read_seq"] as? Int == 1)
            two.send("sync", ["positions": [["conversation_id": 78, "after_seq": 0]]], id: "x")
            let refused = try await two.next("error")
            #expect(refused.data["conversation_id"] as? Int == 78 && refused.data["code"] as? String == "not_found")
        }
    }

    @Test("a node's pub/sub connection killed while messages flow loses none of them and repeats none")
    func pubSubKilled() async throws {
        let server = try RedisServerProcess()
        try await withNodes(2, configure: { $0.redisURL = server.url() }) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            let alice = try await Self.open(ports[0], "alice", device: "laptop")
            let bob = try await Self.open(ports[1], "bob", device: "phone")
            try await Task.sleep(for: SessionHub.messageOpeningHold + .milliseconds(200))
            for number in 1...40 {
                Self.send(alice, "m\(number)", "#\(number)")
                if number % 10 == 0 { try server.cli("CLIENT", "KILL", "TYPE", "pubsub") }
                try await Task.sleep(for: .milliseconds(20))
            }
            for socket in [alice, bob] {
                #expect(Self.seqs(await Self.messages(socket, count: 40, timeout: .seconds(15))) == Array(1...40))
                #expect(await Self.messages(socket, count: 1, timeout: .milliseconds(500)).isEmpty)
            }
        }
    }
}
