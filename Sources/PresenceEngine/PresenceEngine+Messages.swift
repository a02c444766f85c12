import Foundation
import PresenceProtocol
import RedisClient

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
        let outcome = try await evaluate(SendMessage(conversation: conversation, sender: sender, message: message, newEpoch: Self.newEpoch()))
        switch outcome {
        case .stored(let stored): return (stored, false)
        case .duplicate(let stored): return (stored, true)
        }
    }

    /// Throws unless `message` is one API.md accepts.
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
            guard seq >= 0 else { throw PresenceError(.invalidRequest, "a seq must not be negative") }
        case .latest: break
        }
        return try await evaluate(ReadHistory(conversation: conversation, reader: reader, page: range, limit: limit, newEpoch: Self.newEpoch()))
    }

    /// Moves `user`'s `kind` cursor in `conversation` up to `seq`; returns both cursors.
    public func moveCursor(_ kind: CursorKind, of user: String, in conversation: String, to seq: Int64) async throws(PresenceError) -> Cursors {
        guard seq >= 0 else { throw PresenceError(.invalidRequest, "seq must not be negative") }
        return try await evaluate(MoveCursor(conversation: conversation, user: user, kind: kind, seq: seq))
    }

    /// Every member's cursors in `conversation`, for the member `reader`.
    public func receipts(of conversation: String, for reader: String) async throws(PresenceError) -> [(user: String, cursors: Cursors)] {
        try await evaluate(ReadReceipts(conversation: conversation, reader: reader))
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
        guard let object = try? JSONSerialization.jsonObject(with: Data(payload)) as? [String: Any],
              let conversation = object["conversation_id"] as? String, let epoch = object["epoch"] as? String else { return nil }
        func int(_ key: String) -> Int64? { (object[key] as? NSNumber).map { $0.int64Value } }
        func text(_ key: String) -> String? { (object[key] as? String).flatMap { $0.isEmpty ? nil : $0 } }
        switch object["type"] as? String {
        case "message":
            guard let seq = int("seq"), let id = text("id"), let sender = text("sender_id"), let clientID = text("client_message_id"),
                  let type = text("message_type").flatMap(MessageType.init(rawValue:)), let body = object["text"] as? String,
                  let created = int("created_at") else { return nil }
            var fields = ["i", id, "u", sender, "c", clientID, "t", type.rawValue, "x", body, "a", String(created)]
            if let image = text("image_url") { fields += ["g", image] }
            if let clientAt = text("client_created_at") { fields += ["k", clientAt] }
            return StoredMessage(conversation: conversation, epoch: epoch, seq: seq, fields: fields).map(MessageEvent.message)
        case "receipt":
            guard let user = text("user_id"), let delivered = int("delivered_seq"), let read = int("read_seq") else { return nil }
            return .receipt(conversationID: conversation, epoch: epoch, userID: user, cursors: Cursors(deliveredSeq: delivered, readSeq: read))
        default:
            return nil
        }
    }
}
