import Foundation
import Logging

/// A client's messages (docs/API.md, "Messages"): an outbox kept in a ``MessageOutboxStore`` that
/// goes out whenever a session is open, each conversation's messages in `seq` order without
/// repeats, `sync` on every session, and statuses from acks and receipts.
struct ChatState {
    /// One conversation as this device knows it.
    struct Log {
        /// The history's epoch and the last seq received; `nil` epoch before any.
        var epoch: String?
        var lastSeq: Int64 = 0
        /// Stored messages received, in the order of the history.
        var messages: [ChatMessage] = []
        /// Ids (`epoch-seq`) of those.
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
        /// The frame of the attempt under way, and when it counts as unanswered.
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
    /// Conversations whose `sync` is under way.
    var syncing: Set<String> = []
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
    /// when a session opens).
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
            chat.outbox[index].frameID = send(.send(draft), request: .message(entry.message.clientMessageID))
            chat.outbox[index].deadline = now.addingTimeInterval(Self.ackTimeout)
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
        chat.syncing = []
        // What was said on the ended session may not have arrived: said again on the next.
        for conversation in chat.logs.keys {
            chat.logs[conversation]?.deliveredSent = 0
            chat.logs[conversation]?.readSent = 0
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

    private func statusChanged(_ message: ChatMessage) {
        emit([.messageStatus(MessageStatusChange(conversationID: message.conversationID, clientMessageID: message.clientMessageID,
                                                 status: message.status, failure: message.failure))])
    }

    // MARK: - Sync

    /// The session opened: every conversation this device knows is synced (from its last seq, or
    /// from the start of what the gateway keeps), then the outbox goes out.
    func messagesSessionOpened() {
        let positions = Set(chat.logs.keys).union(joinedConversations).sorted().map { conversation in
            let log = chat.logs[conversation]
            return SyncPosition(conversationID: conversation, afterSeq: log?.lastSeq ?? 0, epoch: log?.epoch)
        }
        sync(positions)
        for conversation in chat.logs.keys.sorted() { sendCursors(conversation) }
        sendOutbox()
    }

    private func sync(_ positions: [SyncPosition]) {
        // Nothing to sync: the empty `sync` ends the session's opening hold of live messages.
        if positions.isEmpty { send(.sync([]), request: .other) }
        for chunk in positions.chunks(of: 100) where !chunk.isEmpty {
            for position in chunk { chat.syncing.insert(position.conversationID) }
            send(.sync(chunk), request: .sync)
        }
    }

    // MARK: - Frames from the gateway

    func received(ack: MessageAckPayload) {
        guard let index = chat.outbox.firstIndex(where: { $0.message.clientMessageID == ack.clientMessageID }) else { return }
        var message = chat.outbox.remove(at: index).message
        message.seq = ack.seq
        message.id = ack.id
        message.epoch = String(ack.id.split(separator: "-").first ?? "")
        message.status = .sent
        message.failure = nil
        saveOutbox()
        place(message)
        statusChanged(message)
        refreshStatuses(message.conversationID)
        sendOutbox()
    }

    func received(message payload: MessagePayload) {
        let conversation = payload.conversationID
        let epoch = String(payload.id.split(separator: "-").first ?? "")
        if chat.written.contains(payload.clientMessageID) { chat.ownUserID = payload.senderID }
        let own = payload.senderID == chat.ownUserID
        var message = ChatMessage(payload, epoch: epoch, status: own ? .sent : .delivered)
        let isNew = chat.logs[conversation] == nil
        // The gateway's copy of a message this device wrote may come before its ack.
        if own, let index = chat.outbox.firstIndex(where: { $0.message.clientMessageID == payload.clientMessageID }) {
            let local = chat.outbox.remove(at: index).message
            message.createdAt = local.createdAt
            saveOutbox()
            place(message)
            statusChanged(message)
        } else if place(message) {
            emit([.message(message)])
        }
        var log = chat.logs[conversation] ?? ChatState.Log()
        if log.epoch != epoch {
            log.epoch = epoch
            log.lastSeq = 0
        }
        log.lastSeq = max(log.lastSeq, payload.seq)
        chat.logs[conversation] = log
        refreshStatuses(conversation)
        if isNew {
            // First heard of here: what came before, and every member's cursors.
            sync([SyncPosition(conversationID: conversation, afterSeq: 0)])
        } else if !chat.syncing.contains(conversation) {
            sendCursors(conversation)
        }
        sendOutbox()
    }

    func received(synced: SyncedPayload) {
        let conversation = synced.conversationID
        chat.syncing.remove(conversation)
        var log = chat.logs[conversation] ?? ChatState.Log()
        if log.epoch != synced.epoch {
            log.epoch = synced.epoch
            log.lastSeq = 0
        }
        if !synced.more { log.lastSeq = max(log.lastSeq, synced.lastSeq) }
        if let receipts = synced.receipts {
            for row in receipts {
                guard let user = row.userID else { continue }
                let known = log.receipts[user]
                log.receipts[user] = MemberReceipt(userID: user, deliveredSeq: max(known?.deliveredSeq ?? 0, row.deliveredSeq),
                                                   readSeq: max(known?.readSeq ?? 0, row.readSeq))
            }
            log.receiptsComplete = true
        }
        chat.logs[conversation] = log
        for range in synced.missing {
            emit([.messageGap(MessageGap(conversationID: conversation, epoch: range.epoch, fromSeq: range.fromSeq, toSeq: range.toSeq))])
        }
        refreshStatuses(conversation)
        if synced.more {
            sync([SyncPosition(conversationID: conversation, afterSeq: log.lastSeq, epoch: log.epoch)])
        } else {
            sendCursors(conversation)
        }
    }

    func received(receipt: ReceiptPayload) {
        guard let conversation = receipt.conversationID, let user = receipt.userID, var log = chat.logs[conversation] else { return }
        let known = log.receipts[user]
        log.receipts[user] = MemberReceipt(userID: user, deliveredSeq: max(known?.deliveredSeq ?? 0, receipt.deliveredSeq),
                                           readSeq: max(known?.readSeq ?? 0, receipt.readSeq))
        chat.logs[conversation] = log
        refreshStatuses(conversation)
    }

    /// A `sync` position was refused (not a member, no such conversation): it is not synced again.
    func syncRefused(_ conversation: String) {
        chat.syncing.remove(conversation)
        if chat.logs[conversation]?.messages.isEmpty == true, !chat.outbox.contains(where: { $0.message.conversationID == conversation }) {
            chat.logs[conversation] = nil
        }
    }

    /// Puts a stored message in its conversation's log (once), in history order; returns
    /// whether it is new there.
    @discardableResult
    private func place(_ message: ChatMessage) -> Bool {
        guard let id = message.id else { return false }
        var log = chat.logs[message.conversationID] ?? ChatState.Log()
        if log.seen.contains(id) {
            // Already there (the ack and the gateway's copy): keep the later details.
            if let index = log.messages.firstIndex(where: { $0.id == id }), log.messages[index].senderID == nil {
                log.messages[index].senderID = message.senderID
            }
            chat.logs[message.conversationID] = log
            return false
        }
        log.seen.insert(id)
        let position = log.messages.lastIndex { $0.epoch == message.epoch && ($0.seq ?? 0) < (message.seq ?? 0) || $0.epoch != message.epoch }
        log.messages.insert(message, at: position.map { $0 + 1 } ?? 0)
        chat.logs[message.conversationID] = log
        return true
    }

    /// Own messages' status from the other members' cursors: delivered (read) once every other
    /// member's delivered (read) seq is at or past it. This device's user is known from the
    /// gateway's copy of a message it wrote.
    private func refreshStatuses(_ conversation: String) {
        guard var log = chat.logs[conversation], log.receiptsComplete, let own = chat.ownUserID else { return }
        let others = log.receipts.values.filter { $0.userID != own }
        guard !others.isEmpty else { return }
        let delivered = others.map(\.deliveredSeq).min() ?? 0
        let read = others.map(\.readSeq).min() ?? 0
        var changed: [ChatMessage] = []
        for index in log.messages.indices {
            let message = log.messages[index]
            guard message.senderID == chat.ownUserID || chat.written.contains(message.clientMessageID), let seq = message.seq,
                  message.epoch == log.epoch else { continue }
            let status: MessageStatus = seq <= read ? .read : seq <= delivered ? .delivered : .sent
            if status != message.status, Self.rank(status) > Self.rank(message.status) {
                log.messages[index].status = status
                changed.append(log.messages[index])
            }
        }
        chat.logs[conversation] = log
        for message in changed { statusChanged(message) }
    }

    private static func rank(_ status: MessageStatus) -> Int {
        switch status {
        case .failed: 0
        case .sending: 1
        case .sent: 2
        case .delivered: 3
        case .read: 4
        }
    }

    /// Tells the gateway what this device received and what the app read.
    func sendCursors(_ conversation: String) {
        guard outbox != nil, !awaitingInitialState, var log = chat.logs[conversation], log.lastSeq > 0 else { return }
        if log.readUpTo > log.readSent {
            send(.read(conversationID: conversation, seq: log.readUpTo), request: .other)
            log.readSent = log.readUpTo
            log.deliveredSent = max(log.deliveredSent, log.readUpTo)
        }
        if log.lastSeq > log.deliveredSent {
            send(.delivered(conversationID: conversation, seq: log.lastSeq), request: .other)
            log.deliveredSent = log.lastSeq
        }
        chat.logs[conversation] = log
    }
}
