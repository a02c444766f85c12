import Foundation
import HTTPTypes
import Hummingbird
import Logging
import NIOConcurrencyHelpers
import NIOCore
import PresenceEngine
import PresenceProtocol
import PresenceWebClient
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
            Self.asset(PresenceWebClient.module, type: "text/javascript; charset=utf-8", extra: client)
        }
        router.get("/client/presence.d.ts") { _, _ in
            Self.asset(PresenceWebClient.declarations, type: "text/plain; charset=utf-8", extra: client)
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
    }

    /// The admin reads behind the dashboard, behind `admin` (the admin token).
    func addAdminReadRoutes(to admin: RouterGroup<GatewayRequestContext>) {
        admin.get("/api/admin/users/{user_id}") { _, context in
            let user = try self.pathID(context, "user_id", "user id")
            guard try await self.engine.userExists(user) else { throw APIError.notFound("no such user") }
            let views = try await self.engine.views(of: user)
            let devices = try await self.engine.devices(of: user)
            let conversations = try await self.engine.conversationSummaries(of: user)
            return RESTBody.UserDetail(views: views, devices: devices, conversations: conversations)
        }
        admin.get("/api/admin/conversations/{conversation_id}") { request, context in
            let conversation = try self.pathID(context, "conversation_id", "conversation id")
            let limit = try Self.limitParameter(request.uri.queryParameters.get("limit"), default: 50)
            guard let detail = try await self.engine.conversationDetail(conversation, limit: limit) else {
                throw APIError.notFound("no such conversation")
            }
            return RESTBody.ConversationDetail(conversation: conversation, detail: detail)
        }
        admin.get("/api/admin/overview") { _, _ in
            return RESTBody.Overview(try await self.overviews.current(engine: self.engine))
        }
        admin.get("/api/admin/events") { _, _ -> Response in
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
