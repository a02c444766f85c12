import Foundation
import NIOConcurrencyHelpers
import PresenceProtocol
import RedisClient

/// The answer to one position of a `sync`: the messages to send, in order, and what cannot be.
public struct SyncAnswer: Sendable, Equatable {
    public var epoch: String
    public var lastSeq: Int64
    public var messages: [StoredMessage]
    /// The page was cut at its cap before the last seq.
    public var more: Bool
    /// Exactly what cannot be given: a lost epoch's rest, then the current epoch's trimmed start.
    public var missing: [MissingRange]
    /// The seqs the client holds of an epoch the current one forked from, above the fork point:
    /// Redis lost them (docs/API.md, "Forks").
    public var truncated: [MissingRange] = []
    /// The seq the answer goes on from: the position's, or the fork point below it.
    public var after: Int64

    /// Reads a page of the current epoch after `after`, following `lostEpoch` (the client's, gone).
    init(page: HistoryPage, after: Int64, lostEpoch: MissingRange?) {
        epoch = page.epoch
        lastSeq = page.lastSeq
        messages = page.messages
        more = page.messages.count >= PresenceEngine.maxHistoryPage && (page.messages.last?.seq ?? page.lastSeq) < page.lastSeq
        missing = lostEpoch.map { [$0] } ?? []
        self.after = after
        // Trimmed before what is kept (or all of it, when nothing is).
        let trimmedTo = min(page.firstSeq - 1, page.lastSeq)
        if trimmedTo > after { missing.append(MissingRange(epoch: page.epoch, fromSeq: after + 1, toSeq: trimmedTo)) }
    }

    public var complete: Bool { missing.isEmpty }
}

/// A message or a receipt as published on a conversation's message channel.
public enum MessageEvent: Sendable, Equatable {
    case message(StoredMessage)
    case receipt(conversationID: String, epoch: String, userID: String, cursors: Cursors)
}

extension PresenceEngine {
    /// Most messages one history read returns.
    public static let maxHistoryPage = 1_000

    /// Stores `message` from `sender` in `conversation`'s history and publishes it; a retry of
    /// a `clientMessageID` the sender sent there before returns that message, `duplicate`.
    ///
    /// - Throws: `notFound` without the conversation, `forbidden` for a non-member,
    ///   `invalidRequest` or `payloadTooLarge` for a message out of bounds, `unavailable`.
    public func send(_ message: OutgoingMessage, to conversation: String, from sender: String) async throws(PresenceError) -> (message: StoredMessage, duplicate: Bool) {
        try check(message)
        // With replicas to wait for, the write and the WAIT share a connection of their own.
        let replicated = configuration.messageReplicas > 0
        let client = replicated ? sendRedis : redis
        let outcome = try await evaluate(SendMessage(conversation: conversation, sender: sender, message: message, newEpoch: Self.newEpoch(),
                                                     publish: !replicated), on: client)
        let sent: (message: StoredMessage, duplicate: Bool) = switch outcome {
        case .stored(let stored): (stored, false)
        case .duplicate(let stored): (stored, true)
        }
        if !sent.duplicate { messagesStored.withLockedValue { $0 += 1 } }
        if replicated {
            try await awaitReplicas(of: conversation)
            // Delivered only once the replicas have it (a retry's duplicate publishes too: the
            // first try may have stopped short of it; nodes drop a seq they delivered already).
            let channel = keys.messageChannel(conversation)
            _ = try await run { try await self.redis.publish(Self.messageEvent(sent.message), on: channel) }
            // The sender's cursors moved with it, as the send script tells when it publishes.
            let members = try await run { try await self.redis.execute(SCARD(key: self.keys.members(conversation))) }
            if !sent.duplicate, members <= configuration.largeGroup {
                let receipt = PublishedReceipt(conversationID: conversation, epoch: sent.message.epoch, userID: sender,
                                               deliveredSeq: sent.message.seq, readSeq: sent.message.seq)
                _ = try await run { try await self.redis.publish(Array((try? JSONEncoder().encode(receipt)) ?? Data()), on: channel) }
            }
        }
        return sent
    }

    /// A message as the send script publishes it (see ``PublishedMessage``).
    static func messageEvent(_ message: StoredMessage) -> [UInt8] {
        Array((try? JSONEncoder().encode(PublishedMessage(message))) ?? Data())
    }

    /// With `messageReplicas`, waits up to a second for that many replicas to have what this
    /// node's send connection wrote to the conversation's server (a retry's duplicate too: the retry after a 503
    /// learns whether the message got there since).
    ///
    /// - Throws: `unavailable` when fewer confirm it in time; the message stays stored.
    func awaitReplicas(of conversation: String) async throws(PresenceError) {
        let wanted = configuration.messageReplicas
        guard wanted > 0 else { return }
        let confirmed = try await run {
            try await self.sendRedis.waitForReplicas(wanted, timeoutMilliseconds: 1_000, afterWriting: self.keys.history(conversation))
        }
        guard confirmed >= wanted else {
            throw PresenceError(.unavailable, "the message is stored, but \(confirmed) of the \(wanted) replicas asked for confirmed it within 1 s; send it again with the same client_message_id")
        }
    }

    /// Throws unless `message` is one docs/API.md accepts.
    func check(_ message: OutgoingMessage) throws(PresenceError) {
        guard PresenceID.isValid(message.clientMessageID) else {
            throw PresenceError(.invalidRequest, "client_message_id must be \(PresenceID.rule)")
        }
        let bytes = message.text.utf8.count
        guard bytes > 0 else { throw PresenceError(.invalidRequest, "text must not be empty") }
        guard bytes <= configuration.messageMaxBytes else {
            throw PresenceError(.payloadTooLarge, "text is \(bytes) bytes; at most \(configuration.messageMaxBytes) are allowed")
        }
        switch message.type {
        case .text:
            guard message.imageURL == nil else { throw PresenceError(.invalidRequest, "image_url is only for messages of type image") }
        case .image:
            guard let url = message.imageURL, Self.isImageURL(url) else {
                throw PresenceError(.invalidRequest, "a message of type image needs an http or https image_url of at most 2,048 characters")
            }
        }
    }

    static func isImageURL(_ text: String) -> Bool {
        guard text.utf8.count <= 2_048, let url = URL(string: text), let scheme = url.scheme?.lowercased(), url.host != nil else { return false }
        return scheme == "https" || scheme == "http"
    }

    /// A history's new epoch: 64 random bits, so that no epoch is used twice, even after Redis
    /// lost the record of the last one.
    static func newEpoch() -> String {
        String(UInt64.random(in: 1...UInt64.max), radix: 16)
    }

    /// A page of `conversation`'s history for the member `reader`, at most `limit` messages.
    public func history(of conversation: String, for reader: String, _ range: HistoryRange, limit: Int = 100) async throws(PresenceError) -> HistoryPage {
        guard (1...Self.maxHistoryPage).contains(limit) else { throw PresenceError(.invalidRequest, "limit must be 1 to \(Self.maxHistoryPage)") }
        switch range {
        case .after(let seq), .before(let seq):
            guard SeqBounds.range.contains(seq) else { throw PresenceError(.invalidRequest, "a seq must be \(SeqBounds.rule)") }
        case .latest: break
        }
        return try await evaluate(ReadHistory(conversation: conversation, reader: reader, page: range, limit: limit, newEpoch: Self.newEpoch()))
    }

    /// A page of `conversation`'s history for this node's delivery: no member check, and an
    /// empty epoch for a conversation without history.
    /// With `epoch`, an `after` read of an epoch the current one forked from reads on from the
    /// lower of the seq and its fork point (``HistoryPage/forkPoint``).
    public func deliveryPage(of conversation: String, _ range: HistoryRange, limit: Int = maxHistoryPage,
                             epoch: String? = nil) async throws(PresenceError) -> HistoryPage {
        try await evaluate(ReadHistory(conversation: conversation, reader: "", page: range, limit: limit, newEpoch: "", epoch: epoch))
    }

    /// Where each conversation's history stands (its epoch, empty for none, and last seq), read
    /// in one pipeline; a conversation whose read failed is left out.
    public func historyPositions(_ conversations: [String]) async throws(PresenceError) -> [String: (epoch: String, lastSeq: Int64)] {
        let calls = conversations.map { ReadHistory(conversation: $0, reader: "", page: .latest, limit: 1, newEpoch: "") }
        var positions: [String: (epoch: String, lastSeq: Int64)] = [:]
        for (call, result) in zip(calls, try await evaluate(calls)) {
            if case .success(let page) = result { positions[call.conversation] = (page.epoch, page.lastSeq) }
        }
        return positions
    }

    /// What `reader` is missing of a conversation after `position` (docs/API.md's `sync`): at most
    /// ``maxHistoryPage`` messages, and exactly what cannot be given.
    public func sync(_ position: SyncPosition, for reader: String) async throws(PresenceError) -> SyncAnswer {
        guard SeqBounds.range.contains(position.afterSeq) else { throw PresenceError(.invalidRequest, "after_seq must be \(SeqBounds.rule)") }
        let first = try await evaluate(ReadHistory(conversation: position.conversationID, reader: reader, page: .after(position.afterSeq),
                                                   limit: Self.maxHistoryPage, newEpoch: Self.newEpoch(), epoch: position.epoch))
        if let point = first.forkPoint, let epoch = position.epoch {
            // An epoch the current one forked from: on from the fork point, and what the client
            // holds above it is named.
            let from = min(point, position.afterSeq)
            var answer = SyncAnswer(page: first, after: from, lostEpoch: nil)
            if position.afterSeq > point { answer.truncated = [MissingRange(epoch: epoch, fromSeq: point + 1, toSeq: position.afterSeq)] }
            return answer
        }
        let lost = position.epoch.map { $0 != first.epoch } ?? (position.afterSeq > first.lastSeq)
        guard lost else { return SyncAnswer(page: first, after: position.afterSeq, lostEpoch: nil) }
        // The client's history is gone: the current one from its start.
        let page = position.afterSeq == 0 ? first : try await history(of: position.conversationID, for: reader, .after(0), limit: Self.maxHistoryPage)
        return SyncAnswer(page: page, after: 0, lostEpoch: MissingRange(epoch: position.epoch, fromSeq: position.afterSeq + 1, toSeq: nil))
    }

    /// Moves `user`'s `kind` cursor in `conversation` up to `seq`; returns both cursors.
    public func moveCursor(_ kind: CursorKind, of user: String, in conversation: String, to seq: Int64) async throws(PresenceError) -> Cursors {
        guard SeqBounds.range.contains(seq) else { throw PresenceError(.invalidRequest, "seq must be \(SeqBounds.rule)") }
        let move = try await evaluate(MoveCursor(conversation: conversation, user: user, kind: kind, seq: seq))
        if move.large { deliveredBatch.withLockedValue { $0.learn(conversation, member: user, at: .now) } }
        return move.cursors
    }

    /// A conversation as an administrator sees it (the dashboard): its newest `limit` messages and
    /// every member's cursors; `nil` when there is no such conversation.
    public func conversationDetail(_ conversation: String, limit: Int = 50) async throws(PresenceError) -> ConversationSnapshot? {
        let members: [(user: String, cursors: Cursors)]
        do {
            members = try await evaluate(ReadReceipts(conversation: conversation, reader: "")) ?? []
        } catch where error.code == .notFound {
            return nil
        }
        let page = try await deliveryPage(of: conversation, .latest, limit: limit)
        return ConversationSnapshot(page: page, members: members)
    }

    /// Every member's cursors in `conversation`, for the member `reader`.
    public func receipts(of conversation: String, for reader: String) async throws(PresenceError) -> [(user: String, cursors: Cursors)] {
        try await evaluate(ReadReceipts(conversation: conversation, reader: reader)) ?? []
    }

    /// Every member's cursors in `conversation`, for the member `reader`, unless it has more than
    /// `limit` members: then `nil`, and they are not read (a large group's every reconnect must
    /// not read all of them).
    public func receipts(of conversation: String, for reader: String, atMost limit: Int) async throws(PresenceError) -> [(user: String, cursors: Cursors)]? {
        try await evaluate(ReadReceipts(conversation: conversation, reader: reader, atMost: max(1, limit)))
    }

    /// `user`'s conversations with their history's state and the user's cursors, in id order.
    public func conversationSummaries(of user: String) async throws(PresenceError) -> [ConversationSummary] {
        let conversations = try await conversations(of: user).sorted()
        var summaries: [ConversationSummary] = []
        for start in stride(from: 0, to: conversations.count, by: 200) {
            let calls = conversations[start..<min(start + 200, conversations.count)].map { SummarizeConversation(conversation: $0, user: user) }
            for result in try await evaluate(calls) {
                if let summary = try result.get() { summaries.append(summary) }
            }
        }
        return summaries
    }

    /// Decodes a message or receipt published on a message channel; `nil` for anything else.
    public func decodeMessageEvent(_ payload: [UInt8]) -> MessageEvent? {
        (PublishedMessageEvent(direct: payload) ?? (try? JSONDecoder().decode(PublishedMessageEvent.self, from: Data(payload))))?.event
    }
}
