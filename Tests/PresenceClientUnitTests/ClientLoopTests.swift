import Foundation
import Logging
import NIOConcurrencyHelpers
import Testing

@testable import PresenceClient

/// An in-memory gateway for the client's own loop: each attempt is refused, opens with an
/// `initial_state`, or connects and stays silent; what the client writes is recorded; the test
/// can drop the session.
final class ScriptedTransport: PresenceTransport {
    enum Attempt: Sendable { case refuse, open, silent }

    private struct State {
        var script: [Attempt] = []
        var urls: [URL] = []
        var written: [String] = []
        var drop: AsyncStream<UInt16?>.Continuation?
        var receive: (@Sendable (String) async -> Void)?
    }

    private let state = NIOLockedValueBox(State())

    init(_ script: [Attempt]) { state.withLockedValue { $0.script = script } }

    var urls: [URL] { state.withLockedValue { $0.urls } }
    var written: [String] { state.withLockedValue { $0.written } }
    var isOpen: Bool { state.withLockedValue { $0.drop != nil } }

    func then(_ attempts: [Attempt]) { state.withLockedValue { $0.script += attempts } }

    /// Hands `text` to the client as a frame of the open session.
    func deliver(_ text: String) async {
        let receive = state.withLockedValue { $0.receive }
        await receive?(text)
    }

    /// Ends the open session as if the gateway closed with `code` (`nil`: the connection dropped).
    func drop(_ code: UInt16?) {
        let drop = state.withLockedValue { $0.drop }
        drop?.yield(code)
    }

    func session(url: URL, outgoing: AsyncStream<OutgoingFrame>, received: @escaping @Sendable (String) async -> Void) async throws -> UInt16? {
        let attempt = state.withLockedValue { state -> Attempt in
            state.urls.append(url)
            return state.script.isEmpty ? .refuse : state.script.removeFirst()
        }
        if case .refuse = attempt { throw CancellationError() }
        let (drops, dropper) = AsyncStream.makeStream(of: UInt16?.self)
        state.withLockedValue {
            $0.drop = dropper
            $0.receive = received
        }
        defer {
            state.withLockedValue {
                $0.drop = nil
                $0.receive = nil
            }
        }
        if case .open = attempt { await received(#"{"type":"initial_state","data":{"presences":[]}}"#) }
        return await withTaskGroup(of: UInt16?.self) { group in
            group.addTask {
                for await frame in outgoing {
                    switch frame {
                    case .text(let text): self.state.withLockedValue { $0.written.append(text) }
                    case .close(let code): return code.rawValue
                    }
                }
                return nil
            }
            group.addTask {
                for await code in drops { return code }
                return nil
            }
            let code = await group.next() ?? nil
            group.cancelAll()
            return code
        }
    }
}

@Suite("The client's loop on a test clock")
struct ClientLoopTests {
    func makeClient(_ transport: ScriptedTransport, clock: ManualClock) throws -> PresenceClient {
        var configuration = try PresenceClientConfiguration(gatewayURL: URL(string: "ws://gateway.test")!, deviceID: "phone")
        configuration.typingIdleTimeout = 3
        return PresenceClient(configuration: configuration, tokenProvider: { _ in "token" }, clock: clock, transport: transport, outboxStore: MemoryMessageOutboxStore(), logger: Logger(label: "test"))
    }

    /// Waits (bounded, in real time) for the client to reach a state.
    func state(_ client: PresenceClient, _ matches: @escaping @Sendable (ConnectionState) -> Bool) async -> ConnectionState? {
        for _ in 0..<3_000 {
            let state = await client.connectionState
            if matches(state) { return state }
            try? await Task.sleep(for: .milliseconds(1))
        }
        return nil
    }

    /// The delay of the client's next wait (one not ending at `previous`).
    func waitingDelay(_ client: PresenceClient, _ clock: ManualClock, after previous: Date? = nil) async -> TimeInterval? {
        let found = await state(client) { state in
            if case .waiting(let retryAt) = state { retryAt != previous } else { false }
        }
        guard case .waiting(let retryAt)? = found else { return nil }
        return retryAt.timeIntervalSince(clock.now)
    }

    @Test("failed attempts wait 1, 2, 4 s (±20 %) on the clock; a success resets the backoff")
    func backoff() async throws {
        let clock = ManualClock()
        let transport = ScriptedTransport([.refuse, .refuse, .refuse, .open])
        let client = try makeClient(transport, clock: clock)
        let run = Task { await client.run() }
        defer { run.cancel() }
        var previous: Date?
        for base in [1.0, 2, 4] {
            let delay = try #require(await waitingDelay(client, clock, after: previous))
            previous = clock.now + delay
            #expect(delay >= base * 0.8 && delay <= base * 1.2, "waited \(delay) s for \(base) s")
            let attempts = transport.urls.count
            clock.advance(by: delay * 0.9)
            try await Task.sleep(for: .milliseconds(20))
            #expect(transport.urls.count == attempts, "no attempt before the delay is over")
            clock.advance(by: delay * 0.1 + 0.001)
        }
        #expect(await state(client, { $0 == .connected }) == .connected)
        #expect(transport.urls.count == 4)
        transport.drop(nil)
        let delay = try #require(await waitingDelay(client, clock))
        #expect(delay >= 0.8 && delay <= 1.2, "back to 1 s after a success, got \(delay)")
    }

    @Test("an attempt that never opens is given up after openTimeout on the clock and tried again after the backoff")
    func openTimeout() async throws {
        let clock = ManualClock()
        let transport = ScriptedTransport([.silent, .open])
        let client = try makeClient(transport, clock: clock)
        let run = Task { await client.run() }
        defer { run.cancel() }
        for _ in 0..<1_000 where !transport.isOpen { try await Task.sleep(for: .milliseconds(1)) }
        #expect(transport.isOpen, "the first attempt connected")
        clock.advance(by: 9.9)
        try await Task.sleep(for: .milliseconds(50))
        #expect(await client.connectionState == .connecting, "still waiting for initial_state before 10 s")
        #expect(transport.isOpen)
        clock.advance(by: 0.2)
        let delay = try #require(await waitingDelay(client, clock), "the attempt was given up at 10 s")
        #expect(!transport.isOpen, "its connection was closed")
        #expect(delay >= 0.8 && delay <= 1.2, "then the backoff: \(delay) s")
        clock.advance(by: delay + 0.001)
        #expect(await state(client, { $0 == .connected }) == .connected)
        #expect(transport.urls.count == 2)
    }

    @Test("backgroundPolicy .offline(after: 30): away at once, a clean close (1000) at 30 s on the clock, no reconnect until active")
    func backgroundOffline() async throws {
        let clock = ManualClock()
        let transport = ScriptedTransport([.open, .open])
        var configuration = try PresenceClientConfiguration(gatewayURL: URL(string: "ws://gateway.test")!, deviceID: "phone")
        configuration.backgroundPolicy = .offline(after: 30)
        let client = PresenceClient(configuration: configuration, tokenProvider: { _ in "token" }, clock: clock, transport: transport, outboxStore: MemoryMessageOutboxStore(), logger: Logger(label: "test"))
        let run = Task { await client.run() }
        defer { run.cancel() }
        #expect(await state(client, { $0 == .connected }) == .connected)
        await client.didEnterBackground()
        for _ in 0..<1_000 where !transport.written.contains(where: { $0.contains(#""away""#) }) { try await Task.sleep(for: .milliseconds(1)) }
        #expect(transport.written.contains { $0.contains(#""status""#) && $0.contains(#""away""#) }, "away at once: \(transport.written)")
        clock.advance(by: 29)
        try await Task.sleep(for: .milliseconds(50))
        #expect(transport.isOpen, "still connected before 30 s")
        clock.advance(by: 1.001)
        #expect(await state(client, { $0 == .idle }) == .idle, "the session closed and the client waits")
        #expect(!transport.isOpen)
        #expect(await client.lastCloseCode == 1000, "closed cleanly: offline at once on the gateway")
        clock.advance(by: 60)
        try await Task.sleep(for: .milliseconds(50))
        #expect(transport.urls.count == 1, "no reconnect while in the background")
        await client.didBecomeActive()
        #expect(await state(client, { $0 == .connected }) == .connected)
        #expect(transport.urls.count == 2)
        #expect(transport.urls.last?.query?.contains("status=online") == true, "opens online again")
    }

    @Test("lastCloseCode is the last session's: a refused attempt after it does not erase it")
    func lastCloseCode() async throws {
        let clock = ManualClock()
        let transport = ScriptedTransport([.open, .refuse, .open])
        let client = try makeClient(transport, clock: clock)
        let run = Task { await client.run() }
        defer { run.cancel() }
        #expect(await state(client, { $0 == .connected }) == .connected)
        transport.drop(1001)
        let delay = try #require(await waitingDelay(client, clock), "the quick retry was refused; backing off")
        #expect(transport.urls.count == 2)
        #expect(await client.lastCloseCode == 1001)
        clock.advance(by: delay + 0.001)
        #expect(await state(client, { $0 == .connected }) == .connected)
        transport.drop(nil)
        _ = try #require(await waitingDelay(client, clock))
        #expect(await client.lastCloseCode == nil, "a session that dropped without a close")
    }

    @Test("1001 reconnects at once; 4003 stops for good")
    func closeCodes() async throws {
        let clock = ManualClock()
        let transport = ScriptedTransport([.open, .open])
        let client = try makeClient(transport, clock: clock)
        let run = Task { await client.run() }
        #expect(await state(client, { $0 == .connected }) == .connected)
        transport.drop(1001)
        for _ in 0..<1_000 where transport.urls.count < 2 { try await Task.sleep(for: .milliseconds(1)) }
        #expect(transport.urls.count == 2, "reconnected without the clock moving")
        #expect(await state(client, { $0 == .connected }) == .connected)
        transport.drop(4003)
        #expect(await state(client, { $0 == .stopped(.disconnectedByAdmin) }) == .stopped(.disconnectedByAdmin))
        await run.value
        #expect(transport.urls.count == 2)
    }

    @Test("a status chosen while disconnected opens the next session; no status frame follows")
    func statusWhileDisconnected() async throws {
        let clock = ManualClock()
        let transport = ScriptedTransport([.refuse])
        let client = try makeClient(transport, clock: clock)
        let run = Task { await client.run() }
        defer { run.cancel() }
        let delay = try #require(await waitingDelay(client, clock))
        await client.setStatus(.offline)
        await client.setStatus(.away)
        transport.then([.open])
        clock.advance(by: delay)
        #expect(await state(client, { $0 == .connected }) == .connected)
        #expect(transport.urls.last?.query?.contains("status=away") == true, "\(transport.urls)")
        try await Task.sleep(for: .milliseconds(50))
        #expect(!transport.written.contains { $0.contains(#""type":"status""#) }, "sent with the connection, not again: \(transport.written)")
        await client.setStatus(.online)
        try await Task.sleep(for: .milliseconds(50))
        #expect(transport.written.filter { $0.contains(#""type":"status""#) }.count == 1)
    }

    @Test("typing: true at once, false after 3 s idle on the clock, nothing while offline")
    func typing() async throws {
        let clock = ManualClock()
        let transport = ScriptedTransport([.open])
        let client = try makeClient(transport, clock: clock)
        let run = Task { await client.run() }
        defer { run.cancel() }
        #expect(await state(client, { $0 == .connected }) == .connected)
        func typingFrames() -> [String] { transport.written.filter { $0.contains(#""type":"typing""#) } }
        try await client.userTyped(in: "room")
        clock.advance(by: 1)
        try await client.userTyped(in: "room")
        try await Task.sleep(for: .milliseconds(30))
        #expect(typingFrames().count == 1 && typingFrames()[0].contains(#""is_typing":true"#))
        clock.advance(by: 2.9)
        try await Task.sleep(for: .milliseconds(30))
        #expect(typingFrames().count == 1, "still typing 2.9 s after the last keystroke")
        clock.advance(by: 0.2)
        for _ in 0..<1_000 where typingFrames().count < 2 { try await Task.sleep(for: .milliseconds(1)) }
        #expect(typingFrames().count == 2 && typingFrames()[1].contains(#""is_typing":false"#))

        await client.setStatus(.offline)
        try await client.userTyped(in: "room")
        try await Task.sleep(for: .milliseconds(30))
        #expect(typingFrames().count == 2, "no typing while appearing offline")
    }

    @Test("a message gets 3 attempts on a live session, 1 s and 2 s apart on the clock (an error, or no ack in 10 s), with one id; then failed, and the next goes")
    func messageAttempts() async throws {
        let clock = ManualClock()
        let transport = ScriptedTransport([.open])
        let client = try makeClient(transport, clock: clock)
        let run = Task { await client.run() }
        defer { run.cancel() }
        #expect(await state(client, { $0 == .connected }) == .connected)
        /// The `send` frames written so far: frame id and client message id.
        func sends() -> [(id: String, message: String)] {
            transport.written.compactMap { text in
                guard let object = try? JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any], object["type"] as? String == "send",
                      let id = object["id"] as? String, let message = (object["data"] as? [String: Any])?["client_message_id"] as? String else { return nil }
                return (id, message)
            }
        }
        // Up to 5 s of the machine's time: on a busy machine 1,000 sleeps of 1 ms were too few.
        func waitForSends(_ count: Int) async -> Bool {
            let deadline = ContinuousClock.now + .seconds(5)
            while sends().count < count, ContinuousClock.now < deadline { try? await Task.sleep(for: .milliseconds(1)) }
            return sends().count == count
        }
        let first = try await client.send("one", to: "room")
        let second = try await client.send("two", to: "room")
        try #require(await waitForSends(1), "one message of a conversation under way at a time")
        await transport.deliver(#"{"type":"error","id":"\#(sends()[0].id)","data":{"code":"internal","message":"boom"}}"#)
        clock.advance(by: 0.9)
        try await Task.sleep(for: .milliseconds(30))
        #expect(sends().count == 1, "not before 1 s")
        clock.advance(by: 0.1)
        try #require(await waitForSends(2), "the second attempt 1 s after the first failed")
        // No answer within 10 s fails the second attempt; the third comes 2 s later.
        clock.advance(by: 10)
        try await Task.sleep(for: .milliseconds(30))
        clock.advance(by: 1.9)
        try await Task.sleep(for: .milliseconds(30))
        #expect(sends().count == 2)
        clock.advance(by: 0.1)
        try #require(await waitForSends(3))
        await transport.deliver(#"{"type":"error","id":"\#(sends()[2].id)","data":{"code":"unavailable","message":"later"}}"#)
        try #require(await waitForSends(4), "the next message goes once the first has failed")
        #expect(sends().map(\.message) == [first.clientMessageID, first.clientMessageID, first.clientMessageID, second.clientMessageID])
        let failed = await client.messages(in: "room").first { $0.clientMessageID == first.clientMessageID }
        #expect(failed?.status == .failed && failed?.failure == "unavailable: later", "\(String(describing: failed))")
        // A rate-limited attempt costs none: the message waits retryDelay and goes again.
        await transport.deliver(#"{"type":"error","id":"\#(sends()[3].id)","data":{"code":"rate_limited","message":"slow down"}}"#)
        clock.advance(by: 1)
        try #require(await waitForSends(5))
        #expect(await client.messages(in: "room").first { $0.clientMessageID == second.clientMessageID }?.status == .sending)
    }
}
