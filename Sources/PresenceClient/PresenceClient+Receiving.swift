import Foundation
import Logging

/// Receiving messages (docs/API.md, "Messages"): `sync` on every session, messages placed in
/// `seq` order without repeats, gaps announced, receipts and the statuses of this device's own
/// messages. The outbox is in PresenceClient+Messages.swift.
extension PresenceClient {
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
