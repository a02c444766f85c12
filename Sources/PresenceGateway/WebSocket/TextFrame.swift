import NIOCore

/// A text message as the bytes of one whole WebSocket frame: header and payload, unmasked as a
/// server's frames are (RFC 6455 5.2), in one buffer. Made once, it is written as it is to every
/// session it goes to: an update that 4,000 sessions watch is framed once, not by NIO's frame
/// encoder once per connection (``SessionChannelHandler`` writes it past the encoder).
struct TextFrame: Sendable {
    /// The frame, header first.
    let bytes: ByteBuffer
    /// How many of ``bytes`` are the header: 2, 4 or 10.
    let headerLength: Int

    /// The frame of a text message whose UTF-8 is `payload`.
    init(_ payload: some Collection<UInt8>) {
        let count = payload.count
        var buffer = ByteBuffer()
        buffer.reserveCapacity(count + 10)
        // FIN, opcode 1 (text).
        buffer.writeInteger(UInt8(0x81))
        switch count {
        case ..<126:
            buffer.writeInteger(UInt8(count))
        case ...Int(UInt16.max):
            buffer.writeInteger(UInt8(126))
            buffer.writeInteger(UInt16(count))
        default:
            buffer.writeInteger(UInt8(127))
            buffer.writeInteger(UInt64(count))
        }
        headerLength = buffer.readableBytes
        buffer.writeBytes(payload)
        bytes = buffer
    }

    /// The frame of a text message.
    init(_ text: String) {
        self.init(text.utf8)
    }

    /// The message's UTF-8, without the header.
    var payload: ByteBuffer {
        bytes.getSlice(at: bytes.readerIndex + headerLength, length: bytes.readableBytes - headerLength) ?? ByteBuffer()
    }
}
