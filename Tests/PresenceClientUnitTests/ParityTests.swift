import Foundation
import Logging
import NIOConcurrencyHelpers
import PresenceClient
import PresenceProtocol
import Testing

// Feeds the recorded gateway frames of Tests/Fixtures/parity.json to the Swift SDK and checks it
// announces exactly the events (and labels) the fixture expects; the fixture's `about` gives the
// format. Tests/Web/parity.test.mjs is the same test for the browser SDK.

@Suite("Parity of the Swift SDK with Tests/Fixtures/parity.json")
struct ParityTests {
    @Test("the Swift SDK announces exactly what parity.json expects for its gateway frames")
    func parity() async throws {
        let fixture = try ParityFixture.load()
        let startMilliseconds = try #require(PresenceTimestamp.milliseconds(fixture.now), "the fixture's now, \(fixture.now), is a timestamp")
        let start = Date(timeIntervalSince1970: Double(startMilliseconds) / 1000)
        let clock = ManualClock(start: start)
        let transport = ParityTransport()
        // The default configuration, as the fixture says (typingDisplayTimeout 8 s).
        let configuration = try PresenceClientConfiguration(gatewayURL: URL(string: "wss://gateway.test")!, deviceID: "parity")
        let client = PresenceClient(
            configuration: configuration, tokenProvider: { _ in "token" }, clock: clock, transport: transport,
            outboxStore: MemoryMessageOutboxStore(), logger: Logger(label: "parity")
        )
        let recorder = EventRecorder()
        let events = await client.events()
        let listening = Task { for await event in events { recorder.append(event) } }
        var running: Task<Void, Never>?
        defer {
            running?.cancel()
            listening.cancel()
        }

        /// Who types where, as the events tell.
        var typing: [String: Set<String>] = [:]
        /// Milliseconds the clock has moved since the fixture's now.
        var elapsed: Int64 = 0
        var total = 0
        for (index, step) in fixture.steps.enumerated() {
            let context = "step \(index): \(step.summary)"
            switch step.action {
            case .start:
                try #require(running == nil, "\(context): the client starts once")
                running = Task { await client.run() }
                let opened = await transport.waitForSession()
                try #require(opened, "\(context): the client opened a session within 2 s")
                #expect(transport.sessions == 1, "\(context): one connection attempt")
            case .frame(let text):
                let delivered = await transport.deliver(text)
                try #require(delivered, "\(context): a session is open to carry the frame")
            case .advance(let seconds):
                // The clock goes to the fixture's now plus the time moved so far, so that sums of
                // fractions (7.9 + 0.1) land exactly where the client computed its deadlines.
                elapsed += Int64((seconds * 1000).rounded())
                let target = start.addingTimeInterval(Double(elapsed) / 1000)
                clock.advance(by: target.timeIntervalSince(clock.now))
            }
            let heard = await recorder.take(expecting: step.expect.count)
            let now = clock.now
            let described = heard.map { Self.describe($0, now: now, typing: &typing) }
            #expect(
                described == step.expect,
                "\(context)\n  heard:    \(Self.render(described))\n  expected: \(Self.render(step.expect))"
            )
            // The cache says the same as the events.
            for (conversation, users) in typing.sorted(by: { $0.key < $1.key }) {
                let cached = await client.typingUsers(in: conversation)
                #expect(cached == users.sorted(), "\(context): typing in \(conversation)")
            }
            total += step.expect.count
        }
        #expect(total >= 20, "the fixture exercises a real sequence")
        #expect(transport.sessions == 1, "one session throughout")
    }

    // MARK: - Events in the fixture's words

    /// A client event as the fixture writes it; typing labels come from `typing`, who types
    /// where as the events so far tell, which this event updates.
    static func describe(_ event: PresenceClientEvent, now: Date, typing: inout [String: Set<String>]) -> [String: ParityValue] {
        switch event {
        case .connection(let state):
            return ["event": "connection", "state": .string(name(of: state))]
        case .presence(let presence):
            let lastSeen = presence.lastSeen.map { date in
                ParityValue.string(PresenceTimestamp.iso8601(Int64((date.timeIntervalSince1970 * 1000).rounded())))
            }
            return [
                "event": "presence",
                "user_id": .string(presence.userID),
                "status": .string(presence.status.rawValue),
                "last_seen": lastSeen ?? .null,
                "label": .string(PresenceText.status(presence, now: now)),
            ]
        case .removed(let userID):
            return ["event": "removed", "user_id": .string(userID)]
        case .typing(let conversationID, let userID, let isTyping):
            if isTyping {
                typing[conversationID, default: []].insert(userID)
            } else {
                typing[conversationID, default: []].remove(userID)
            }
            return [
                "event": "typing",
                "conversation_id": .string(conversationID),
                "user_id": .string(userID),
                "is_typing": .bool(isTyping),
                "label": .string(PresenceText.typing((typing[conversationID] ?? []).sorted())),
            ]
        case .group(let group):
            return [
                "event": "group",
                "conversation_id": .string(group.conversationID),
                "total": .number(Double(group.total)),
                "online": .number(Double(group.online)),
                "away": .number(Double(group.away)),
                "label": .string(PresenceText.group(group)),
            ]
        case .error(let code, let message):
            return ["event": "error", "code": .string(code.rawValue), "message": .string(message)]
        case .message(let message):
            return [
                "event": "message", "conversation_id": .string(message.conversationID), "client_message_id": .string(message.clientMessageID),
                "seq": message.seq.map { .number(Double($0)) } ?? .null, "sender_id": message.senderID.map { .string($0) } ?? .null,
                "text": .string(message.text), "status": .string(message.status.rawValue),
            ]
        case .messageStatus(let change):
            return [
                "event": "message_status", "conversation_id": .string(change.conversationID),
                "client_message_id": .string(change.clientMessageID), "status": .string(change.status.rawValue),
            ]
        case .messageGap(let gap):
            return [
                "event": "message_gap", "conversation_id": .string(gap.conversationID), "epoch": gap.epoch.map { .string($0) } ?? .null,
                "from_seq": .number(Double(gap.fromSeq)),
                "to_seq": gap.toSeq.map { .number(Double($0)) } ?? .null,
            ]
        case .messageTruncated(let range):
            return [
                "event": "message_truncated", "conversation_id": .string(range.conversationID), "epoch": range.epoch.map { .string($0) } ?? .null,
                "from_seq": .number(Double(range.fromSeq)),
                "to_seq": range.toSeq.map { .number(Double($0)) } ?? .null,
            ]
        case .sessionEnded(let end):
            // Not in the fixture (one session throughout); named for a failure message.
            return ["event": "session_ended", "close_code": end.closeCode.map { .number(Double($0)) } ?? .null, "reason": .string(end.reason)]
        }
    }

    /// The fixture's name of a connection state.
    static func name(of state: ConnectionState) -> String {
        switch state {
        case .idle: "idle"
        case .connecting: "connecting"
        case .connected: "connected"
        case .waiting: "waiting"
        case .stopped: "stopped"
        }
    }

    /// Events as one line of JSON each, keys sorted, for failure messages.
    static func render(_ events: [[String: ParityValue]]) -> String {
        guard !events.isEmpty else { return "[]" }
        let lines = events.map { event in
            "{" + event.keys.sorted().map { "\"\($0)\":\(event[$0]!)" }.joined(separator: ",") + "}"
        }
        return "[\n    " + lines.joined(separator: ",\n    ") + "\n  ]"
    }
}

// MARK: - The fixture

/// Tests/Fixtures/parity.json.
struct ParityFixture: Decodable {
    var about: [String]
    var now: String
    var steps: [Step]

    struct Step: Decodable {
        enum Action {
            case start
            case frame(String)
            case advance(Double)
        }

        var action: Action
        var note: String?
        var expect: [[String: ParityValue]]

        enum CodingKeys: String, CodingKey {
            case start, frame, advanceSeconds = "advance_seconds", note, expect
        }

        init(from decoder: any Decoder) throws {
            let container = try decoder.container(keyedBy: CodingKeys.self)
            note = try container.decodeIfPresent(String.self, forKey: .note)
            expect = try container.decode([[String: ParityValue]].self, forKey: .expect)
            if try container.decodeIfPresent(Bool.self, forKey: .start) == true {
                action = .start
            } else if let frame = try container.decodeIfPresent(String.self, forKey: .frame) {
                action = .frame(frame)
            } else if let seconds = try container.decodeIfPresent(Double.self, forKey: .advanceSeconds) {
                action = .advance(seconds)
            } else {
                throw DecodingError.dataCorruptedError(
                    forKey: .expect, in: container, debugDescription: "a step is none of start, frame, advance_seconds"
                )
            }
        }

        /// The step in a few words, for failure messages.
        var summary: String {
            if let note { return note }
            switch action {
            case .start: return "start"
            case .frame(let text): return text
            case .advance(let seconds): return "advance \(seconds) s"
            }
        }
    }

    /// The fixture, found beside this file's folder.
    static func load(filePath: String = #filePath) throws -> ParityFixture {
        let url = URL(fileURLWithPath: filePath)
            .deletingLastPathComponent()
            .deletingLastPathComponent()
            .appendingPathComponent("Fixtures")
            .appendingPathComponent("parity.json")
        return try JSONDecoder().decode(ParityFixture.self, from: Data(contentsOf: url))
    }
}

/// A JSON scalar of the fixture's events.
enum ParityValue: Decodable, Hashable, CustomStringConvertible, ExpressibleByStringLiteral {
    case null
    case bool(Bool)
    case number(Double)
    case string(String)

    init(stringLiteral value: String) { self = .string(value) }

    init(from decoder: any Decoder) throws {
        let container = try decoder.singleValueContainer()
        if container.decodeNil() {
            self = .null
        } else if let value = try? container.decode(Bool.self) {
            self = .bool(value)
        } else if let value = try? container.decode(Double.self) {
            self = .number(value)
        } else {
            self = .string(try container.decode(String.self))
        }
    }

    var description: String {
        switch self {
        case .null: "null"
        case .bool(let value): "\(value)"
        case .number(let value): value == value.rounded() && abs(value) < 1e15 ? "\(Int64(value))" : "\(value)"
        case .string(let value): String(reflecting: value)
        }
    }
}

// MARK: - The gateway's end and the listener

/// The gateway's end of the client's sessions: each opens at once and stays open until the client
/// closes it or gives it up; the test hands it the gateway's frames one at a time.
final class ParityTransport: PresenceTransport {
    private struct State {
        var sessions = 0
        var received: (@Sendable (String) async -> Void)?
    }

    private let state = NIOLockedValueBox(State())

    /// How many sessions the client has opened.
    var sessions: Int { state.withLockedValue { $0.sessions } }

    /// Waits (at most `limit`, in real time) for a session to be open.
    func waitForSession(within limit: Duration = .seconds(2)) async -> Bool {
        let clock = ContinuousClock()
        let deadline = clock.now.advanced(by: limit)
        while clock.now < deadline {
            if state.withLockedValue({ $0.received != nil }) { return true }
            try? await Task.sleep(for: .milliseconds(1))
        }
        return state.withLockedValue { $0.received != nil }
    }

    /// Hands `text` to the client as a frame of the open session, and returns once the client
    /// has taken it in; false when no session is open.
    func deliver(_ text: String) async -> Bool {
        guard let received = state.withLockedValue({ $0.received }) else { return false }
        await received(text)
        return true
    }

    func session(url: URL, outgoing: AsyncStream<OutgoingFrame>, received: @escaping @Sendable (String) async -> Void) async throws -> UInt16? {
        state.withLockedValue { state in
            state.sessions += 1
            state.received = received
        }
        defer { state.withLockedValue { $0.received = nil } }
        // What the client writes is not part of the fixture; its close ends the session.
        for await frame in outgoing {
            if case .close(let code) = frame { return code.rawValue }
        }
        return nil
    }
}

/// Every event the client announces, in order, until taken.
final class EventRecorder: Sendable {
    private let events = NIOLockedValueBox<[PresenceClientEvent]>([])

    func append(_ event: PresenceClientEvent) {
        events.withLockedValue { $0.append(event) }
    }

    /// The events announced since the last take: waits (in real time) until `count` have come or
    /// `limit` has passed, then `grace` more for any extra one.
    func take(expecting count: Int, within limit: Duration = .seconds(2), grace: Duration = .milliseconds(50)) async -> [PresenceClientEvent] {
        let clock = ContinuousClock()
        let deadline = clock.now.advanced(by: limit)
        while events.withLockedValue({ $0.count }) < count, clock.now < deadline {
            try? await Task.sleep(for: .milliseconds(1))
        }
        try? await Task.sleep(for: grace)
        return events.withLockedValue { events in
            let taken = events
            events.removeAll()
            return taken
        }
    }
}
