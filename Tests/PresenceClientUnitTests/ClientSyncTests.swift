import Foundation
import Logging
import NIOConcurrencyHelpers
import PresenceProtocol
import Testing

@testable import PresenceClient

// The Swift SDK's sync on a test clock with an in-memory gateway: refused syncs sent again with
// backoff, opening frames paced within the gateway's budgets, a last seq that never moves past a
// gap, epochs read from the frames, lost and forked histories. Tests/Web/presence.test.mjs
// ("syncing: retries, pacing, gaps and epochs") holds the same cases for the browser module.

/// The gateway's end of the client's sessions: every attempt opens at once (its `initial_state`),
/// what the client writes is recorded with the session's number and the test clock's time, and
/// the test hands frames in or drops the session.
final class RecordingTransport: PresenceTransport {
    struct Written: Sendable {
        var session: Int
        var at: Date
        var text: String
    }

    private struct State {
        var written: [Written] = []
        var sessions = 0
        var drop: AsyncStream<UInt16?>.Continuation?
        var receive: (@Sendable (String) async -> Void)?
    }

    private let state = NIOLockedValueBox(State())
    private let clock: ManualClock

    init(clock: ManualClock) {
        self.clock = clock
    }

    var written: [Written] { state.withLockedValue { $0.written } }
    /// Sessions opened so far; the open one's number.
    var sessions: Int { state.withLockedValue { $0.sessions } }

    /// Hands `text` to the client as a frame of the open session; returns once it was taken in.
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
        let (drops, dropper) = AsyncStream.makeStream(of: UInt16?.self)
        let number = state.withLockedValue { state -> Int in
            state.sessions += 1
            state.drop = dropper
            state.receive = received
            return state.sessions
        }
        defer {
            state.withLockedValue { state in
                state.drop = nil
                state.receive = nil
            }
        }
        await received(#"{"type":"initial_state","data":{"presences":[]}}"#)
        return await withTaskGroup(of: UInt16?.self) { group in
            group.addTask {
                for await frame in outgoing {
                    switch frame {
                    case .text(let text):
                        let at = self.clock.now
                        self.state.withLockedValue { $0.written.append(Written(session: number, at: at, text: text)) }
                    case .close(let code):
                        return code.rawValue
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

/// The gateway's frames, as the tests hand them in.
enum Wire {
    static let createdAt: Int64 = 1_800_000_000_000

    static func message(_ seq: Int64, from sender: String, _ text: String, in conversation: String = "room", epoch: String? = "e1",
                        id: String? = nil, clientMessageID: String? = nil) -> ServerFrame {
        .message(MessagePayload(conversationID: conversation, epoch: epoch, seq: seq, id: id ?? "\(sender)-\(epoch ?? "none")-\(seq)", senderID: sender,
                                clientMessageID: clientMessageID ?? "\(sender)-\(epoch ?? "none")-\(seq)", type: "text", text: text, imageURL: nil,
                                createdAt: createdAt, clientCreatedAt: nil))
    }

    static func synced(_ conversation: String = "room", lastSeq: Int64, epoch: String = "e1", more: Bool = false, missing: [MissingRange] = [],
                       truncated: [MissingRange] = [], receipts: [ReceiptPayload]? = nil) -> ServerFrame {
        .synced(SyncedPayload(conversationID: conversation, epoch: epoch, lastSeq: lastSeq, complete: missing.isEmpty, more: more, missing: missing,
                              truncated: truncated, receipts: receipts))
    }

    static func ack(_ clientMessageID: String, seq: Int64, epoch: String? = "e1", id: String? = nil, in conversation: String = "room") -> ServerFrame {
        .messageAck(MessageAckPayload(conversationID: conversation, clientMessageID: clientMessageID, epoch: epoch, seq: seq,
                                      id: id ?? "me-\(epoch ?? "none")-\(seq)", createdAt: createdAt, duplicate: false))
    }

    static func error(_ code: ErrorCode, conversation: String? = nil) -> ServerFrame {
        .error(ErrorPayload(code: code, message: "\(code.rawValue) here", conversationID: conversation))
    }

    static func receipt(_ user: String, delivered: Int64, read: Int64, in conversation: String = "room") -> ServerFrame {
        .receipt(ReceiptPayload(conversationID: conversation, userID: user, deliveredSeq: delivered, readSeq: read))
    }

    /// A member's cursors as a `synced` lists them.
    static func cursors(_ user: String, _ delivered: Int64, _ read: Int64) -> ReceiptPayload {
        ReceiptPayload(userID: user, deliveredSeq: delivered, readSeq: read)
    }

    static func range(_ epoch: String?, _ from: Int64, _ to: Int64?) -> MissingRange {
        MissingRange(epoch: epoch, fromSeq: from, toSeq: to)
    }
}

/// A client on a test clock that follows `conversations`, with a ``RecordingTransport``, what it
/// announced, and what it wrote read back as the gateway reads it.
final class ChatHarness: Sendable {
    let clock: ManualClock
    let transport: RecordingTransport
    let client: PresenceClient
    private let announced = NIOLockedValueBox<[PresenceClientEvent]>([])
    private let tasks = NIOLockedValueBox<[Task<Void, Never>]>([])
    static let coder = FrameCoder()

    init(joining conversations: [String]) async throws {
        let clock = ManualClock()
        let transport = RecordingTransport(clock: clock)
        let configuration = try PresenceClientConfiguration(gatewayURL: URL(string: "ws://gateway.test")!, deviceID: "phone")
        let client = PresenceClient(configuration: configuration, tokenProvider: { _ in "token" }, clock: clock, transport: transport,
                                    outboxStore: MemoryMessageOutboxStore(), logger: Logger(label: "test"))
        self.clock = clock
        self.transport = transport
        self.client = client
        for conversation in conversations { try await client.join(conversation: conversation) }
        let events = await client.events()
        let log = announced
        let listening = Task { for await event in events { log.withLockedValue { $0.append(event) } } }
        let running = Task { await client.run() }
        tasks.withLockedValue { $0 = [listening, running] }
        if !conversations.isEmpty { _ = await until { !self.frames("sync").isEmpty } }
    }

    func stop() {
        for task in tasks.withLockedValue({ $0 }) { task.cancel() }
    }

    // MARK: What the client wrote

    /// The frames of `type` (every frame without one) the client wrote, on `session` (every
    /// session without one), in order.
    func frames(_ type: String? = nil, session: Int? = nil) -> [(id: String?, frame: ClientFrame, at: Date)] {
        transport.written.compactMap { written -> (id: String?, frame: ClientFrame, at: Date)? in
            guard session == nil || written.session == session, let message = try? Self.coder.clientMessage(written.text),
                  type == nil || message.frame.type == type else { return nil }
            return (message.id, message.frame, written.at)
        }
    }

    /// Each `sync` written, its positions as `conversation:after_seq[:epoch]`.
    func syncs(session: Int? = nil) -> [[String]] {
        frames("sync", session: session).map { written -> [String] in
            guard case .sync(let positions) = written.frame else { return [] }
            return positions.map { "\($0.conversationID):\($0.afterSeq)" + ($0.epoch.map { ":\($0)" } ?? "") }
        }
    }

    /// The id of the last `sync` written.
    func lastSync() throws -> String {
        try #require(frames("sync").last?.id)
    }

    /// The seqs of the `delivered` frames written.
    func delivered(session: Int? = nil) -> [Int64] {
        frames("delivered", session: session).compactMap { written in
            if case .delivered(_, let seq) = written.frame { seq } else { nil }
        }
    }

    /// The `send` frames written: frame id and draft.
    func sends(session: Int? = nil) -> [(id: String?, draft: MessageDraft)] {
        frames("send", session: session).compactMap { written in
            if case .send(let draft) = written.frame { (written.id, draft) } else { nil }
        }
    }

    // MARK: What the client announced

    var events: [PresenceClientEvent] { announced.withLockedValue { $0 } }

    var errorCodes: [ErrorCode] {
        events.compactMap { event in if case .error(let code, _) = event { code } else { nil } }
    }

    var gaps: [MessageGap] {
        events.compactMap { event in if case .messageGap(let gap) = event { gap } else { nil } }
    }

    var truncations: [MessageGap] {
        events.compactMap { event in if case .messageTruncated(let range) = event { range } else { nil } }
    }

    /// The seqs of the messages announced as they joined `messages(in:)`.
    var announcedSeqs: [Int64] {
        events.compactMap { event in if case .message(let message) = event { message.seq } else { nil } }
    }

    /// The status changes announced after the first `since` events.
    func statusChanges(since: Int = 0) -> [MessageStatusChange] {
        events.dropFirst(since).compactMap { event in if case .messageStatus(let change) = event { change } else { nil } }
    }

    /// The conversation as `messages(in:)` shows it: `epoch:seq:text:status`, `-` for none.
    func shown(_ conversation: String = "room") async -> [String] {
        await client.messages(in: conversation).map { message in
            "\(message.epoch ?? "-"):\(message.seq.map(String.init) ?? "-"):\(message.text):\(message.status.rawValue)"
        }
    }

    // MARK: Driving it

    func deliver(_ frame: ServerFrame, id: String? = nil) async {
        await transport.deliver(Self.coder.text(frame, id: id))
    }

    /// Waits (in real time, at most 3 s) for `condition`.
    func until(_ condition: () async -> Bool) async -> Bool {
        for _ in 0..<3_000 {
            if await condition() { return true }
            try? await Task.sleep(for: .milliseconds(1))
        }
        return await condition()
    }

    /// Waits until the client has written what it had to (nothing new for 20 ms).
    func settle() async {
        var last = -1
        var quiet = 0
        while quiet < 4 {
            try? await Task.sleep(for: .milliseconds(5))
            let count = transport.written.count
            if count == last {
                quiet += 1
            } else {
                quiet = 0
                last = count
            }
        }
    }

    /// Moves the test clock and lets the client do what came due: its timer loop sleeps on the
    /// clock again (when it has a deadline), and nothing new is written for a moment.
    func advance(by seconds: TimeInterval) async {
        clock.advance(by: seconds)
        for _ in 0..<100 where clock.sleeperCount == 0 { try? await Task.sleep(for: .milliseconds(1)) }
        await settle()
    }

    /// Drops the open session; returns when the client will reconnect.
    func drop() async throws -> Date {
        transport.drop(nil)
        var retryAt: Date?
        _ = await until {
            if case .waiting(let at) = await client.connectionState { retryAt = at }
            return retryAt != nil
        }
        return try #require(retryAt, "the client waits to reconnect")
    }

    /// Waits out the reconnect's backoff on the clock until the next session has written its
    /// opening `sync`.
    func reopen(at retryAt: Date) async {
        let sessions = transport.sessions
        clock.advance(by: retryAt.timeIntervalSince(clock.now) + 0.001)
        #expect(await until { self.transport.sessions == sessions + 1 && !self.frames("sync", session: sessions + 1).isEmpty })
        await settle()
    }

    /// Drops the open session and opens the next once the backoff is over.
    func reconnect() async throws {
        await reopen(at: try await drop())
    }
}

@Suite("The client's sync on a test clock: retries, pacing, gaps and epochs")
struct ClientSyncTests {
    @Test("a refused or failed sync goes again after 1 s ±20 %, doubling per conversation: a position (conversation_id), or every unanswered one of a whole frame; forbidden is an error and not synced again; a synced resets the wait")
    func syncRetries() async throws {
        let h = try await ChatHarness(joining: ["a", "b", "c", "d"])
        defer { h.stop() }
        #expect(h.syncs() == [["a:0", "b:0", "c:0", "d:0"]])
        let first = try h.lastSync()
        await h.deliver(Wire.synced("a", lastSeq: 0), id: first)
        await h.deliver(Wire.error(.unavailable, conversation: "b"), id: first)
        await h.deliver(Wire.error(.forbidden, conversation: "c"), id: first)
        await h.deliver(Wire.error(.internal, conversation: "d"), id: first)
        await h.settle()
        #expect(h.errorCodes == [.forbidden], "only the refusal for good is an error event")
        // The first wait is 1 s, moved by up to ±20 %.
        await h.advance(by: 0.79)
        #expect(h.syncs().count == 1, "not before 0.8 s")
        await h.advance(by: 0.42)
        #expect(await h.until { h.syncs().count == 2 })
        #expect(h.syncs().last == ["b:0", "d:0"], "both again, in one frame; c never")

        // The whole frame refused (no conversation_id): every position of it goes again; each
        // conversation's wait has doubled to 2 s (±20 %).
        await h.deliver(Wire.error(.rateLimited), id: try h.lastSync())
        await h.advance(by: 1.59)
        #expect(h.syncs().count == 2, "not before 1.6 s")
        await h.advance(by: 0.82)
        #expect(await h.until { h.syncs().count == 3 })
        #expect(h.syncs().last == ["b:0", "d:0"])

        // b fails a third time (4 s ±20 %); d is answered.
        let third = try h.lastSync()
        await h.deliver(Wire.error(.unavailable, conversation: "b"), id: third)
        await h.deliver(Wire.synced("d", lastSeq: 0), id: third)
        await h.advance(by: 3.19)
        #expect(h.syncs().count == 3, "not before 3.2 s")
        await h.advance(by: 1.62)
        #expect(await h.until { h.syncs().count == 4 })
        #expect(h.syncs().last == ["b:0"])
        await h.deliver(Wire.synced("b", lastSeq: 0), id: try h.lastSync())
        await h.advance(by: 120)
        #expect(h.syncs().count == 4, "answered: nothing more")

        // d's synced reset its wait: a new failure of d waits 1 s again, not 4 or 8.
        await h.deliver(Wire.message(3, from: "bob", "past a gap", in: "d"))
        #expect(await h.until { h.syncs().count == 5 })
        #expect(h.syncs().last == ["d:0:e1"])
        await h.deliver(Wire.error(.unavailable, conversation: "d"), id: try h.lastSync())
        await h.advance(by: 1.21)
        #expect(await h.until { h.syncs().count == 6 })
        #expect(h.errorCodes == [.forbidden])
    }

    @Test("a sync's retries end with its session; the next session syncs once at its opening, and its own refusal waits 1 s again")
    func syncRetriesEndWithSession() async throws {
        let h = try await ChatHarness(joining: ["room"])
        defer { h.stop() }
        await h.deliver(Wire.error(.unavailable, conversation: "room"), id: try h.lastSync())
        await h.advance(by: 1.21)
        #expect(await h.until { h.syncs().count == 2 }, "sent again after about 1 s")
        // Failed again: the next try would be in about 2 s, but the session ends first.
        await h.deliver(Wire.error(.unavailable, conversation: "room"), id: try h.lastSync())
        try await h.reconnect()
        await h.advance(by: 60)
        #expect(h.syncs(session: 1).count == 2, "nothing more on the session that ended")
        #expect(h.syncs(session: 2) == [["room:0"]], "one sync on the next, at its opening")
        await h.deliver(Wire.error(.internal, conversation: "room"), id: try h.lastSync())
        await h.advance(by: 1.21)
        #expect(await h.until { h.syncs(session: 2).count == 2 }, "the backoff started again with the session")
    }

    @Test("300 joined conversations: the opening's 3 syncs go at once, before anything else; subscribes are paced (8, then 4 a second); no second holds more than the budgets, and the gateway's own buckets refuse nothing")
    func pacedOpening() async throws {
        let conversations = (0..<300).map { number -> String in
            let digits = String(number)
            return "c" + String(repeating: "0", count: 3 - digits.count) + digits
        }
        let h = try await ChatHarness(joining: conversations)
        defer { h.stop() }
        let start = h.clock.now
        await h.settle()
        let syncs = h.frames("sync")
        #expect(syncs.count == 3)
        #expect(h.syncs().flatMap { $0 }.map { String($0.split(separator: ":")[0]) } == conversations)
        #expect(h.frames().prefix(3).map { $0.frame.type } == ["sync", "sync", "sync"], "the syncs first")
        #expect(syncs.allSatisfy { $0.at == start }, "at once")
        #expect(h.frames("subscribe").count == 8, "the subscribe burst, and no more")
        // Each conversation has two seqs to say delivered (named missing): 300 frames more.
        for sync in syncs {
            guard case .sync(let positions) = sync.frame else { continue }
            for position in positions {
                await h.deliver(Wire.synced(position.conversationID, lastSeq: 2, missing: [Wire.range("e1", 1, 2)]), id: sync.id)
            }
        }
        // The gateway answers each subscribe as it arrives; the clock moves a second at a time.
        var answered = 0
        for _ in 0..<90 {
            let subscribes = h.frames("subscribe")
            for frame in subscribes[answered...] { await h.deliver(.initialState([]), id: frame.id) }
            answered = subscribes.count
            await h.advance(by: 1)
        }
        #expect(h.frames("subscribe").count == 300, "every conversation followed")
        #expect(h.delivered().count == 300)
        #expect(await h.client.connectionState == .connected)
        #expect(h.errorCodes.isEmpty)
        let written = h.frames()
        // Frames per one-second window: at most the burst and a second's worth.
        for frame in written {
            let window = written.filter { $0.at >= frame.at && $0.at < frame.at.addingTimeInterval(1) }
            let offset = frame.at.timeIntervalSince(start)
            #expect(window.filter { $0.frame.type == "subscribe" }.count <= 10 + 5, "subscribes in the second from \(offset) s")
            #expect(window.filter { $0.frame.type == "sync" }.count <= 10 + 5, "syncs in the second from \(offset) s")
            #expect(window.count <= 100 + 50, "frames in the second from \(offset) s")
        }
        // And as the gateway counts them (FrameHandler's buckets): none would be refused.
        var frameBudget = GatewayBucket(rate: 50, burst: 100)
        var subscribeBudget = GatewayBucket(rate: 5, burst: 10)
        var syncBudget = GatewayBucket(rate: 5, burst: 10)
        for (index, frame) in written.enumerated() {
            let offset = frame.at.timeIntervalSince(start)
            let withinFrames = frameBudget.take(at: frame.at)
            #expect(withinFrames, "frame \(index) (\(frame.frame.type)) at \(offset) s is over the frame rate")
            if frame.frame.type == "subscribe" {
                let within = subscribeBudget.take(at: frame.at)
                #expect(within, "subscribe \(index) at \(offset) s is over its budget")
            }
            if frame.frame.type == "sync" {
                let within = syncBudget.take(at: frame.at)
                #expect(within, "sync \(index) at \(offset) s is over its budget")
            }
        }
    }

    @Test("leaving a conversation whose subscribe still waits for the budget drops it: never written, no unsubscribe, not waited for")
    func leaveQueuedSubscribe() async throws {
        let conversations = (10..<22).map { "c\($0)" }
        let h = try await ChatHarness(joining: conversations)
        defer { h.stop() }
        await h.settle()
        let subscribed = { h.frames("subscribe").compactMap { written -> String? in
            if case .subscribe(.conversation(let conversation)) = written.frame { conversation } else { nil }
        } }
        #expect(subscribed() == Array(conversations.prefix(8)), "the burst of 8")
        try await h.client.leave(conversation: "c21")
        await h.advance(by: 5)
        #expect(subscribed() == Array(conversations.prefix(11)))
        #expect(h.frames("unsubscribe").isEmpty)
        for frame in h.frames("subscribe") { await h.deliver(.initialState([]), id: frame.id) }
        #expect(await h.until { await h.client.connectionState == .connected }, "the dropped subscribe is not waited for")
    }

    @Test("a live message past a gap is kept in seq order but the last seq stays before it: synced from the last seq, delivered only up to what is held or named missing")
    func gapKeepsLastSeq() async throws {
        let h = try await ChatHarness(joining: ["room"])
        defer { h.stop() }
        await h.deliver(Wire.message(1, from: "bob", "b1"))
        await h.deliver(Wire.message(2, from: "bob", "b2"))
        await h.deliver(Wire.synced(lastSeq: 2), id: try h.lastSync())
        #expect(await h.until { h.delivered() == [2] })
        // 3 and 4 never came (a node that missed them); 5 does.
        await h.deliver(Wire.message(5, from: "bob", "b5"))
        #expect(await h.until { h.syncs().count == 2 })
        #expect(h.syncs().last == ["room:2:e1"], "synced from the last seq")
        #expect(h.delivered() == [2], "not past the gap")
        #expect(await h.client.messages(in: "room").compactMap(\.seq) == [1, 2, 5], "kept, in order")
        // While that sync is under way, a live message starts no other.
        await h.deliver(Wire.message(6, from: "bob", "b6"))
        await h.settle()
        #expect(h.syncs().count == 2)
        // The session was sent 5 and 6 already: the gateway names 3-4, to read over REST.
        await h.deliver(Wire.synced(lastSeq: 6, missing: [Wire.range("e1", 3, 4)]), id: try h.lastSync())
        #expect(await h.until { h.delivered() == [2, 6] }, "past the range named missing, and no further")
        #expect(h.gaps == [MessageGap(conversationID: "room", epoch: "e1", fromSeq: 3, toSeq: 4)])
        await h.deliver(Wire.message(7, from: "bob", "b7"))
        #expect(await h.until { h.delivered() == [2, 6, 7] })
        #expect(h.syncs().count == 2, "no gap: no sync")
        #expect(h.announcedSeqs == [1, 2, 5, 6, 7])
    }

    @Test("delivered after a synced with missing: the highest seq up to which every seq is held or named, never past one that did not arrive; the next session syncs from there")
    func deliveredNeverPastAHole() async throws {
        let h = try await ChatHarness(joining: ["room"])
        defer { h.stop() }
        for seq: Int64 in [1, 2, 6, 7] { await h.deliver(Wire.message(seq, from: "bob", "b\(seq)")) }
        // 8 comes in a frame that does not read: dropped.
        await h.transport.deliver(#"{"type":"message","data":{"conversation_id":"room","epoch":"e1","seq":8,"sender_id":"bob"}}"#)
        await h.deliver(Wire.synced(lastSeq: 8, missing: [Wire.range("e1", 3, 5)]), id: try h.lastSync())
        #expect(await h.until { h.delivered() == [7] }, "past the named range 3-5, not past 8")
        #expect(h.gaps == [MessageGap(conversationID: "room", epoch: "e1", fromSeq: 3, toSeq: 5)])
        // This session counts 8 as given and will not send it again: a live 9 asks for nothing more.
        await h.deliver(Wire.message(9, from: "bob", "b9"))
        await h.settle()
        #expect(h.syncs().count == 1)
        #expect(h.delivered() == [7])
        #expect(await h.client.messages(in: "room").compactMap(\.seq) == [1, 2, 6, 7, 9])
        // The next session syncs from 7 and gets it.
        try await h.reconnect()
        #expect(h.syncs(session: 2) == [["room:7:e1"]])
        await h.deliver(Wire.message(8, from: "bob", "b8"))
        await h.deliver(Wire.message(9, from: "bob", "b9"))
        await h.deliver(Wire.synced(lastSeq: 9), id: try h.lastSync())
        #expect(await h.until { h.delivered(session: 2) == [9] })
        #expect(await h.client.messages(in: "room").compactMap(\.seq) == [1, 2, 6, 7, 8, 9])
    }

    @Test("a live message of another epoch syncs from the old position (epoch and last seq), not from zero; a fork that lost nothing keeps every message")
    func otherEpochSyncsFromOldPosition() async throws {
        let h = try await ChatHarness(joining: ["room"])
        defer { h.stop() }
        for seq: Int64 in [1, 2, 3] { await h.deliver(Wire.message(seq, from: "bob", "b\(seq)")) }
        await h.deliver(Wire.synced(lastSeq: 3), id: try h.lastSync())
        #expect(await h.until { h.delivered() == [3] })
        // Redis restarted without losing anything: the next message is in a new epoch.
        await h.deliver(Wire.message(4, from: "bob", "b4", epoch: "e2"))
        #expect(await h.until { h.syncs().count == 2 })
        #expect(h.syncs().last == ["room:3:e1"])
        #expect(h.delivered() == [3], "nothing said of the new epoch before the answer")
        // The answer: e2 forked from e1 at or past 3, so everything here carried over.
        await h.deliver(Wire.synced(lastSeq: 4, epoch: "e2"), id: try h.lastSync())
        #expect(await h.until { h.delivered() == [3, 4] })
        #expect(await h.client.messages(in: "room").map { "\($0.epoch ?? "-"):\($0.seq ?? 0)" } == ["e2:1", "e2:2", "e2:3", "e2:4"])
        #expect(h.truncations.isEmpty)
    }

    @Test("the epoch is the frame's (message and message_ack), never read from the id")
    func epochFromTheFrame() async throws {
        let h = try await ChatHarness(joining: ["room"])
        defer { h.stop() }
        await h.deliver(Wire.message(1, from: "bob", "b1", epoch: "blue", id: "4b1d-77"))
        await h.deliver(Wire.synced(lastSeq: 1, epoch: "blue"), id: try h.lastSync())
        let local = try await h.client.send("mine", to: "room")
        try #require(await h.until { h.sends().count == 1 })
        await h.deliver(Wire.ack(local.clientMessageID, seq: 2, epoch: "blue", id: "9f3e"), id: h.sends()[0].id)
        #expect(await h.until { await h.client.messages(in: "room").last?.seq == 2 })
        let shown = await h.client.messages(in: "room").map { "\($0.epoch ?? "-"):\($0.seq ?? 0):\($0.id ?? "-")" }
        #expect(shown == ["blue:1:4b1d-77", "blue:2:9f3e"])
        #expect(await h.client.messages(in: "room").last?.clientMessageID == local.clientMessageID)
    }

    @Test("a message_ack with no live copy of the message takes it out of the outbox: it is sent, and not sent again on the next session")
    func ackWithoutLiveCopy() async throws {
        let h = try await ChatHarness(joining: ["room"])
        defer { h.stop() }
        await h.deliver(Wire.synced(lastSeq: 0, epoch: "e1"), id: try h.lastSync())
        let local = try await h.client.send("only acked", to: "room")
        try #require(await h.until { h.sends().count == 1 })
        let sent = try #require(h.sends().first)
        await h.deliver(Wire.ack(local.clientMessageID, seq: 1, epoch: "e1"), id: sent.id)
        #expect(await h.until { await h.client.messages(in: "room").first?.status == .sent })
        try await h.reconnect()
        await h.settle()
        #expect(h.sends(session: h.transport.sessions).isEmpty, "acknowledged, so not in the outbox any more")
        #expect(h.sends().count == 1)
    }

    @Test("a fork with truncated: others' lost messages leave messages(in:) (messageTruncated); own ones go back in the outbox ahead of its unsent ones and are sent again with the same client_message_id")
    func forkTruncated() async throws {
        let h = try await ChatHarness(joining: ["room"])
        defer { h.stop() }
        for seq: Int64 in 1...8 { await h.deliver(Wire.message(seq, from: "bob", "b\(seq)")) }
        await h.deliver(Wire.synced(lastSeq: 8, receipts: [Wire.cursors("bob", 8, 8), Wire.cursors("me", 8, 8)]), id: try h.lastSync())
        let mine = try await h.client.send("mine", to: "room")
        try #require(await h.until { h.sends().count == 1 })
        await h.deliver(Wire.ack(mine.clientMessageID, seq: 9), id: h.sends()[0].id)
        await h.deliver(Wire.message(9, from: "me", "mine", id: "me-e1-9", clientMessageID: mine.clientMessageID))
        await h.deliver(Wire.message(10, from: "bob", "b10"))
        await h.deliver(Wire.receipt("bob", delivered: 10, read: 9))
        #expect(await h.until { await h.client.messages(in: "room").first { $0.text == "mine" }?.status == .read })
        // Two messages written while the connection is down.
        let retryAt = try await h.drop()
        try await h.client.send("later 1", to: "room")
        try await h.client.send("later 2", to: "room")
        await h.reopen(at: retryAt)
        let session = h.transport.sessions
        #expect(session == 2)
        #expect(h.syncs(session: session) == [["room:10:e1"]])
        #expect(h.sends(session: session).map { $0.draft.text } == ["later 1"], "the outbox went at the opening, one message at a time")
        // Redis came back from a snapshot that had up to 8: e2 forked from e1 at 8, and carol's
        // new message took seq 9.
        await h.settle()
        let mark = h.events.count
        await h.deliver(Wire.message(9, from: "carol", "c9", epoch: "e2"))
        await h.deliver(Wire.synced(lastSeq: 9, epoch: "e2", truncated: [Wire.range("e1", 9, 10)],
                                    receipts: [Wire.cursors("bob", 8, 8), Wire.cursors("carol", 9, 9), Wire.cursors("me", 8, 8)]),
                        id: try h.lastSync())
        #expect(await h.until { h.delivered(session: session) == [9] }, "the fork point, and the new epoch's 9; never the old 10")
        #expect(await h.shown() == (1...8).map { "e2:\($0):b\($0):delivered" } + [
            "e2:9:c9:delivered", "-:-:mine:sending", "-:-:later 1:sending", "-:-:later 2:sending",
        ], "kept up to the fork point (now e2's), b10 gone, mine back in the outbox ahead of what was written after it")
        #expect(h.truncations == [MessageGap(conversationID: "room", epoch: "e1", fromSeq: 9, toSeq: 10)])
        #expect(h.statusChanges(since: mark).map(\.status) == [.sending])
        #expect(h.statusChanges(since: mark).map(\.clientMessageID) == [mine.clientMessageID])
        // "later 1" was under way: answered first; then mine, once, with its client_message_id;
        // then "later 2".
        let later = try #require(h.sends(session: session).first)
        await h.deliver(Wire.ack(later.draft.clientMessageID, seq: 10, epoch: "e2"), id: later.id)
        #expect(await h.until { h.sends(session: session).count == 2 })
        let again = h.sends(session: session)[1]
        #expect(again.draft.text == "mine" && again.draft.clientMessageID == mine.clientMessageID)
        await h.deliver(Wire.ack(mine.clientMessageID, seq: 11, epoch: "e2"), id: again.id)
        #expect(await h.until { h.sends(session: session).count == 3 })
        let last = h.sends(session: session)[2]
        #expect(last.draft.text == "later 2")
        await h.deliver(Wire.ack(last.draft.clientMessageID, seq: 12, epoch: "e2"), id: last.id)
        #expect(await h.until { await h.shown().count == 12 && h.sends(session: session).count == 3 })
        #expect(Array(await h.shown().suffix(3)) == ["e2:10:later 1:sent", "e2:11:mine:sent", "e2:12:later 2:sent"])
    }

    /// Fails before the change: a new epoch kept the old epoch's cursors, so the new history's
    /// messages showed `read` at once and no `delivered` went until its seqs passed the old one.
    @Test("a new epoch that is no fork (the history lost), heard live: last seq, delivered, read and receipts start again from 0; new messages are not read at once; old ones stay as they were")
    func newEpochResetsCursors() async throws {
        let h = try await ChatHarness(joining: ["room"])
        defer { h.stop() }
        for seq: Int64 in [1, 2, 3] { await h.deliver(Wire.message(seq, from: "bob", "b\(seq)")) }
        await h.deliver(Wire.synced(lastSeq: 3, receipts: [Wire.cursors("bob", 3, 3)]), id: try h.lastSync())
        let old = try await h.client.send("old", to: "room")
        try #require(await h.until { h.sends().count == 1 })
        await h.deliver(Wire.ack(old.clientMessageID, seq: 4), id: h.sends()[0].id)
        await h.deliver(Wire.message(4, from: "me", "old", id: "me-e1-4", clientMessageID: old.clientMessageID))
        await h.deliver(Wire.receipt("bob", delivered: 4, read: 4))
        #expect(await h.until { h.delivered() == [3, 4] })
        // Redis lost the history; bob starts a new one.
        await h.deliver(Wire.message(1, from: "bob", "new b1", epoch: "e2"))
        #expect(await h.until { h.syncs().count == 2 })
        #expect(h.syncs().last == ["room:4:e1"], "from where this device is")
        await h.deliver(Wire.synced(lastSeq: 1, epoch: "e2", missing: [Wire.range("e1", 5, nil)],
                                    receipts: [Wire.cursors("bob", 1, 0), Wire.cursors("me", 0, 0)]), id: try h.lastSync())
        #expect(await h.until { h.delivered() == [3, 4, 1] }, "the new history's cursor from 0")
        #expect(h.gaps == [MessageGap(conversationID: "room", epoch: "e1", fromSeq: 5, toSeq: nil)])
        #expect(await h.client.receipts(in: "room") == [MemberReceipt(userID: "bob", deliveredSeq: 1, readSeq: 0),
                                                       MemberReceipt(userID: "me", deliveredSeq: 0, readSeq: 0)])
        let new = try await h.client.send("new", to: "room")
        try #require(await h.until { h.sends().count == 2 })
        await h.deliver(Wire.ack(new.clientMessageID, seq: 2, epoch: "e2"), id: h.sends()[1].id)
        await h.deliver(Wire.message(2, from: "me", "new", epoch: "e2", clientMessageID: new.clientMessageID))
        await h.deliver(Wire.message(3, from: "bob", "new b3", epoch: "e2"))
        #expect(await h.until { h.delivered() == [3, 4, 1, 2, 3] }, "delivered goes on in the new history")
        #expect(await h.shown() == [
            "e1:1:b1:delivered", "e1:2:b2:delivered", "e1:3:b3:delivered", "e1:4:old:read",
            "e2:1:new b1:delivered", "e2:2:new:sent", "e2:3:new b3:delivered",
        ], "bob read 4 of the old history, not 2 of the new")
        await h.deliver(Wire.receipt("bob", delivered: 2, read: 0))
        #expect(await h.until { await h.client.messages(in: "room").first { $0.clientMessageID == new.clientMessageID }?.status == .delivered })
    }

    /// The issue as it was seen: Redis lost its data while the device was away.
    @Test("a new epoch met on reconnect (Redis lost its data): the old epoch's cursors are dropped, a new message is sent (not read) until the server's cursors say otherwise, and delivered is said")
    func newEpochAfterReconnect() async throws {
        let h = try await ChatHarness(joining: ["room"])
        defer { h.stop() }
        for seq: Int64 in [1, 2, 3] { await h.deliver(Wire.message(seq, from: "bob", "b\(seq)")) }
        await h.deliver(Wire.synced(lastSeq: 3, receipts: [Wire.cursors("bob", 3, 3), Wire.cursors("me", 3, 3)]), id: try h.lastSync())
        let old = try await h.client.send("old", to: "room")
        try #require(await h.until { h.sends().count == 1 })
        await h.deliver(Wire.ack(old.clientMessageID, seq: 4), id: h.sends()[0].id)
        await h.deliver(Wire.message(4, from: "me", "old", id: "me-e1-4", clientMessageID: old.clientMessageID))
        await h.deliver(Wire.receipt("bob", delivered: 4, read: 4))
        #expect(await h.until { await h.client.messages(in: "room").last?.status == .read })
        try await h.reconnect()
        #expect(h.syncs(session: 2) == [["room:4:e1"]])
        #expect(h.delivered(session: 2).isEmpty, "nothing said before the answer says which epoch")
        await h.deliver(Wire.message(1, from: "bob", "new b1", epoch: "e2"))
        await h.deliver(Wire.synced(lastSeq: 1, epoch: "e2", missing: [Wire.range("e1", 5, nil)],
                                    receipts: [Wire.cursors("bob", 1, 0), Wire.cursors("me", 1, 1)]), id: try h.lastSync())
        #expect(await h.until { h.delivered(session: 2) == [1] })
        let new = try await h.client.send("new", to: "room")
        #expect(await h.until { h.sends(session: 2).count == 1 })
        await h.deliver(Wire.ack(new.clientMessageID, seq: 2, epoch: "e2"), id: h.sends(session: 2)[0].id)
        await h.deliver(Wire.message(2, from: "me", "new", epoch: "e2", clientMessageID: new.clientMessageID))
        #expect(await h.until { h.delivered(session: 2) == [1, 2] })
        #expect(await h.client.messages(in: "room").first { $0.clientMessageID == new.clientMessageID }?.status == .sent, "as the server says: sent")
        #expect(await h.client.messages(in: "room").first { $0.clientMessageID == old.clientMessageID }?.status == .read)
    }
}

/// A budget as the gateway keeps one (FrameHandler): full at first, `rate` tokens a second,
/// counted in milliseconds as frames arrive.
struct GatewayBucket {
    let rate: Double
    let burst: Double
    private var tokens: Double
    private var updated: Int64?

    init(rate: Double, burst: Double) {
        self.rate = rate
        self.burst = burst
        tokens = burst
    }

    mutating func take(at moment: Date) -> Bool {
        let now = Int64((moment.timeIntervalSince1970 * 1000).rounded())
        if let updated { tokens = min(burst, tokens + Double(now - updated) * rate / 1000) }
        updated = now
        guard tokens >= 1 - 1e-9 else { return false }
        tokens -= 1
        return true
    }
}

@Suite("Pacing apart from the network")
struct FramePacerTests {
    let start = Date(timeIntervalSince1970: 1_800_000_000)

    func frame(_ id: String, _ frame: ClientFrame) -> FramePacer.Frame {
        let (lane, spendsLane) = FramePacer.lane(of: frame)
        return FramePacer.Frame(id: id, text: id, lane: lane, spendsLane: spendsLane, request: .other)
    }

    @Test("lanes: subscribes past their burst (8) wait 250 ms each; a sync and other frames do not wait behind them; an unsubscribe keeps its place behind them")
    func lanes() {
        #expect(FramePacer.subscribeRate == 4 && FramePacer.subscribeBurst == 8, "a fifth under the gateway's 5 a second, burst 10")
        var pacer = FramePacer(now: start)
        for index in 0..<10 { pacer.enqueue(frame("s\(index)", .subscribe(.conversation("c\(index)")))) }
        pacer.enqueue(frame("u", .unsubscribe(.conversation("c0"))))
        pacer.enqueue(frame("y", .sync([SyncPosition(conversationID: "c0", afterSeq: 0)])))
        pacer.enqueue(frame("d", .delivered(conversationID: "c0", seq: 1)))
        let first = pacer.due(at: start).map(\.id)
        #expect(first == (0..<8).map { "s\($0)" } + ["y", "d"])
        #expect(pacer.waiting.map(\.id) == ["s8", "s9", "u"])
        let next = pacer.nextDeadline(after: start)
        #expect(next.map { abs($0.timeIntervalSince(start) - 0.25) < 1e-6 } == true, "\(String(describing: next))")
        let early = pacer.due(at: start.addingTimeInterval(0.249)).map(\.id)
        #expect(early.isEmpty)
        let second = pacer.due(at: start.addingTimeInterval(0.25)).map(\.id)
        #expect(second == ["s8"])
        let third = pacer.due(at: start.addingTimeInterval(0.5)).map(\.id)
        #expect(third == ["s9", "u"], "the unsubscribe right behind the subscribe before it")
        #expect(pacer.nextDeadline(after: start.addingTimeInterval(0.5)) == nil)
    }

    @Test("every frame: 80 at once, then one each 25 ms; syncs: 8 at once, then 4 a second")
    func budgets() {
        var pacer = FramePacer(now: start)
        for index in 0..<81 { pacer.enqueue(frame("d\(index)", .delivered(conversationID: "c", seq: Int64(index + 1)))) }
        let burst = pacer.due(at: start).count
        #expect(burst == 80)
        let next = pacer.nextDeadline(after: start)
        #expect(next.map { abs($0.timeIntervalSince(start) - 0.025) < 1e-6 } == true, "\(String(describing: next))")
        let last = pacer.due(at: start.addingTimeInterval(0.025)).map(\.id)
        #expect(last == ["d80"])

        var syncs = FramePacer(now: start)
        for index in 0..<10 { syncs.enqueue(frame("y\(index)", .sync([]))) }
        var written: [[String]] = []
        for offset in [0, 0.25, 0.499, 0.5] { written.append(syncs.due(at: start.addingTimeInterval(offset)).map(\.id)) }
        #expect(written.map(\.count) == [8, 1, 0, 1])
        #expect(written[1] == ["y8"] && written[3] == ["y9"])
    }
}

@Suite("Why a session ended, for the terminal client and apps")
struct SessionEndTests {
    @Test("each end says why in words: a refused token, a refused connection, a node starting, nothing reached, a drop, this device")
    func reasons() {
        let refused = SessionEnd(closeCode: 4001, opened: false, next: .reconnectNow(newToken: true))
        #expect(refused.tokenRefused)
        #expect(refused.reason == "the gateway refused the token (4001)")
        #expect(refused.outcome == "reconnecting now with a new token")
        let starting = SessionEnd(closeCode: 1013, opened: false, next: .reconnectAfterBackoff(newToken: false))
        #expect(!starting.tokenRefused)
        #expect(starting.reason == "the node is starting or full (1013)")
        #expect(starting.outcome == "reconnecting after the backoff")
        let upgrade = SessionEnd(closeCode: nil, upgradeRefused: true, opened: false, next: .reconnectAfterBackoff(newToken: true))
        #expect(upgrade.reason.hasPrefix("the gateway refused the connection"))
        #expect(!upgrade.tokenRefused, "an HTTP refusal's status is not known: a node shutting down answers 400")
        let unreachable = SessionEnd(closeCode: nil, unreachable: true, opened: false, next: .reconnectNow(newToken: false))
        #expect(unreachable.reason.hasPrefix("no gateway answered"))
        #expect(SessionEnd(closeCode: nil, opened: true, next: .reconnectAfterBackoff(newToken: false)).reason == "the connection dropped")
        #expect(SessionEnd(closeCode: 4003, opened: true, next: .stop(.disconnectedByAdmin)).outcome == "not reconnecting")
        #expect(SessionEnd(closeCode: 4321, opened: true, next: .reconnectAfterBackoff(newToken: false)).reason == "the gateway closed the session (4321)")
        let mine = SessionEnd(closeCode: 1000, opened: true, next: nil)
        #expect(mine.reason == "ended by this device" && mine.outcome.isEmpty)
    }

    @Test("token refusals count in a row: the second in a row is the limit; any other end starts again")
    func tokenRefusalsInARow() {
        let refused = SessionEnd(closeCode: 4001, opened: false, next: .reconnectNow(newToken: true))
        let starting = SessionEnd(closeCode: 1013, opened: false, next: .reconnectAfterBackoff(newToken: false))
        var count = TokenRefusals()
        let stops = [refused, starting, refused, refused].map { count.record($0) }
        #expect(stops == [false, false, false, true], "only twice in a row")
        #expect(count.inARow == 2)
    }

    @Test("the client announces each session's end with its close code and what comes next, before the state that follows")
    func announced() async throws {
        let clock = ManualClock()
        let transport = ScriptedTransport([.open, .open])
        let configuration = try PresenceClientConfiguration(gatewayURL: URL(string: "ws://gateway.test")!, deviceID: "phone")
        let client = PresenceClient(configuration: configuration, tokenProvider: { _ in "token" }, clock: clock, transport: transport,
                                    outboxStore: MemoryMessageOutboxStore(), logger: Logger(label: "test"))
        let events = await client.events()
        let heard = NIOLockedValueBox<[PresenceClientEvent]>([])
        let listening = Task { for await event in events { heard.withLockedValue { $0.append(event) } } }
        let run = Task { await client.run() }
        defer {
            run.cancel()
            listening.cancel()
        }
        for _ in 0..<3_000 {
            if await client.connectionState == .connected { break }
            try await Task.sleep(for: .milliseconds(1))
        }
        #expect(await client.connectionState == .connected)
        transport.drop(4001)
        for _ in 0..<3_000 where transport.urls.count < 2 { try await Task.sleep(for: .milliseconds(1)) }
        try await Task.sleep(for: .milliseconds(30))
        let ends = heard.withLockedValue { events in
            events.compactMap { event in if case .sessionEnded(let end) = event { end } else { nil } }
        }
        #expect(ends == [SessionEnd(closeCode: 4001, opened: true, next: .reconnectNow(newToken: true))])
        #expect(ends.first?.tokenRefused == true)
    }
}
