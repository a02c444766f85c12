import NIOCore
import NIOEmbedded
import NIOWebSocket
import PresenceProtocol
import Testing

@testable import PresenceGateway

/// The mailbox that carries sessions' sends and closes to their event loop: two sessions'
/// connections on one embedded loop. No sockets and no Redis.
@Suite("Loop mailbox")
struct LoopMailboxTests {
    /// Counts the flushes that pass it on their way to the socket.
    final class FlushCounter: ChannelOutboundHandler {
        typealias OutboundIn = WebSocketFrame
        var flushes = 0

        func flush(context: ChannelHandlerContext) {
            flushes += 1
            context.flush()
        }
    }

    struct Connected {
        let harness: SessionChannelHandlerTests.Harness
        let counter: FlushCounter
        let connection: SessionConnection
    }

    static func connect(on loop: EmbeddedEventLoop, mailbox: LoopMailbox) throws -> Connected {
        let counter = FlushCounter()
        let harness = try SessionChannelHandlerTests.Harness(loop: loop, before: counter)
        counter.flushes = 0  // those of the connect
        return Connected(harness: harness, counter: counter, connection: SessionConnection(harness.handler, mailbox: mailbox))
    }

    static func texts(_ frames: [WebSocketFrame]) -> [String] {
        frames.filter { $0.opcode == .text }.map { String(buffer: $0.data) }
    }

    @Test("a burst of sends to the sessions of one loop runs there in one batch, in order, with one flush per connection")
    func burst() throws {
        let loop = EmbeddedEventLoop()
        let mailbox = LoopMailbox(eventLoop: loop)
        let ann = try Self.connect(on: loop, mailbox: mailbox)
        let bob = try Self.connect(on: loop, mailbox: mailbox)
        let frame = TextFrame("shared")
        for index in 0..<3 {
            ann.connection.send(TextFrame("ann \(index)"))
            bob.connection.send(frame)
        }
        #expect(try ann.harness.written().isEmpty, "nothing is written before the loop runs the batch")
        loop.run()
        #expect(try Self.texts(ann.harness.written()) == ["ann 0", "ann 1", "ann 2"])
        #expect(try Self.texts(bob.harness.written()) == ["shared", "shared", "shared"])
        #expect(ann.counter.flushes == 1, "three frames, one flush")
        #expect(bob.counter.flushes == 1)
        // The next burst is a batch of its own.
        ann.connection.send(TextFrame("later"))
        loop.run()
        #expect(try Self.texts(ann.harness.written()) == ["later"])
        #expect(ann.counter.flushes == 2)
    }

    @Test("a close posted between sends comes after the sends before it; nothing sent after it is written")
    func closeKeepsOrder() throws {
        let loop = EmbeddedEventLoop()
        let mailbox = LoopMailbox(eventLoop: loop)
        let ann = try Self.connect(on: loop, mailbox: mailbox)
        ann.connection.send(TextFrame("before"))
        ann.connection.close(CloseCode.replaced.rawValue, reason: "replaced")
        ann.connection.send(TextFrame("after"))
        loop.run()
        let frames = try ann.harness.written()
        #expect(frames.map(\.opcode) == [.text, .connectionClose])
        #expect(Self.texts(frames) == ["before"])
        #expect(SessionChannelHandlerTests.closeCode(frames.last) == CloseCode.replaced.rawValue)
    }

    @Test("the node keeps one mailbox per event loop")
    func onePerLoop() {
        let mailboxes = LoopMailboxes()
        let first = EmbeddedEventLoop()
        let second = EmbeddedEventLoop()
        #expect(mailboxes.mailbox(for: first) === mailboxes.mailbox(for: first))
        #expect(mailboxes.mailbox(for: first) !== mailboxes.mailbox(for: second))
    }
}
