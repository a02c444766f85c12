import Foundation
import NIOConcurrencyHelpers
import PresenceClient
import PresenceProtocol
import RedisTestSupport

/// A device that speaks the message frames over the SDK's WebSocket transport, as an app with an
/// outbox would: on each session it first sends `sync` from the last seq (and epoch) it holds of
/// each conversation, follows `more`, then resends every message not yet acknowledged with the
/// same `client_message_id`. It records every message in the order received, across sessions.
///
/// Across a Redis rollback it does what docs/sdks.md says the SDKs do: a live message of another
/// epoch syncs the conversation from the old position (epoch and last seq), and what `synced`
/// names in `truncated` leaves the history it holds; its own messages among those go back in the
/// outbox and are sent again with the same `client_message_id`.
public final class MessageDevice: Sendable {
    public let user: String
    public let device: String
    public let conversations: [String]
    let transport = WebSocketTransport(logger: TestRedis.logger("messages"))
    private let state = NIOLockedValueBox(State())

    struct State {
        /// Conversation → every message received, in the order received (truncated ones too).
        var received: [String: [MessagePayload]] = [:]
        /// Conversation → the history as this device holds it: what it received, in order, less
        /// what a `synced` named truncated (messages Redis lost in a rollback).
        var held: [String: [MessagePayload]] = [:]
        /// Conversation → the epoch of the history as this device last heard it.
        var epochs: [String: String] = [:]
        /// Ids of messages a `synced` named truncated to this device.
        var truncated: Set<String> = []
        /// Sent and not acknowledged, in the order written: (conversation, client id, text).
        var outbox: [(conversation: String, clientID: String, text: String)] = []
        /// Client id → the acknowledgement's conversation, seq and id, the last one given.
        var acknowledged: [String: (conversation: String, seq: Int64, duplicate: Bool, id: String)] = [:]
        /// Client id → its text, for sending one again that a rollback lost.
        var written: [String: (conversation: String, text: String)] = [:]
        var session: (task: Task<Void, Never>, outgoing: AsyncStream<OutgoingFrame>.Continuation, number: Int)?
        var sessions = 0
        /// The port of the node the last session was opened on.
        var port: Int?
        var synced: [SyncedPayload] = []
        var errors: [String] = []
        var repeats: [String] = []
        /// The last frames sent and received, one line each, for a report.
        var trace: [String] = []

        mutating func note(_ line: String) {
            trace.append(line)
            if trace.count > 400 { trace.removeFirst(trace.count - 300) }
        }
    }

    public init(user: String, device: String, conversations: [String]) {
        self.user = user
        self.device = device
        self.conversations = conversations
    }

    public var isConnected: Bool { state.withLockedValue { $0.session != nil } }
    /// The number of the open session and the port of its node, for a report.
    public var whereabouts: String { state.withLockedValue { "session \($0.sessions) on port \($0.port.map(String.init) ?? "-"), \($0.session == nil ? "closed" : "open")" } }
    /// The conversation's history as this device holds it (without what was named truncated).
    public func received(_ conversation: String) -> [MessagePayload] { state.withLockedValue { $0.held[conversation] ?? [] } }
    /// Every message received in the conversation, truncated ones too, in the order received.
    public func everyReceived(_ conversation: String) -> [MessagePayload] { state.withLockedValue { $0.received[conversation] ?? [] } }
    /// Ids of the messages a `synced` named truncated to this device.
    public var truncatedIDs: Set<String> { state.withLockedValue { $0.truncated } }
    public var acknowledged: [String: (conversation: String, seq: Int64, duplicate: Bool, id: String)] { state.withLockedValue { $0.acknowledged } }
    public var unacknowledged: Int { state.withLockedValue { $0.outbox.count } }
    public var syncedAnswers: [SyncedPayload] { state.withLockedValue { $0.synced } }
    public var errors: [String] { state.withLockedValue { $0.errors } }
    /// Messages received twice, or out of order, in one epoch: what must never happen.
    public var repeats: [String] { state.withLockedValue { $0.repeats } }
    /// The last frames of `conversation` sent and received (and every session opened), oldest
    /// first: for a report when the device's history is wrong.
    public func trace(_ conversation: String) -> [String] {
        state.withLockedValue { $0.trace.filter { $0.contains(" \(conversation) ") || $0.hasPrefix("session") } }
    }

    /// Opens a session on `port` (ending any open one without a close, as a dropped network does).
    public func connect(port: Int) async throws {
        drop()
        let token = try await mint(user)
        let url = URL(string: "ws://127.0.0.1:\(port)/api/presence/subscribe?token=\(token)&device_id=\(device)")!
        let (outgoing, continuation) = AsyncStream.makeStream(of: OutgoingFrame.self)
        let number = state.withLockedValue { state -> Int in
            state.sessions += 1
            state.port = port
            state.note("session \(state.sessions) on \(port)")
            return state.sessions
        }
        let task = Task {
            _ = try? await self.transport.session(url: url, outgoing: outgoing) { text in self.handle(text, session: number) }
            self.state.withLockedValue { state in
                if state.session?.number == number { state.session = nil }
            }
        }
        state.withLockedValue { $0.session = (task, continuation, number) }
        // The catch-up first, then the outbox, all in order on the new session.
        write(.sync(syncPositions()), id: "sync-\(number)")
        for entry in state.withLockedValue({ $0.outbox }) { write(Self.sendFrame(entry), id: entry.clientID) }
    }

    /// The connection ends without a close (the network went away).
    public func drop() {
        let session = state.withLockedValue { state -> (task: Task<Void, Never>, outgoing: AsyncStream<OutgoingFrame>.Continuation, number: Int)? in
            defer { state.session = nil }
            return state.session
        }
        session?.outgoing.finish()
        session?.task.cancel()
    }

    /// Puts a message in the outbox and sends it now if a session is open.
    public func send(_ text: String, to conversation: String, clientID: String) {
        let entry = (conversation, clientID, text)
        state.withLockedValue { state in
            state.outbox.append(entry)
            state.written[clientID] = (conversation, text)
        }
        write(Self.sendFrame(entry), id: clientID)
    }

    /// Sends every unacknowledged message again on the open session (after `unavailable`
    /// answers), with the same client ids.
    public func resend() {
        for entry in state.withLockedValue({ $0.outbox }) { write(Self.sendFrame(entry), id: entry.clientID) }
    }

    /// Syncs every conversation from where the device stands, on the open session (as an app
    /// does when it comes to the foreground): a rollback since is named in the answers.
    public func resync() {
        write(.sync(syncPositions()), id: "resync")
    }

    private static func sendFrame(_ entry: (conversation: String, clientID: String, text: String)) -> ClientFrame {
        .send(MessageDraft(conversationID: entry.conversation, clientMessageID: entry.clientID, text: entry.text))
    }

    private func syncPositions() -> [SyncPosition] {
        state.withLockedValue { state in
            conversations.map { Self.position($0, in: state) }
        }
    }

    /// Where the device stands in a conversation: the epoch it last heard and its last seq held.
    private static func position(_ conversation: String, in state: State) -> SyncPosition {
        SyncPosition(conversationID: conversation, afterSeq: state.held[conversation]?.last?.seq ?? 0, epoch: state.epochs[conversation])
    }

    private func write(_ frame: ClientFrame, id: String) {
        let text = FrameCoder().text(ClientMessage(frame, id: id))
        let session = state.withLockedValue { state in
            if case .sync(let positions) = frame {
                for position in positions { state.note("> sync \(id) \(position.conversationID) \(position.epoch ?? "-") \(position.afterSeq)") }
            }
            return state.session
        }
        session?.outgoing.yield(.text(text))
    }

    private func handle(_ text: String, session: Int) {
        guard let message = try? FrameCoder().serverMessage(text) else { return }
        switch message.frame {
        case .message(let payload):
            let fork = state.withLockedValue { state -> SyncPosition? in
                let conversation = payload.conversationID
                let epoch = payload.epoch ?? ""
                state.note("< \(session) message \(conversation) \(epoch) \(payload.seq) \(payload.id) \(payload.senderID)/\(payload.clientMessageID)")
                let last = state.received[conversation]?.last
                if let last, last.epoch == epoch, payload.seq != last.seq + 1 {
                    state.repeats.append("\(user)/\(device) session \(session): \(conversation) seq \(payload.seq) after \(last.seq)")
                }
                // A live message of another epoch: sync from where the device stood before it,
                // whose answer says what happened (a fork names what Redis lost).
                let before = Self.position(conversation, in: state)
                let another = before.epoch != nil && before.epoch != epoch
                state.epochs[conversation] = epoch
                state.received[conversation, default: []].append(payload)
                state.held[conversation, default: []].append(payload)
                return another ? before : nil
            }
            if let fork { write(.sync([fork]), id: "sync-epoch-\(session)") }
        case .messageAck(let ack):
            state.withLockedValue { state in
                state.outbox.removeAll { $0.clientID == ack.clientMessageID }
                state.acknowledged[ack.clientMessageID] = (ack.conversationID, ack.seq, ack.duplicate, ack.id)
            }
        case .synced(let synced):
            let (again, resend) = state.withLockedValue { state -> (Bool, [(conversation: String, clientID: String, text: String)]) in
                state.synced.append(synced)
                let conversation = synced.conversationID
                state.note("< \(session) synced \(conversation) \(message.id ?? "-") \(synced.epoch) last \(synced.lastSeq) missing \(synced.missing.map { "\($0.epoch ?? "-") \($0.fromSeq)-\($0.toSeq.map(String.init) ?? "")" }) truncated \(synced.truncated.map { "\($0.epoch ?? "-") \($0.fromSeq)-\($0.toSeq.map(String.init) ?? "")" })")
                var resend: [(conversation: String, clientID: String, text: String)] = []
                for range in synced.truncated {
                    let lost = (state.held[conversation] ?? []).filter { message in
                        message.epoch == range.epoch && message.seq >= range.fromSeq && message.seq <= (range.toSeq ?? .max)
                    }
                    state.truncated.formUnion(lost.map(\.id))
                    state.held[conversation]?.removeAll { message in lost.contains { $0.id == message.id } }
                    // This device's own: back in the outbox, sent again with the same client id.
                    for message in lost where message.senderID == user {
                        guard let written = state.written[message.clientMessageID],
                              !state.outbox.contains(where: { $0.clientID == message.clientMessageID }) else { continue }
                        let entry = (conversation, message.clientMessageID, written.text)
                        state.outbox.append(entry)
                        resend.append(entry)
                    }
                }
                if !synced.epoch.isEmpty { state.epochs[conversation] = synced.epoch }
                return (synced.more, resend)
            }
            for entry in resend { write(Self.sendFrame(entry), id: entry.clientID) }
            if again {
                let position = syncPositions().filter { $0.conversationID == synced.conversationID }
                write(.sync(position), id: "sync-more-\(session)")
            }
        case .error(let error):
            // A send refused for being unavailable (a node losing Redis) stays in the outbox.
            state.withLockedValue { state in
                state.errors.append("\(message.id ?? "-"): \(error.code.rawValue) \(error.message)")
                state.note("< \(session) error \(error.conversationID ?? "-") \(message.id ?? "-") \(error.code.rawValue)")
            }
            // A sync of a conversation refused: again a second later, as the SDKs do.
            if let conversation = error.conversationID, message.id?.contains("sync") == true {
                Task {
                    try? await Task.sleep(for: .seconds(1))
                    let position = self.syncPositions().filter { $0.conversationID == conversation }
                    self.write(.sync(position), id: "sync-again-\(session)")
                }
            }
        default:
            break
        }
    }
}
