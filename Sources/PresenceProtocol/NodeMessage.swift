/// What one gateway node tells another through Redis pub/sub: on the broadcast channel every
/// node hears, or on one node's own channel.
public enum NodeMessage: Sendable, Hashable {
    /// Close every session of this user with 4003 (an administrator's disconnect).
    case disconnectUser(userID: String)
    /// The node `node` found that Redis lost data: every node reads its watchers' views again.
    case resync(node: String)
    /// Close this session with 4009: a newer session on another node took its device over.
    case closeSession(sessionID: String)
}

extension NodeMessage: Codable {
    enum CodingKeys: String, CodingKey { case type, userID = "user_id", node, session }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        switch try container.decode(String.self, forKey: .type) {
        case "disconnect_user": self = .disconnectUser(userID: try container.decode(String.self, forKey: .userID))
        case "resync": self = .resync(node: try container.decode(String.self, forKey: .node))
        case "close_session": self = .closeSession(sessionID: try container.decode(String.self, forKey: .session))
        case let type: throw ProtocolError.unknownType(String(type.prefix(64)))
        }
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        switch self {
        case .disconnectUser(let user):
            try container.encode("disconnect_user", forKey: .type)
            try container.encode(user, forKey: .userID)
        case .resync(let node):
            try container.encode("resync", forKey: .type)
            try container.encode(node, forKey: .node)
        case .closeSession(let session):
            try container.encode("close_session", forKey: .type)
            try container.encode(session, forKey: .session)
        }
    }
}
