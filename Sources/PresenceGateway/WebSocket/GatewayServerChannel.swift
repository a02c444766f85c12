import HTTPTypes
import Hummingbird
import HummingbirdCore
import Logging
import NIOCore
import NIOHTTP1
import NIOHTTPTypes
import NIOHTTPTypesHTTP1
import NIOWebSocket

/// Each connection of the node's one port: HTTP/1.1 for Hummingbird's router, or, when its first
/// request is the session upgrade, a WebSocket session on NIO handlers.
///
/// The seam: NIO's typed HTTP upgrader sits in front of Hummingbird's HTTP handlers. A first
/// request asking for a WebSocket on the session path is upgraded here, and the connection's
/// pipeline becomes NIO's frame decoder and encoder plus a ``SessionChannelHandler``; no Swift
/// task serves it. Every other connection is handed to Hummingbird as its own HTTP/1.1 server
/// would set it up (`HTTPConnectionStateHandler`, an async channel, `handleHTTP`).
struct GatewayServerChannel: ServerChildChannel, HTTPChannelHandler {
    enum Negotiated: Sendable {
        /// A session: its handlers are in the pipeline and run on their own.
        case session
        /// An ordinary HTTP connection, or one whose upgrade was refused (answered 400).
        case http(NIOAsyncChannel<HTTPRequestPart, HTTPResponsePart>, upgradeRefused: Bool)
    }

    struct Value: ServerChildChannelValue {
        let negotiated: EventLoopFuture<Negotiated>
        let channel: any Channel
    }

    let responder: HTTPChannelHandler.Responder
    let sessions: SessionStarter

    init(responder: @escaping HTTPChannelHandler.Responder, sessions: SessionStarter) {
        self.sessions = sessions
        // Only a connection's first request can be upgraded: until then NIO's upgrader sits in
        // front of HTTP. A later one arrives when a balancer sends it over a connection it keeps
        // to this node (HAProxy does, with requests it sent there before). It is answered 503
        // with `Connection: close`, and the connection closed: a balancer retries it on a new
        // connection (HAProxy's `retry-on 503`), where it is the first request.
        // An upgrade to any other path is an ordinary request there: the router answers it (404
        // for a path it does not serve).
        self.responder = { request, writer, channel in
            let refused = request.headers[HTTPField.Name(UpgradeScreen.refusedHeader)!] != nil
            let upgrade = request.headers[.upgrade]?.lowercased() == "websocket" && request.uri.path == Gateway.sessionPath
            guard upgrade || refused else {
                return try await responder(request, writer, channel)
            }
            try await writer.writeResponse(HTTPResponse(status: .serviceUnavailable, headerFields: [
                .connection: "close", .contentLength: "0", .retryAfter: "0",
            ]))
            throw UpgradeOnReusedConnection()
        }
    }

    /// Ends a connection that carried an upgrade as a later request.
    struct UpgradeOnReusedConnection: Error {}

    /// How a connection's reads are sized. The channel keeps its last read buffer for the next
    /// read, for its whole life: NIO's default first size, 2 KiB, was the largest single part of
    /// an idle session. A session's frames, pings and pongs are mostly a few hundred bytes; a
    /// read that fills its buffer doubles the next (up to 64 KiB), so a large body or frame costs
    /// a few more reads, not more.
    static let receiveBuffers = AdaptiveRecvByteBufferAllocator(minimum: 64, initial: 512, maximum: 65536)

    func setup(channel: any Channel, logger: Logger) -> EventLoopFuture<Value> {
        GatewayMetrics.connections(1)
        channel.closeFuture.whenComplete { _ in GatewayMetrics.connections(-1) }
        return channel.eventLoop.makeCompletedFuture {
            try channel.syncOptions?.setOption(ChannelOptions.recvAllocator, value: Self.receiveBuffers)
            let upgrader = NIOTypedWebSocketServerUpgrader<Negotiated>(
                maxFrameSize: sessions.maxFrameSize,
                shouldUpgrade: { channel, head in
                    channel.eventLoop.makeSucceededFuture(sessions.accepts(head) ? HTTPHeaders() : nil)
                },
                upgradePipelineHandler: { channel, head in
                    channel.eventLoop.makeCompletedFuture {
                        // The pipeline carries WebSocket frames from now on.
                        let guardHandler = try channel.pipeline.syncOperations.handler(type: HTTPConnectionGuard.self)
                        channel.pipeline.syncOperations.removeHandler(guardHandler, promise: nil)
                        let screen = try channel.pipeline.syncOperations.handler(type: UpgradeScreen.self)
                        channel.pipeline.syncOperations.removeHandler(screen, promise: nil)
                        try sessions.start(on: channel, head: head)
                        return Negotiated.session
                    }
                }
            )
            let upgrading = NIOTypedHTTPServerUpgradeConfiguration<Negotiated>(
                upgraders: [upgrader],
                notUpgradingCompletionHandler: { channel in
                    channel.eventLoop.makeCompletedFuture {
                        try channel.pipeline.syncOperations.addHandler(HTTP1ToHTTPServerCodec(secure: false))
                        try channel.pipeline.syncOperations.addHandler(HTTPConnectionStateHandler(idleTimeout: nil, logger: logger))
                        let http = try NIOAsyncChannel<HTTPRequestPart, HTTPResponsePart>(
                            wrappingChannelSynchronously: channel,
                            configuration: .init(isOutboundHalfClosureEnabled: true)
                        )
                        return Negotiated.http(http, upgradeRefused: false)
                    }
                }
            )
            var configuration = NIOUpgradableHTTPServerPipelineConfiguration<Negotiated>(upgradeConfiguration: upgrading)
            // Hummingbird's async channel pipelines requests and answers errors itself.
            configuration.enablePipelining = false
            configuration.enableErrorHandling = false
            configuration.enableResponseHeaderValidation = false
            let negotiated = try channel.pipeline.syncOperations.configureUpgradableHTTPServerPipeline(configuration: configuration)
            try channel.pipeline.syncOperations.addHandler(HTTPConnectionGuard(headTimeout: TimeAmount(sessions.gateway.configuration.requestHeadTimeout)))
            let upgradeHandler = try channel.pipeline.syncOperations.handler(type: NIOTypedHTTPServerUpgradeHandler<Negotiated>.self)
            try channel.pipeline.syncOperations.addHandler(UpgradeScreen(accepts: sessions.accepts), position: .before(upgradeHandler))
            return Value(negotiated: negotiated, channel: channel)
        }
    }

    func handle(value: Value, logger: Logger) async {
        do {
            switch try await value.negotiated.get() {
            case .session:
                break
            case .http(let http, _):
                await handleHTTP(asyncChannel: http, logger: logger)
            }
        } catch {
            logger.debug("connection ended before its first request was answered", metadata: ["error": "\(error)"])
        }
    }
}
