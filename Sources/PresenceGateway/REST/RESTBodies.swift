import Hummingbird
import NIOCore
import PresenceProtocol

/// The answers of the REST routes that are not a presence or a list of them, written by
/// ``RESTResponseEncoder``: keys in snake case (`conversationId` as `conversation_id`), ids in
/// the node's format.
enum RESTBody {
    struct Status: ResponseEncodable { var status: String }
    struct Empty: ResponseEncodable {}
    struct Privacy: ResponseCodable { var showOnlineStatus: Bool }
    struct ConversationPresence: ResponseEncodable {
        var conversationId: JSONID
        var total: Int
        var online: Int
        var away: Int
        var members: [PresencePayload]
    }
    struct Members: ResponseEncodable {
        var conversationId: JSONID
        var memberIds: [JSONID]
    }
    struct MemberRemoved: ResponseEncodable {
        var conversationId: JSONID
        var userId: JSONID
        var removed: Bool
    }
    struct ConversationDeleted: ResponseEncodable {
        var conversationId: JSONID
        var deleted: Bool
    }
    struct Disconnected: ResponseEncodable { var userId: JSONID }
    struct Node: Encodable {
        var nodeID: String
        var sessions: Int
        /// Milliseconds since 1970; written as an API timestamp, or `null`.
        var leaseExpiresAt: Int64?

        enum CodingKeys: String, CodingKey { case nodeID = "node_id", sessions, leaseExpiresAt = "lease_expires_at" }

        func encode(to encoder: any Encoder) throws {
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encode(nodeID, forKey: .nodeID)
            try container.encode(sessions, forKey: .sessions)
            try container.encode(leaseExpiresAt.map(PresenceTimestamp.iso8601), forKey: .leaseExpiresAt)
        }
    }
}
