import Foundation
import NIOConcurrencyHelpers
@testable import PresenceEngine
import RedisClient
import RedisTestSupport
import Testing

/// A conversation's messages against a real Redis (or the cluster `PRESENCE_TEST_REDIS_URL`
/// names): numbering, retries, history pages and trimming, epochs, cursors.
@Suite("Messages in the engine")
struct MessageEngineTests {
    static func text(_ id: String, _ text: String) -> OutgoingMessage { OutgoingMessage(clientMessageID: id, text: text) }

    @Test("sends are numbered 1, 2, 3 with the store's clock; a retry of a client_message_id gets the stored message back")
    func numberingAndRetries() async throws {
        try await EngineCluster.with { cluster in
            let engine = cluster.engine(node: "n1")
            try await engine.setMembers(of: "chat", to: ["ann", "bo"])
            let first = try await engine.send(Self.text("a-1", "hello"), to: "chat", from: "ann")
            cluster.clock.advance(.milliseconds(5))
            let second = try await engine.send(Self.text("b-1", "hi"), to: "chat", from: "bo")
            let third = try await engine.send(OutgoingMessage(clientMessageID: "a-2", type: .image, text: "a cat", imageURL: "https://img.test/cat.png",
                                                              clientCreatedAt: 1_700_000_000_123), to: "chat", from: "ann")
            #expect([first, second, third].map(\.message.seq) == [1, 2, 3])
            #expect([first, second, third].allSatisfy { !$0.duplicate })
            #expect(Set([first, second, third].map(\.message.id)).count == 3)
            #expect(second.message.createdAt == first.message.createdAt + 5, "created_at is the store's (here the test's) clock")
            #expect(third.message.imageURL == "https://img.test/cat.png" && third.message.clientCreatedAt == 1_700_000_000_123)
            #expect(first.message.epoch == third.message.epoch && !first.message.epoch.isEmpty)

            let retry = try await engine.send(Self.text("a-1", "hello, again"), to: "chat", from: "ann")
            #expect(retry.duplicate && retry.message == first.message, "the stored message, whatever the retry carries")
            let other = try await engine.send(Self.text("a-1", "mine"), to: "chat", from: "bo")
            #expect(!other.duplicate && other.message.seq == 4, "another sender's id is another message")
            let page = try await engine.history(of: "chat", for: "bo", .latest)
            #expect(page.messages.map(\.text) == ["hello", "hi", "a cat", "mine"] && page.lastSeq == 4 && page.firstSeq == 1)
        }
    }

    @Test("only members send or read; a conversation that does not exist is not found; bad messages are refused, nothing stored")
    func refusals() async throws {
        try await EngineCluster.with { cluster in
            let engine = cluster.engine(node: "n1", messageMaxBytes: 10)
            try await engine.setMembers(of: "chat", to: ["ann", "bo"])
            func code(_ body: () async throws -> Void) async -> PresenceError.Code? {
                do { try await body(); return nil } catch let error as PresenceError { return error.code } catch { return .internal }
            }
            #expect(await code { _ = try await engine.send(Self.text("x", "hi"), to: "chat", from: "eve") } == .forbidden)
            #expect(await code { _ = try await engine.history(of: "chat", for: "eve", .latest) } == .forbidden)
            #expect(await code { _ = try await engine.moveCursor(.read, of: "eve", in: "chat", to: 1) } == .forbidden)
            #expect(await code { _ = try await engine.receipts(of: "chat", for: "eve") } == .forbidden)
            #expect(await code { _ = try await engine.send(Self.text("x", "hi"), to: "nowhere", from: "ann") } == .notFound)
            #expect(await code { _ = try await engine.history(of: "nowhere", for: "ann", .latest) } == .notFound)
            #expect(await code { _ = try await engine.send(Self.text("x", ""), to: "chat", from: "ann") } == .invalidRequest)
            #expect(await code { _ = try await engine.send(Self.text("x", "0123456789a"), to: "chat", from: "ann") } == .payloadTooLarge)
            #expect(await code { _ = try await engine.send(Self.text("x", "héllo wör"), to: "chat", from: "ann") } == .payloadTooLarge,
                    "the limit counts UTF-8 bytes (11 here), not characters")
            #expect(await code { _ = try await engine.send(Self.text("bad id!", "hi"), to: "chat", from: "ann") } == .invalidRequest)
            #expect(await code { _ = try await engine.send(OutgoingMessage(clientMessageID: "x", type: .image, text: "pic"), to: "chat", from: "ann") } == .invalidRequest)
            #expect(await code {
                _ = try await engine.send(OutgoingMessage(clientMessageID: "x", type: .image, text: "pic", imageURL: "file:///etc/passwd"), to: "chat", from: "ann")
            } == .invalidRequest)
            #expect(await code {
                _ = try await engine.send(OutgoingMessage(clientMessageID: "x", text: "hi", imageURL: "https://img.test/a.png"), to: "chat", from: "ann")
            } == .invalidRequest)
            #expect(await code { _ = try await engine.history(of: "chat", for: "ann", .latest, limit: 1_001) } == .invalidRequest)
            #expect(try await engine.history(of: "chat", for: "ann", .latest).lastSeq == 0, "nothing was stored")
        }
    }

    @Test("pages after a seq, before one and the latest; a trimmed history says where it starts")
    func pagesAndTrimming() async throws {
        try await EngineCluster.with { cluster in
            let engine = cluster.engine(node: "n1", messageHistory: 5)
            try await engine.setMembers(of: "chat", to: ["ann"])
            let empty = try await engine.history(of: "chat", for: "ann", .latest)
            #expect(empty.messages.isEmpty && empty.lastSeq == 0 && empty.firstSeq == 1 && !empty.epoch.isEmpty)
            #expect(try await engine.history(of: "chat", for: "ann", .latest).epoch == empty.epoch, "an empty history keeps the epoch it was given")
            for index in 1...8 { _ = try await engine.send(Self.text("m\(index)", "#\(index)"), to: "chat", from: "ann") }
            let latest = try await engine.history(of: "chat", for: "ann", .latest, limit: 2)
            #expect(latest.messages.map(\.seq) == [7, 8] && latest.lastSeq == 8 && latest.firstSeq == 4, "five kept: 4 to 8")
            #expect(latest.epoch == empty.epoch, "the first message keeps the epoch a read made")
            #expect(try await engine.history(of: "chat", for: "ann", .after(5)).messages.map(\.seq) == [6, 7, 8])
            #expect(try await engine.history(of: "chat", for: "ann", .after(0)).messages.map(\.seq) == [4, 5, 6, 7, 8], "from the oldest kept")
            #expect(try await engine.history(of: "chat", for: "ann", .after(8)).messages.isEmpty)
            #expect(try await engine.history(of: "chat", for: "ann", .before(7), limit: 2).messages.map(\.seq) == [5, 6])
            #expect(try await engine.history(of: "chat", for: "ann", .before(5)).messages.map(\.seq) == [4])
            #expect(try await engine.history(of: "chat", for: "ann", .before(1)).messages.isEmpty)
            let retry = try await engine.send(Self.text("m1", "again"), to: "chat", from: "ann")
            #expect(retry.duplicate && retry.message.seq == 1 && retry.message.text == "#1", "a trimmed message's retry still finds it")
        }
    }

    @Test("a history lost or deleted comes back as a new epoch, from seq 1; a retry of the old epoch's id is a new message")
    func epochs() async throws {
        try await EngineCluster.with { cluster in
            let engine = cluster.engine(node: "n1")
            try await engine.setMembers(of: "chat", to: ["ann", "bo"])
            let old = try await engine.send(Self.text("m1", "one"), to: "chat", from: "ann").message
            _ = try await engine.moveCursor(.read, of: "bo", in: "chat", to: 1)
            #expect(try await engine.deleteConversation("chat"))
            try await engine.setMembers(of: "chat", to: ["ann", "bo"])
            let fresh = try await engine.send(Self.text("m1", "one again"), to: "chat", from: "ann")
            #expect(!fresh.duplicate && fresh.message.seq == 1 && fresh.message.epoch != old.epoch)
            let receipts = try await engine.receipts(of: "chat", for: "ann")
            #expect(receipts.first { $0.user == "bo" }?.cursors == Cursors(deliveredSeq: 0, readSeq: 0), "cursors belong to their epoch")
            // Redis loses the history's keys (not the members): a new epoch again.
            try await cluster.redis.send("DEL", RedisArgument(engine.keys.historyMeta("chat")), RedisArgument(engine.keys.history("chat")))
            let after = try await engine.send(Self.text("m2", "two"), to: "chat", from: "ann").message
            #expect(after.seq == 1 && after.epoch != fresh.message.epoch && after.epoch != old.epoch)
        }
    }

    @Test("cursors move forward only, up to the last seq; read moves delivered; a sender's and a new member's start where they should")
    func cursors() async throws {
        try await EngineCluster.with { cluster in
            let engine = cluster.engine(node: "n1")
            try await engine.setMembers(of: "chat", to: ["ann", "bo"])
            #expect(try await engine.moveCursor(.read, of: "bo", in: "chat", to: 3) == Cursors(deliveredSeq: 0, readSeq: 0), "no history: nothing to move")
            for index in 1...4 { _ = try await engine.send(Self.text("m\(index)", "#\(index)"), to: "chat", from: "ann") }
            #expect(try await engine.moveCursor(.delivered, of: "bo", in: "chat", to: 3) == Cursors(deliveredSeq: 3, readSeq: 0))
            #expect(try await engine.moveCursor(.read, of: "bo", in: "chat", to: 2) == Cursors(deliveredSeq: 3, readSeq: 2))
            #expect(try await engine.moveCursor(.delivered, of: "bo", in: "chat", to: 1) == Cursors(deliveredSeq: 3, readSeq: 2), "never back")
            #expect(try await engine.moveCursor(.read, of: "bo", in: "chat", to: 99) == Cursors(deliveredSeq: 4, readSeq: 4), "above the last: the last")
            _ = try await engine.addMembers(to: "chat", ["cy"])
            _ = try await engine.send(Self.text("b1", "from bo"), to: "chat", from: "bo")
            let receipts = Dictionary(uniqueKeysWithValues: try await engine.receipts(of: "chat", for: "cy").map { ($0.user, $0.cursors) })
            #expect(receipts["ann"] == Cursors(deliveredSeq: 4, readSeq: 4), "her own messages moved hers")
            #expect(receipts["bo"] == Cursors(deliveredSeq: 5, readSeq: 5))
            #expect(receipts["cy"] == Cursors(deliveredSeq: 4, readSeq: 4), "a new member starts at the last seq when they joined")
            let summaries = try await engine.conversationSummaries(of: "ann")
            #expect(summaries.count == 1 && summaries[0].lastSeq == 5 && summaries[0].unread == 1 && summaries[0].lastMessage?.text == "from bo")
            try await engine.setMembers(of: "quiet", to: ["ann"])
            let both = try await engine.conversationSummaries(of: "ann")
            #expect(both.map(\.conversationID) == ["chat", "quiet"] && both[1].epoch.isEmpty && both[1].lastMessage == nil && both[1].unread == 0)
        }
    }

    @Test("delivered moves of a large group written together: each member's highest, never back, never past the last seq, a member removed meanwhile left out; past a thousand members too")
    func deliveredTogether() async throws {
        try await EngineCluster.with { cluster in
            let engine = cluster.engine(node: "n1", largeGroup: 3)
            // 2,500 members: the write reads and checks them a thousand at a time.
            let members = ["ann", "bo", "cy", "dee"] + (0..<2_496).map { "m\($0)" }
            try await engine.setMembers(of: "hall", to: members)
            for index in 1...5 { _ = try await engine.send(Self.text("h\(index)", "#\(index)"), to: "hall", from: "ann") }
            // A member's first move is written at once: it tells the node that the group is a
            // large one and that the user is a member. A non-member's is refused.
            for member in members.dropFirst() { try await engine.markDelivered(1, of: member, in: "hall") }
            await #expect(throws: PresenceError.self) { try await engine.markDelivered(5, of: "stranger", in: "hall") }
            try await engine.markDelivered(2, of: "bo", in: "hall")
            try await engine.markDelivered(4, of: "bo", in: "hall")
            try await engine.markDelivered(3, of: "bo", in: "hall")
            try await engine.markDelivered(99, of: "cy", in: "hall")
            try await engine.markDelivered(3, of: "dee", in: "hall")
            for member in members.dropFirst(4) { try await engine.markDelivered(2, of: member, in: "hall") }
            #expect(try await engine.removeMember(from: "hall", "dee"))
            func delivered() async throws -> [String: Int64] {
                Dictionary(uniqueKeysWithValues: try await engine.receipts(of: "hall", for: "ann").map { ($0.user, $0.cursors.deliveredSeq) })
            }
            let before = try await delivered()
            #expect(before["bo"] == 1 && before["cy"] == 1 && before["m0"] == 1, "queued, not written yet")
            #expect(await engine.flushDelivered() == 2 + 2_496, "one move each of bo, cy and the 2,496; none of dee, no longer a member")
            let after = try await delivered()
            #expect(after["bo"] == 4, "the highest of the moves queued")
            #expect(after["cy"] == 5, "past the last seq: the last")
            #expect(after["stranger"] == nil && after["dee"] == nil)
            #expect(members.dropFirst(4).allSatisfy { after[$0] == 2 })
            // Lower than what is written: nothing moves back.
            try await engine.markDelivered(1, of: "bo", in: "hall")
            #expect(await engine.flushDelivered() == 0)
            #expect(try await delivered()["bo"] == 4)
        }
    }

    @Test("a send and a cursor move are published on the conversation's message channel, and read back as sent")
    func published() async throws {
        try await EngineCluster.with { cluster in
            let engine = cluster.engine(node: "n1")
            try await engine.setMembers(of: "chat", to: ["ann", "bo"])
            let heard = NIOLockedValueBox<[MessageEvent]>([])
            try await withRedisSubscriber(for: engine.redis, logger: TestRedis.logger()) { subscriber in
                try await subscriber.subscribe([engine.keys.messageChannel("chat")])
                let listener = Task {
                    for await event in subscriber.events {
                        if case .message(_, let payload) = event, let decoded = engine.decodeMessageEvent(payload) { heard.withLockedValue { $0.append(decoded) } }
                    }
                }
                defer { listener.cancel() }
                let sent = try await engine.send(OutgoingMessage(clientMessageID: "a1", type: .image, text: "\"quoted\" / ünïcode ✓", imageURL: "https://img.test/x.png",
                                                                 clientCreatedAt: 1_700_000_000_000), to: "chat", from: "ann").message
                _ = try await engine.send(Self.text("a1", "retry"), to: "chat", from: "ann")
                _ = try await engine.moveCursor(.read, of: "bo", in: "chat", to: 1)
                _ = try await engine.moveCursor(.read, of: "bo", in: "chat", to: 1)
                #expect(await eventually { heard.withLockedValue { $0.count } >= 2 })
                try await Task.sleep(for: .milliseconds(200))
                let events = heard.withLockedValue { $0 }
                #expect(events == [.message(sent), .receipt(conversationID: "chat", epoch: sent.epoch, userID: "ann", cursors: Cursors(deliveredSeq: 1, readSeq: 1)),
                                   .receipt(conversationID: "chat", epoch: sent.epoch, userID: "bo", cursors: Cursors(deliveredSeq: 1, readSeq: 1))],
                        "the send moved the sender's cursors; a retry and a cursor that did not move publish nothing: \(events)")
            }
        }
    }
}
