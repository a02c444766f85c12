import NIOConcurrencyHelpers
import NIOCore
import NIOEmbedded
import NIOWebSocket
import PresenceProtocol
import RedisClient

/// What the fuzzers drive: each target takes arbitrary bytes and must neither crash nor leave
/// work undone. `presence-fuzz` runs them under libFuzzer, and the tests replay the corpus and
/// every input that once failed (`Fuzz/`).
public enum FuzzTarget: String, CaseIterable, Sendable {
    /// Bytes from Redis: the RESP parser, then a connection's reply handler.
    case resp
    /// Bytes from a WebSocket client: the frame decoder as a node sets it up, then the client
    /// frame decoder in both id formats.
    case frames

    public func run(_ bytes: [UInt8]) {
        switch self {
        case .resp: fuzzRESP(bytes)
        case .frames: fuzzFrames(bytes)
        }
    }
}

/// The first byte chooses how the rest is cut (a socket splits a stream anywhere) and whether the
/// handler is a subscriber's; the rest is what Redis sent.
private func fuzzRESP(_ bytes: [UInt8]) {
    guard let first = bytes.first else { return }
    let body = Array(bytes.dropFirst())
    let piece = Int(first & 0x0F) + 1
    let parser = RESPParser(maxPendingBytes: 1 << 16)
    var offset = 0
    parsing: while offset < body.count {
        let end = min(offset + piece, body.count)
        do {
            try parser.feed(ByteBuffer(bytes: body[offset..<end]))
            while let reply = try parser.next() {
                precondition(arrayDepth(reply) <= RESPParser.maxArrayDepth, "a reply nested deeper than the parser's limit got through")
            }
        } catch {
            break parsing
        }
        offset = end
    }

    // Three commands wait; whatever arrives, each must end with a reply or an error once the
    // connection closes.
    let channel = EmbeddedChannel(handler: makeRedisReplyHandler(maxReplyBytes: 1 << 16, subscriber: first & 0x80 != 0))
    let completed = NIOLockedValueBox(0)
    for _ in 0..<3 {
        let promise = channel.eventLoop.makePromise(of: RESPValue.self)
        promise.futureResult.whenComplete { _ in completed.withLockedValue { $0 += 1 } }
        _ = try? channel.writeOutbound(RedisRequest(encoded: ByteBuffer(string: "*1\r\n$4\r\nPING\r\n"), expectedReplies: 1, promise: promise))
    }
    _ = try? channel.writeInbound(ByteBuffer(bytes: body))
    _ = try? channel.finish()
    precondition(completed.withLockedValue { $0 } == 3, "a command was left waiting after the connection closed")
}

/// How many arrays nest in `value`, the outermost included (a scalar is 0).
private func arrayDepth(_ value: RESPValue) -> Int {
    if case .array(let items) = value { return 1 + (items.map(arrayDepth).max() ?? 0) }
    return 0
}

/// The bytes a client sends after the upgrade.
private func fuzzFrames(_ bytes: [UInt8]) {
    let maxFrameSize = MessageSize.maxFrameBytes(maxTextBytes: MessageSize.defaultMaxTextBytes)
    let channel = EmbeddedChannel()
    do {
        try channel.pipeline.syncOperations.addHandlers([
            ByteToMessageHandler(WebSocketFrameDecoder(maxFrameSize: maxFrameSize)),
            WebSocketProtocolErrorHandler(),
        ])
    } catch {
        preconditionFailure("cannot set up the pipeline: \(error)")
    }
    _ = try? channel.writeInbound(ByteBuffer(bytes: bytes))
    var message: [UInt8] = []
    while let frame = try? channel.readInbound(as: WebSocketFrame.self) {
        precondition(frame.length <= maxFrameSize, "the decoder let a frame over the limit through")
        guard frame.opcode == .text || frame.opcode == .continuation else { continue }
        var data = frame.unmaskedData
        message += data.readBytes(length: data.readableBytes) ?? []
        // As the node does: a message over the limit is refused whole.
        if message.count > maxFrameSize { message = []; continue }
        guard frame.fin else { continue }
        let text = String(decoding: message, as: UTF8.self)
        for coder in frameCoders { checkClientFrame(text, coder) }
        message = []
    }
    _ = try? channel.finish()
}

private let frameCoders = PresenceIDFormat.allCases.map { FrameCoder(ids: $0) }

/// A client frame the gateway takes has an id of at most 128 bytes and ids valid in the
/// format, and reads back the same once written; one it refuses says why.
private func checkClientFrame(_ text: String, _ coder: FrameCoder) {
    let message: ClientMessage
    do {
        message = try coder.clientMessage(text)
    } catch {
        precondition(!error.message.isEmpty, "a refused frame says why")
        return
    }
    precondition((message.id?.utf8.count ?? 0) <= ClientMessage.maxIDBytes, "an id over 128 bytes was taken")
    precondition(message.frame.ids.allSatisfy { coder.ids.canonical($0) == $0 }, "an id not in its stored spelling was taken")
    let again = try? coder.clientMessage(coder.text(message))
    precondition(again == message, "a frame written again reads differently: \(text.prefix(200))")
}
