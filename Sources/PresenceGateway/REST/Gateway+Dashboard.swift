import Foundation
import HTTPTypes
import Hummingbird
import Logging
import NIOConcurrencyHelpers
import NIOCore
import PresenceEngine
import PresenceProtocol
import RedisClient
import ServiceLifecycle

/// The browser client (`/client/presence.js`), the operator's dashboard (`/dashboard`) and the
/// admin reads behind it: a user's devices, an overview, and a live feed of both as Server-Sent
/// Events.
extension Gateway {
    /// What the dashboard's page may load and do: only this node's own script, styles and API.
    static let dashboardPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        + "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

    func addDashboardRoutes(to router: Router<GatewayRequestContext>) {
        // The client is public code: any origin may import it as a module.
        let client: HTTPFields = [.accessControlAllowOrigin: "*"]
        router.get("/client/presence.js") { _, _ in
            Self.asset(PackageResources.presence_js, type: "text/javascript; charset=utf-8", extra: client)
        }
        router.get("/client/presence.d.ts") { _, _ in
            Self.asset(PackageResources.presence_d_ts, type: "text/plain; charset=utf-8", extra: client)
        }
        let page: HTTPFields = [
            .contentSecurityPolicy: Self.dashboardPolicy, HTTPField.Name("Referrer-Policy")!: "no-referrer",
            HTTPField.Name("X-Frame-Options")!: "DENY",
        ]
        router.get("/dashboard") { _, _ in
            Self.asset(PackageResources.dashboard_html, type: "text/html; charset=utf-8", extra: page)
        }
        router.get("/dashboard/dashboard.js") { _, _ in
            Self.asset(PackageResources.dashboard_js, type: "text/javascript; charset=utf-8", extra: page)
        }
        router.get("/dashboard/dashboard.css") { _, _ in
            Self.asset(PackageResources.dashboard_css, type: "text/css; charset=utf-8", extra: page)
        }

        router.get("/api/admin/users/{user_id}") { request, context in
            try self.requireAdmin(request)
            let user = try self.pathID(context, "user_id", "user id")
            guard try await self.engine.userExists(user) else { throw APIError.notFound("no such user") }
            let views = try await self.engine.views(of: user)
            let devices = try await self.engine.devices(of: user)
            let conversations = try await self.engine.conversationSummaries(of: user)
            return RESTBody.UserDetail(views: views, devices: devices, conversations: conversations)
        }
        router.get("/api/admin/conversations/{conversation_id}") { request, context in
            try self.requireAdmin(request)
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            let limit = try Self.limitParameter(request.uri.queryParameters.get("limit"), default: 50)
            guard let detail = try await self.engine.conversationDetail(conversation, limit: limit) else {
                throw APIError.notFound("no such conversation")
            }
            return RESTBody.ConversationDetail(conversation: conversation, detail: detail)
        }
        router.get("/api/admin/overview") { request, _ in
            try self.requireAdmin(request)
            return RESTBody.Overview(try await self.overviews.current(engine: self.engine))
        }
        router.get("/api/admin/events") { request, _ -> Response in
            try self.requireAdmin(request)
            var headers: HTTPFields = [.contentType: "text/event-stream; charset=utf-8", .cacheControl: "no-store"]
            // Proxies that buffer responses (nginx) would hold the events back.
            headers[HTTPField.Name("X-Accel-Buffering")!] = "no"
            return Response(status: .ok, headers: headers, body: ResponseBody { writer in
                try await self.streamAdminEvents(to: &writer)
            })
        }
    }

    /// A file compiled into the binary, never cached without asking again (a new node version
    /// serves a new one).
    static func asset(_ bytes: [UInt8], type: String, extra: HTTPFields) -> Response {
        var headers = extra
        headers[.contentType] = type
        headers[.cacheControl] = "no-cache"
        headers[HTTPField.Name("X-Content-Type-Options")!] = "nosniff"
        return Response(status: .ok, headers: headers, body: .init(byteBuffer: ByteBuffer(bytes: bytes)))
    }

    /// The admin feed: an `overview` event at once and every `AdminFeed.overviewInterval`, and a
    /// `presence` event for each change of a user's aggregate, read on a Redis connection of the
    /// feed's own: with classic pub/sub, every user's (a pattern subscription); with sharded
    /// pub/sub (a cluster), which has no patterns, the changes of the users the last overview
    /// listed as present (at most 500), whose channels the feed follows; anyone else's change
    /// shows in the next overview. Ends when the client goes away, or when the node shuts down.
    func streamAdminEvents(to writer: inout any ResponseBodyWriter) async throws {
        let (items, sink) = AsyncStream.makeStream(of: AdminFeed.Item.self, bufferingPolicy: .bufferingNewest(AdminFeed.backlog))
        let engine = engine
        let logger = logger
        let clientName = "presence-gateway:\(configuration.nodeID):dashboard"
        // The first overview waits for the subscription: every change after it is in the stream.
        let (subscribed, subscribedSink) = AsyncStream.makeStream(of: Void.self)
        // The users each overview lists, for a sharded feed to follow.
        let (listed, listedSink) = AsyncStream.makeStream(of: Set<String>.self, bufferingPolicy: .bufferingNewest(1))
        /// Subscribes and forwards every change until the subscriber stops.
        @Sendable func follow() async throws {
            try await withRedisSubscriber(for: engine.redis, clientName: clientName, logger: logger) { subscriber in
                if let classic = subscriber as? RedisSubscriber, engine.redis.pubSub == .classic {
                    try await classic.subscribe(pattern: engine.keys.allUserChannelsPattern)
                    listedSink.finish()
                }
                subscribedSink.finish()
                await withTaskGroup(of: Void.self) { feed in
                    feed.addTask {
                        var following = Set<String>()
                        for await users in listed {
                            let added = users.subtracting(following), removed = following.subtracting(users)
                            // A channel not subscribed now (its primary is failing over) is
                            // subscribed by the subscriber when it can; the next overview tries again.
                            try? await subscriber.subscribe(added.map { engine.keys.userChannel($0) })
                            try? await subscriber.unsubscribe(removed.map { engine.keys.userChannel($0) })
                            following = users
                        }
                    }
                    for await event in subscriber.events {
                        guard case .message(let channel, let payload) = event, let change = engine.decodeEvent(payload),
                              change.changed || change.shownChanged
                        else { continue }
                        let user = engine.keys.user(fromKey: channel, suffix: "events") ?? change.views.real.userID
                        sink.yield(.presence(user: user, change))
                    }
                    feed.cancelAll()
                }
            }
        }
        try await withThrowingTaskGroup(of: Void.self) { tasks in
            tasks.addTask {
                // Until the subscriber connects (Redis down when the feed opens), the feed says so
                // once a try, as an `unavailable` event, and tries again: it never sits silent.
                while !Task.isCancelled {
                    do {
                        try await follow()
                        return
                    } catch is CancellationError {
                        return
                    } catch {
                        logger.warning("admin feed: \(error)")
                        sink.yield(.unavailable(String(describing: error)))
                        try await Task.sleep(for: AdminFeed.retryInterval)
                    }
                }
            }
            tasks.addTask {
                for await _ in subscribed {}
                while !Task.isCancelled {
                    sink.yield(.overview)
                    try await Task.sleep(for: AdminFeed.overviewInterval)
                }
            }
            try await withGracefulShutdownHandler {
                for await item in items {
                    let event: String
                    switch item {
                    case .overview:
                        // Redis gone since: the feed says so and the next tick reads again.
                        guard let overview = try? await self.overviews.current(engine: engine) else {
                            try await writer.write(Self.serverSentEvent("unavailable", self.bodies.text(RESTBody.FeedUnavailable(message: "the overview could not be read: the presence store is unreachable"))))
                            continue
                        }
                        event = "overview"
                        listedSink.yield(Set(overview.present.map(\.userID)))
                        try await writer.write(Self.serverSentEvent(event, self.bodies.text(RESTBody.Overview(overview))))
                    case .unavailable(let reason):
                        event = "unavailable"
                        try await writer.write(Self.serverSentEvent(event, self.bodies.text(RESTBody.FeedUnavailable(message: "the feed's subscriber could not connect (\(reason)); trying again"))))
                    case .presence(let user, let change):
                        event = "presence"
                        try await writer.write(Self.serverSentEvent(event, self.bodies.text(RESTBody.FeedPresence(user: user, change))))
                    }
                }
            } onGracefulShutdown: {
                sink.finish()
            }
            tasks.cancelAll()
        }
        try await writer.finish(nil)
    }

    /// One Server-Sent Event: its name and one line of JSON.
    static func serverSentEvent(_ name: String, _ json: String) -> ByteBuffer {
        ByteBuffer(string: "event: \(name)\ndata: \(json)\n\n")
    }
}

/// The admin feed's constants and items.
enum AdminFeed {
    static let overviewInterval: Duration = .seconds(2)
    /// Presence events kept for a slow reader; past that the oldest are dropped (the next
    /// overview has the truth).
    static let backlog = 10_000
    /// How soon a feed whose subscriber could not connect tries again.
    static let retryInterval: Duration = .seconds(1)

    enum Item: Sendable {
        case overview
        case presence(user: String, PresenceEvent)
        /// Redis could not be reached: said to the reader, then tried again.
        case unavailable(String)
    }
}

/// The last overview, shared by every dashboard on this node: read from Redis at most once a
/// second however many feeds are open.
actor OverviewCache {
    private var last: (read: ContinuousClock.Instant, overview: PresenceOverview)?
    let maxAge: Duration

    init(maxAge: Duration = .seconds(1)) { self.maxAge = maxAge }

    func current(engine: PresenceEngine) async throws -> PresenceOverview {
        if let last, ContinuousClock.now - last.read < maxAge { return last.overview }
        let overview = try await engine.overview()
        // Another caller may have read a newer one while this one awaited.
        if let last, last.overview.at > overview.at { return last.overview }
        last = (ContinuousClock.now, overview)
        return overview
    }
}

extension RESTBody {
    /// `GET /api/admin/conversations/{conversation_id}`: the newest messages, each with how far
    /// it got (`sent`, `delivered` to every other member, `read` by every other member), and every
    /// member's cursors.
    struct ConversationDetail: ResponseEncodable {
        struct Member: Encodable {
            var userId: JSONID
            var deliveredSeq: Int64
            var readSeq: Int64
        }
        /// A message as `message` frames carry it, with its `status`.
        struct Reached: Encodable {
            var message: MessagePayload
            var status: String

            enum CodingKeys: CodingKey { case status }

            func encode(to encoder: any Encoder) throws {
                try message.encode(to: encoder)
                var container = encoder.container(keyedBy: CodingKeys.self)
                try container.encode(status, forKey: .status)
            }
        }
        enum CodingKeys: CodingKey { case conversationId, epoch, firstSeq, lastSeq, members, messages }

        var conversationId: JSONID
        var epoch: String?
        var firstSeq: Int64
        var lastSeq: Int64
        var members: [Member]
        var messages: [Reached]

        init(conversation: String, detail: ConversationSnapshot) {
            conversationId = JSONID(conversation)
            epoch = detail.page.epoch.isEmpty ? nil : detail.page.epoch
            firstSeq = detail.page.firstSeq
            lastSeq = detail.page.lastSeq
            members = detail.members.map { Member(userId: JSONID($0.user), deliveredSeq: $0.cursors.deliveredSeq, readSeq: $0.cursors.readSeq) }
            messages = detail.page.messages.map { Reached(message: MessagePayload($0), status: detail.reach(of: $0)) }
        }

        /// `epoch` is written as null, not left out, while there is no history.
        func encode(to encoder: any Encoder) throws {
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encode(conversationId, forKey: .conversationId)
            if let epoch { try container.encode(epoch, forKey: .epoch) } else { try container.encodeNil(forKey: .epoch) }
            try container.encode(firstSeq, forKey: .firstSeq)
            try container.encode(lastSeq, forKey: .lastSeq)
            try container.encode(members, forKey: .members)
            try container.encode(messages, forKey: .messages)
        }
    }

    /// `GET /api/admin/users/{user_id}`: what `presencectl user --json` prints.
    struct UserDetail: ResponseEncodable {
        struct Shown: Encodable {
            var status: PresenceStatus
            var lastSeen: Int64?

            enum CodingKeys: CodingKey { case status, lastSeen }

            func encode(to encoder: any Encoder) throws {
                var container = encoder.container(keyedBy: CodingKeys.self)
                try container.encode(status, forKey: .status)
                try container.encodeTimestamp(lastSeen, forKey: .lastSeen)
            }
        }
        struct Device: Encodable {
            var deviceId: String
            var status: PresenceStatus
            var node: String?
            var since: Int64
            var deadline: Int64?
            var lastAlive: Int64

            enum CodingKeys: CodingKey { case deviceId, status, node, since, deadline, lastAlive }

            func encode(to encoder: any Encoder) throws {
                var container = encoder.container(keyedBy: CodingKeys.self)
                try container.encode(deviceId, forKey: .deviceId)
                try container.encode(status, forKey: .status)
                if let node { try container.encode(node, forKey: .node) } else { try container.encodeNil(forKey: .node) }
                try container.encodeTimestamp(since, forKey: .since)
                try container.encodeTimestamp(deadline, forKey: .deadline)
                try container.encodeTimestamp(lastAlive, forKey: .lastAlive)
            }
        }
        /// One of the user's conversations with the user's cursors in it.
        struct Conversation: Encodable {
            var conversationId: JSONID
            var epoch: String?
            var lastSeq: Int64
            var deliveredSeq: Int64
            var readSeq: Int64
            var unread: Int64

            enum CodingKeys: CodingKey { case conversationId, epoch, lastSeq, deliveredSeq, readSeq, unread }

            /// `epoch` is written as null, not left out, while there is no history.
            func encode(to encoder: any Encoder) throws {
                var container = encoder.container(keyedBy: CodingKeys.self)
                try container.encode(conversationId, forKey: .conversationId)
                if let epoch { try container.encode(epoch, forKey: .epoch) } else { try container.encodeNil(forKey: .epoch) }
                try container.encode(lastSeq, forKey: .lastSeq)
                try container.encode(deliveredSeq, forKey: .deliveredSeq)
                try container.encode(readSeq, forKey: .readSeq)
                try container.encode(unread, forKey: .unread)
            }
        }
        enum CodingKeys: CodingKey { case userId, status, lastSeen, showOnlineStatus, shownToOthers, devices, conversations }

        var userId: JSONID
        var status: PresenceStatus
        var lastSeen: Int64?
        var showOnlineStatus: Bool
        var shownToOthers: Shown
        var devices: [Device]
        var conversations: [Conversation]

        func encode(to encoder: any Encoder) throws {
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encode(userId, forKey: .userId)
            try container.encode(status, forKey: .status)
            try container.encodeTimestamp(lastSeen, forKey: .lastSeen)
            try container.encode(showOnlineStatus, forKey: .showOnlineStatus)
            try container.encode(shownToOthers, forKey: .shownToOthers)
            try container.encode(devices, forKey: .devices)
            try container.encode(conversations, forKey: .conversations)
        }

        init(views: PresenceViews, devices: [DeviceRecord], conversations: [ConversationSummary]) {
            userId = JSONID(views.real.userID)
            status = views.real.status
            lastSeen = views.real.lastSeen
            showOnlineStatus = !views.hidden
            shownToOthers = Shown(status: views.shown.status, lastSeen: views.shown.lastSeen)
            self.devices = devices.map { device in
                Device(
                    deviceId: device.deviceID, status: device.status, node: device.node.isEmpty ? nil : device.node,
                    since: device.since, deadline: device.deadline, lastAlive: device.lastAlive
                )
            }
            self.conversations = conversations.map { summary in
                Conversation(conversationId: JSONID(summary.conversationID), epoch: summary.epoch.isEmpty ? nil : summary.epoch, lastSeq: summary.lastSeq,
                             deliveredSeq: summary.cursors.deliveredSeq, readSeq: summary.cursors.readSeq, unread: summary.unread)
            }
        }
    }

    /// The dashboard's overview (`GET /api/admin/overview`, and the feed's `overview` event).
    struct Overview: ResponseEncodable {
        struct Node: Encodable {
            var nodeId: String
            var sessions: Int
            var leaseExpiresAt: String
            /// Messages stored through the node since it started, as of its last lease renewal.
            var messagesStored: Int
        }
        struct Conversation: Encodable {
            var conversationId: JSONID
            var total: Int
            var online: Int
            var away: Int
        }
        var at: String
        var usersOnline: Int
        var usersAway: Int
        var users: [PresencePayload]
        var usersTruncated: Bool
        var nodes: [Node]
        var conversations: [Conversation]
        var conversationsTruncated: Bool
        /// The live nodes' `messages_stored`, summed: the dashboard's messages a second come from
        /// its change between overviews.
        var messagesStored: Int

        init(_ overview: PresenceOverview) {
            at = PresenceTimestamp.iso8601(overview.at)
            usersOnline = overview.usersOnline
            usersAway = overview.usersAway
            users = overview.present.map { PresencePayload($0) }
            usersTruncated = overview.presentTruncated
            nodes = overview.nodes.map {
                Node(nodeId: $0.nodeID, sessions: $0.sessions, leaseExpiresAt: PresenceTimestamp.iso8601($0.leaseExpiresAt), messagesStored: $0.messagesStored)
            }
            messagesStored = overview.nodes.reduce(0) { $0 + $1.messagesStored }
            conversations = overview.conversations.map {
                Conversation(conversationId: JSONID($0.conversationID), total: $0.total, online: $0.online, away: $0.away)
            }
            conversationsTruncated = overview.conversationsTruncated
        }
    }

    /// The feed's `unavailable` event: Redis could not be reached for the feed's subscriber or its
    /// overview; the feed goes on and tries again.
    struct FeedUnavailable: Encodable {
        var error = "unavailable"
        var message: String
    }

    /// The feed's `presence` event: a user's aggregate changed (`shown_status` is what others
    /// see, which differs while the user hides their status).
    struct FeedPresence: Encodable {
        var userId: JSONID
        var status: PresenceStatus
        var lastSeen: Int64?
        var shownStatus: PresenceStatus
        var at: Int64

        enum CodingKeys: CodingKey { case userId, status, lastSeen, shownStatus, at }

        func encode(to encoder: any Encoder) throws {
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encode(userId, forKey: .userId)
            try container.encode(status, forKey: .status)
            try container.encodeTimestamp(lastSeen, forKey: .lastSeen)
            try container.encode(shownStatus, forKey: .shownStatus)
            try container.encodeTimestamp(at, forKey: .at)
        }

        init(user: String, _ change: PresenceEvent) {
            userId = JSONID(user)
            status = change.views.real.status
            lastSeen = change.views.real.lastSeen
            shownStatus = change.views.shown.status
            at = change.at
        }
    }
}
