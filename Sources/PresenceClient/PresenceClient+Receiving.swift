import Foundation
import Logging

/// Receiving messages (docs/API.md, "Messages"): `sync` on every session (sent again with backoff
/// when refused or failed), messages placed in `seq` order without repeats, a last seq never moved
/// past a gap, gaps announced, epochs lost or forked, receipts and the statuses of this device's
/// own messages. The outbox is in PresenceClient+Messages.swift; the log's own rules in
/// ConversationLog.swift.
extension PresenceClient {
    /// Error codes after which the same `sync` may succeed later: sent again after a wait.
    static let syncRetried: Set<ErrorCode> = [.rateLimited, .unavailable, .internal]
    /// The wait before a refused or failed `sync` goes again: 1 s doubling up to 30 s, ±20 %, per
    /// conversation, reset by its `synced`.
    static let syncBackoff = ReconnectBackoff(initial: 1, maximum: 30, jitter: 0.2)

    // MARK: - Sync

    /// The session opened: every conversation this device knows is synced at once (from its last
    /// seq and epoch, or from the start of what the gateway keeps), then the outbox goes out.
    /// Each conversation's `synced` says its cursors: said before it, a `delivered` of the old
    /// epoch would count as the new one's last seq (a seq above `last_seq` counts as `last_seq`),
    /// past what this device has.
    func messagesSessionOpened() {
        let conversations = Set(chat.logs.keys).union(joinedConversations).sorted()
        sync(conversations.map { position(of: $0) })
        sendOutbox()
    }

    /// Where a conversation's next `sync` starts: its last seq and epoch, or the start.
    func position(of conversation: String) -> SyncPosition {
        let log = chat.logs[conversation]
        return SyncPosition(conversationID: conversation, afterSeq: log?.lastSeq ?? 0, epoch: log?.epoch)
    }

    func sync(_ positions: [SyncPosition]) {
        // Nothing to sync: the empty `sync` ends the session's opening hold of live messages.
        if positions.isEmpty { send(.sync([]), request: .other) }
        for chunk in positions.chunks(of: ClientFrame.maxSyncPositions) where !chunk.isEmpty {
            for position in chunk { chat.syncing.insert(position.conversationID) }
            send(.sync(chunk), request: .sync(Set(chunk.map(\.conversationID))))
        }
    }

    /// A position of a `sync` was answered, by its `synced` or by an `error` naming it; the
    /// frame's request is done once every position is.
    private func syncAnswered(id: String?, _ conversation: String) {
        guard let id, case .sync(var waiting)? = pending[id] else { return }
        waiting.remove(conversation)
        pending[id] = waiting.isEmpty ? nil : .sync(waiting)
    }

    /// The gateway refused or failed a `sync`: the whole frame (`conversation` nil: every position
    /// not answered yet) or one position. What may succeed later (`rate_limited`, `unavailable`,
    /// `internal`) goes again after a wait, and is no `error` event; a position refused for good
    /// (not a member, no such conversation) is not synced again.
    func syncFailed(id: String, waiting: Set<String>, code: ErrorCode, message: String, conversation: String?) {
        // A position already answered (its `synced` came) is not the refusal's.
        let conversations = conversation.map { waiting.contains($0) ? [$0] : [] } ?? waiting.sorted()
        for refused in conversations { syncAnswered(id: id, refused) }
        if Self.syncRetried.contains(code) {
            logger.info("a sync was refused; it goes again", metadata: [
                "presence.code": "\(code.rawValue)", "presence.message": "\(message)", "presence.conversations": "\(conversations.count)",
            ])
            retrySync(conversations)
            return
        }
        for refused in conversations {
            if conversation != nil {
                syncRefused(refused)
            } else {
                chat.syncing.remove(refused)
            }
        }
        emit([.error(code: code, message: message)])
    }

    /// Sends conversations' `sync` again after their backoff, which grows with each failure of
    /// this session. Positions refused about together (one frame's, refused one by one) go again
    /// in one frame, not one each, which would spend the sync budget. Until then the conversation
    /// counts as syncing, so live messages start no other sync.
    private func retrySync(_ conversations: [String]) {
        let now = clock.now
        for conversation in conversations {
            var backoff = chat.syncBackoffs[conversation] ?? Self.syncBackoff
            let delay = backoff.nextDelay()
            let allowed = Self.syncWaits(failures: backoff.attempts)
            // Another position already waits for a moment this one's backoff allows: together.
            let joined = chat.syncRetries.values.filter { allowed.contains($0.timeIntervalSince(now)) }.min()
            chat.syncBackoffs[conversation] = backoff
            chat.syncRetries[conversation] = joined ?? now.addingTimeInterval(delay)
            chat.syncing.insert(conversation)
        }
        timers.signal()
    }

    /// The waits ``syncBackoff`` may give after `failures` failures in a row: its delay, moved by
    /// up to its jitter.
    static func syncWaits(failures: Int) -> ClosedRange<TimeInterval> {
        let backoff = syncBackoff
        let base = min(backoff.maximum, backoff.initial * pow(2, Double(max(0, failures - 1))))
        return base * (1 - backoff.jitter)...base * (1 + backoff.jitter)
    }

    /// Sends the `sync`s whose wait is over, together, each from where its conversation is now
    /// (live messages may have moved it meanwhile).
    func syncRetriesDue(at now: Date) {
        let due = chat.syncRetries.filter { $0.value <= now }.keys.sorted()
        guard !due.isEmpty else { return }
        for conversation in due { chat.syncRetries[conversation] = nil }
        sync(due.map { position(of: $0) })
    }

    // MARK: - Frames from the gateway

    func received(ack: MessageAckPayload) {
        guard let index = chat.outbox.firstIndex(where: { $0.message.clientMessageID == ack.clientMessageID }) else { return }
        var message = chat.outbox.remove(at: index).message
        message.seq = ack.seq
        message.id = ack.id
        // The frame's epoch, never read from the id; from a gateway too old to say it, the
        // conversation's as known here.
        message.epoch = ack.epoch ?? chat.logs[message.conversationID]?.epoch
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
        if chat.written.contains(payload.clientMessageID) { chat.ownUserID = payload.senderID }
        let own = payload.senderID == chat.ownUserID
        let isNew = chat.logs[conversation] == nil
        var log = chat.logs[conversation] ?? ChatState.Log()
        if log.epoch == nil, let first = payload.epoch { log.adopt(epoch: first) }
        chat.logs[conversation] = log
        // The frame's epoch, never read from the id; from a gateway too old to say it, the
        // message is of the history as known here.
        let epoch = payload.epoch ?? log.epoch
        // A session gets an epoch's messages in seq order and is told of every gap: a seq past the
        // next one means something was skipped. The message is kept (messages(in:) stays in seq
        // order), but the last seq stays before the gap.
        let gap = epoch == log.epoch && payload.seq > log.lastSeq + 1
        var message = ChatMessage(payload, epoch: epoch, status: own ? .sent : .delivered)
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
        refreshStatuses(conversation)
        let placed = chat.logs[conversation] ?? ChatState.Log()
        if chat.syncing.contains(conversation) {
            // The sync under way (or waiting to go again) answers for it, a conversation joined
            // but not heard of yet included.
        } else if isNew {
            // First heard of here: what came before, and every member's cursors.
            sync([SyncPosition(conversationID: conversation, afterSeq: 0)])
        } else if epoch != placed.epoch {
            // Another epoch: Redis lost the history, or went back in time. A sync from where this
            // device is (not from nothing) says which, and what of its history carried over.
            sync([position(of: conversation)])
        } else if gap, placed.stuckAt != placed.lastSeq {
            // The sync from the last seq gives the gap, or names it in `missing`.
            sync([position(of: conversation)])
        } else {
            sendCursors(conversation)
        }
        sendOutbox()
    }

    func received(synced: SyncedPayload, id: String?) {
        let conversation = synced.conversationID
        syncAnswered(id: id, conversation)
        chat.syncBackoffs[conversation] = nil
        chat.syncRetries[conversation] = nil
        chat.syncing.remove(conversation)
        var log = chat.logs[conversation] ?? ChatState.Log()
        var lost: (messages: [ChatMessage], epoch: String, ranges: [MissingRange])?
        if let old = log.epoch, old != synced.epoch {
            if synced.missing.contains(where: { ($0.epoch ?? old) == old && $0.toSeq == nil }) {
                // `missing` names the rest of this device's epoch, with no end: it was lost as a whole.
                log.epochLost(to: synced.epoch)
            } else {
                // Not lost: the new epoch forked from it (directly or through earlier forks).
                let truncated = synced.truncated.filter { ($0.epoch ?? old) == old }
                lost = (log.forked(to: synced.epoch, truncated: truncated), old, truncated)
            }
        } else if log.epoch == nil {
            log.adopt(epoch: synced.epoch)
        }
        for range in synced.missing { log.name(missing: range, current: synced.epoch) }
        for row in synced.receipts ?? [] { log.merge(row) }
        if synced.receipts != nil { log.receiptsComplete = true }
        log.advanceLastSeq()
        // A complete answer can leave a gap only where this session was sent seqs this device does
        // not hold (a frame that did not read): the gateway counts them as given and never sends a
        // seq twice on a session, so asking again would be answered the same. The next session's
        // sync starts from here and gets them.
        log.stuckAt = !synced.more && log.lastSeq < synced.lastSeq ? log.lastSeq : nil
        chat.logs[conversation] = log
        if let lost { lose(lost.messages, from: lost.epoch, in: conversation, ranges: lost.ranges) }
        emit(synced.missing.map { .messageGap(MessageGap(conversationID: conversation, epoch: $0.epoch, fromSeq: $0.fromSeq, toSeq: $0.toSeq)) })
        refreshStatuses(conversation)
        if synced.more {
            sync([position(of: conversation)])
        } else {
            sendCursors(conversation)
        }
        // Own messages Redis lost are back in the outbox.
        sendOutbox()
    }

    func received(receipt: ReceiptPayload) {
        guard let conversation = receipt.conversationID, receipt.userID != nil, var log = chat.logs[conversation] else { return }
        log.merge(receipt)
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
        var log = chat.logs[message.conversationID] ?? ChatState.Log()
        let (isNew, displaced) = log.insert(message)
        chat.logs[message.conversationID] = log
        if let displaced, let epoch = displaced.epoch { lose([displaced], from: epoch, in: message.conversationID, ranges: []) }
        return isNew
    }

    /// Messages this device held that Redis lost (they already left the log). Other members'
    /// are gone; this device's own go back in the outbox and are sent again with the same
    /// `client_message_id`, which the gateway stores as new. `.messageTruncated` names the
    /// ranges: those the gateway gave, and alone each lost message outside them.
    private func lose(_ lost: [ChatMessage], from epoch: String, in conversation: String, ranges: [MissingRange]) {
        var told = ranges.map { MessageGap(conversationID: conversation, epoch: $0.epoch ?? epoch, fromSeq: $0.fromSeq, toSeq: $0.toSeq) }
        for message in lost {
            guard let seq = message.seq else { continue }
            let covered = told.contains { range in
                range.epoch == message.epoch && range.fromSeq <= seq && (range.toSeq.map { seq <= $0 } ?? true)
            }
            if !covered { told.append(MessageGap(conversationID: conversation, epoch: message.epoch, fromSeq: seq, toSeq: seq)) }
        }
        emit(told.map { .messageTruncated($0) })
        requeue(lost.filter { isOwn($0) }, in: conversation)
    }

    /// Puts this device's own stored messages back in the outbox, as `sending`. They were written
    /// before anything of the conversation still in the outbox (which is stored one message at a
    /// time, in order), so they go back ahead of it, in their old order; a message already under
    /// way is answered first (its conversation is busy until then).
    private func requeue(_ messages: [ChatMessage], in conversation: String) {
        let queued = Set(chat.outbox.map(\.message.clientMessageID))
        let entries = messages.sorted { ($0.seq ?? 0) < ($1.seq ?? 0) }
            .filter { !queued.contains($0.clientMessageID) }
            .map { message -> ChatState.Outgoing in
                var again = message
                again.seq = nil
                again.id = nil
                again.epoch = nil
                again.status = .sending
                again.failure = nil
                return ChatState.Outgoing(message: again)
            }
        guard !entries.isEmpty else { return }
        let first = chat.outbox.firstIndex { $0.message.conversationID == conversation } ?? chat.outbox.endIndex
        chat.outbox.insert(contentsOf: entries, at: first)
        for entry in entries {
            chat.written.insert(entry.message.clientMessageID)
            statusChanged(entry.message)
        }
        logger.info("messages Redis lost go again", metadata: ["presence.conversation": "\(conversation)", "presence.messages": "\(entries.count)"])
        saveOutbox()
    }

    /// Whether a message is this user's: written on this device, or by the user elsewhere.
    private func isOwn(_ message: ChatMessage) -> Bool {
        (message.senderID != nil && message.senderID == chat.ownUserID) || chat.written.contains(message.clientMessageID)
    }

    /// Own messages' status from the other members' cursors: delivered (read) once every other
    /// member's delivered (read) seq is at or past it. Only messages of the epoch the cursors
    /// count in. This device's user is known from the gateway's copy of a message it wrote.
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

    /// Tells the gateway what this device received and what the app read: never past its last
    /// seq, so never past a seq it has not got, and never held back by a range named missing.
    /// Not while the conversation's sync is under way: its `synced` may say the epoch changed, and
    /// a cursor of the old one would count as the new one's last seq. The `synced` sends them.
    func sendCursors(_ conversation: String) {
        guard outbox != nil, !awaitingInitialState, !chat.syncing.contains(conversation), var log = chat.logs[conversation], log.lastSeq > 0 else {
            return
        }
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
