import NIOConcurrencyHelpers
import NIOCore
import NIOWebSocket

/// Remembers the close code a client sent, which the WebSocket handler does not surface:
/// code 1000 takes the device offline at once, anything else lets it linger.
final class CloseCodeRecorder: ChannelInboundHandler, RemovableChannelHandler, Sendable {
    typealias InboundIn = WebSocketFrame
    private let code = NIOLockedValueBox<UInt16?>(nil)

    var receivedCode: UInt16? { code.withLockedValue { $0 } }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let frame = unwrapInboundIn(data)
        if frame.opcode == .connectionClose {
            var payload = frame.unmaskedData
            let received = payload.readInteger(as: UInt16.self) ?? 1005
            code.withLockedValue { $0 = received }
        }
        context.fireChannelRead(data)
    }

    /// Puts a recorder right after the frame decoder of a WebSocket channel.
    static func install(on channel: any Channel) async -> CloseCodeRecorder? {
        let recorder = CloseCodeRecorder()
        do {
            try await channel.eventLoop.submit {
                let pipeline = channel.pipeline.syncOperations
                let decoder = try pipeline.handler(type: ByteToMessageHandler<WebSocketFrameDecoder>.self)
                try pipeline.addHandler(recorder, position: .after(decoder))
            }.get()
            return recorder
        } catch {
            return nil
        }
    }
}
