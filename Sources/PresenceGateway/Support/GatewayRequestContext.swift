import Hummingbird
import HummingbirdWebSocket
import NIOConcurrencyHelpers
import NIOCore

/// The request context of every route: Hummingbird's, plus the channel (to read a client's
/// close code) and the WebSocket handler slot.
public struct GatewayRequestContext: RequestContext, WebSocketRequestContext {
    public var coreContext: CoreRequestContextStorage
    /// The connection's channel.
    public let channel: any Channel
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
