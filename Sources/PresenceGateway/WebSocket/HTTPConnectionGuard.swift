import NIOCore
import NIOHTTP1

/// Guards a connection while it speaks HTTP/1.1:
/// - a request NIO's HTTP decoder could not read is answered, then the connection closed: 431 for
///   a head over the decoder's limit (80 KiB), 400 for anything else it refused. Without it, such
///   a connection was neither answered nor closed: the decoder stops reading after its error;
/// - a request's head must arrive whole within `headTimeout` of the connection's start or of the
///   last response's end, or the connection is closed: a client that sends a head slowly, byte
///   by byte (slowloris), or opens connections and sends nothing, or half an upgrade, or keeps an
///   idle keep-alive connection, held it for good.
///
/// It sits at the end of the connection's HTTP pipeline, where HTTP parts pass through it
/// unchanged; a session's upgrade takes it out before the pipeline carries WebSocket frames (the
/// session's pings watch it from then on).
final class HTTPConnectionGuard: ChannelDuplexHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias InboundOut = HTTPServerRequestPart
    typealias OutboundIn = HTTPServerResponsePart
    typealias OutboundOut = HTTPServerResponsePart

    private let headTimeout: TimeAmount
    /// Closes the connection unless a request head arrives first.
    private var headDeadline: Scheduled<Void>?
    /// A response was begun and not finished: an error answer now would corrupt it.
    private var responding = false

    init(headTimeout: TimeAmount) {
        self.headTimeout = headTimeout
    }

    func handlerAdded(context: ChannelHandlerContext) {
        awaitHead(context)
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        headDeadline?.cancel()
        headDeadline = nil
    }

    private func awaitHead(_ context: ChannelHandlerContext) {
        headDeadline?.cancel()
        headDeadline = context.eventLoop.assumeIsolated().scheduleTask(in: headTimeout) { [weak self] in
            guard let self, !self.responding else { return }
            context.close(promise: nil)
        }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        if case .head = unwrapInboundIn(data) {
            headDeadline?.cancel()
            headDeadline = nil
        }
        context.fireChannelRead(data)
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        switch unwrapOutboundIn(data) {
        case .head(let head) where head.status.code >= 200: responding = true
        case .end:
            responding = false
            awaitHead(context)
        default: break
        }
        context.write(data, promise: promise)
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        guard let parseError = error as? HTTPParserError else {
            return context.fireErrorCaught(error)
        }
        guard !responding else {
            context.close(promise: nil)
            return
        }
        let (status, reason): (HTTPResponseStatus, String) = switch parseError {
        case .headerOverflow: (.requestHeaderFieldsTooLarge, "the request's headers are over 80 KiB")
        default: (.badRequest, "the request is not valid HTTP/1.1")
        }
        let body = #"{"error":{"code":"invalid_request","message":"\#(reason)"}}"#
        let head = HTTPResponseHead(version: .http1_1, status: status, headers: [
            "Connection": "close", "Content-Type": "application/json", "Content-Length": "\(body.utf8.count)",
        ])
        responding = true
        context.write(wrapOutboundOut(.head(head)), promise: nil)
        context.write(wrapOutboundOut(.body(.byteBuffer(ByteBuffer(string: body)))), promise: nil)
        context.writeAndFlush(wrapOutboundOut(.end(nil))).assumeIsolated().whenComplete { _ in context.close(promise: nil) }
    }
}
