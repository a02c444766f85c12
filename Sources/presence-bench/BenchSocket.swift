import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import NIOWebSocket

/// A lean WebSocket client for load generation: one NIO channel, an HTTP upgrade written by
/// hand, text frames handed to a callback. It can bind its source address, so that many
/// sessions can spread over 127.0.0.x and pass the ~28k ephemeral ports of one address pair.
final class BenchSocket: Sendable {
    let channel: any Channel

    private init(channel: any Channel) { self.channel = channel }

    /// Opens a session to `127.0.0.1:port` at `path` (with the query), from `source` if given.
    /// `onText` gets every text frame, on the channel's event loop; `onClose` once it ends, with
    /// the code of the server's close frame (nil when the connection ended without one).
    static func connect(
        port: Int, path: String, source: String? = nil, group: any EventLoopGroup,
        onText: @escaping @Sendable (String) -> Void, onClose: @escaping @Sendable (UInt16?) -> Void = { _ in }
    ) async throws -> BenchSocket {
        let upgraded = group.any().makePromise(of: Void.self)
        var bootstrap = ClientBootstrap(group: group)
            .channelOption(.socketOption(.so_reuseaddr), value: 1)
            .connectTimeout(.seconds(10))
            .channelInitializer { channel in
                channel.eventLoop.makeCompletedFuture {
                    let handler = UpgradeHandler(path: path, port: port, upgraded: upgraded, onText: onText, onClose: onClose)
                    try channel.pipeline.syncOperations.addHandler(handler)
                }
            }
        do {
            if let source { bootstrap = bootstrap.bind(to: try SocketAddress(ipAddress: source, port: 0)) }
            let channel = try await bootstrap.connect(host: "127.0.0.1", port: port).get()
            try await upgraded.futureResult.get()
            return BenchSocket(channel: channel)
        } catch {
            upgraded.fail(error)  // a no-op when the handler already failed it
            throw error
        }
    }

    /// Sends a text frame (masked, as a client must).
    func send(_ text: String) {
        let frame = WebSocketFrame(fin: true, opcode: .text, maskKey: .random(), data: channel.allocator.buffer(string: text))
        channel.writeAndFlush(frame, promise: nil)
    }

    /// Drops the connection without a close frame.
    func abort() { channel.close(promise: nil) }

    /// Closes with code 1000 (a sign-out: the device goes offline at once) and waits for the end.
    func closeNormally() async {
        var code = channel.allocator.buffer(capacity: 2)
        code.writeInteger(UInt16(1000))
        let frame = WebSocketFrame(fin: true, opcode: .connectionClose, maskKey: .random(), data: code)
        channel.writeAndFlush(frame, promise: nil)
        // The server answers with its close frame and shuts the connection; a bounded wait.
        _ = try? await channel.closeFuture.get()
    }
}

/// Writes the upgrade request, waits for `101`, then swaps itself for the frame codec.
private final class UpgradeHandler: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    let path: String
    let port: Int
    let onText: @Sendable (String) -> Void
    let onClose: @Sendable (UInt16?) -> Void
    let upgraded: EventLoopPromise<Void>
    private var settled = false
    private var response = ByteBuffer()

    /// Completes the upgrade promise once.
    private func settle(_ error: (any Error)?) {
        guard !settled else { return }
        settled = true
        if let error { upgraded.fail(error) } else { upgraded.succeed() }
    }

    init(path: String, port: Int, upgraded: EventLoopPromise<Void>, onText: @escaping @Sendable (String) -> Void, onClose: @escaping @Sendable (UInt16?) -> Void) {
        self.path = path
        self.port = port
        self.upgraded = upgraded
        self.onText = onText
        self.onClose = onClose
    }

    func channelActive(context: ChannelHandlerContext) {
        let key = Data((0..<16).map { _ in UInt8.random(in: 0...255) }).base64EncodedString()
        let request = "GET \(path) HTTP/1.1\r\nHost: 127.0.0.1:\(port)\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            + "Sec-WebSocket-Key: \(key)\r\nSec-WebSocket-Version: 13\r\n\r\n"
        context.writeAndFlush(wrapOutboundOut(context.channel.allocator.buffer(string: request)), promise: nil)
        context.fireChannelActive()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        var buffer = unwrapInboundIn(data)
        response.writeBuffer(&buffer)
        let view = response.readableBytesView
        guard let end = view.firstRange(of: Array("\r\n\r\n".utf8)) else { return }
        let head = String(decoding: view[view.startIndex..<end.lowerBound], as: UTF8.self)
        guard head.hasPrefix("HTTP/1.1 101") else {
            settle(BenchSocketError.refused(String(head.prefix(40))))
            context.close(promise: nil)
            return
        }
        response.moveReaderIndex(forwardBy: end.upperBound - view.startIndex)
        let rest = response
        do {
            let operations = context.pipeline.syncOperations
            try operations.addHandler(ByteToMessageHandler(WebSocketFrameDecoder(maxFrameSize: 1 << 24)), position: .after(self))
            try operations.addHandler(WebSocketFrameEncoder(), position: .after(self))
            try operations.addHandler(FrameHandler(onText: onText, onClose: onClose), position: .last)
        } catch {
            settle(error)
            context.close(promise: nil)
            return
        }
        settle(nil)
        // Frames that came with the 101 go to the decoder first, then this handler leaves.
        if rest.readableBytes > 0 { context.fireChannelRead(NIOAny(rest)) }
        context.pipeline.syncOperations.removeHandler(context: context, promise: nil)
    }

    func channelInactive(context: ChannelHandlerContext) {
        settle(BenchSocketError.closed)
        onClose(nil)
        context.fireChannelInactive()
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        settle(error)
        context.close(promise: nil)
    }
}

/// Hands text frames to the callback and answers pings.
private final class FrameHandler: ChannelInboundHandler {
    typealias InboundIn = WebSocketFrame
    typealias OutboundOut = WebSocketFrame

    let onText: @Sendable (String) -> Void
    let onClose: @Sendable (UInt16?) -> Void
    private var partial: ByteBuffer?
    private var closeCode: UInt16?

    init(onText: @escaping @Sendable (String) -> Void, onClose: @escaping @Sendable (UInt16?) -> Void) {
        self.onText = onText
        self.onClose = onClose
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let frame = unwrapInboundIn(data)
        switch frame.opcode {
        case .text where frame.fin:
            onText(String(buffer: frame.unmaskedData))
        case .text:
            // A large message comes in fragments (the server's frame size limit applies to it too).
            partial = frame.unmaskedData
        case .continuation:
            var data = frame.unmaskedData
            partial?.writeBuffer(&data)
            if frame.fin, let message = partial {
                partial = nil
                onText(String(buffer: message))
            }
        case .ping:
            let pong = WebSocketFrame(fin: true, opcode: .pong, maskKey: .random(), data: frame.unmaskedData)
            context.writeAndFlush(wrapOutboundOut(pong), promise: nil)
        case .connectionClose:
            var data = frame.unmaskedData
            closeCode = data.readInteger(as: UInt16.self)
            context.close(promise: nil)
        default:
            break
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        onClose(closeCode)
        context.fireChannelInactive()
    }
}

enum BenchSocketError: Error {
    case refused(String)
    case closed
}
