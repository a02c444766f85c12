import Foundation
import Hummingbird
import PresenceEngine
import PresenceProtocol

extension Gateway {
    /// The admin changes, behind `admin` (the admin token).
    func addAdminRoutes(to admin: RouterGroup<GatewayRequestContext>) {
        admin.put("/api/admin/conversations/{conversation_id}") { request, context in
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            let body = try await request.decode(as: MembersBody.self, context: context)
            let members = try self.validIDs(body.memberIds)
            try await self.engine.setMembers(of: conversation, to: members)
            return RESTBody.Members(conversationId: JSONID(conversation), memberIds: Array(Set(members)).sorted().map(JSONID.init))
        }
        admin.post("/api/admin/conversations/{conversation_id}/members") { request, context in
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            let body = try await request.decode(as: UsersBody.self, context: context)
            let users = try self.validIDs(body.userIds)
            try await self.engine.addMembers(to: conversation, users)
            return RESTBody.Members(conversationId: JSONID(conversation), memberIds: (try await self.engine.members(of: conversation) ?? []).map(JSONID.init))
        }
        admin.delete("/api/admin/conversations/{conversation_id}/members/{user_id}") { _, context in
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            let user = try self.pathID(context, "user_id", "user id")
            guard try await self.engine.members(of: conversation) != nil else { throw APIError.notFound("no such conversation") }
            let removed = try await self.engine.removeMember(from: conversation, user)
            return RESTBody.MemberRemoved(conversationId: JSONID(conversation), userId: JSONID(user), removed: removed)
        }
        admin.delete("/api/admin/conversations/{conversation_id}") { _, context in
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            guard try await self.engine.deleteConversation(conversation) else { throw APIError.notFound("no such conversation") }
            return RESTBody.ConversationDeleted(conversationId: JSONID(conversation), deleted: true)
        }
        admin.post("/api/admin/users/{user_id}/disconnect") { _, context in
            let user = try self.pathID(context, "user_id", "user id")
            try await self.engine.requestDisconnect(user: user)
            return RESTBody.Disconnected(userId: JSONID(user))
        }
        admin.get("/api/admin/nodes") { _, _ in
            let nodes = try await self.engine.nodes().filter { !$0.lapsed }
            return nodes.map { RESTBody.Node(nodeID: $0.nodeID, sessions: $0.sessions, leaseExpiresAt: $0.leaseExpiresAt) }
        }
    }

    struct MembersBody: Decodable { var memberIds: [JSONID] }
    struct UsersBody: Decodable { var userIds: [JSONID] }

    /// User ids of a body, each valid in the node's id format, in their stored spelling.
    func validIDs(_ ids: [JSONID]) throws(APIError) -> [String] {
        guard ids.count <= 100_000 else { throw .invalid("at most 100000 ids at once") }
        var valid: [String] = []
        valid.reserveCapacity(ids.count)
        for id in ids {
            guard let canonical = id.canonical(configuration.idFormat) else { throw .invalid("user ids must be \(configuration.idFormat.rule)") }
            valid.append(canonical)
        }
        return valid
    }
}
