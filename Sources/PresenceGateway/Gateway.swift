import Foundation
import Hummingbird
import HummingbirdWebSocket
import Logging
import NIOCore
import PresenceEngine
import RedisClient
import ServiceLifecycle

/// One gateway node: configuration, the presence engine, the session hub and the authenticator.
public final class Gateway: Sendable {
    /// The node's configuration.
    public let configuration: GatewayConfiguration
    /// The presence engine.
    public let engine: PresenceEngine
    let hub: SessionHub
    let authenticator: Authenticator
    let restLimiter: RateLimiter
    let logger: Logger
    /// The long-lived parts, in start order (stopped in reverse).
    let services: [any Service]

    /// Builds a node from a validated configuration.
    public init(configuration: GatewayConfiguration, logger: Logger) async throws {
        try configuration.validate()
        self.configuration = configuration
        self.logger = logger
        var redisConfiguration = try RedisConfiguration(url: configuration.redisURL)
        redisConfiguration.clientName = "presence-gateway:\(configuration.nodeID)"
        let redis = RedisClient(configuration: redisConfiguration, logger: logger)
        let subscriber = RedisSubscriber(configuration: redisConfiguration, logger: logger)
        engine = PresenceEngine(redis: redis, configuration: configuration.engineConfiguration, logger: logger)
        hub = SessionHub(engine: engine, subscriber: subscriber, logger: logger)
        authenticator = try await Authenticator(configuration: configuration)
        restLimiter = RateLimiter(rate: configuration.statusRate)
        services = [redis, subscriber, hub, PresenceLeaseService(engine: engine), PresenceReaperService(engine: engine)]
        GatewayMetrics.bootstrap()
    }

    /// The user a request's bearer token (header, or `?token=` where allowed) stands for.
    func authenticate(_ request: Request, allowQuery: Bool = false) async throws(APIError) -> AuthenticatedUser {
        var token = Authenticator.bearer(request.headers[.authorization])
        if token == nil, allowQuery { token = request.uri.queryParameters.get("token") }
        return try await authenticator.authenticate(token: token)
    }

    /// Checks the admin token: 404 when admin routes are off, 401 for a wrong token.
    func requireAdmin(_ request: Request) throws(APIError) {
        guard authenticator.adminEnabled else { throw .notFound("no such route") }
        guard authenticator.isAdmin(token: Authenticator.bearer(request.headers[.authorization])) else {
            throw .unauthorized("the admin token is missing or wrong")
        }
    }
}

/// Builds the gateway application: routes, WebSocket upgrade and services. Tests call it too.
public func buildApplication(configuration: GatewayConfiguration, logger: Logger) async throws -> Application<RouterResponder<GatewayRequestContext>> {
    let gateway = try await Gateway(configuration: configuration, logger: logger)
    let router = Router(context: GatewayRequestContext.self)
    router.add(middleware: APIErrorMiddleware())
    gateway.addRESTRoutes(to: router)
    gateway.addAdminRoutes(to: router)
    gateway.addWebSocketRoute(to: router)
    var app = Application(
        router: router,
        server: .http1WebSocketUpgrade(
            webSocketRouter: router,
            configuration: .init(ws: .init(maxFrameSize: configuration.maxFrameSize, autoPing: .enabled(timePeriod: configuration.pingInterval), closeTimeout: .seconds(3)))
        ),
        configuration: .init(address: .hostname(configuration.host, port: configuration.port), serverName: "presence-gateway"),
        logger: logger
    )
    for service in gateway.services { app.addServices(service) }
    return app
}
