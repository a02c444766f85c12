import Foundation
import Logging

/// A client's messages (docs/API.md, "Messages"): an outbox kept in a ``MessageOutboxStore`` that
/// goes out whenever a session is open, each conversation's messages in `seq` order without
/// repeats, `sync` on every session, and statuses from acks and receipts.
struct ChatState {
    /// One conversation as this device knows it.
    struct Log {
        /// The history's epoch; `nil` before any.
        var epoch: String?
        /// The highest seq of the epoch such that every seq up to it is held here or was named
        /// unrecoverable (`missing`): where the next `sync` starts, and what `delivered` says.
        /// Never moved past a gap this device was neither given nor told about.
        var lastSeq: Int64 = 0
        /// Seqs of the epoch held here above `lastSeq` (past a gap).
        var above: Set<Int64> = []
        /// Ranges of the epoch above `lastSeq` that a `synced` named as missing.
        var named: [ClosedRange<Int64>] = []
        /// A complete `synced` of this session left `lastSeq` here, below its `last_seq`: the
        /// session was sent seqs this device does not hold (a frame that did not read), which the
        /// gateway counts as given and never sends again on the session, so the gap is not asked
        /// for again until the next session.
        var stuckAt: Int64?
        /// Stored messages received, in the order of the history.
        var messages: [ChatMessage] = []
        /// The gateway's ids of those (opaque: the epoch is the frame's, never read from them).
        var seen: Set<String> = []
        /// Members' cursors.
        var receipts: [String: MemberReceipt] = [:]
        /// Whether `receipts` names every member (a `synced` carried them).
        var receiptsComplete = false
        /// The highest seq this device said `delivered` (or `read`) for.
        var deliveredSent: Int64 = 0
        /// The highest seq the app read; sent as `read` when a session is open.
        var readUpTo: Int64 = 0
        var readSent: Int64 = 0
    }

    /// A message of the outbox and its attempts.
    struct Outgoing {
        var message: ChatMessage
        /// Attempts used on live sessions.
        var attempts = 0
        /// The frame of the attempt under way, and when it counts as unanswered (`nil` while the
        /// frame waits for the session's budget: the wait starts when it is written).
        var frameID: String?
        var deadline: Date?
        /// Not sent again before this.
        var due: Date?
    }

    var logs: [String: Log] = [:]
    /// Oldest first.
    var outbox: [Outgoing] = []
    /// Learned from the gateway's copy of a message this device wrote.
    var ownUserID: String?
    /// Client message ids written on this device.
    var written: Set<String> = []
    /// Conversations whose `sync` is under way, or waits to be sent again.
    var syncing: Set<String> = []
    /// Conversations whose refused or failed `sync` goes again at that moment (this session's).
    var syncRetries: [String: Date] = [:]
    /// Their waits, growing with each failure; a conversation's `synced` resets its own.
    var syncBackoffs: [String: ReconnectBackoff] = [:]
    /// Whether the store's outbox was read.
    var loaded = false

    /// The earliest moment after `now` an outbox message needs attention: an attempt's answer
    /// is overdue, or a wait before the next attempt ends. A wait already over needs none: the
    /// message goes when its conversation's message under way is answered.
    func nextDeadline(after now: Date) -> Date? {
        outbox.compactMap { entry in
            if entry.frameID != nil { return entry.deadline }
            guard entry.message.status == .sending, let due = entry.due, due > now else { return nil }
            return due
        }.min()
    }
}

extension PresenceClient {
    /// Attempts per message on live sessions; the waits before the second and third.
    static let messageAttempts = 3
    static let attemptDelays: [TimeInterval] = [1, 2]
    /// Seconds an attempt waits for its `message_ack`.
    static let ackTimeout: TimeInterval = 10

    // MARK: - The app's side

    /// Writes a message: it is returned at once as `sending`, kept in the outbox (saved on the
    /// device) and goes out when a session is open, in the order written.
    @discardableResult
    public func send(_ text: String, to conversation: String, type: String = "text", imageURL: String? = nil) throws(PresenceClientError) -> ChatMessage {
        try ClientID.check([conversation], "conversation id")
        guard !text.isEmpty else { throw .invalid("a message's text must not be empty") }
        guard type == "text" || type == "image" else { throw .invalid("a message's type is text or image") }
        let message = ChatMessage(conversationID: conversation, clientMessageID: UUID().uuidString.lowercased(), type: type, text: text,
                                  imageURL: imageURL, createdAt: clock.now, status: .sending)
        chat.outbox.append(ChatState.Outgoing(message: message))
        chat.written.insert(message.clientMessageID)
        if chat.logs[conversation] == nil { chat.logs[conversation] = ChatState.Log() }
        if let debounced = debouncer.stop(in: conversation) { sendTyping(debounced) }
        saveOutbox()
        emit([.message(message)])
        sendOutbox()
        return message
    }

    /// The conversation's messages in order: those the gateway stored, then this device's not
    /// stored yet (sending or failed).
    public func messages(in conversation: String) -> [ChatMessage] {
        (chat.logs[conversation]?.messages ?? []) + chat.outbox.map(\.message).filter { $0.conversationID == conversation }
    }

    /// Every member's cursors in `conversation`, as last heard.
    public func receipts(in conversation: String) -> [MemberReceipt] {
        (chat.logs[conversation]?.receipts.values).map { $0.sorted { $0.userID < $1.userID } } ?? []
    }

    /// Sends a `failed` message again (three new attempts); returns whether it was in the outbox.
    @discardableResult
    public func retry(_ clientMessageID: String) -> Bool {
        guard let index = chat.outbox.firstIndex(where: { $0.message.clientMessageID == clientMessageID && $0.message.status == .failed }) else {
            return false
        }
        chat.outbox[index] = ChatState.Outgoing(message: chat.outbox[index].message)
        chat.outbox[index].message.status = .sending
        chat.outbox[index].message.failure = nil
        statusChanged(chat.outbox[index].message)
        saveOutbox()
        sendOutbox()
        return true
    }

    /// The conversation is on screen: everything received in it counts as read (sent now, or
    /// once a session has synced the conversation).
    public func markRead(_ conversation: String) {
        guard var log = chat.logs[conversation] else { return }
        log.readUpTo = log.lastSeq
        for index in log.messages.indices where log.messages[index].senderID != chat.ownUserID && log.messages[index].status != .read {
            log.messages[index].status = .read
            emit([.messageStatus(MessageStatusChange(conversationID: conversation, clientMessageID: log.messages[index].clientMessageID, status: .read))])
        }
        chat.logs[conversation] = log
        sendCursors(conversation)
    }

    /// The app's own "offline" switch, like airplane mode: `true` closes the session cleanly
    /// (others see this device offline), sends nothing (messages wait in the outbox) and hides
    /// others' typing; `false` connects again and sends the outbox.
    public func setOffline(_ offline: Bool) {
        lifecycle.setOffline(offline)
        if offline {
            for send in debouncer.stopAll() { sendTyping(send) }
            emit(cache.clearTyping())
            outbox?.yield(.close(.normal))
        } else {
            backoff.reset()
        }
        wake.signal()
    }

    /// Whether the app's offline switch is on.
    public var isOffline: Bool { lifecycle.offlineMode }

    // MARK: - The outbox

    /// Reads the store's outbox (once, as `run()` starts); messages written before it came go
    /// after the saved ones.
    func loadOutbox() async {
        guard !chat.loaded else { return }
        // Saves wait until the read is done (`send` may run meanwhile), so none replaces it.
        defer { chat.loaded = true }
        do {
            let saved = try await outboxStore.load()
            let known = Set(chat.outbox.map(\.message.clientMessageID))
            let restored = saved.filter { !known.contains($0.clientMessageID) }.map { ChatState.Outgoing(message: $0) }
            let writtenBefore = !chat.outbox.isEmpty
            chat.outbox = restored + chat.outbox
            for message in saved {
                chat.written.insert(message.clientMessageID)
                if chat.logs[message.conversationID] == nil { chat.logs[message.conversationID] = ChatState.Log() }
            }
            if !restored.isEmpty {
                logger.info("outbox restored", metadata: ["presence.messages": "\(restored.count)"])
                emit(restored.map { .message($0.message) })
            }
            // Messages written before the read were not saved (that would have replaced the
            // store's outbox): saved with it now.
            if writtenBefore {
                chat.loaded = true
                saveOutbox()
            }
        } catch {
            logger.error("the outbox store could not be read; starting with an empty outbox", metadata: ["error": "\(error)"])
        }
    }

    /// Saves the outbox, after the saves before it; not before the store's outbox was read.
    func saveOutbox() {
        guard chat.loaded else { return }
        let snapshot = chat.outbox.map(\.message)
        let previous = saving
        let store = outboxStore
        let logger = logger
        saving = Task {
            await previous?.value
            do {
                try await store.save(snapshot)
            } catch {
                logger.error("the outbox could not be saved", metadata: ["error": "\(error)"])
            }
        }
    }

    /// Waits until every outbox change so far is saved.
    public func outboxSaved() async {
        await saving?.value
    }

    /// Sends what is due: per conversation, its oldest `sending` message not under way, if no
    /// other of the conversation is under way. Nothing without an open session.
    func sendOutbox() {
        guard outbox != nil, !awaitingInitialState else { return }
        let now = clock.now
        var busy = Set(chat.outbox.filter { $0.frameID != nil }.map(\.message.conversationID))
        for index in chat.outbox.indices {
            let entry = chat.outbox[index]
            let conversation = entry.message.conversationID
            guard entry.message.status == .sending, entry.frameID == nil, !busy.contains(conversation) else { continue }
            busy.insert(conversation)
            if let due = entry.due, due > now { continue }
            let draft = MessageDraft(conversationID: conversation, clientMessageID: entry.message.clientMessageID, text: entry.message.text,
                                     type: entry.message.type, imageURL: entry.message.imageURL,
                                     clientCreatedAt: Int64(entry.message.createdAt.timeIntervalSince1970 * 1000))
            let id = send(.send(draft), request: .message(entry.message.clientMessageID))
            chat.outbox[index].frameID = id
            // The wait for the answer starts when the frame is written: now, or when the frame
            // budget has room (`frameWritten`).
            let waiting = pacer.waiting.contains { $0.id == id }
            chat.outbox[index].deadline = waiting ? nil : now.addingTimeInterval(Self.ackTimeout)
        }
        timers.signal()
    }

    /// Attempts that went unanswered count as failed ones.
    func outboxTimers(at now: Date) {
        for index in chat.outbox.indices {
            guard chat.outbox[index].frameID != nil, let deadline = chat.outbox[index].deadline, deadline <= now else { continue }
            if let frame = chat.outbox[index].frameID { pending[frame] = nil }
            attemptFailed(at: index, reason: "no answer within \(Int(Self.ackTimeout)) s")
        }
        sendOutbox()
    }

    /// The session ended: attempts under way used nothing up, and go again on the next one.
    func outboxSessionEnded() {
        for index in chat.outbox.indices {
            chat.outbox[index].frameID = nil
            chat.outbox[index].deadline = nil
            chat.outbox[index].due = nil
        }
        // Syncs under way, and those waiting to go again, end with the session: the next one
        // syncs every conversation anyway.
        chat.syncing = []
        chat.syncRetries = [:]
        chat.syncBackoffs = [:]
        // What was said on the ended session may not have arrived: said again on the next. A gap
        // this session could not fill is asked for again on the next.
        for conversation in chat.logs.keys {
            chat.logs[conversation]?.deliveredSent = 0
            chat.logs[conversation]?.readSent = 0
            chat.logs[conversation]?.stuckAt = nil
        }
    }

    /// The gateway refused an attempt.
    func messageRefused(_ clientMessageID: String, code: ErrorCode, message: String) {
        guard let index = chat.outbox.firstIndex(where: { $0.message.clientMessageID == clientMessageID }) else { return }
        chat.outbox[index].frameID = nil
        chat.outbox[index].deadline = nil
        switch code {
        case .rateLimited:
            // Costs no attempt: it waits and goes again.
            chat.outbox[index].due = clock.now.addingTimeInterval(configuration.retryDelay)
        case .forbidden, .notFound, .invalidRequest, .payloadTooLarge:
            // Sending it again cannot succeed.
            fail(at: index, reason: "\(code.rawValue): \(message)")
        default:
            attemptFailed(at: index, reason: "\(code.rawValue): \(message)")
        }
        sendOutbox()
    }

    private func attemptFailed(at index: Int, reason: String) {
        chat.outbox[index].frameID = nil
        chat.outbox[index].deadline = nil
        chat.outbox[index].attempts += 1
        let attempts = chat.outbox[index].attempts
        guard attempts < Self.messageAttempts else {
            fail(at: index, reason: reason)
            return
        }
        chat.outbox[index].due = clock.now.addingTimeInterval(Self.attemptDelays[min(attempts, Self.attemptDelays.count) - 1])
        logger.info("a message attempt failed; trying again", metadata: ["presence.client_message_id": "\(chat.outbox[index].message.clientMessageID)", "presence.reason": "\(reason)"])
    }

    private func fail(at index: Int, reason: String) {
        chat.outbox[index].message.status = .failed
        chat.outbox[index].message.failure = reason
        chat.outbox[index].due = nil
        logger.warning("a message failed; it stays in the outbox for retry(_:)", metadata: [
            "presence.client_message_id": "\(chat.outbox[index].message.clientMessageID)", "presence.reason": "\(reason)",
        ])
        statusChanged(chat.outbox[index].message)
        saveOutbox()
    }

    func statusChanged(_ message: ChatMessage) {
        emit([.messageStatus(MessageStatusChange(conversationID: message.conversationID, clientMessageID: message.clientMessageID,
                                                 status: message.status, failure: message.failure))])
    }
}
