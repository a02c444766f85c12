import RedisClient
import Foundation
import HTTPTypes
import Hummingbird
import NIOCore
import PresenceEngine
import PresenceProtocol

extension Gateway {
    /// The probes, open to anyone, and the presence routes, behind `users` (a client token).
    func addRESTRoutes(to router: Router<GatewayRequestContext>, users: RouterGroup<GatewayRequestContext>) {
        router.get("/healthz") { _, _ in RESTBody.Status(status: "ok") }
        router.get("/readyz") { _, _ in
            guard !self.hub.isDraining else { throw APIError.unavailable("this node is shutting down") }
            // On a cluster, ready while some primary answers: a primary failing over makes only its
            // own slots' commands fail, on every node alike, so leaving the balancer helps nobody.
            guard self.engine.redis.isAvailable, self.hub.subscriber.isAvailable else { throw APIError.unavailable() }
            // Not while its lease lapsed and its sessions are not written again.
            guard self.engine.holdsCurrentState else { throw APIError.unavailable("this node is catching up with the presence store") }
            return RESTBody.Status(status: "ready")
        }
        router.get("/metrics") { _, _ in
            let work = [self.sessionWork.load, self.sessionEnds.load].reduce((running: 0, waiting: 0)) { ($0.running + $1.running, $0.waiting + $1.waiting) }
            GatewayMetrics.sample(sessions: self.hub.sessionCount, channels: self.hub.subscriber.channels.count, work: work)
            return Response(status: .ok, headers: [.contentType: "text/plain; version=0.0.4"], body: .init(byteBuffer: ByteBuffer(string: GatewayMetrics.render())))
        }
        users.post("/api/presence/status") { request, context in
            let user = try context.user
            let body = try await request.decode(as: StatusBody.self, context: context)
            guard let status = PresenceStatus(rawValue: body.status) else { throw APIError.invalid("status must be \(PresenceStatus.rule)") }
            let device = body.deviceId ?? "rest"
            guard PresenceID.isValid(device) else { throw APIError.invalid("device_id must be \(PresenceID.rule)") }
            if let wait = self.restLimiter.take(user.userID) { throw APIError.rateLimited("too many status posts", retryAfter: wait) }
            let change = try await self.engine.post(user: user.userID, device: device, status: status)
            if change.changed { GatewayMetrics.transition() }
            return PresencePayload(change.views.real)
        }
        users.get("/api/presence/users") { request, context in
            let user = try context.user
            var targets: [String]
            if let list = request.uri.queryParameters.get("user_ids") {
                let listed = list.split(separator: ",", omittingEmptySubsequences: false)
                guard listed.count <= self.configuration.maxIDsPerRequest else {
                    throw APIError.invalid("at most \(self.configuration.maxIDsPerRequest) user ids per request")
                }
                let format = self.configuration.idFormat
                targets = try listed.map { id throws(APIError) in
                    guard let canonical = format.canonical(id) else { throw APIError.invalid("user ids must be \(format.rule)") }
                    return canonical
                }
                var seen = Set<String>()
                targets = targets.filter { seen.insert($0).inserted }
                targets = try await self.engine.visible(to: user.userID, among: targets)
            } else {
                targets = try await self.engine.contacts(of: user.userID, includingLarge: true)
            }
            let views = try await self.engine.views(of: targets)
            var presences: [PresencePayload] = []
            let typing = try await self.engine.typing(among: targets, sharedWith: user.userID)
            for view in views {
                presences.append(PresencePayload(view.seen(by: user.userID), isTyping: typing.contains(view.real.userID)))
            }
            return presences
        }
        users.get("/api/presence/users/{user_id}") { _, context in
            let user = try context.user
            let target = try self.pathID(context, "user_id", "user id")
            guard try await self.engine.canSee(viewer: user.userID, target: target) else { throw APIError.notFound("no such user") }
            let view = try await self.engine.views(of: target)
            let typing = try await self.engine.isTyping(target, sharedWith: user.userID)
            return PresencePayload(view.seen(by: user.userID), isTyping: typing)
        }
        users.put("/api/presence/privacy") { request, context in
            let user = try context.user
            let body = try await request.decode(as: RESTBody.Privacy.self, context: context)
            _ = try await self.engine.setPrivacy(user: user.userID, showOnlineStatus: body.showOnlineStatus)
            return RESTBody.Privacy(showOnlineStatus: body.showOnlineStatus)
        }
        users.get("/api/conversations/{conversation_id}/presence") { _, context in
            let user = try context.user
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            guard let members = try await self.engine.members(of: conversation) else { throw APIError.notFound("no such conversation") }
            guard members.contains(user.userID) else { throw APIError.forbidden("you are not a member of this conversation") }
            let presences = try await self.engine.views(of: members).map { $0.seen(by: user.userID) }
            let typing = try await self.engine.typingUsers(in: conversation)
            let counts = GroupCounts(presences.map(\.status))
            return RESTBody.ConversationPresence(
                conversationId: JSONID(conversation), total: counts.total, online: counts.online, away: counts.away,
                members: presences.map { PresencePayload($0, isTyping: typing.contains($0.userID)) }
            )
        }
        users.post("/api/conversations/{conversation_id}/typing") { request, context in
            let user = try context.user
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            let body = try await request.decode(as: TypingBody.self, context: context)
            if let wait = self.typingLimiter.take(user.userID) { throw APIError.rateLimited("too many typing posts", retryAfter: wait) }
            try await self.engine.setTyping(user: user.userID, conversation: conversation, isTyping: body.isTyping)
            return RESTBody.Empty()
        }
    }

    struct StatusBody: Decodable {
        var status: String
        var deviceId: String?
    }

    struct TypingBody: Decodable {
        var isTyping: Bool
    }

    /// A path parameter that must be a valid user or conversation id in the node's id format
    /// (422 otherwise), in its stored spelling.
    func pathID(_ context: GatewayRequestContext, _ name: String, _ what: String) throws(APIError) -> String {
        // Routes match the raw path: `a%40b` is the id `a@b`, as any URL encoder writes it.
        guard let value = context.parameters.get(name)?.removingPercentEncoding, let id = configuration.idFormat.canonical(value) else {
            throw .invalid("the \(what) must be \(configuration.idFormat.rule)")
        }
        return id
    }
}
