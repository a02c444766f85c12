import Hummingbird
import HummingbirdWebSocket
import NIOConcurrencyHelpers
import NIOCore
import PresenceProtocol

/// The request context of every route: Hummingbird's, plus the channel (to read a client's
/// close code), the WebSocket handler slot and the node's REST body coder.
public struct GatewayRequestContext: RequestContext, WebSocketRequestContext {
    public var coreContext: CoreRequestContextStorage
    /// The connection's channel.
    public let channel: any Channel
    /// How bodies are read and written: set for every request by ``RESTCodingMiddleware``.
    var bodies = FrameCoder(snakeCaseKeys: true)

    /// API.md's limit on a request body.
    public var maxUploadSize: Int { 64 * 1024 }
    public var requestDecoder: RESTRequestDecoder { RESTRequestDecoder(coder: bodies) }
    public var responseEncoder: RESTResponseEncoder { RESTResponseEncoder(coder: bodies) }
    private let slot: WebSocketSlot

    /// hummingbird-websocket (2.8) stores the upgrade's handler in this reference together with
    /// a copy of this context, which holds the reference: a cycle that would keep every upgraded
    /// connection (its channel, buffers and logger) alive for good. The slot lets the session
    /// break it once the upgrade has happened (``releaseWebSocketHandler()``).
    public var webSocket: WebSocketHandlerReference<Self> { slot.reference.withLockedValue { $0 } ?? .init() }

    public init(source: ApplicationRequestContextSource) {
        self.coreContext = .init(source: source)
        self.channel = source.channel
        self.slot = WebSocketSlot()
    }

    /// Lets go of the upgrade's handler reference; called when a session starts, after the
    /// WebSocket layer has taken the handler from it.
    func releaseWebSocketHandler() {
        slot.reference.withLockedValue { $0 = nil }
    }

    private final class WebSocketSlot: Sendable {
        let reference = NIOLockedValueBox<WebSocketHandlerReference<GatewayRequestContext>?>(.init())
    }
}
