import Foundation
import Logging
import Testing

@testable import PresenceClient

@Suite("The client's outbox, apart from the network")
struct OutboxTests {
    static func message(_ text: String, at seconds: TimeInterval = 0) -> ChatMessage {
        ChatMessage(conversationID: "room", clientMessageID: "id-\(text)", text: text, createdAt: Date(timeIntervalSince1970: seconds), status: .sending)
    }

    @Test("a message written before the store's outbox is read keeps what the store had: both are saved, the older first; each is announced",
          .timeLimit(.minutes(1)))
    func writtenBeforeLoad() async throws {
        let store = MemoryMessageOutboxStore()
        try await store.save([Self.message("from the last run")])
        let configuration = try PresenceClientConfiguration(gatewayURL: URL(string: "ws://gateway.test")!, deviceID: "phone")
        let client = PresenceClient(configuration: configuration, tokenProvider: { _ in "token" }, outboxStore: store, logger: Logger(label: "test"))
        let events = await client.events()
        try await client.send("written before run()", to: "room")
        await client.outboxSaved()
        await client.loadOutbox()
        await client.outboxSaved()
        #expect(try await store.load().map(\.text) == ["from the last run", "written before run()"])
        #expect(await client.messages(in: "room").map(\.text) == ["from the last run", "written before run()"])
        // Each is announced once: the new one when written, the restored one when read back.
        var announced: [String] = []
        for await event in events {
            if case .message(let message) = event { announced.append(message.text) }
            if announced.count == 2 { break }
        }
        #expect(announced == ["written before run()", "from the last run"])
    }

    @Test("a wait before the next attempt that is over sets no timer while another message of its conversation is under way")
    func noPastDeadline() {
        let now = Date(timeIntervalSince1970: 1_000)
        var state = ChatState()
        var underWay = ChatState.Outgoing(message: Self.message("under way"))
        underWay.frameID = "1.1"
        underWay.deadline = now.addingTimeInterval(10)
        var waiting = ChatState.Outgoing(message: Self.message("waited"))
        waiting.due = now.addingTimeInterval(-1)
        state.outbox = [underWay, waiting]
        #expect(state.nextDeadline(after: now) == now.addingTimeInterval(10))
        state.outbox[1].due = now.addingTimeInterval(2)
        #expect(state.nextDeadline(after: now) == now.addingTimeInterval(2))
        state.outbox[1].message.status = .failed
        #expect(state.nextDeadline(after: now) == now.addingTimeInterval(10))
    }
}
