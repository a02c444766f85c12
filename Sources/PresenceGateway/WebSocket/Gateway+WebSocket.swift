import Foundation
import HTTPTypes
import Hummingbird
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOHTTP1
import NIOHTTPTypesHTTP1
import PresenceEngine
import PresenceProtocol

extension Gateway {
    /// The path of the session upgrade.
    static let sessionPath = "/api/presence/subscribe"

    /// A request to the session path that is not an upgrade (``GatewayServerChannel`` takes
    /// those) is refused with the reason; a node shutting down says so.
    func addWebSocketRoute(to router: Router<GatewayRequestContext>) {
        router.get(RouterPath(Self.sessionPath)) { _, _ -> Response in
            guard !self.hub.isDraining else { throw APIError.unavailable("this node is shutting down; connect to another") }
            throw APIError.invalid("this path takes a WebSocket upgrade, as the first request of its connection")
        }
    }

    /// The upgrade's `device_id`; without one, a device of the connection's own (see
    /// ``connectionDeviceID()``).
    static func deviceID(_ request: Request) throws(APIError) -> String {
        guard let device = request.uri.queryParameters.get("device_id") else { return connectionDeviceID() }
        guard PresenceID.isValid(device) else { throw .invalid("device_id must be \(PresenceID.rule)") }
        return String(device)
    }

    /// The id of a device that lives as long as one connection, for clients that send no
    /// `device_id` (those written against the original presence API). It starts with `~`, which
    /// no client's `device_id` may hold, so no later connection can take the device over; it
    /// lingers after a drop like any device.
    static func connectionDeviceID() -> String {
        "~" + UUID().uuidString.lowercased()
    }

    /// The status a session opens with: `online` unless the upgrade says `status=away` or
    /// `status=offline`, so that a client reconnecting while away (or appearing offline) is never
    /// shown online for a moment.
    static func openingStatus(_ request: Request) throws(APIError) -> PresenceStatus {
        guard let raw = request.uri.queryParameters.get("status") else { return .online }
        guard let status = PresenceStatus(rawValue: String(raw)) else {
            throw .invalid("status must be \(PresenceStatus.rule)")
        }
        return status
    }
}

/// Decides an upgrade and starts the session on the upgraded connection.
struct SessionStarter: Sendable {
    let gateway: Gateway

    var maxFrameSize: Int { gateway.configuration.maxFrameSize }

    /// Whether to upgrade: a GET of the session path while the node is not shutting down. The
    /// token and the query are checked once upgraded, where a refusal can say why (4001, or an
    /// `error` frame and 1008); a refused upgrade goes to the router, which answers with the
    /// reason. A node shutting down refuses here: a session opened and closed at once while the
    /// node stops may end before the client has finished its upgrade.
    func accepts(_ head: HTTPRequestHead) -> Bool {
        head.method == .GET && head.uri.prefix { $0 != "?" } == Gateway.sessionPath && !gateway.hub.isDraining
    }

    /// Puts the session's handler in the upgraded pipeline (on its event loop) and starts opening it.
    func start(on channel: any Channel, head: HTTPRequestHead) throws {
        let request = Request(head: try HTTPRequest(head, secure: false, splitCookie: false), body: .init(buffer: ByteBuffer()))
        let configuration = gateway.configuration
        let run = SessionRun(gateway: gateway)
        let handler = SessionChannelHandler(
            limits: .init(
                maxMessageSize: configuration.maxFrameSize,
                pingInterval: TimeAmount(configuration.pingInterval),
                pongTimeout: TimeAmount(configuration.pongTimeout),
                closeTimeout: TimeAmount(configuration.closeTimeout),
                unwritableBytes: configuration.outboundBufferLimit
            ),
            events: .init(
                text: { run.received(.text($0)) },
                binary: { run.received(.binary) },
                ended: { run.ended($0) }
            )
        )
        try channel.pipeline.syncOperations.addHandler(handler)
        run.open(SessionConnection(handler, mailbox: gateway.mailboxes.mailbox(for: channel.eventLoop)), request: request)
    }
}

/// One session from its upgrade to its end: its opening (token, device, the engine's record),
/// its messages, handled in order by one short-lived task at a time, and its end.
final class SessionRun: Sendable {
    private let gateway: Gateway
    private let state: NIOLockedValueBox<State>

    private struct State {
        /// Counted against the node's session limit.
        var admitted = false
        /// The connection, from the upgrade on: closed from here when the inbox overflows.
        var connection: SessionConnection?
        var lifecycle: SessionLifecycle<Open>
        /// The session's frame rate, taken as each message arrives (on the connection's loop).
        var frameBucket: TokenBucket
    }

    /// At most this many messages, or this many bytes of them, wait to be handled (while the
    /// session opens, or behind a slow Redis call); past either, the session is closed with 4029.
    /// Without a bound, a client flooding large frames meanwhile grew the node's memory at will.
    static let queueLimit = (messages: 256, bytes: 1 << 20)

    private struct Open: Sendable {
        let session: Session
        let user: AuthenticatedUser
        let frames: FrameHandlerBox
    }

    init(gateway: Gateway) {
        self.gateway = gateway
        let configuration = gateway.configuration
        let limits = SessionLifecycle<Open>.Limits(
            messages: Self.queueLimit.messages, bytes: Self.queueLimit.bytes,
            // As many as close the session when answered in a row (FrameHandler).
            refusedKept: configuration.maxRateLimitedFrames + 1
        )
        state = NIOLockedValueBox(State(
            lifecycle: SessionLifecycle(limits: limits),
            frameBucket: TokenBucket(rate: configuration.frameRate, burst: configuration.frameRate * 2)
        ))
    }

    /// The loop of the session's connection, where its work runs (none before the upgrade).
    private var executor: EventLoopTaskExecutor? { state.withLockedValue { $0.connection?.executor } }

    /// Runs what the lifecycle asked for.
    private func run(_ action: SessionLifecycle<Open>.Action) {
        switch action {
        case .none, .handle:
            break
        case .startHandling, .handleAgain:
            gateway.sessionWork.start(on: executor) { await self.handleMessages() }
        case .overflow:
            GatewayMetrics.refused("queue_overflow")
            state.withLockedValue { $0.connection }?.close(CloseCode.rateLimited.rawValue, reason: "too many messages waiting to be handled")
        case .finish(let open, let ending):
            gateway.sessionEnds.start(on: executor) { await self.finish(open, ending) }
        }
    }

    /// Starts opening the session on `connection` (counted from here against the node's limit).
    /// The upgrade's request is held by the opening alone: kept for the session's life, its
    /// headers and URI were some 1.5 KB of every idle session.
    func open(_ connection: SessionConnection, request: Request) {
        // Counted before the token is checked: a flood of bad tokens holds connections too.
        let admitted = gateway.hub.admit(limit: gateway.configuration.maxSessions)
        state.withLockedValue { state in
            state.admitted = admitted
            state.connection = connection
        }
        guard admitted else {
            GatewayMetrics.refused("full")
            refuse(connection, .tryAgainLater, reason: "this node holds its most sessions; try another")
            openingEnded()
            return
        }
        gateway.sessionWork.start(on: connection.executor) { await self.opening(connection, request) }
    }

    /// A message from the client, on its connection's loop. The frame rate is taken here, not
    /// when the message is handled: a flood then costs its text nothing, and what the client is
    /// allowed does not depend on how fast the node handles what came before (a flood used to
    /// fill the inbox, and end with the overflow's 4029, before a slow node had answered the
    /// burst).
    func received(_ message: SessionMessage) {
        run(state.withLockedValue { state in
            let arrived = state.frameBucket.take().map { SessionMessage.refused(retryAfter: $0) } ?? message
            return state.lifecycle.received(arrived)
        })
    }

    /// Whether the client has gone (its connection ended, or it is being closed).
    private var clientGone: Bool { state.withLockedValue { $0.lifecycle.clientGone } }

    /// The connection ended (on its loop).
    func ended(_ ending: SessionChannelHandler.Ending) {
        run(state.withLockedValue { $0.lifecycle.connectionEnded(ending) })
    }

    private func openingEnded(_ open: Open? = nil) {
        run(state.withLockedValue { $0.lifecycle.openingEnded(open) })
    }

    /// Closes a session that never started. The close follows the 101 after a short pause:
    /// arriving with the 101 and the end of the connection, it is lost by some clients
    /// (HummingbirdWSClient among them), which then wait for good.
    private func refuse(_ connection: SessionConnection, _ code: CloseCode, reason: String) {
        connection.eventLoop.scheduleTask(in: .milliseconds(100)) {
            connection.close(code.rawValue, reason: reason)
        }
    }

    private func opening(_ connection: SessionConnection, _ request: Request) async {
        let frames = gateway.frames
        guard let user = try? await gateway.authenticateUpgrade(request) else {
            refuse(connection, .unauthorized, reason: "unauthorized")
            return openingEnded()
        }
        let device: String
        let status: PresenceStatus
        do {
            device = try Gateway.deviceID(request)
            status = try Gateway.openingStatus(request)
        } catch {
            connection.send(TextFrame(frames.bytes(.error(error.payload))))
            refuse(connection, .policyViolation, reason: error.message)
            return openingEnded()
        }
        // A node that has not taken its lease yet writes no device: until it has, what an earlier
        // process under its node id left is still being taken offline.
        guard await gateway.engine.waitUntilRegistered(timeout: .seconds(5)) else {
            refuse(connection, .tryAgainLater, reason: "this node is starting; try again")
            return openingEnded()
        }
        // The client may have left while its token was checked or the node started: nothing of
        // it is written then (it would show online for a moment, then offline).
        guard !clientGone else { return openingEnded() }
        let session = Session(userID: user.userID, deviceID: device, frames: frames, connection: connection)
        session.setDeviceStatus(status)
        await gateway.hub.register(session)
        guard !clientGone else {
            await gateway.hub.unregister(session)
            return openingEnded()
        }
        // The conversations whose messages it gets, beside the device's write (not after it: a
        // client that writes at once would queue frames meanwhile), and done before
        // `initial_state`: from its first frame on, the session gets every message stored
        // after, and a `sync` finds its live messages routed.
        async let routed: Void = gateway.hub.openMessageRoutes(of: session)
        do {
            let opened = try await gateway.engine.connect(user: user.userID, device: device, session: session.id, status: status)
            if opened.change.changed { GatewayMetrics.transition() }
            if let replaced = opened.replaced { await gateway.hub.closeRemote(node: replaced.node, session: replaced.session) }
            await routed
            if let probe = gateway.beforeInitialState.withLockedValue({ $0 }) { await probe(session) }
            try await sendInitialState(to: session, user: user.userID)
            startOpeningHoldClock(session)
        } catch {
            await routed
            let apiError = APIError.from(error)
            connection.send(TextFrame(frames.bytes(.error(apiError.payload))))
            refuse(connection, apiError.code == .rateLimited ? .rateLimited : .internalError, reason: apiError.message)
            await gateway.hub.unregister(session)
            _ = try? await gateway.engine.disconnect(user: user.userID, device: device, session: session.id, clean: true)
            return openingEnded()
        }
        // Clamped: a far-future `exp` must not overflow the conversion to nanoseconds.
        let expiry = min(max(0, user.expiresAt.timeIntervalSinceNow), 366 * 86_400)
        connection.expire(at: .now() + .milliseconds(Int64(expiry * 1000)))
        gateway.logger.info("session opened", metadata: Self.metadata(of: session))
        let handler = FrameHandlerBox(FrameHandler(gateway: gateway, session: session, user: user))
        openingEnded(Open(session: session, user: user, frames: handler))
    }

    /// Starts the clock of the session's opening hold once its `initial_state` is on its way:
    /// from then on the client has the whole hold to send its first `sync`, and live messages
    /// wait from the registration until then. When the time is up while frames of the client wait
    /// to be handled (one may be that `sync`), the hold goes on until none waits, at most
    /// ``SessionHub/messageOpeningHoldExtension`` more. Counted from the registration and ended
    /// by the clock alone, a node slow to open and answer sessions (a reconnect storm) sent live
    /// messages ahead of syncs it had not read yet, and those syncs then named what came before
    /// them `missing`, to be read over REST. Timers of the connection's loop, not tasks asleep on
    /// the pool: a task per session woke a pool thread for each after a connect storm.
    private func startOpeningHoldClock(_ session: Session) {
        let loop = session.connection.eventLoop
        let latest = NIODeadline.now() + TimeAmount(SessionHub.messageOpeningHold + SessionHub.messageOpeningHoldExtension)
        @Sendable func end() {
            if state.withLockedValue({ $0.lifecycle.hasWaitingMessages }), NIODeadline.now() < latest {
                loop.scheduleTask(in: .milliseconds(50)) { end() }
            } else {
                session.endOpeningHold()
            }
        }
        loop.scheduleTask(in: TimeAmount(SessionHub.messageOpeningHold)) { end() }
    }

    /// What each line logged about a session says of it. Made for each line rather than kept in
    /// a logger of the session's: the metadata dictionary and the log handler's rendering of it
    /// were some 700 bytes of every idle session.
    private static func metadata(of session: Session) -> Logger.Metadata {
        ["presence.user_id": "\(session.userID)", "presence.device_id": "\(session.deviceID)"]
    }

    private func sendInitialState(to session: Session, user: String) async throws {
        let frames = gateway.frames
        guard gateway.configuration.visibility == .conversations else {
            session.send(frames.text(.initialState([])))
            return
        }
        let checks = session.visibilityChecks.begun
        let contacts = try await gateway.engine.contacts(of: user)
        try await gateway.hub.watchAndRead(session, contacts, visibleAsOf: checks) { presences in
            [frames.text(.initialState(presences.map { PresencePayload($0) }))]
        }
    }

    /// Handles the next queued message, then gives its turn of the gate back and queues for the
    /// next one: a session with many messages, each awaiting a slow Redis, takes one turn at a
    /// time like any other, and does not hold a slot while others' messages wait. The only task
    /// handling this session's messages (see ``SessionLifecycle``).
    private func handleMessages() async {
        let next = state.withLockedValue { $0.lifecycle.nextMessage() }
        guard case .handle(let message, let open) = next else { return run(next) }
        let goesOn: Bool
        switch message {
        case .text(let text, let arrived): goesOn = await open.frames.handle(text, arrived: arrived)
        case .binary: goesOn = open.frames.handleBinary()
        case .refused(let wait): goesOn = open.frames.handleRefused(retryAfter: wait)
        }
        if let probe = gateway.afterMessageHandled.withLockedValue({ $0 }) { await probe(open.session) }
        if !goesOn { open.session.close(.normal, reason: "") }
        run(state.withLockedValue { $0.lifecycle.handled(goesOn: goesOn) })
    }

    /// After the connection ended: the session leaves the hub and its device is closed, at once
    /// for a clean close (the client's 1000, a sign-out, an admin disconnect), else after the
    /// linger.
    private func finish(_ open: Open?, _ ending: SessionChannelHandler.Ending) async {
        let admitted = state.withLockedValue { $0.admitted }
        if let open {
            let session = open.session
            session.close(nil, reason: "")
            await gateway.hub.unregister(session)
            let serverClose = session.closeRequest?.code
            let clean = ending.clientCode == CloseCode.normal.rawValue && ending.serverCode == nil
                || session.deviceStatus.saidOffline || serverClose == .disconnectedByAdmin
            _ = try? await gateway.engine.disconnect(user: open.user.userID, device: session.deviceID, session: session.id, clean: clean)
            var metadata = Self.metadata(of: session)
            metadata["presence.clean"] = "\(clean)"
            metadata["presence.close_code"] = "\(ending.clientCode ?? ending.serverCode ?? 0)"
            gateway.logger.info("session closed", metadata: metadata)
        }
        if admitted { gateway.hub.leave() }
        // The handler's events hold this run, and the run (through its session and its
        // connection) the handler: let go, or both stay for good. (The lifecycle, finished, holds
        // nothing.)
        state.withLockedValue { $0.connection = nil }
    }
}

/// A session's frame handler, used by one task at a time (``SessionRun`` starts a task only
/// when none is handling messages).
final class FrameHandlerBox: @unchecked Sendable {
    private var handler: FrameHandler

    init(_ handler: FrameHandler) { self.handler = handler }

    func handle(_ text: String, arrived: ContinuousClock.Instant) async -> Bool { await handler.handle(text, arrived: arrived) }
    func handleBinary() -> Bool { handler.handleBinary() }
    func handleRefused(retryAfter wait: Int) -> Bool { handler.handleRefused(retryAfter: wait) }
}
