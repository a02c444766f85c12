import Foundation
import NIOConcurrencyHelpers
import PresenceClient
import PresenceProtocol
import RedisTestSupport

/// A device that speaks the message frames over the SDK's WebSocket transport, as an app with an
/// outbox would: on each session it first sends `sync` from the last seq (and epoch) it holds of
/// each conversation, follows `more`, then resends every message not yet acknowledged with the
/// same `client_message_id`. It records every message in the order received, across sessions.
public final class MessageDevice: Sendable {
    public let user: String
    public let device: String
    public let conversations: [String]
    let transport = WebSocketTransport(logger: TestRedis.logger("messages"))
    private let state = NIOLockedValueBox(State())

    struct State {
        /// Conversation → the messages received, in order: (epoch, seq, id, client id, sender).
        var received: [String: [MessagePayload]] = [:]
        var epochs: [String: String] = [:]
        /// Sent and not acknowledged, in the order written: (conversation, client id, text).
        var outbox: [(conversation: String, clientID: String, text: String)] = []
        /// Client id → the seq its acknowledgement gave.
        var acknowledged: [String: (conversation: String, seq: Int64, duplicate: Bool)] = [:]
        var session: (task: Task<Void, Never>, outgoing: AsyncStream<OutgoingFrame>.Continuation, number: Int)?
        var sessions = 0
        /// The port of the node the last session was opened on.
        var port: Int?
        var synced: [SyncedPayload] = []
        var errors: [String] = []
        var repeats: [String] = []
    }

    public init(user: String, device: String, conversations: [String]) {
        self.user = user
        self.device = device
        self.conversations = conversations
    }

    public var isConnected: Bool { state.withLockedValue { $0.session != nil } }
    /// The number of the open session and the port of its node, for a report.
    public var whereabouts: String { state.withLockedValue { "session \($0.sessions) on port \($0.port.map(String.init) ?? "-"), \($0.session == nil ? "closed" : "open")" } }
    public func received(_ conversation: String) -> [MessagePayload] { state.withLockedValue { $0.received[conversation] ?? [] } }
    public var acknowledged: [String: (conversation: String, seq: Int64, duplicate: Bool)] { state.withLockedValue { $0.acknowledged } }
    public var unacknowledged: Int { state.withLockedValue { $0.outbox.count } }
    public var syncedAnswers: [SyncedPayload] { state.withLockedValue { $0.synced } }
    public var errors: [String] { state.withLockedValue { $0.errors } }
    /// Messages received twice, or out of order, in one epoch: what must never happen.
    public var repeats: [String] { state.withLockedValue { $0.repeats } }

    /// Opens a session on `port` (ending any open one without a close, as a dropped network does).
    public func connect(port: Int) async throws {
        drop()
        let token = try await mint(user)
        let url = URL(string: "ws://127.0.0.1:\(port)/api/presence/subscribe?token=\(token)&device_id=\(device)")!
        let (outgoing, continuation) = AsyncStream.makeStream(of: OutgoingFrame.self)
        let number = state.withLockedValue { state -> Int in
            state.sessions += 1
            state.port = port
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
        state.withLockedValue { $0.outbox.append(entry) }
        write(Self.sendFrame(entry), id: clientID)
    }

    /// Sends every unacknowledged message again on the open session (after `unavailable`
    /// answers), with the same client ids.
    public func resend() {
        for entry in state.withLockedValue({ $0.outbox }) { write(Self.sendFrame(entry), id: entry.clientID) }
    }

    private static func sendFrame(_ entry: (conversation: String, clientID: String, text: String)) -> ClientFrame {
        .send(MessageDraft(conversationID: entry.conversation, clientMessageID: entry.clientID, text: entry.text))
    }

    private func syncPositions() -> [SyncPosition] {
        state.withLockedValue { state in
            conversations.map { SyncPosition(conversationID: $0, afterSeq: state.received[$0]?.last?.seq ?? 0, epoch: state.epochs[$0]) }
        }
    }

    private func write(_ frame: ClientFrame, id: String) {
        let text = FrameCoder().text(ClientMessage(frame, id: id))
        state.withLockedValue { $0.session }?.outgoing.yield(.text(text))
    }

    private func handle(_ text: String, session: Int) {
        guard let message = try? FrameCoder().serverMessage(text) else { return }
        switch message.frame {
        case .message(let payload):
            state.withLockedValue { state in
                let conversation = payload.conversationID
                let epoch = payload.id.split(separator: "-").first.map(String.init) ?? ""
                if state.epochs[conversation] != epoch {
                    state.epochs[conversation] = epoch
                }
                let last = state.received[conversation]?.last
                if let last, last.id.split(separator: "-").first.map(String.init) == epoch, payload.seq != last.seq + 1 {
                    state.repeats.append("\(user)/\(device) session \(session): \(conversation) seq \(payload.seq) after \(last.seq)")
                }
                state.received[conversation, default: []].append(payload)
            }
        case .messageAck(let ack):
            state.withLockedValue { state in
                state.outbox.removeAll { $0.clientID == ack.clientMessageID }
                state.acknowledged[ack.clientMessageID] = (ack.conversationID, ack.seq, ack.duplicate)
            }
        case .synced(let synced):
            let again = state.withLockedValue { state -> Bool in
                state.synced.append(synced)
                if !synced.epoch.isEmpty { state.epochs[synced.conversationID] = synced.epoch }
                return synced.more
            }
            if again {
                let position = syncPositions().filter { $0.conversationID == synced.conversationID }
                write(.sync(position), id: "sync-more-\(session)")
            }
        case .error(let error):
            // A send refused for being unavailable (a node losing Redis) stays in the outbox.
            state.withLockedValue { $0.errors.append("\(message.id ?? "-"): \(error.code.rawValue) \(error.message)") }
        default:
            break
        }
    }
}
