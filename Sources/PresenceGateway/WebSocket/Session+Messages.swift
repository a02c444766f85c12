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
        /// What the session keeps of each conversation it was sent, is syncing or holds
        /// messages of: one entry, so that a live message looks its conversation up once.
        var conversations: [String: ConversationState] = [:]
        /// Set from the session's opening until its first `sync` or the opening hold's end:
        /// every conversation's live messages wait.
        var openingHold = true
        /// The session ended: no conversation is joined for it any more.
        var ended = false

        /// Runs `body` on `conversation`'s entry (a fresh one if it has none) and drops the entry
        /// if nothing is left in it.
        mutating func update<T>(_ conversation: String, _ body: (inout ConversationState) -> T) -> T {
            let result = body(&conversations[conversation, default: ConversationState()])
            if conversations[conversation]?.isEmpty == true { conversations[conversation] = nil }
            return result
        }
    }

    struct ConversationState {
        /// The epoch and seq last sent, and the first seq of the unbroken run of seqs sent that
        /// ends there: the client has every seq of that run (``take(_:)`` keeps it).
        var sent: SentRun?
        /// `sync`s of the conversation under way.
        var syncing = 0
        /// Live messages waiting, with their frame.
        var held: [(message: StoredMessage, frame: TextFrame)] = []
        /// The last `sync` said `more`, or was refused: live messages are dropped (the client
        /// syncs on and reads them from the history), not sent past a gap.
        var behind = false
        /// Epochs this session has moved past (the history forked or began again since): a live
        /// message of one of them, published before Redis went back in time and arriving late,
        /// is dropped. Its seq now names another message, or the new epoch gives it again.
        var pastEpochs: Set<String> = []

        var isEmpty: Bool { sent == nil && syncing == 0 && held.isEmpty && !behind && pastEpochs.isEmpty }

        /// Whether `message` may pass a hold: nothing of the conversation is held or being
        /// synced, and it is the first of its history's life or this session was sent the seq
        /// just before it. No `sync` can then owe the client anything before it, so holding it
        /// would only make it late (a client that never syncs waited the whole opening hold).
        func owesNothingBefore(_ message: StoredMessage) -> Bool {
            guard syncing == 0, held.isEmpty else { return false }
            if message.seq == 1 { return true }
            guard let sent else { return false }
            return sent.epoch == message.epoch && sent.seq == message.seq - 1
        }

        /// Whether `message` is after what was sent; records it sent, extending the run when it
        /// is the next seq and starting a new one otherwise.
        mutating func take(_ message: StoredMessage) -> Bool {
            guard !pastEpochs.contains(message.epoch) else { return false }
            if let sent, sent.epoch == message.epoch {
                guard message.seq > sent.seq else { return false }
                self.sent = SentRun(epoch: message.epoch, seq: message.seq, runStart: message.seq == sent.seq + 1 ? sent.runStart : message.seq)
            } else {
                if let sent { pastEpochs.insert(sent.epoch) }
                sent = SentRun(epoch: message.epoch, seq: message.seq, runStart: message.seq)
            }
            return true
        }

        /// A `synced` in `epoch` went to the client: the epoch of what was sent before, and the
        /// one the client named, are past if they are not that one.
        mutating func answered(in epoch: String, clientEpoch: String?) {
            for past in [sent?.epoch, clientEpoch].compactMap({ $0 }) where past != epoch { pastEpochs.insert(past) }
        }

        /// A live message: whether to send it now. Otherwise it is held (the session's opening
        /// hold or a `sync` under way) or dropped (already sent, or the conversation is behind).
        mutating func live(_ message: StoredMessage, frame: TextFrame, openingHold: Bool) -> Bool {
            if openingHold || syncing > 0, !owesNothingBefore(message) {
                held.append((message, frame))
                return false
            }
            return !behind && take(message)
        }

        /// Sends the held live messages in seq order (an epoch change in the middle starts the
        /// order again), skipping what was sent; drops them if the conversation is behind.
        mutating func flush(send: (TextFrame) -> Void) {
            let waiting = held
            held = []
            guard !behind else { return }
            for entry in waiting where take(entry.message) { send(entry.frame) }
        }
    }

    /// A live message: sent now, held, or dropped (already sent, or the conversation is behind).
    /// The hot path: one lookup of the conversation, and its entry is never left empty here.
    func deliverLive(_ message: StoredMessage, frame: TextFrame) {
        messageState.withLockedValue { state in
            let openingHold = state.openingHold
            if state.conversations[message.conversationID, default: ConversationState()].live(message, frame: frame, openingHold: openingHold) {
                send(frame)
            }
        }
    }

    /// A `sync` of `conversations` begins: their live messages wait until ``endSync``. The
    /// session's first `sync` ends the opening hold of the conversations it does not name.
    func beginSync(_ conversations: [String]) {
        messageState.withLockedValue { state in
            for conversation in conversations { state.conversations[conversation, default: ConversationState()].syncing += 1 }
            if state.openingHold { Self.releaseOpeningHold(&state, send: send) }
        }
    }

    /// What was sent of a conversation on a session: its last seq, and where the unbroken run of
    /// seqs ending there began.
    struct SentRun: Equatable {
        var epoch: String
        var seq: Int64
        var runStart: Int64
    }

    /// What was last sent of `conversation` on this session.
    func sentPosition(_ conversation: String) -> SentRun? {
        messageState.withLockedValue { $0.conversations[conversation]?.sent }
    }

    /// One conversation's part of a `sync` answer: its messages, its `synced` frame, whether it
    /// was cut, the epoch it answered in and the one the client's position named.
    struct SyncAnswer {
        var messages: [(message: StoredMessage, frame: TextFrame)]
        var synced: String
        var more: Bool
        var epoch: String
        var clientEpoch: String?
    }

    /// Ends a `sync` of one conversation: sends its messages not sent yet, then `synced`, then
    /// the live messages held meanwhile, all in one step so that nothing comes in between. A
    /// failed sync passes `nil` and sends nothing of its own; the conversation is then behind
    /// (its live messages dropped) until a sync of it is answered.
    func endSync(_ conversation: String, answer: SyncAnswer?) {
        messageState.withLockedValue { state in
            let openingHold = state.openingHold
            state.update(conversation) { entry in
                if let answer {
                    for (message, frame) in answer.messages where entry.take(message) { send(frame) }
                    send(answer.synced)
                    entry.answered(in: answer.epoch, clientEpoch: answer.clientEpoch)
                    entry.behind = answer.more
                } else {
                    // Refused: the client was told (an `error` naming the conversation) and
                    // syncs again; live messages meanwhile would come after a gap.
                    entry.behind = true
                }
                entry.syncing = max(0, entry.syncing - 1)
                if entry.syncing == 0, !openingHold { entry.flush(send: send) }
            }
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
            state.update(conversation) { entry in
                entry.held = []
                entry.sent = nil
                entry.behind = false
            }
        }
    }

    private static func releaseOpeningHold(_ state: inout MessageState, send: (TextFrame) -> Void) {
        state.openingHold = false
        let waiting = state.conversations.filter { !$0.value.held.isEmpty && $0.value.syncing == 0 }.keys.sorted()
        for conversation in waiting { state.update(conversation) { $0.flush(send: send) } }
    }
}
