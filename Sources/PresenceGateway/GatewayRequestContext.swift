import Hummingbird
import HummingbirdWebSocket
import NIOCore

/// The request context of every route: Hummingbird's, plus the channel (to read a client's
/// close code) and the WebSocket handler slot.
public struct GatewayRequestContext: RequestContext, WebSocketRequestContext {
    public var coreContext: CoreRequestContextStorage
    public let webSocket: WebSocketHandlerReference<Self>
    /// The connection's channel.
    public let channel: any Channel

    public init(source: ApplicationRequestContextSource) {
        self.coreContext = .init(source: source)
        self.webSocket = .init()
        self.channel = source.channel
    }
}
