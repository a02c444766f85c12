/// One user's presence as the API writes it: `{"user_id", "status", "last_seen"}`, and
/// `is_typing` in REST reads.
public struct PresencePayload: Sendable, Hashable, Codable {
    /// The user.
    public var userID: String
    /// Their aggregate status, as the reader may see it.
    public var status: PresenceStatus
    /// The last moment they were online or away, in milliseconds since 1970; `nil` if never.
    public var lastSeen: Int64?
    /// Whether they are typing in a conversation shared with the reader (REST reads only).
    public var isTyping: Bool?

    /// A presence.
    public init(userID: String, status: PresenceStatus, lastSeen: Int64?, isTyping: Bool? = nil) {
        self.userID = userID
        self.status = status
        self.lastSeen = lastSeen
        self.isTyping = isTyping
    }

    enum CodingKeys: String, CodingKey {
        case userID = "user_id", status, lastSeen = "last_seen", isTyping = "is_typing"
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        userID = try container.decodeID(forKey: .userID)
        status = try container.decode(PresenceStatus.self, forKey: .status)
        lastSeen = try container.decodeTimestamp(forKey: .lastSeen)
        isTyping = try container.decodeIfPresent(Bool.self, forKey: .isTyping)
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try PresenceIDFormat(userInfo: encoder.userInfo).encode(userID, forKey: .userID, in: &container)
        try container.encode(status, forKey: .status)
        try container.encodeTimestamp(lastSeen, forKey: .lastSeen)
        try container.encodeIfPresent(isTyping, forKey: .isTyping)
    }
}

/// A user started or stopped typing in a conversation: `{"user_id", "conversation_id", "is_typing"}`.
public struct TypingUpdate: Sendable, Hashable, Codable {
    /// Who types.
    public var userID: String
    /// Where.
    public var conversationID: String
    /// Whether they are typing now.
    public var isTyping: Bool

    /// A typing change.
    public init(userID: String, conversationID: String, isTyping: Bool) {
        self.userID = userID
        self.conversationID = conversationID
        self.isTyping = isTyping
    }

    enum CodingKeys: String, CodingKey {
        case userID = "user_id", conversationID = "conversation_id", isTyping = "is_typing"
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        userID = try container.decodeID(forKey: .userID)
        conversationID = try container.decodeID(forKey: .conversationID)
        isTyping = try container.decode(Bool.self, forKey: .isTyping)
    }

    public func encode(to encoder: any Encoder) throws {
        let ids = PresenceIDFormat(userInfo: encoder.userInfo)
        var container = encoder.container(keyedBy: CodingKeys.self)
        try ids.encode(userID, forKey: .userID, in: &container)
        try ids.encode(conversationID, forKey: .conversationID, in: &container)
        try container.encode(isTyping, forKey: .isTyping)
    }
}

/// The counts of a conversation, "3 of 5 online": `{"conversation_id", "total", "online", "away"}`.
public struct GroupPresence: Sendable, Hashable, Codable {
    /// The conversation.
    public var conversationID: String
    /// Its members.
    public var total: Int
    /// Members online.
    public var online: Int
    /// Members away.
    public var away: Int

    /// Counts of a conversation.
    public init(conversationID: String, total: Int, online: Int, away: Int) {
        self.conversationID = conversationID
        self.total = total
        self.online = online
        self.away = away
    }

    enum CodingKeys: String, CodingKey {
        case conversationID = "conversation_id", total, online, away
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        conversationID = try container.decodeID(forKey: .conversationID)
        total = try container.decode(Int.self, forKey: .total)
        online = try container.decode(Int.self, forKey: .online)
        away = try container.decode(Int.self, forKey: .away)
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try PresenceIDFormat(userInfo: encoder.userInfo).encode(conversationID, forKey: .conversationID, in: &container)
        try container.encode(total, forKey: .total)
        try container.encode(online, forKey: .online)
        try container.encode(away, forKey: .away)
    }
}

/// An error answer: `{"code", "message"}`, the `data` of an `error` frame and the `error` of a
/// REST error body.
public struct ErrorPayload: Sendable, Hashable, Codable {
    /// What kind of error.
    public var code: ErrorCode
    /// Words for a person.
    public var message: String
    /// The conversation a refusal is about, when one frame names several (a `sync`).
    public var conversationID: String?

    /// An error answer.
    public init(code: ErrorCode, message: String, conversationID: String? = nil) {
        self.code = code
        self.message = message
        self.conversationID = conversationID
    }

    enum CodingKeys: String, CodingKey {
        case code, message, conversationID = "conversation_id"
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        code = try container.decode(ErrorCode.self, forKey: .code)
        message = try container.decode(String.self, forKey: .message)
        conversationID = container.contains(.conversationID) ? try container.decodeID(forKey: .conversationID) : nil
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode(code, forKey: .code)
        try container.encode(message, forKey: .message)
        if let conversationID { try PresenceIDFormat(userInfo: encoder.userInfo).encode(conversationID, forKey: .conversationID, in: &container) }
    }
}

extension KeyedDecodingContainer {
    /// A user or conversation id: a string, or a whole number from a peer that writes ids as
    /// numbers (`PRESENCE_ID_FORMAT=numeric`); kept as its decimal text either way.
    func decodeID(forKey key: Key) throws -> String {
        if let number = try? decode(Int64.self, forKey: key) { return String(number) }
        return try decode(String.self, forKey: key)
    }

    /// An API timestamp, or `null`.
    func decodeTimestamp(forKey key: Key) throws -> Int64? {
        guard let text = try decodeIfPresent(String.self, forKey: key) else { return nil }
        guard let milliseconds = PresenceTimestamp.milliseconds(text) else {
            throw DecodingError.dataCorruptedError(forKey: key, in: self, debugDescription: "not an ISO 8601 UTC timestamp: \(text.prefix(64))")
        }
        return milliseconds
    }
}

extension KeyedEncodingContainer {
    /// An API timestamp, or an explicit `null` (the API writes `"last_seen": null`, never leaves it out).
    public mutating func encodeTimestamp(_ milliseconds: Int64?, forKey key: Key) throws {
        if let milliseconds {
            try encode(PresenceTimestamp.iso8601(milliseconds), forKey: key)
        } else {
            try encodeNil(forKey: key)
        }
    }
}
