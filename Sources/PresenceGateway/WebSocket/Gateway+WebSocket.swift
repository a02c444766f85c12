import NIOCore
import Foundation
import Hummingbird
import HummingbirdWebSocket
import Logging
import NIOWebSocket
import PresenceEngine
import PresenceProtocol
import ServiceLifecycle

extension Gateway {
    func addWebSocketRoute(to router: Router<GatewayRequestContext>) {
        // The token and the query are checked once upgraded, where a refusal can say why (4001,
        // or an `error` frame and 1008): an upgrade refused here reaches the client as a bare
        // HTTP 400. A node shutting down refuses here all the same: a session opened and closed
        // at once while the node stops may end before the client has finished its upgrade, and
        // HummingbirdWSClient then waits for good instead of going to another node.
        router.ws("/api/presence/subscribe", shouldUpgrade: { _, _ in
            guard !self.hub.isDraining else { throw APIError.unavailable("this node is shutting down; connect to another") }
            return .upgrade([:])
        }, onUpgrade: { inbound, outbound, context in
            context.requestContext.releaseWebSocketHandler()
            // Counted before the token is checked: a flood of bad tokens holds connections too.
            guard self.hub.admit(limit: self.configuration.maxSessions) else {
                GatewayMetrics.refused("full")
                await self.refuse(outbound, .tryAgainLater, reason: "this node holds its most sessions; try another")
                return
            }
            defer { self.hub.leave() }
            try await self.serve(inbound: inbound, outbound: outbound, request: context.request, channel: context.requestContext.channel)
        })
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

    private func serve(inbound: WebSocketInboundStream, outbound: WebSocketOutboundWriter, request: Request, channel: any Channel) async throws {
        guard let user = try? await authenticate(request, allowQuery: true) else {
            await refuse(outbound, .unauthorized, reason: "unauthorized")
            return
        }
        let device: String
        let status: PresenceStatus
        do {
            device = try Self.deviceID(request)
            status = try Self.openingStatus(request)
        } catch {
            try? await outbound.writeTextMessage(frames.text(.error(error.payload)))
            await refuse(outbound, .policyViolation, reason: error.message)
            return
        }
        // A node that has not taken its lease yet writes no device: until it has, what an earlier
        // process under its node id left is still being taken offline.
        guard await engine.waitUntilRegistered(timeout: .seconds(5)) else {
            await refuse(outbound, .tryAgainLater, reason: "this node is starting; try again")
            return
        }
        let recorder = await CloseCodeRecorder.install(on: channel)
        let session = Session(userID: user.userID, deviceID: device, frames: frames, queueLimit: configuration.outboundQueueLimit)
        var logger = self.logger
        logger[metadataKey: "presence.user_id"] = "\(user.userID)"
        logger[metadataKey: "presence.device_id"] = "\(device)"
        session.setDeviceStatus(status)
        await hub.register(session)
        do {
            let opened = try await engine.connect(user: user.userID, device: device, session: session.id, status: status)
            if opened.change.changed { GatewayMetrics.transition() }
            if let replaced = opened.replaced { await hub.closeRemote(node: replaced.node, session: replaced.session) }
            try await sendInitialState(to: session, user: user.userID)
        } catch {
            let apiError = APIError.from(error)
            try? await outbound.writeTextMessage(frames.text(.error(apiError.payload)))
            await refuse(outbound, apiError.code == .rateLimited ? .rateLimited : .internalError, reason: apiError.message)
            await hub.unregister(session)
            _ = try? await engine.disconnect(user: user.userID, device: device, session: session.id, clean: true)
            return
        }
        logger.info("session opened")
        // A protocol error while reading (a message over the size limit, a bad frame) is thrown
        // again at the end, so that the WebSocket layer closes with its code (1009, 1002...).
        let readError: (any Error)? = await withGracefulShutdownHandler {
            await run(session, user: user, inbound: inbound, outbound: outbound, channel: channel, logger: logger)
        } onGracefulShutdown: {
            // Clients reconnect to another node within the linger: no offline flicker.
            session.close(.goingAway, reason: "the node is shutting down")
        }
        await hub.unregister(session)
        let serverClose = session.closeRequest?.code
        let clean = recorder?.receivedCode == CloseCode.normal.rawValue && serverClose == .normal || session.deviceStatus.saidOffline
            || serverClose == .disconnectedByAdmin
        _ = try? await engine.disconnect(user: user.userID, device: device, session: session.id, clean: clean)
        logger.info("session closed", metadata: ["presence.clean": "\(clean)", "presence.close_code": "\(recorder?.receivedCode ?? serverClose?.rawValue ?? 0)"])
        if let readError { throw readError }
    }

    /// Closes a session that never started. The WebSocket layer ends the connection right
    /// behind a server's close frame; arriving with the 101 and the end of the connection, that
    /// close is lost by some clients (HummingbirdWSClient among them), which then wait for
    /// good. A short pause lets the client finish its upgrade first.
    private func refuse(_ outbound: WebSocketOutboundWriter, _ code: CloseCode, reason: String) async {
        try? await Task.sleep(for: .milliseconds(100))
        try? await outbound.close(.init(codeNumber: Int(code.rawValue)), reason: reason)
    }

    /// Runs a session until it closes: a writer draining its queue, a timer for the token's
    /// expiry, a watchdog on the close, and the reader handling frames. Returns the error that
    /// ended reading, if any.
    private func run(_ session: Session, user: AuthenticatedUser, inbound: WebSocketInboundStream, outbound: WebSocketOutboundWriter, channel: any Channel, logger: Logger) async -> (any Error)? {
        // Clamped: a far-future `exp` must not overflow the conversion to milliseconds.
        let expiry = min(max(0, user.expiresAt.timeIntervalSinceNow), 366 * 86_400)
        return await withTaskGroup(of: Void.self) { group in
            group.addTask {
                for await frame in session.outbound {
                    guard case .text(let text) = frame else { continue }
                    do { try await outbound.writeTextMessage(text) } catch { break }
                }
                let close = session.closeRequest ?? (.normal, "")
                if let code = close.code { try? await outbound.close(.init(codeNumber: Int(code.rawValue)), reason: close.reason) }
            }
            group.addTask {
                try? await Task.sleep(for: .milliseconds(Int64(expiry * 1000)))
                if !Task.isCancelled { session.close(.unauthorized, reason: "the token has expired") }
            }
            group.addTask {
                // A client that reads nothing (its queue overflowed, or it ignores the close)
                // holds the writer in a write and the reader in a read: shut its connection.
                await session.closeRequested()
                guard (try? await Task.sleep(for: self.configuration.closeTimeout)) != nil else { return }
                logger.info("the client took nothing for the close timeout; shutting its connection", metadata: ["presence.close_code": "\(session.closeRequest?.code?.rawValue ?? 0)"])
                channel.close(promise: nil)
            }
            var handler = FrameHandler(gateway: self, session: session, user: user, logger: logger)
            var readError: (any Error)?
            do {
                for try await message in inbound.messages(maxSize: configuration.maxFrameSize) {
                    guard case .text(let text) = message else {
                        if !handler.handleBinary() { break }
                        continue
                    }
                    if await !handler.handle(text) { break }
                }
            } catch {
                logger.debug("session read failed", metadata: ["error": "\(error)"])
                readError = error
            }
            // No code: the WebSocket layer closes, with the code of the error rethrown below.
            session.close(readError == nil ? .normal : nil, reason: "")
            await group.next()
            group.cancelAll()
            return readError
        }
    }

    private func sendInitialState(to session: Session, user: String) async throws {
        guard configuration.visibility == .conversations else {
            session.send(frames.text(.initialState([])))
            return
        }
        let contacts = try await engine.contacts(of: user)
        try await hub.watchAndRead(session, contacts) { presences in
            [self.frames.text(.initialState(presences.map { PresencePayload($0) }))]
        }
    }
}
