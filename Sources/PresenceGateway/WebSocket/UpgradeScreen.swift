import NIOCore
import NIOHTTP1

/// Takes the `Upgrade` header off a connection's request when NIO's upgrader would not upgrade
/// it, so that the request reaches the router as an ordinary one.
///
/// NIO's typed upgrade handler drops the head of a request that asks for an upgrade none of its
/// upgraders takes (a WebSocket upgrade to another path, a missing `Sec-WebSocket-Key`, a
/// version other than 13, `Upgrade: h2c`): only the request's end reaches HTTP, and the
/// connection closed with no answer at all. Screened here, such a request gets the router's
/// answer (404 for another path, 422 with the reason for the session path), and a session upgrade
/// refused while the node drains gets 503 (see ``GatewayServerChannel``).
///
/// It sits between the HTTP decoder and the upgrade handler; a session's upgrade takes it out.
final class UpgradeScreen: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias InboundOut = HTTPServerRequestPart

    /// Set on a request whose session upgrade this node refused because it is draining.
    static let refusedHeader = "presence-upgrade-refused"

    private let accepts: (HTTPRequestHead) -> Bool

    init(accepts: @escaping (HTTPRequestHead) -> Bool) {
        self.accepts = accepts
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        guard case .head(var head) = unwrapInboundIn(data) else {
            return context.fireChannelRead(data)
        }
        // The marker is this node's word alone, never a client's.
        head.headers.remove(name: Self.refusedHeader)
        if head.headers.contains(name: "upgrade") {
            let websocket = head.headers[canonicalForm: "upgrade"].contains { $0.lowercased() == "websocket" }
            let wellFormed = websocket && head.headers["sec-websocket-key"].count == 1
                && head.headers["sec-websocket-version"] == ["13"]
            if !(wellFormed && accepts(head)) {
                head.headers.remove(name: "upgrade")
                // A well-formed GET of the session path is refused only while the node drains;
                // any other request is the router's to answer (405 for another method).
                if wellFormed && head.method == .GET && head.uri.prefix(while: { $0 != "?" }) == Gateway.sessionPath {
                    head.headers.add(name: Self.refusedHeader, value: "draining")
                }
            }
        }
        context.fireChannelRead(wrapInboundOut(.head(head)))
    }
}
