/// How large a message's text, and the REST bodies and frames that carry one, may be.
public enum MessageSize {
    /// The largest `text`, in UTF-8 bytes, unless `PRESENCE_MESSAGE_MAX_BYTES` says otherwise.
    public static let defaultMaxTextBytes = 16_384

    /// The largest REST body or WebSocket message for texts of up to `maxTextBytes`: room for the
    /// text written with JSON's longest escapes (six bytes a byte) and the rest of its body; at
    /// least 128 KiB.
    public static func maxFrameBytes(maxTextBytes: Int) -> Int { max(128 * 1024, maxTextBytes * 6 + 4 * 1024) }
}

/// A conversation's message as REST and the `message` frame carry it (docs/API.md, "Messages").
public struct MessagePayload: Sendable, Hashable, Codable {
    public var conversationID: String
    /// The life of the history the message belongs to; `(epoch, seq)` names it. `nil` only when
    /// read from a frame that did not carry it.
    public var epoch: String?
    public var seq: Int64
    public var id: String
    public var senderID: String
    public var clientMessageID: String
    /// `text` or `image`.
    public var type: String
    public var text: String
    public var imageURL: String?
    /// Milliseconds since 1970.
    public var createdAt: Int64
    /// Milliseconds since 1970, as the client said; `nil` when it said nothing.
    public var clientCreatedAt: Int64?
    /// Set on a send's answer only: whether the send was a retry of one already stored.
    public var duplicate: Bool?

    public init(conversationID: String, epoch: String?, seq: Int64, id: String, senderID: String, clientMessageID: String, type: String,
                text: String, imageURL: String?, createdAt: Int64, clientCreatedAt: Int64?, duplicate: Bool? = nil) {
        self.conversationID = conversationID
        self.epoch = epoch
        self.seq = seq
        self.id = id
        self.senderID = senderID
        self.clientMessageID = clientMessageID
        self.type = type
        self.text = text
        self.imageURL = imageURL
        self.createdAt = createdAt
        self.clientCreatedAt = clientCreatedAt
        self.duplicate = duplicate
    }

    enum CodingKeys: String, CodingKey {
        case conversationID = "conversation_id", epoch, seq, id, senderID = "sender_id", clientMessageID = "client_message_id", type, text
        case imageURL = "image_url", createdAt = "created_at", clientCreatedAt = "client_created_at", duplicate
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        conversationID = try container.decodeID(forKey: .conversationID)
        epoch = try container.decodeIfPresent(String.self, forKey: .epoch)
        seq = try container.decode(Int64.self, forKey: .seq)
        id = try container.decode(String.self, forKey: .id)
        senderID = try container.decodeID(forKey: .senderID)
        clientMessageID = try container.decode(String.self, forKey: .clientMessageID)
        type = try container.decode(String.self, forKey: .type)
        text = try container.decode(String.self, forKey: .text)
        imageURL = try container.decodeIfPresent(String.self, forKey: .imageURL)
        guard let created = try container.decodeTimestamp(forKey: .createdAt) else {
            throw DecodingError.valueNotFound(String.self, .init(codingPath: [CodingKeys.createdAt], debugDescription: "created_at is null"))
        }
        createdAt = created
        clientCreatedAt = try container.decodeTimestamp(forKey: .clientCreatedAt)
        duplicate = try container.decodeIfPresent(Bool.self, forKey: .duplicate)
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        let format = PresenceIDFormat(userInfo: encoder.userInfo)
        try format.encode(conversationID, forKey: .conversationID, in: &container)
        try container.encodeIfPresent(epoch, forKey: .epoch)
        try container.encode(seq, forKey: .seq)
        try container.encode(id, forKey: .id)
        try format.encode(senderID, forKey: .senderID, in: &container)
        try container.encode(clientMessageID, forKey: .clientMessageID)
        try container.encode(type, forKey: .type)
        try container.encode(text, forKey: .text)
        try container.encode(imageURL, forKey: .imageURL)
        try container.encodeTimestamp(createdAt, forKey: .createdAt)
        try container.encodeTimestamp(clientCreatedAt, forKey: .clientCreatedAt)
        try container.encodeIfPresent(duplicate, forKey: .duplicate)
    }
}

/// A page of history: `{"conversation_id","epoch","first_seq","last_seq","messages"}`.
public struct HistoryPayload: Sendable, Hashable, Encodable {
    public var conversationID: String
    public var epoch: String
    public var firstSeq: Int64
    public var lastSeq: Int64
    public var messages: [MessagePayload]

    public init(conversationID: String, epoch: String, firstSeq: Int64, lastSeq: Int64, messages: [MessagePayload]) {
        self.conversationID = conversationID
        self.epoch = epoch
        self.firstSeq = firstSeq
        self.lastSeq = lastSeq
        self.messages = messages
    }

    enum CodingKeys: String, CodingKey {
        case conversationID = "conversation_id", epoch, firstSeq = "first_seq", lastSeq = "last_seq", messages
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try PresenceIDFormat(userInfo: encoder.userInfo).encode(conversationID, forKey: .conversationID, in: &container)
        try container.encode(epoch, forKey: .epoch)
        try container.encode(firstSeq, forKey: .firstSeq)
        try container.encode(lastSeq, forKey: .lastSeq)
        try container.encode(messages, forKey: .messages)
    }
}

/// A member's cursors: `{"user_id"?, "conversation_id"?, "delivered_seq", "read_seq"}` (the
/// answer to `read` has neither id; a receipt row has the user's; a `receipt` frame both).
public struct ReceiptPayload: Sendable, Hashable, Codable {
    public var conversationID: String?
    public var userID: String?
    public var deliveredSeq: Int64
    public var readSeq: Int64

    public init(conversationID: String? = nil, userID: String? = nil, deliveredSeq: Int64, readSeq: Int64) {
        self.conversationID = conversationID
        self.userID = userID
        self.deliveredSeq = deliveredSeq
        self.readSeq = readSeq
    }

    enum CodingKeys: String, CodingKey {
        case conversationID = "conversation_id", userID = "user_id", deliveredSeq = "delivered_seq", readSeq = "read_seq"
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        conversationID = container.contains(.conversationID) ? try container.decodeID(forKey: .conversationID) : nil
        userID = container.contains(.userID) ? try container.decodeID(forKey: .userID) : nil
        deliveredSeq = try container.decode(Int64.self, forKey: .deliveredSeq)
        readSeq = try container.decode(Int64.self, forKey: .readSeq)
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        let format = PresenceIDFormat(userInfo: encoder.userInfo)
        if let conversationID { try format.encode(conversationID, forKey: .conversationID, in: &container) }
        if let userID { try format.encode(userID, forKey: .userID, in: &container) }
        try container.encode(deliveredSeq, forKey: .deliveredSeq)
        try container.encode(readSeq, forKey: .readSeq)
    }
}

/// One of the caller's conversations in `GET /api/conversations`.
public struct ConversationEntryPayload: Sendable, Hashable, Encodable {
    public var conversationID: String
    /// `null` while the conversation has no history.
    public var epoch: String?
    public var lastSeq: Int64
    public var deliveredSeq: Int64
    public var readSeq: Int64
    public var unread: Int64
    public var lastMessage: MessagePayload?

    public init(conversationID: String, epoch: String?, lastSeq: Int64, deliveredSeq: Int64, readSeq: Int64, unread: Int64, lastMessage: MessagePayload?) {
        self.conversationID = conversationID
        self.epoch = epoch
        self.lastSeq = lastSeq
        self.deliveredSeq = deliveredSeq
        self.readSeq = readSeq
        self.unread = unread
        self.lastMessage = lastMessage
    }

    enum CodingKeys: String, CodingKey {
        case conversationID = "conversation_id", epoch, lastSeq = "last_seq", deliveredSeq = "delivered_seq", readSeq = "read_seq", unread
        case lastMessage = "last_message"
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try PresenceIDFormat(userInfo: encoder.userInfo).encode(conversationID, forKey: .conversationID, in: &container)
        try container.encode(epoch, forKey: .epoch)
        try container.encode(lastSeq, forKey: .lastSeq)
        try container.encode(deliveredSeq, forKey: .deliveredSeq)
        try container.encode(readSeq, forKey: .readSeq)
        try container.encode(unread, forKey: .unread)
        try container.encode(lastMessage, forKey: .lastMessage)
    }
}

/// The answer to a WebSocket `send`: `{"conversation_id","client_message_id","seq","id",
/// "created_at","duplicate"}`.
public struct MessageAckPayload: Sendable, Hashable, Codable {
    public var conversationID: String
    public var clientMessageID: String
    /// The epoch `seq` belongs to; `nil` only when read from a frame that did not carry it.
    public var epoch: String?
    public var seq: Int64
    public var id: String
    /// Milliseconds since 1970.
    public var createdAt: Int64
    /// Whether the send was a retry of a message already stored.
    public var duplicate: Bool

    public init(conversationID: String, clientMessageID: String, epoch: String?, seq: Int64, id: String, createdAt: Int64, duplicate: Bool) {
        self.conversationID = conversationID
        self.clientMessageID = clientMessageID
        self.epoch = epoch
        self.seq = seq
        self.id = id
        self.createdAt = createdAt
        self.duplicate = duplicate
    }

    enum CodingKeys: String, CodingKey {
        case conversationID = "conversation_id", clientMessageID = "client_message_id", epoch, seq, id, createdAt = "created_at", duplicate
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        conversationID = try container.decodeID(forKey: .conversationID)
        clientMessageID = try container.decode(String.self, forKey: .clientMessageID)
        epoch = try container.decodeIfPresent(String.self, forKey: .epoch)
        seq = try container.decode(Int64.self, forKey: .seq)
        id = try container.decode(String.self, forKey: .id)
        guard let created = try container.decodeTimestamp(forKey: .createdAt) else {
            throw DecodingError.valueNotFound(String.self, .init(codingPath: [CodingKeys.createdAt], debugDescription: "created_at is null"))
        }
        createdAt = created
        duplicate = try container.decode(Bool.self, forKey: .duplicate)
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try PresenceIDFormat(userInfo: encoder.userInfo).encode(conversationID, forKey: .conversationID, in: &container)
        try container.encode(clientMessageID, forKey: .clientMessageID)
        try container.encodeIfPresent(epoch, forKey: .epoch)
        try container.encode(seq, forKey: .seq)
        try container.encode(id, forKey: .id)
        try container.encodeTimestamp(createdAt, forKey: .createdAt)
        try container.encode(duplicate, forKey: .duplicate)
    }
}

/// A range of messages a `sync` cannot give: `{"epoch","from_seq","to_seq"}`; `to_seq` is
/// `null` for the rest of a lost epoch.
public struct MissingRange: Sendable, Hashable, Codable {
    public var epoch: String?
    public var fromSeq: Int64
    public var toSeq: Int64?

    public init(epoch: String?, fromSeq: Int64, toSeq: Int64?) {
        self.epoch = epoch
        self.fromSeq = fromSeq
        self.toSeq = toSeq
    }

    enum CodingKeys: String, CodingKey {
        case epoch, fromSeq = "from_seq", toSeq = "to_seq"
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode(epoch, forKey: .epoch)
        try container.encode(fromSeq, forKey: .fromSeq)
        try container.encode(toSeq, forKey: .toSeq)
    }
}

/// The end of one conversation's answer to `sync`: `{"conversation_id","epoch","last_seq",
/// "complete","more","missing"}`.
public struct SyncedPayload: Sendable, Hashable, Codable {
    public var conversationID: String
    public var epoch: String
    public var lastSeq: Int64
    /// Nothing after the position asked for is missing.
    public var complete: Bool
    /// The answer was cut at its cap: sync again from the last seq received.
    public var more: Bool
    /// Exactly what cannot be given; empty when `complete`.
    public var missing: [MissingRange]
    /// Seqs of the client's epoch, an ancestor of the current one, above the fork point: held by
    /// the client, lost by Redis. Empty otherwise.
    public var truncated: [MissingRange]
    /// Every member's cursors (`user_id` set), as read after the messages; `nil` (left out) for
    /// a conversation over ``SyncedPayload/receiptsLimit`` members.
    public var receipts: [ReceiptPayload]?

    /// The most members whose cursors a `synced` carries.
    public static let receiptsLimit = 100

    public init(conversationID: String, epoch: String, lastSeq: Int64, complete: Bool, more: Bool, missing: [MissingRange],
                truncated: [MissingRange] = [], receipts: [ReceiptPayload]? = nil) {
        self.conversationID = conversationID
        self.epoch = epoch
        self.lastSeq = lastSeq
        self.complete = complete
        self.more = more
        self.missing = missing
        self.truncated = truncated
        self.receipts = receipts
    }

    enum CodingKeys: String, CodingKey {
        case conversationID = "conversation_id", epoch, lastSeq = "last_seq", complete, more, missing, truncated, receipts
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        conversationID = try container.decodeID(forKey: .conversationID)
        epoch = try container.decode(String.self, forKey: .epoch)
        lastSeq = try container.decode(Int64.self, forKey: .lastSeq)
        complete = try container.decode(Bool.self, forKey: .complete)
        more = try container.decode(Bool.self, forKey: .more)
        missing = try container.decode([MissingRange].self, forKey: .missing)
        truncated = try container.decodeIfPresent([MissingRange].self, forKey: .truncated) ?? []
        receipts = try container.decodeIfPresent([ReceiptPayload].self, forKey: .receipts)
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try PresenceIDFormat(userInfo: encoder.userInfo).encode(conversationID, forKey: .conversationID, in: &container)
        try container.encode(epoch, forKey: .epoch)
        try container.encode(lastSeq, forKey: .lastSeq)
        try container.encode(complete, forKey: .complete)
        try container.encode(more, forKey: .more)
        try container.encode(missing, forKey: .missing)
        try container.encode(truncated, forKey: .truncated)
        try container.encodeIfPresent(receipts, forKey: .receipts)
    }
}
