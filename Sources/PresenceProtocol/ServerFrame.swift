import Foundation

/// What the gateway sends a client. Each case is one `type` of the API, with its `data`.
public enum ServerFrame: Sendable, Hashable {
    /// The presence of users: first on every session, then in answer to `subscribe`.
    case initialState([PresencePayload])
    /// A watched user's aggregate status (or `last_seen` on going offline) changed.
    case presenceUpdate(PresencePayload)
    /// A user started or stopped typing in a conversation the session follows.
    case typingUpdate(TypingUpdate)
    /// A followed conversation's counts: on subscribing, and whenever they change.
    case groupPresence(GroupPresence)
    /// A conversation's message, to every live session of every member, in `seq` order.
    case message(MessagePayload)
    /// The answer to `send`: the message is stored.
    case messageAck(MessageAckPayload)
    /// The end of one conversation's answer to `sync`.
    case synced(SyncedPayload)
    /// A member's cursors moved (`conversation_id` and `user_id` set).
    case receipt(ReceiptPayload)
    /// A client frame was done.
    case ack
    /// The answer to `ping`.
    case pong
    /// A client frame was refused, or the session is about to be closed.
    case error(ErrorPayload)

    /// The frame's `type`.
    public var type: String {
        switch self {
        case .initialState: "initial_state"
        case .presenceUpdate: "presence_update"
        case .typingUpdate: "typing_update"
        case .groupPresence: "group_presence"
        case .message: "message"
        case .messageAck: "message_ack"
        case .synced: "synced"
        case .receipt: "receipt"
        case .ack: "ack"
        case .pong: "pong"
        case .error: "error"
        }
    }
}

/// A server frame with the `id` of the client frame it answers, if it answers one:
/// `{"type", "data", "id"?}`.
public struct ServerMessage: Sendable, Hashable {
    /// The frame.
    public var frame: ServerFrame
    /// The `id` of the client frame this answers.
    public var id: String?

    /// A frame, answering the client frame `id` if given.
    public init(_ frame: ServerFrame, id: String? = nil) {
        self.frame = frame
        self.id = id
    }
}

extension ServerMessage: Codable {
    enum CodingKeys: String, CodingKey { case type, data, id }
    enum InitialStateKeys: String, CodingKey { case presences }
    struct NoData: Codable {}

    /// Decodes any frame of the API; a `type` this version does not know throws
    /// ``ProtocolError/unknownType(_:)`` (newer gateways may send more).
    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        id = try container.decodeIfPresent(String.self, forKey: .id)
        let type = try container.decode(String.self, forKey: .type)
        switch type {
        case "initial_state":
            let data = try container.nestedContainer(keyedBy: InitialStateKeys.self, forKey: .data)
            frame = .initialState(try data.decode([PresencePayload].self, forKey: .presences))
        case "presence_update": frame = .presenceUpdate(try container.decode(PresencePayload.self, forKey: .data))
        case "typing_update": frame = .typingUpdate(try container.decode(TypingUpdate.self, forKey: .data))
        case "group_presence": frame = .groupPresence(try container.decode(GroupPresence.self, forKey: .data))
        case "message": frame = .message(try container.decode(MessagePayload.self, forKey: .data))
        case "message_ack": frame = .messageAck(try container.decode(MessageAckPayload.self, forKey: .data))
        case "synced": frame = .synced(try container.decode(SyncedPayload.self, forKey: .data))
        case "receipt": frame = .receipt(try container.decode(ReceiptPayload.self, forKey: .data))
        case "ack": frame = .ack
        case "pong": frame = .pong
        case "error": frame = .error(try container.decode(ErrorPayload.self, forKey: .data))
        default: throw ProtocolError.unknownType(String(type.prefix(64)))
        }
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode(frame.type, forKey: .type)
        switch frame {
        case .initialState(let presences):
            var data = container.nestedContainer(keyedBy: InitialStateKeys.self, forKey: .data)
            try data.encode(presences, forKey: .presences)
        case .presenceUpdate(let presence): try container.encode(presence, forKey: .data)
        case .typingUpdate(let typing): try container.encode(typing, forKey: .data)
        case .groupPresence(let group): try container.encode(group, forKey: .data)
        case .message(let message): try container.encode(message, forKey: .data)
        case .messageAck(let ack): try container.encode(ack, forKey: .data)
        case .synced(let synced): try container.encode(synced, forKey: .data)
        case .receipt(let receipt): try container.encode(receipt, forKey: .data)
        case .ack, .pong: try container.encode(NoData(), forKey: .data)
        case .error(let error): try container.encode(error, forKey: .data)
        }
        try container.encodeIfPresent(id, forKey: .id)
    }
}

/// A frame that is not one of the protocol's.
public enum ProtocolError: Error, Sendable, Hashable, CustomStringConvertible {
    /// A `type` this version does not know.
    case unknownType(String)

    public var description: String {
        switch self {
        case .unknownType(let type): "unknown frame type '\(type)'"
        }
    }
}
