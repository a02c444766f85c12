import Hummingbird
import NIOCore
import PresenceProtocol

/// The answers of the REST routes that are not a presence or a list of them. Keys are written
/// in snake case (`conversationID` as `conversation_id`) and ids in the node's format.
enum RESTBody {
    struct Status: Encodable { var status: String }
    struct Empty: Encodable {}
    struct Privacy: Codable { var show_online_status: Bool }
    struct ConversationPresence: Encodable {
        var conversationId: JSONID
        var total: Int
        var online: Int
        var away: Int
        var members: [PresencePayload]
    }
    struct Members: Encodable {
        var conversationId: JSONID
        var memberIds: [JSONID]
    }
    struct MemberRemoved: Encodable {
        var conversationId: JSONID
        var userId: JSONID
        var removed: Bool
    }
    struct ConversationDeleted: Encodable {
        var conversationId: JSONID
        var deleted: Bool
    }
    struct Disconnected: Encodable { var userId: JSONID }
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

extension Gateway {
    /// A 200 answer with `body` as JSON.
    func respond(_ body: some Encodable) -> Response {
        Response(status: .ok, headers: [.contentType: "application/json; charset=utf-8"], body: .init(byteBuffer: ByteBuffer(bytes: bodies.data(body))))
    }
}
