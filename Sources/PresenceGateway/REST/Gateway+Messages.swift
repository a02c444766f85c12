import Foundation
import Hummingbird
import PresenceEngine
import PresenceProtocol

/// The message routes of docs/API.md, "Messages": send, history, read cursor, receipts, and the
/// caller's conversations.
extension Gateway {
    func addMessageRoutes(to users: RouterGroup<GatewayRequestContext>) {
        users.post("/api/conversations/{conversation_id}/messages") { request, context in
            let user = try context.user
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            let body = try await request.decode(as: SendBody.self, context: context)
            let message = try body.message()
            if let wait = self.messageLimiter.take(user.userID) { throw APIError.rateLimited("too many messages", retryAfter: wait) }
            let sent = try await self.engine.send(message, to: conversation, from: user.userID)
            if !sent.duplicate { GatewayMetrics.messageSent() }
            var payload = MessagePayload(sent.message)
            payload.duplicate = sent.duplicate
            return EditedResponse(status: sent.duplicate ? .ok : .created, response: payload)
        }
        users.get("/api/conversations/{conversation_id}/messages") { request, context in
            let user = try context.user
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            let query = request.uri.queryParameters
            let after = try Self.seqParameter(query.get("after_seq"), "after_seq")
            let before = try Self.seqParameter(query.get("before_seq"), "before_seq")
            let limit = try Self.limitParameter(query.get("limit"))
            let range: HistoryRange
            switch (after, before) {
            case (.some, .some): throw APIError.invalid("give after_seq or before_seq, not both")
            case (.some(let seq), nil): range = .after(seq)
            case (nil, .some(let seq)): range = .before(seq)
            case (nil, nil): range = .latest
            }
            let page = try await self.engine.history(of: conversation, for: user.userID, range, limit: limit)
            return HistoryPayload(conversationID: conversation, epoch: page.epoch, firstSeq: page.firstSeq, lastSeq: page.lastSeq,
                                  messages: page.messages.map(MessagePayload.init))
        }
        users.post("/api/conversations/{conversation_id}/read") { request, context in
            let user = try context.user
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            let body = try await request.decode(as: CursorBody.self, context: context)
            guard SeqBounds.range.contains(body.seq) else { throw APIError.invalid("seq must be \(SeqBounds.rule)") }
            let cursors = try await self.engine.moveCursor(.read, of: user.userID, in: conversation, to: body.seq)
            return ReceiptPayload(deliveredSeq: cursors.deliveredSeq, readSeq: cursors.readSeq)
        }
        users.get("/api/conversations/{conversation_id}/receipts") { _, context in
            let user = try context.user
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            return try await self.engine.receipts(of: conversation, for: user.userID).map {
                ReceiptPayload(userID: $0.user, deliveredSeq: $0.cursors.deliveredSeq, readSeq: $0.cursors.readSeq)
            }
        }
        users.get("/api/conversations") { _, context in
            let user = try context.user
            return try await self.engine.conversationSummaries(of: user.userID).map { summary in
                ConversationEntryPayload(
                    conversationID: summary.conversationID, epoch: summary.epoch.isEmpty ? nil : summary.epoch, lastSeq: summary.lastSeq,
                    deliveredSeq: summary.cursors.deliveredSeq, readSeq: summary.cursors.readSeq, unread: summary.unread,
                    lastMessage: summary.lastMessage.map(MessagePayload.init)
                )
            }
        }
    }

    /// A `seq` query parameter: a whole number from 0, or absent.
    static func seqParameter(_ value: String?, _ name: String) throws(APIError) -> Int64? {
        guard let value else { return nil }
        guard let seq = Int64(value), SeqBounds.range.contains(seq) else { throw .invalid("\(name) must be \(SeqBounds.rule)") }
        return seq
    }

    /// The `limit` query parameter: 1 to 1,000, 100 when absent.
    static func limitParameter(_ value: String?, default fallback: Int = 100) throws(APIError) -> Int {
        guard let value else { return fallback }
        guard let limit = Int(value), (1...PresenceEngine.maxHistoryPage).contains(limit) else {
            throw .invalid("limit must be a whole number from 1 to \(PresenceEngine.maxHistoryPage)")
        }
        return limit
    }

    /// `POST .../messages`: `{"client_message_id","text","type"?,"image_url"?,"client_created_at"?}`.
    struct SendBody: Decodable {
        var clientMessageId: String
        var text: String
        var type: String?
        var imageUrl: String?
        var clientCreatedAt: String?

        /// The message, or the 422 that says what is wrong with it.
        func message() throws(APIError) -> OutgoingMessage {
            let kind: MessageType
            if let type {
                guard let known = MessageType(rawValue: type) else { throw .invalid("type must be text or image") }
                kind = known
            } else {
                kind = .text
            }
            var clientAt: Int64?
            if let clientCreatedAt {
                guard let moment = PresenceTimestamp.milliseconds(clientCreatedAt), moment >= 0 else {
                    throw .invalid("client_created_at must be an ISO 8601 UTC timestamp from 1970 on, such as 2026-11-21T12:00:00.123Z")
                }
                clientAt = moment
            }
            return OutgoingMessage(clientMessageID: clientMessageId, type: kind, text: text, imageURL: imageUrl, clientCreatedAt: clientAt)
        }
    }

    /// `POST .../read`: `{"seq"}`.
    struct CursorBody: Decodable {
        var seq: Int64
    }
}

extension MessagePayload {
    init(_ message: StoredMessage) {
        self.init(conversationID: message.conversationID, epoch: message.epoch, seq: message.seq, id: message.id, senderID: message.senderID,
                  clientMessageID: message.clientMessageID, type: message.type.rawValue, text: message.text, imageURL: message.imageURL,
                  createdAt: message.createdAt, clientCreatedAt: message.clientCreatedAt)
    }
}
