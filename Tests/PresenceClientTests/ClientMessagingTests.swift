import ClientTestSupport
import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import NIOConcurrencyHelpers
import RedisTestSupport
import Testing

@testable import PresenceClient

/// The offline-messaging story (seed 004) with two `PresenceClient`s on a live gateway process:
/// typing while offline, messages written offline, offline/online cycles on both devices, a
/// restart while offline.
@Suite("PresenceClient messages against a live gateway process", .serialized)
struct ClientMessagingTests {
    static func node(_ tag: String) async throws -> GatewayProcess {
        let node = try await GatewayProcess(nodeID: "n1", environment: nodeEnvironment(prefix: TestRedis.uniquePrefix(tag)))
        #expect(admin(node, "PUT", "/api/admin/conversations/room", #"{"member_ids":["alice","bob"]}"#)?.status == 200)
        return node
    }

    /// The texts of `conversation` as `client` has them, in order, with their statuses.
    static func texts(_ client: LiveClient, _ conversation: String = "room") async -> [String] {
        await client.client.messages(in: conversation).map(\.text)
    }

    static func statuses(_ client: LiveClient, _ conversation: String = "room") async -> [MessageStatus] {
        await client.client.messages(in: conversation).map(\.status)
    }

    @Test("30 followed conversations (12 written to while offline, 18 more groups): back online, every message is shown once, in order")
    func manyConversations() async throws {
        let node = try await GatewayProcess(nodeID: "n1", environment: nodeEnvironment(prefix: TestRedis.uniquePrefix("msg-many")))
        let talks = (0..<12).map { "talk\($0)" }
        let groups = (0..<18).map { "group\($0)" }
        for talk in talks { #expect(admin(node, "PUT", "/api/admin/conversations/\(talk)", #"{"member_ids":["alice","bob"]}"#)?.status == 200) }
        for group in groups {
            #expect(admin(node, "PUT", "/api/admin/conversations/\(group)", #"{"member_ids":["alice","bob","carol"]}"#)?.status == 200)
        }
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        for conversation in talks + groups { try await alice.client.join(conversation: conversation) }
        #expect(await alice.connected(.seconds(20)))
        await alice.client.setOffline(true)
        #expect(await alice.waitUntil { await $0.connectionState == .idle })
        let bob = try await mint("bob")
        for talk in talks {
            for number in 1...2 {
                let body = #"{"client_message_id":"\#(talk)-\#(number)","text":"\#(talk) #\#(number)"}"#
                let sent = GatewayProcess.http(port: node.port, method: "POST", path: "/api/conversations/\(talk)/messages",
                                               headers: ["Authorization": "Bearer \(bob)"], body: body)
                #expect(sent?.status == 201)
            }
        }
        await alice.client.setOffline(false)
        let caughtUp = await alice.waitUntil(.seconds(15)) { client in
            for talk in talks {
                if await client.messages(in: talk).count < 2 { return false }
            }
            return true
        }
        #expect(caughtUp, "every conversation's two messages arrived")
        for talk in talks {
            let messages = await alice.client.messages(in: talk)
            #expect(messages.map(\.text) == ["\(talk) #1", "\(talk) #2"] && messages.compactMap(\.seq) == [1, 2], "\(talk): \(messages.map(\.text))")
        }
        let errors = alice.events.filter { if case .error = $0 { true } else { false } }
        #expect(errors.isEmpty, "\(errors)")
    }

    @Test("seed 004, case 1: typing is neither sent nor shown while offline, and works again after")
    func typingOffline() async throws {
        let node = try await Self.node("msg-typing")
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        for client in [alice, bob] {
            try await client.client.join(conversation: "room")
            #expect(await client.connected())
        }
        await alice.client.setOffline(true)
        #expect(await alice.waitUntil { await $0.connectionState == .idle })
        #expect(await bob.sees("alice", .offline), "others see the switch as offline")
        try await alice.client.userTyped(in: "room")
        try await bob.client.userTyped(in: "room")
        try await Task.sleep(for: .milliseconds(800))
        #expect(await bob.client.typingUsers(in: "room").isEmpty, "alice's typing was not sent")
        #expect(await alice.client.typingUsers(in: "room").isEmpty, "bob's typing is not shown to alice")
        await alice.client.setOffline(false)
        #expect(await alice.waitUntil { await $0.connectionState == .connected })
        try await Task.sleep(for: .seconds(2.2))
        try await alice.client.userTyped(in: "room")
        #expect(await bob.waitUntil(.seconds(5)) { await $0.typingUsers(in: "room") == ["alice"] }, "typing works again")
    }

    @Test("seed 004, case 2: five messages written offline show sending, all reach the other device in order within 3 s, and end read")
    func fiveOffline() async throws {
        let node = try await Self.node("msg-five")
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        #expect(await alice.connected())
        #expect(await bob.connected())
        await alice.client.setOffline(true)
        #expect(await alice.waitUntil { await $0.connectionState == .idle })
        let written = (1...5).map { "offline \($0)" }
        for text in written { try await alice.client.send(text, to: "room") }
        try await Task.sleep(for: .milliseconds(500))
        #expect(await Self.statuses(alice) == Array(repeating: .sending, count: 5), "not delivered while offline")
        #expect(await Self.texts(bob).isEmpty)
        let online = ContinuousClock.now
        await alice.client.setOffline(false)
        #expect(await alice.waitUntil(.seconds(3)) { _ in alice.connectedAt.contains { $0 > online } })
        let connected = ContinuousClock.now - online
        #expect(await bob.waitUntil(.seconds(3)) { await $0.messages(in: "room").count == 5 }, "all five within 3 s")
        print("alice connected \(connected) after going online")
        print("five messages written offline reached the other device \(ContinuousClock.now - online) after going online")
        #expect(await Self.texts(bob) == written)
        #expect(await bob.client.messages(in: "room").compactMap(\.seq) == [1, 2, 3, 4, 5])
        // Bob has them delivered; once he has the conversation on screen they are read.
        let delivered = await alice.waitUntil { await $0.messages(in: "room").map(\.status) == Array(repeating: .delivered, count: 5) }
        let afterDelivery = await Self.statuses(alice)
        #expect(delivered, "\(afterDelivery)")
        await bob.client.markRead("room")
        let read = await alice.waitUntil { await $0.messages(in: "room").map(\.status) == Array(repeating: .read, count: 5) }
        let afterRead = await Self.statuses(alice)
        #expect(read, "\(afterRead)")
    }

    @Test("seed 004, case 3: offline/online cycles on both devices (3, 2, then 12 messages) leave both with the same complete history")
    func cycles() async throws {
        let node = try await Self.node("msg-cycles")
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        #expect(await alice.connected())
        #expect(await bob.connected())
        var expected: [String] = []
        for (client, count) in [(alice, 3), (bob, 2), (alice, 12)] {
            await client.client.setOffline(true)
            #expect(await client.waitUntil { await $0.connectionState == .idle })
            for number in 1...count {
                let text = "\(client.user) \(expected.count + 1) (\(number) of \(count))"
                expected.append(text)
                try await client.client.send(text, to: "room")
            }
            await client.client.setOffline(false)
            #expect(await client.connected())
            // Back online and caught up: its own messages stored (the order expected below is
            // the order they reached the server), and the others' received.
            let sent = expected.count
            #expect(await client.waitUntil(.seconds(10)) { await $0.messages(in: "room").filter { $0.seq != nil }.count == sent })
        }
        let total = expected.count
        for client in [alice, bob] {
            let complete = await client.waitUntil(.seconds(10)) { await $0.messages(in: "room").filter { $0.seq != nil }.count == total }
            let texts = await Self.texts(client)
            #expect(complete, "\(client.user): \(texts)")
            #expect(texts == expected, "\(client.user)")
            #expect(await client.client.messages(in: "room").compactMap(\.seq) == Array(1...Int64(expected.count)))
        }
    }

    @Test("a process restart while offline keeps the outbox (a file), and its messages are sent once")
    func restartOffline() async throws {
        let node = try await Self.node("msg-restart")
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("outbox-\(UUID().uuidString).json")
        defer { try? FileManager.default.removeItem(at: file) }
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        #expect(await bob.connected())
        do {
            let first = try await LiveClient("alice", device: "phone", nodes: [node], outboxStore: FileMessageOutboxStore(url: file))
            #expect(await first.connected())
            await first.client.setOffline(true)
            #expect(await first.waitUntil { await $0.connectionState == .idle })
            for number in 1...3 { try await first.client.send("before restart \(number)", to: "room") }
            await first.client.outboxSaved()
            await first.client.signOut()
        }
        let saved = try await FileMessageOutboxStore(url: file).load()
        #expect(saved.map(\.text) == (1...3).map { "before restart \($0)" } && saved.allSatisfy { $0.status == .sending })
        let second = try await LiveClient("alice", device: "phone", nodes: [node], outboxStore: FileMessageOutboxStore(url: file))
        #expect(await bob.waitUntil(.seconds(5)) { await $0.messages(in: "room").count == 3 })
        try await Task.sleep(for: .seconds(1))
        #expect(await Self.texts(bob) == (1...3).map { "before restart \($0)" }, "sent once each")
        #expect(await second.waitUntil { await $0.messages(in: "room").allSatisfy { $0.seq != nil } })
        await second.client.outboxSaved()
        #expect(try await FileMessageOutboxStore(url: file).load().isEmpty, "the outbox is empty once stored")
    }

    @Test("a message the gateway refuses (not a member) fails with the reason, stays for retry, and does not hold back the next")
    func refused() async throws {
        let node = try await Self.node("msg-refused")
        #expect(admin(node, "PUT", "/api/admin/conversations/other", #"{"member_ids":["bob","carol"]}"#)?.status == 200)
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        #expect(await alice.connected())
        let refused = try await alice.client.send("not mine", to: "other")
        try await alice.client.send("first", to: "room")
        #expect(await alice.waitUntil { await $0.messages(in: "other").first?.status == .failed })
        let failed = await alice.client.messages(in: "other").first
        let reason = failed?.failure ?? ""
        #expect(reason.hasPrefix("forbidden") || reason.hasPrefix("not_found"), "\(reason)")
        #expect(await alice.waitUntil { await $0.messages(in: "room").first?.seq == 1 })
        // Once alice is a member, the retry goes through.
        #expect(admin(node, "PUT", "/api/admin/conversations/other", #"{"member_ids":["alice","bob","carol"]}"#)?.status == 200)
        #expect(await alice.client.retry(refused.clientMessageID))
        #expect(await alice.waitUntil { await $0.messages(in: "other").first?.seq == 1 })
    }

    @Test("the connection dropped after the gateway stored a message and before its ack arrived: one message, not two")
    func ackLost() async throws {
        let node = try await Self.node("msg-ack-lost")
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        #expect(await bob.connected())
        let transport = AckDroppingTransport(inner: WebSocketTransport(logger: TestRedis.logger("transport")))
        let configuration = try PresenceClientConfiguration(gatewayURL: URL(string: "ws://127.0.0.1:\(node.port)")!, deviceID: "phone")
        let alice = PresenceClient(configuration: configuration, tokenProvider: { _ in try await mint("alice") }, transport: transport,
                                   outboxStore: MemoryMessageOutboxStore(), logger: TestRedis.logger("client-alice"))
        let running = Task { await alice.run() }
        defer { running.cancel() }
        let sent = try await alice.send("exactly once", to: "room")
        // The connection dies once the message is stored; the next session sends it again.
        let stored = await eventually(timeout: .seconds(10)) { await alice.messages(in: "room").first?.seq != nil }
        let state = await alice.messages(in: "room")
        #expect(stored, "\(state)")
        #expect(transport.cuts.withLockedValue { $0 } == 1, "the first session died after the store")
        #expect(transport.sends.withLockedValue { $0 } == [sent.clientMessageID, sent.clientMessageID], "sent again, with the same id")
        #expect(await alice.messages(in: "room").map(\.seq) == [1])
        #expect(await alice.messages(in: "room").first?.clientMessageID == sent.clientMessageID)
        try await Task.sleep(for: .seconds(1))
        #expect(await bob.client.messages(in: "room").map(\.text) == ["exactly once"], "bob got it once")
        var request = URLRequest(url: URL(string: "http://127.0.0.1:\(node.port)/api/conversations/room/messages")!)
        request.setValue("Bearer \(try await mint("bob"))", forHTTPHeaderField: "Authorization")
        let (data, _) = try await URLSession.shared.data(for: request)
        let history = String(decoding: data, as: UTF8.self)
        #expect(history.components(separatedBy: "exactly once").count == 2 && history.contains(#""last_seq":1"#), "stored once: \(history)")
    }
}

/// A transport whose first session dies right after the gateway stored a message: at the first
/// `message_ack` or `message` frame it drops the connection (no close frame, as a network that
/// goes away) without handing that frame on. It counts the `send` frames written.
final class AckDroppingTransport: PresenceTransport {
    let inner: WebSocketTransport
    /// Connections dropped so far (only the first session's).
    let cuts = NIOLockedValueBox(0)
    /// The client message ids of the `send` frames written, in order.
    let sends = NIOLockedValueBox<[String]>([])

    init(inner: WebSocketTransport) {
        self.inner = inner
    }

    func session(url: URL, outgoing: AsyncStream<OutgoingFrame>, received: @escaping @Sendable (String) async -> Void) async throws -> UInt16? {
        let cut = AsyncStream<Void>.makeStream()
        let (forwarded, forward) = AsyncStream.makeStream(of: OutgoingFrame.self)
        let (cuts, sends, inner) = (self.cuts, self.sends, self.inner)
        let cutting = cuts.withLockedValue { $0 == 0 }
        return try await withThrowingTaskGroup(of: UInt16?.self) { group in
            group.addTask {
                for await frame in outgoing {
                    if case .text(let text) = frame, text.contains(#""type":"send""#),
                       let object = try? JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any],
                       let id = (object["data"] as? [String: Any])?["client_message_id"] as? String {
                        sends.withLockedValue { $0.append(id) }
                    }
                    forward.yield(frame)
                }
                forward.finish()
                // The session ends with the inner one, not here.
                try await Task.sleep(for: .seconds(3_600))
                return nil
            }
            group.addTask {
                try await inner.session(url: url, outgoing: forwarded) { text in
                    guard cutting else { return await received(text) }
                    // From the first sign of the store on, nothing of this session arrives.
                    let stored = text.contains(#""type":"message_ack""#) || text.contains(#""type":"message""#)
                    let withheld = cuts.withLockedValue { count in
                        if stored, count == 0 {
                            count = 1
                            cut.continuation.yield()
                        }
                        return count > 0
                    }
                    if !withheld { await received(text) }
                }
            }
            group.addTask {
                for await _ in cut.stream { break }
                return nil
            }
            let first = try await group.next() ?? nil
            group.cancelAll()
            return first
        }
    }
}
