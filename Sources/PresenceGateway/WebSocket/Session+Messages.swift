import NIOConcurrencyHelpers
import NIOCore
import PresenceEngine
import PresenceProtocol

/// A session's side of message delivery (docs/API.md, "Messages"): per conversation, the highest seq
/// sent, so that no seq is sent twice or out of order; live messages held while a `sync` of the
/// conversation is under way (and for a moment after the session opens, so that a client that
/// syncs at once gets what it missed before what is new, unless nothing before the message can
/// be owed); conversations whose `sync` was cut at its cap, which get no live messages until the
/// client has synced to the end.
extension Session {
    struct MessageState {
        /// Conversation → the epoch and seq last sent.
        var sent: [String: (epoch: String, seq: Int64)] = [:]
        /// Set from the session's opening until its first `sync` or the opening hold's end:
        /// every conversation's live messages wait.
        var openingHold = true
        /// Conversation → `sync`s of it under way.
        var syncing: [String: Int] = [:]
        /// Live messages waiting, by conversation, with their frame.
        var held: [String: [(message: StoredMessage, frame: TextFrame)]] = [:]
        /// Conversations whose last `sync` said `more`: live messages are dropped (the client
        /// syncs on and reads them from the history), not sent past a gap.
        var behind: Set<String> = []
        /// The session ended: no conversation is joined for it any more.
        var ended = false

        func isHolding(_ conversation: String) -> Bool {
            openingHold || syncing[conversation, default: 0] > 0
        }

        /// Whether `message` may pass the opening hold: nothing of its conversation is held or
        /// being synced, and it is the first of its history's life or this session was sent the
        /// seq just before it. No `sync` can then owe the client anything before it, so holding
        /// it would only make it late (a client that never syncs waited the whole hold).
        func owesNothingBefore(_ message: StoredMessage) -> Bool {
            let conversation = message.conversationID
            guard syncing[conversation] == nil, held[conversation] == nil else { return false }
            if message.seq == 1 { return true }
            guard let last = sent[conversation] else { return false }
            return last.epoch == message.epoch && last.seq == message.seq - 1
        }

        /// Whether `message` is after what was sent of its conversation; records it sent.
        mutating func take(_ message: StoredMessage) -> Bool {
            if let last = sent[message.conversationID], last.epoch == message.epoch, message.seq <= last.seq { return false }
            sent[message.conversationID] = (message.epoch, message.seq)
            return true
        }
    }

    /// A live message: sent now, held, or dropped (already sent, or the conversation is behind).
    func deliverLive(_ message: StoredMessage, frame: TextFrame) {
        messageState.withLockedValue { state in
            let conversation = message.conversationID
            if state.isHolding(conversation), !state.owesNothingBefore(message) {
                state.held[conversation, default: []].append((message, frame))
            } else if !state.behind.contains(conversation), state.take(message) {
                send(frame)
            }
        }
    }

    /// A `sync` of `conversations` begins: their live messages wait until ``endSync``. The
    /// session's first `sync` ends the opening hold of the conversations it does not name.
    func beginSync(_ conversations: [String]) {
        messageState.withLockedValue { state in
            for conversation in conversations { state.syncing[conversation, default: 0] += 1 }
            if state.openingHold { Self.releaseOpeningHold(&state, send: send) }
        }
    }

    /// What was last sent of `conversation` on this session.
    func sentPosition(_ conversation: String) -> (epoch: String, seq: Int64)? {
        messageState.withLockedValue { $0.sent[conversation] }
    }

    /// Ends a `sync` of one conversation: sends its messages not sent yet, then `synced`, then
    /// the live messages held meanwhile, all in one step so that nothing comes in between. A
    /// failed sync passes `nil` and sends nothing of its own.
    func endSync(_ conversation: String, answer: (messages: [StoredMessage], synced: String, more: Bool)?, encode: (StoredMessage) -> TextFrame) {
        messageState.withLockedValue { state in
            if let answer {
                for message in answer.messages where state.take(message) { send(encode(message)) }
                send(answer.synced)
                if answer.more { state.behind.insert(conversation) } else { state.behind.remove(conversation) }
            }
            let remaining = state.syncing[conversation, default: 1] - 1
            state.syncing[conversation] = remaining > 0 ? remaining : nil
            if remaining <= 0, !state.openingHold { Self.flush(conversation, &state, send: send) }
        }
    }

    /// Ends the hold a session starts with (at its first `sync`, or a moment after opening).
    func endOpeningHold() {
        messageState.withLockedValue { state in
            if state.openingHold { Self.releaseOpeningHold(&state, send: send) }
        }
    }

    /// Forgets a conversation the user is no longer a member of: nothing held is sent.
    func forgetConversation(_ conversation: String) {
        messageState.withLockedValue { state in
            state.held[conversation] = nil
            state.sent[conversation] = nil
            state.behind.remove(conversation)
        }
    }

    private static func releaseOpeningHold(_ state: inout MessageState, send: (TextFrame) -> Void) {
        state.openingHold = false
        for conversation in state.held.keys.sorted() where state.syncing[conversation] == nil {
            flush(conversation, &state, send: send)
        }
    }

    /// Sends the held live messages of `conversation` in seq order (an epoch change in the
    /// middle starts the order again), skipping what was sent.
    private static func flush(_ conversation: String, _ state: inout MessageState, send: (TextFrame) -> Void) {
        guard let held = state.held.removeValue(forKey: conversation), !state.behind.contains(conversation) else { return }
        for entry in held where state.take(entry.message) { send(entry.frame) }
    }
}
