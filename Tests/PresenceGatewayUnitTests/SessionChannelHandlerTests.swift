import NIOCore
import NIOEmbedded
import NIOWebSocket
import PresenceProtocol
import Testing

@testable import PresenceGateway

/// The session's connection handler on an embedded channel: frames in, frames out, and its
/// timers on the embedded loop's clock. No sockets and no Redis.
@Suite("Session connection handler")
struct SessionChannelHandlerTests {
    static let limits = SessionChannelHandler.Limits(
        maxMessageSize: 64, pingInterval: .seconds(10), pongTimeout: .seconds(4), closeTimeout: .seconds(3), unwritableBytes: 100
    )

    /// An embedded channel with the handler, connected, and what the handler reported.
    final class Harness {
        /// What the handler reported.
        final class Reports {
            var texts: [String] = []
            var binaries = 0
            var endings: [SessionChannelHandler.Ending] = []
        }

        let channel: EmbeddedChannel
        let handler: SessionChannelHandler
        let reports = Reports()
        var texts: [String] { reports.texts }
        var binaries: Int { reports.binaries }
        var endings: [SessionChannelHandler.Ending] { reports.endings }

        /// `before` goes in the pipeline ahead of the handler (nearer the socket).
        init(
            limits: SessionChannelHandler.Limits = SessionChannelHandlerTests.limits,
            loop: EmbeddedEventLoop = EmbeddedEventLoop(), before: (any ChannelHandler)? = nil
        ) throws {
            channel = EmbeddedChannel(loop: loop)
            if let before { try channel.pipeline.syncOperations.addHandler(before) }
            let reports = self.reports
            handler = SessionChannelHandler(limits: limits, events: .init(
                text: { reports.texts.append($0) },
                binary: { reports.binaries += 1 },
                ended: { reports.endings.append($0) }
            ))
            try channel.pipeline.syncOperations.addHandler(handler)
            try channel.connect(to: SocketAddress(ipAddress: "127.0.0.1", port: 9)).wait()
        }

        func receive(_ opcode: WebSocketOpcode, _ text: String, fin: Bool = true) throws {
            try channel.writeInbound(WebSocketFrame(fin: fin, opcode: opcode, data: ByteBuffer(string: text)))
        }

        func receiveClose(_ code: UInt16?) throws {
            var data = ByteBuffer()
            if let code { data.writeInteger(code) }
            try channel.writeInbound(WebSocketFrame(fin: true, opcode: .connectionClose, data: data))
        }

        /// Every frame written so far.
        func written() throws -> [WebSocketFrame] {
            var frames: [WebSocketFrame] = []
            while let frame = try channel.readOutbound(as: WebSocketFrame.self) { frames.append(frame) }
            return frames
        }

        func advance(_ amount: TimeAmount) {
            channel.embeddedEventLoop.advanceTime(by: amount)
        }
    }

    static func closeCode(_ frame: WebSocketFrame?) -> UInt16? {
        guard let frame, frame.opcode == .connectionClose else { return nil }
        var data = frame.data
        return data.readInteger(as: UInt16.self)
    }

    @Test("messages are delivered whole: single frames, fragments joined, binary reported")
    func messages() throws {
        let harness = try Harness()
        try harness.receive(.text, "hello")
        try harness.receive(.text, "frag", fin: false)
        try harness.receive(.continuation, "men", fin: false)
        try harness.receive(.continuation, "ted")
        try harness.receive(.binary, "bytes")
        #expect(harness.texts == ["hello", "fragmented"])
        #expect(harness.binaries == 1)
        #expect(try harness.written().isEmpty)
    }

    @Test("a message over the limit across its fragments is closed with 1009; a continuation with nothing to continue with 1002")
    func limitsAndProtocolErrors() throws {
        let large = try Harness()
        try large.receive(.text, String(repeating: "a", count: 40), fin: false)
        try large.receive(.continuation, String(repeating: "b", count: 40))
        #expect(large.texts.isEmpty)
        #expect(Self.closeCode(try large.written().first) == 1009)

        let stray = try Harness()
        try stray.receive(.continuation, "x")
        #expect(Self.closeCode(try stray.written().first) == 1002)
        let interleaved = try Harness()
        try interleaved.receive(.text, "a", fin: false)
        try interleaved.receive(.text, "b")
        #expect(Self.closeCode(try interleaved.written().first) == 1002)
    }

    @Test("a text message that is not UTF-8 is closed with 1007 and never reported; UTF-8 split across fragments is joined whole")
    func invalidUTF8() throws {
        let harness = try Harness()
        try harness.channel.writeInbound(WebSocketFrame(fin: true, opcode: .text, data: ByteBuffer(bytes: [0x7B, 0xC3, 0x28, 0x7D])))
        #expect(harness.texts.isEmpty)
        #expect(Self.closeCode(try harness.written().first) == 1007)

        let split = try Harness()
        let bytes = Array("café ✓".utf8)
        try split.channel.writeInbound(WebSocketFrame(fin: false, opcode: .text, data: ByteBuffer(bytes: bytes[..<4])))
        try split.channel.writeInbound(WebSocketFrame(fin: false, opcode: .continuation, data: ByteBuffer(bytes: bytes[4..<7])))
        try split.channel.writeInbound(WebSocketFrame(fin: true, opcode: .continuation, data: ByteBuffer(bytes: bytes[7...])))
        #expect(split.texts == ["café ✓"])
        #expect(try split.written().isEmpty)
    }

    @Test("a message in more frames than the limit is closed with 1008, empty fragments included; the limit itself passes")
    func fragmentStorm() throws {
        var limits = Self.limits
        limits.maxFragments = 4
        let whole = try Harness(limits: limits)
        try whole.receive(.text, "a", fin: false)
        for _ in 0..<2 { try whole.receive(.continuation, "b", fin: false) }
        try whole.receive(.continuation, "c")
        #expect(whole.texts == ["abbc"])

        let storm = try Harness(limits: limits)
        try storm.receive(.text, "", fin: false)
        for _ in 0..<10 { try storm.receive(.continuation, "", fin: false) }
        #expect(storm.texts.isEmpty)
        let frames = try storm.written()
        #expect(frames.count == 1, "closed once")
        #expect(Self.closeCode(frames.first) == 1008)
    }

    @Test("pings from a client that reads nothing: pongs count against the outbound budget, and past it the session is closed with 1008")
    func pingFloodWithoutReading() throws {
        let harness = try Harness()
        harness.channel.isWritable = false
        harness.channel.pipeline.fireChannelWritabilityChanged()
        let payload = String(repeating: "p", count: 30)
        for _ in 0..<3 { try harness.receive(.ping, payload) }
        #expect(try harness.written().map(\.opcode) == [.pong, .pong, .pong], "90 bytes are within the budget of 100")
        for _ in 0..<100 { try harness.receive(.ping, payload) }
        let frames = try harness.written()
        #expect(frames.count == 1, "no pong past the budget, only the close: \(frames.map(\.opcode))")
        #expect(Self.closeCode(frames.first) == 1008)
    }

    @Test("a ping is answered with a pong of the same payload")
    func pong() throws {
        let harness = try Harness()
        try harness.receive(.ping, "are you there")
        let frames = try harness.written()
        #expect(frames.count == 1)
        #expect(frames.first?.opcode == .pong)
        #expect(frames.first.map { String(buffer: $0.data) } == "are you there")
    }

    @Test("the client closes first: its code is echoed, the connection ends, and the ending says the client's code")
    func clientCloses() throws {
        let harness = try Harness()
        try harness.receiveClose(1000)
        #expect(Self.closeCode(try harness.written().first) == 1000)
        #expect(!harness.channel.isActive)
        #expect(harness.endings == [.init(clientCode: 1000, serverCode: nil)])
    }

    /// Holds every write, as a socket whose peer stopped reading does: nothing it is given is
    /// ever written.
    final class StalledWrites: ChannelOutboundHandler, @unchecked Sendable {
        typealias OutboundIn = Any
        var held: [EventLoopPromise<Void>] = []

        func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
            if let promise { held.append(promise) }
        }
    }

    /// A client whose buffers are full (a backgrounded app) and that then sends its close: the
    /// answer can never be written. Fails without the close timeout on this path: the connection,
    /// and the user's device with it, stayed for as long as the TCP connection lived.
    @Test("the client closes first but reads nothing: the unwritten answer does not keep the connection past the close timeout")
    func clientClosesWithoutReading() throws {
        let harness = try Harness(before: StalledWrites())
        try harness.receiveClose(1000)
        harness.advance(.milliseconds(2900))
        #expect(harness.channel.isActive, "the answer may still be written")
        #expect(harness.endings.isEmpty)
        harness.advance(.milliseconds(200))
        #expect(!harness.channel.isActive)
        #expect(harness.endings == [.init(clientCode: 1000, serverCode: nil)])
        // A close frame sent again meanwhile changes nothing.
        let again = try Harness(before: StalledWrites())
        try again.receiveClose(1000)
        try again.receiveClose(1000)
        again.advance(.seconds(3))
        #expect(!again.channel.isActive)
        #expect(again.endings.count == 1)
    }

    @Test("the client shuts its side without a close frame: the connection ends at once, with no code on either side")
    func clientShutsInput() throws {
        let harness = try Harness()
        harness.channel.pipeline.fireUserInboundEventTriggered(ChannelEvent.inputClosed)
        #expect(!harness.channel.isActive)
        #expect(harness.endings == [.init(clientCode: nil, serverCode: nil)])
    }

    @Test("the server closes: nothing more is sent, the client's answer ends the connection; without one, the close timeout does")
    func serverCloses() throws {
        let answered = try Harness()
        answered.handler.close(4001, reason: "the token has expired")
        answered.handler.send(TextFrame("too late"))
        let frames = try answered.written()
        #expect(frames.count == 1)
        #expect(Self.closeCode(frames.first) == 4001)
        #expect(frames.first.map { String(buffer: $0.data.getSlice(at: 2, length: $0.data.readableBytes - 2) ?? ByteBuffer()) } == "the token has expired")
        #expect(answered.channel.isActive)
        try answered.receiveClose(4001)
        #expect(!answered.channel.isActive)
        #expect(answered.endings == [.init(clientCode: 4001, serverCode: 4001)])

        let silent = try Harness()
        silent.handler.close(1001, reason: "")
        silent.advance(.milliseconds(2900))
        #expect(silent.channel.isActive)
        silent.advance(.milliseconds(200))
        #expect(!silent.channel.isActive)
        #expect(silent.endings == [.init(clientCode: nil, serverCode: 1001)])
    }

    @Test("a client failed for breaking a rule (1002, 1007, 1008, 1009, 4029) gets the close frame and its connection ends at once; one that reads nothing, without the frame")
    func failedAtOnce() throws {
        for code: UInt16 in [1002, 1007, 1008, 1009, 4029] {
            let harness = try Harness()
            harness.handler.close(code, reason: "no")
            #expect(Self.closeCode(try harness.written().first) == code)
            #expect(!harness.channel.isActive, "\(code) waits for no answer")
            #expect(harness.endings == [.init(clientCode: nil, serverCode: code)])
        }
        let unread = try Harness()
        unread.channel.isWritable = false
        unread.channel.pipeline.fireChannelWritabilityChanged()
        unread.handler.close(1008, reason: "the client does not read fast enough")
        #expect(!unread.channel.isActive)
        for code: UInt16 in [1000, 1001, 4001, 4003, 4009] {
            let harness = try Harness()
            harness.handler.close(code, reason: "bye")
            #expect(harness.channel.isActive, "\(code) waits for the client's answer")
        }
    }

    @Test("a burst of pings in one read is answered with one flush")
    func pongsFlushedOncePerRead() throws {
        let counter = LoopMailboxTests.FlushCounter()
        let harness = try Harness(before: counter)
        for _ in 0..<10 { try harness.channel.writeInbound(WebSocketFrame(fin: true, opcode: .ping, data: ByteBuffer(string: "p"))) }
        // EmbeddedChannel's writeInbound completes a read after each frame: ten frames, ten reads.
        #expect(counter.flushes == 10)
        #expect(try harness.written().count == 10)
        counter.flushes = 0
        harness.channel.pipeline.fireChannelRead(WebSocketFrame(fin: true, opcode: .ping, data: ByteBuffer(string: "p")))
        harness.channel.pipeline.fireChannelRead(WebSocketFrame(fin: true, opcode: .ping, data: ByteBuffer(string: "p")))
        #expect(counter.flushes == 0, "nothing flushed while the read goes on")
        harness.channel.pipeline.fireChannelReadComplete()
        #expect(counter.flushes == 1)
        #expect(try harness.written().count == 2)
    }

    /// A client cut off without a FIN is found within the interval and the pong timeout (14 s
    /// here; 15 s at the defaults), and dropped at once: before, a ping was judged only at the
    /// next one, and the close then waited its own timeout (up to 44 s at the former defaults).
    @Test("a silent client is pinged after the interval; a ping unanswered within the pong timeout closes with 1001 and drops the connection at once")
    func pingTimeout() throws {
        let harness = try Harness()
        harness.advance(.seconds(10))
        #expect(try harness.written().map(\.opcode) == [.ping])
        try harness.receive(.pong, "presence")
        harness.advance(.seconds(10))
        #expect(try harness.written().map(\.opcode) == [.ping])
        harness.advance(.milliseconds(3900))
        #expect(try harness.written().isEmpty && harness.channel.isActive, "the pong may still come")
        harness.advance(.milliseconds(100))
        #expect(Self.closeCode(try harness.written().first) == 1001)
        #expect(!harness.channel.isActive, "dropped with the close: a peer that answers nothing answers no close")
        #expect(harness.endings == [.init(clientCode: nil, serverCode: 1001)])
    }

    @Test("a close while a ping is out ends the ping's wait: the close timeout alone bounds the handshake, and the client's answer completes it")
    func closeWhilePingIsOut() throws {
        let harness = try Harness()
        harness.advance(.seconds(10))
        #expect(try harness.written().map(\.opcode) == [.ping])
        harness.advance(.seconds(3))
        harness.handler.close(4001, reason: "the token has expired")
        #expect(Self.closeCode(try harness.written().first) == 4001)
        // The pong timeout (at 14 s) no longer applies: the close's own wait runs to 16 s.
        harness.advance(.milliseconds(1500))
        #expect(harness.channel.isActive, "still waiting for the client's close")
        #expect(try harness.written().isEmpty, "no 1001 and no ping while closing")
        try harness.receiveClose(4001)
        #expect(!harness.channel.isActive)
        #expect(harness.endings == [.init(clientCode: 4001, serverCode: 4001)])
    }

    @Test("any frame from the client counts as alive: a client that keeps sending is pinged only after the interval of silence")
    func framesCountAsAlive() throws {
        let harness = try Harness()
        harness.advance(.seconds(8))
        try harness.receive(.text, "hello")
        harness.advance(.seconds(8))
        #expect(try harness.written().isEmpty, "heard 8 s ago: no ping yet")
        harness.advance(.seconds(2))
        #expect(try harness.written().map(\.opcode) == [.ping], "10 s of silence")
        // A data frame instead of the pong answers the ping too.
        try harness.receive(.text, "still here")
        harness.advance(.seconds(5))
        #expect(harness.channel.isActive)
        #expect(harness.texts == ["hello", "still here"])
    }

    @Test("a token's expiry closes with 4001 at its deadline, not before")
    func expiry() throws {
        let harness = try Harness()
        harness.handler.expire(at: harness.channel.embeddedEventLoop.now + .seconds(5))
        harness.advance(.milliseconds(4999))
        #expect(try harness.written().isEmpty)
        harness.advance(.milliseconds(1))
        #expect(Self.closeCode(try harness.written().first) == 4001)
    }

    @Test("a client that stops reading: writes pass while the channel is writable; past the budget while it is not, 1008")
    func slowReader() throws {
        let harness = try Harness()
        for _ in 0..<50 { harness.handler.send(TextFrame(String(repeating: "x", count: 30))) }
        #expect(try harness.written().count == 50)
        harness.channel.isWritable = false
        harness.channel.pipeline.fireChannelWritabilityChanged()
        for _ in 0..<3 { harness.handler.send(TextFrame(String(repeating: "x", count: 30))) }
        #expect(try harness.written().count == 3, "90 bytes are within the budget of 100")
        harness.handler.send(TextFrame(String(repeating: "x", count: 30)))
        #expect(Self.closeCode(try harness.written().last) == 1008)

        let recovered = try Harness()
        recovered.channel.isWritable = false
        recovered.channel.pipeline.fireChannelWritabilityChanged()
        for _ in 0..<3 { recovered.handler.send(TextFrame(String(repeating: "x", count: 30))) }
        recovered.channel.isWritable = true
        recovered.channel.pipeline.fireChannelWritabilityChanged()
        recovered.channel.isWritable = false
        recovered.channel.pipeline.fireChannelWritabilityChanged()
        for _ in 0..<3 { recovered.handler.send(TextFrame(String(repeating: "x", count: 30))) }
        #expect(try recovered.written().allSatisfy { $0.opcode == .text }, "the budget starts again once the channel was writable")
    }

    @Test("a ready frame is written past NIO's encoder as its bytes, in order with the frames the encoder writes, at every length form")
    func readyFramesPastTheEncoder() throws {
        let harness = try Harness(before: WebSocketFrameEncoder())
        let texts = ["a", String(repeating: "b", count: 125), String(repeating: "c", count: 126), String(repeating: "d", count: 65_535),
                     String(repeating: "é", count: 40_000)]
        harness.handler.send(TextFrame(texts[0]))
        try harness.receive(.ping, "p")
        for text in texts.dropFirst() { harness.handler.send(TextFrame(text)) }
        var written = ByteBuffer()
        while var part = try harness.channel.readOutbound(as: ByteBuffer.self) { written.writeBuffer(&part) }

        // The same frames through NIO's encoder alone: the bytes a client must get.
        let reference = EmbeddedChannel(handler: WebSocketFrameEncoder())
        try reference.writeOutbound(WebSocketFrame(fin: true, opcode: .text, data: ByteBuffer(string: texts[0])))
        try reference.writeOutbound(WebSocketFrame(fin: true, opcode: .pong, data: ByteBuffer(string: "p")))
        for text in texts.dropFirst() { try reference.writeOutbound(WebSocketFrame(fin: true, opcode: .text, data: ByteBuffer(string: text))) }
        var expected = ByteBuffer()
        while var part = try reference.readOutbound(as: ByteBuffer.self) { expected.writeBuffer(&part) }
        #expect(written.readableBytes == expected.readableBytes)
        #expect(written == expected, "the text frames and the pong between them, byte for byte as the encoder writes them")
        #expect(TextFrame(texts[3]).headerLength == 4 && TextFrame(texts[4]).headerLength == 10 && TextFrame(texts[0]).headerLength == 2)
        #expect(String(buffer: TextFrame(texts[4]).payload) == texts[4])
    }

    /// The handler's timers and write callbacks hold it strongly: once its connection has ended,
    /// nothing of it may be left on the loop. The loop outlives the channel here, as a node's
    /// loops do: a timer left scheduled on it would keep the handler (and its session) for as
    /// long as the timer runs, an hour for a token's expiry.
    @Test("once the connection ends, in any phase, nothing on its event loop keeps the handler")
    func handlerFreedAtEnd() throws {
        let loop = EmbeddedEventLoop()
        // Each ends the connection in another phase, with the token's expiry an hour away.
        let endings: [(String, (Harness) throws -> Void)] = [
            ("dropped while open", { harness in
                _ = harness.channel.close()
            }),
            ("dropped while a ping waits for its pong", { harness in
                harness.advance(.seconds(10))
                _ = harness.channel.close()
            }),
            ("the pong timeout ends it", { harness in
                harness.advance(.seconds(15))
            }),
            ("the server closes and the client answers", { harness in
                harness.handler.close(4001, reason: "bye")
                try harness.receiveClose(4001)
            }),
            ("the server closes and the close timeout ends it", { harness in
                harness.handler.close(1000, reason: "bye")
                harness.advance(.seconds(10))
            }),
            ("the server fails the client", { harness in
                harness.handler.close(1008, reason: "too slow")
            }),
            ("the client closes first", { harness in
                try harness.receiveClose(1000)
            }),
        ]
        for (name, end) in endings {
            weak var freed: SessionChannelHandler?
            try {
                let harness = try Harness(loop: loop)
                freed = harness.handler
                harness.handler.expire(at: loop.now + .hours(1))
                try end(harness)
                #expect(!harness.channel.isActive, "\(name): the connection ended")
            }()
            loop.run()
            #expect(freed == nil, "\(name): the handler outlived its connection")
        }
    }
}
