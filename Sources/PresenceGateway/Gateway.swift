import Foundation
import Hummingbird
import HummingbirdCore
import Logging
import NIOConcurrencyHelpers
import NIOCore
import PresenceEngine
import PresenceProtocol
import RedisClient
import ServiceLifecycle
import UnixSignals

/// One gateway node: configuration, the presence engine, the session hub and the authenticator.
public final class Gateway: Sendable {
    /// The node's configuration.
    public let configuration: GatewayConfiguration
    /// The presence engine.
    public let engine: PresenceEngine
    let hub: SessionHub
    /// What sessions are asked to do, carried to their event loops (one mailbox per loop).
    let mailboxes = LoopMailboxes()
    /// Sessions' openings and frames (one frame per turn): at most 256 at once, so that a burst
    /// does not put every session's Redis calls in flight together.
    let sessionWork: WorkGate
    /// Sessions' ends, in a gate of their own: a user who leaves goes offline on time even while
    /// every slot of ``sessionWork`` waits on a slow Redis.
    let sessionEnds: WorkGate
    /// Runs after each message a session handled, when set: tests slow a session down here.
    let afterMessageHandled = NIOLockedValueBox<(@Sendable (Session) async -> Void)?>(nil)
    /// Runs before a new session's `initial_state` is read and sent, when set: tests slow an
    /// opening down here.
    let beforeInitialState = NIOLockedValueBox<(@Sendable (Session) async -> Void)?>(nil)
    /// The dashboard's overview, read at most once a second for every feed on this node.
    let overviews = OverviewCache()
    /// Frames, with ids in the node's format.
    let frames: FrameCoder
    /// REST bodies: ids in the node's format, keys in snake case.
    let bodies: FrameCoder
    let authenticator: Authenticator
    let restLimiter: RateLimiter
    let typingLimiter: RateLimiter
    /// Messages sent per user, over REST and every session of theirs on this node.
    let messageLimiter: RateLimiter
    let logger: Logger
    /// The long-lived parts, in start order (stopped in reverse).
    let services: [any Service]
    /// How long the oldest command may wait before the connection to Redis is taken for stalled.
    static let redisStallTimeout = Duration.milliseconds(750)

    /// Builds a node from a validated configuration.
    public init(configuration: GatewayConfiguration, logger: Logger) async throws {
        try configuration.validate()
        self.configuration = configuration
        sessionWork = WorkGate(limit: configuration.sessionWorkLimit)
        sessionEnds = WorkGate(limit: configuration.sessionWorkLimit)
        self.logger = logger
        var redisConfiguration = try configuration.redisConfiguration()
        redisConfiguration.clientName = "presence-gateway:\(configuration.nodeID)"
        // REST answers 503 within a second while Redis is unreachable, stalled or refusing: wait
        // little for a connection, drop one whose oldest command waited 750 ms (a partition drops
        // packets without a reset; TCP would resend them only seconds later), and connect again
        // with overlapping attempts every 100 ms, so that the lease is renewed within a moment
        // of the network's return.
        redisConfiguration.waitForConnection = .milliseconds(300)
        redisConfiguration.stallTimeout = Self.redisStallTimeout
        // An idle connection (a cluster primary no command went to lately) finds a silent
        // network within 250 ms + the stall timeout too.
        redisConfiguration.heartbeatInterval = .milliseconds(250)
        redisConfiguration.connectTimeout = .seconds(1)
        redisConfiguration.connectHedgeInterval = .milliseconds(100)
        redisConfiguration.maximumBackoff = .seconds(1)
        let redis = try makeRedisCommands(configuration: redisConfiguration, logger: logger)
        let subscriber = makeRedisSubscriber(for: redis, logger: logger)
        // Sends that wait for replicas get a client of their own: `WAIT` holds its connection
        // for up to a second, which on the shared one would hold up (and stall) everything else.
        var replicated: (any RedisCommands)?
        if configuration.messageReplicas > 0 {
            var sendConfiguration = redisConfiguration
            sendConfiguration.clientName = "presence-gateway:\(configuration.nodeID):sends"
            sendConfiguration.stallTimeout = .milliseconds(2_500)
            replicated = try makeRedisCommands(configuration: sendConfiguration, logger: logger)
        }
        engine = PresenceEngine(redis: redis, replicatedSends: replicated, configuration: configuration.engineConfiguration, logger: logger)
        frames = FrameCoder(ids: configuration.idFormat)
        bodies = FrameCoder(ids: configuration.idFormat, snakeCaseKeys: true)
        hub = SessionHub(engine: engine, subscriber: subscriber, frames: frames, logger: logger)
        authenticator = try await Authenticator(configuration: configuration)
        restLimiter = RateLimiter(rate: configuration.statusRate)
        typingLimiter = RateLimiter(rate: configuration.typingRate)
        messageLimiter = RateLimiter(rate: configuration.messageRate)
        services = [redis] + (replicated.map { [$0] } ?? []) + [subscriber, hub, PresenceLeaseService(engine: engine), PresenceReaperService(engine: engine)]
        GatewayMetrics.bootstrap()
    }

    /// The user a WebSocket upgrade's bearer token (header, or `?token=`) stands for. (REST
    /// routes get theirs from ``UserAuthenticationMiddleware``.)
    func authenticateUpgrade(_ request: Request) async throws(APIError) -> AuthenticatedUser {
        let token = Authenticator.bearer(request.headers[.authorization]) ?? request.uri.queryParameters.get("token").map { String($0) }
        return try await authenticator.authenticate(token: token)
    }
}

/// Builds the gateway application: routes, WebSocket upgrade and services. Tests call it too.
public func buildApplication(configuration: GatewayConfiguration, logger: Logger) async throws -> Application<RouterResponder<GatewayRequestContext>> {
    try await buildGateway(configuration: configuration, logger: logger).application
}

/// The application and the service that drains its sessions on shutdown.
public struct GatewayNode: Sendable {
    /// The HTTP/WebSocket application with the engine's services.
    public var application: Application<RouterResponder<GatewayRequestContext>>
    /// Closes every session with 1001 when a graceful shutdown starts, before the server stops.
    public var drainer: any Service
    /// The node itself (for tests that reach inside).
    let gateway: Gateway

    /// Runs both until SIGTERM or SIGINT, draining sessions first, with the process's heap trim
    /// beside them (a process-wide concern: nodes built in a test process leave it out).
    public func run() async throws {
        let group = ServiceGroup(configuration: .init(
            services: [application, drainer, MemoryTrimService(logger: application.logger, sessions: { gateway.hub.sessionCount })],
            gracefulShutdownSignals: [.sigterm, .sigint],
            logger: application.logger
        ))
        try await group.run()
    }
}

/// Builds a node: the application plus its session drainer. `onListening` gets the bound port
/// (useful with port 0).
public func buildGateway(
    configuration: GatewayConfiguration,
    logger: Logger,
    onListening: @escaping @Sendable (Int) async -> Void = { _ in }
) async throws -> GatewayNode {
    let gateway = try await Gateway(configuration: configuration, logger: logger)
    let router = Router(context: GatewayRequestContext.self)
    router.add(middleware: APIErrorMiddleware())
    router.add(middleware: RESTCodingMiddleware(coder: gateway.bodies, maxBody: configuration.maxBodySize))
    router.add(middleware: CurrentStateMiddleware(engine: gateway.engine))
    router.add(middleware: StoreDeadlineMiddleware())
    let users = router.group().add(middleware: UserAuthenticationMiddleware(authenticator: gateway.authenticator))
    gateway.addRESTRoutes(to: router, users: users)
    gateway.addMessageRoutes(to: users)
    gateway.addDashboardRoutes(to: router)
    // Without an admin token the admin routes are not there at all: 404 under any method.
    if gateway.authenticator.adminEnabled {
        let admin = router.group().add(middleware: AdminAuthenticationMiddleware(authenticator: gateway.authenticator))
        gateway.addAdminRoutes(to: admin)
        gateway.addAdminReadRoutes(to: admin)
    }
    gateway.addWebSocketRoute(to: router)
    router.add(middleware: MethodNotAllowedMiddleware(routes: router.routes))
    var app = Application(
        router: router,
        server: HTTPServerBuilder { responder in
            GatewayServerChannel(responder: responder, sessions: SessionStarter(gateway: gateway))
        },
        configuration: .init(address: .hostname(configuration.host, port: configuration.port), serverName: "presence-gateway"),
        onServerRunning: { channel in await onListening(channel.localAddress?.port ?? 0) },
        logger: logger
    )
    for service in gateway.services { app.addServices(service) }
    return GatewayNode(application: app, drainer: SessionDrainer(hub: gateway.hub), gateway: gateway)
}

/// On graceful shutdown, closes every session with 1001 so clients reconnect to another node
/// within the linger window, and waits (at most 5 s) until they are gone.
struct SessionDrainer: Service {
    let hub: SessionHub

    func run() async throws {
        try? await gracefulShutdown()
        hub.startDraining()
        var closed = Set<String>()
        let deadline = ContinuousClock.now + .seconds(5)
        // Until every session is gone and Redis has taken every device's close (lingering). A
        // session that opened just before draining began is closed on a later pass.
        repeat {
            let sessions = hub.allSessions.filter { !closed.contains($0.id) }
            if !sessions.isEmpty {
                hub.logger.info("shutting down: closing sessions with 1001", metadata: ["presence.sessions": "\(sessions.count)"])
            }
            for session in sessions {
                session.close(.goingAway, reason: "the node is shutting down")
                closed.insert(session.id)
            }
            guard hub.sessionCount > 0 || hub.engine.localDeviceCount > 0 else { break }
            try? await Task.sleep(for: .milliseconds(20))
        } while ContinuousClock.now < deadline
    }
}
