import NIOCore
import NIOWebSocket
import PresenceProtocol

/// A session's WebSocket connection as a channel handler on its event loop, in place of a set of
/// Swift tasks: it assembles messages, answers pings and closes, pings the client, closes a
/// client that stops reading, and runs the session's timers (ping, token expiry, close
/// watchdog) as tasks scheduled on the loop.
///
/// Its timers and write callbacks hold it strongly, not weakly: each either runs or is cancelled
/// when the handler leaves the pipeline (none is scheduled after), so none outlives the
/// connection. A weak reference would give every handler a side table and put every retain of
/// it (several per delivery) on the runtime's slow path.
///
/// It sits behind NIO's WebSocket frame decoder, encoder and protocol error handler (the
/// upgrader installs them): frame-level errors, such as a frame over the size limit or a
/// fragmented control frame, are answered there. What it reports goes to ``Events``, on the loop.
///
/// Outbound messages come from any thread through ``SessionConnection``. The channel's own
/// buffer is the queue: bytes written while the channel is not writable (the socket's buffer and
/// NIO's high-water mark are full) count against ``Limits/unwritableBytes``, and a client that
/// lets them pass it is closed with 1008, as one that does not read fast enough.
final class SessionChannelHandler: ChannelDuplexHandler, RemovableChannelHandler {
    typealias InboundIn = WebSocketFrame
    typealias OutboundIn = WebSocketFrame
    typealias OutboundOut = WebSocketFrame

    struct Limits: Sendable {
        /// The largest message, over all of its fragments; larger is closed with 1009.
        var maxMessageSize: Int
        /// How long the client may be silent before it is pinged.
        var pingInterval: TimeAmount
        /// How long a ping waits for the client's pong, or any frame; past it the connection is
        /// closed with 1001 and dropped at once (a peer that answers nothing answers no close).
        var pongTimeout: TimeAmount
        /// How long a close may wait for the client's close before the connection is dropped.
        var closeTimeout: TimeAmount
        /// Bytes written while the channel is not writable before the client counts as too slow.
        var unwritableBytes: Int
        /// The most frames one message may come in; more is closed with 1008. Clients fragment
        /// large messages into a few frames; a storm of tiny or empty ones only costs the node.
        var maxFragments: Int = 64
    }

    /// How a connection ended: the code the client sent in its close frame, if any, and the
    /// code the server closed with, if it closed first.
    struct Ending: Sendable, Equatable {
        var clientCode: UInt16?
        var serverCode: UInt16?
    }

    /// What the handler reports, on the channel's event loop.
    struct Events {
        var text: (String) -> Void
        var binary: () -> Void
        var ended: (Ending) -> Void
    }

    private let limits: Limits
    private let events: Events
    private var context: ChannelHandlerContext?
    /// The context of NIO's frame encoder, ahead of this handler: a ``TextFrame`` is written
    /// from it, so that its bytes go to the socket as they are. Writes from there and from
    /// this handler's context reach the socket in the order they were made (the encoder writes
    /// what it encodes at once). Nil when there is no such encoder (then frames are encoded).
    private var rawContext: ChannelHandlerContext?
    /// A message arriving in fragments: its first frame's opcode, the data so far and how many
    /// frames brought it.
    private var fragments: (opcode: WebSocketOpcode, data: ByteBuffer, count: Int)?
    private var ending = Ending()
    private var phase = Phase.open
    private var unwritableBytes = 0
    /// The channel's writability as its last change event told it: read at each write, where
    /// asking the channel costs each connection of a fan-out a trip through the pipeline to
    /// the socket channel's state.
    private var writable = true
    /// Written since the last flush.
    private var unflushed = false
    /// Waiting for the channel to be writable again (``whenDrained(_:)``).
    private var drainWaiters: [EventLoopPromise<Void>] = []
    /// Pongs written during the read under way, flushed when it completes.
    private var pongsUnflushed = false
    private var pinger: Scheduled<Void>?
    /// When the client last sent a frame.
    private var lastHeard: NIODeadline?
    private var expiry: Scheduled<Void>?

    /// Where the connection is. Each state that waits on the client holds the timer that ends
    /// the wait, so no wait is without one, and leaving the state cancels it.
    private enum Phase {
        /// Open; a ping is sent once the client has been silent for the ping interval.
        case open
        /// A ping is out: any frame before the timer answers it; the timer closes with 1001
        /// and drops the connection.
        case awaitingPong(Scheduled<Void>)
        /// A close frame was sent (the server's own, or its answer to the client's): only the
        /// client's close, the frame written (for a failing code) or the timer (the close
        /// timeout) ends it, by dropping the connection. Nil: dropped already.
        case closing(Scheduled<Void>?)

        var isClosing: Bool {
            if case .closing = self { true } else { false }
        }

        /// The timer the state holds, if any.
        var timer: Scheduled<Void>? {
            switch self {
            case .open: nil
            case .awaitingPong(let timer): timer
            case .closing(let timer): timer
            }
        }
    }

    /// Whether a close frame was sent: nothing else is written from then on.
    private var closeSent: Bool { phase.isClosing }

    init(limits: Limits, events: Events) {
        self.limits = limits
        self.events = events
    }

    // MARK: Life of the channel

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        writable = context.channel.isWritable
        rawContext = try? context.pipeline.syncOperations.context(handlerType: WebSocketFrameEncoder.self)
        schedulePing()
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        cancelTimers()
        releaseDrainWaiters()
        self.context = nil
        rawContext = nil
    }

    func channelInactive(context: ChannelHandlerContext) {
        cancelTimers()
        releaseDrainWaiters()
        events.ended(ending)
        context.fireChannelInactive()
    }

    /// The client shut its side (the server's port allows half-closure for HTTP): no frame
    /// can come any more, not even the answer to a close, so the connection ends now.
    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if case .some(.inputClosed) = event as? ChannelEvent {
            context.close(promise: nil)
            return
        }
        context.fireUserInboundEventTriggered(event)
    }

    func channelWritabilityChanged(context: ChannelHandlerContext) {
        writable = context.channel.isWritable
        if writable {
            unwritableBytes = 0
            releaseDrainWaiters()
        }
        context.fireChannelWritabilityChanged()
    }

    /// Completes `promise` once the channel is writable: at once if it is (or the connection is
    /// gone), else when it becomes so. A large answer waits on it before it is queued, so that
    /// answers follow one another as the socket drains instead of piling up past the slow-reader
    /// budget.
    func whenDrained(_ promise: EventLoopPromise<Void>) {
        guard writable, context != nil else {
            if context == nil { promise.succeed() } else { drainWaiters.append(promise) }
            return
        }
        promise.succeed()
    }

    private func releaseDrainWaiters() {
        let waiting = drainWaiters
        drainWaiters = []
        for promise in waiting { promise.succeed() }
    }

    private func cancelTimers() {
        pinger?.cancel()
        phase.timer?.cancel()
        expiry?.cancel()
        pinger = nil
        expiry = nil
        if closeSent { phase = .closing(nil) } else { phase = .open }
    }

    /// Enters `.closing`: the wait for a pong, if any, is over (a closing connection is not
    /// pinged), and the close timeout starts unless `dropping` (the connection ends at once).
    private func startClosing(_ context: ChannelHandlerContext, dropping: Bool = false) {
        phase.timer?.cancel()
        phase = .closing(nil)
        guard !dropping else { return }
        phase = .closing(context.eventLoop.assumeIsolated().scheduleTask(in: limits.closeTimeout) {
            self.context?.close(promise: nil)
        })
    }

    // MARK: Inbound

    func channelReadComplete(context: ChannelHandlerContext) {
        if pongsUnflushed {
            pongsUnflushed = false
            context.flush()
        }
        context.fireChannelReadComplete()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let frame = unwrapInboundIn(data)
        // Any frame shows the connection is alive, as a pong does.
        heard()
        switch frame.opcode {
        case .text, .binary:
            guard fragments == nil else { return protocolError("a new message began inside a fragmented one") }
            receive(frame.opcode, frame.unmaskedData, fin: frame.fin, count: 1)
        case .continuation:
            guard var started = fragments else { return protocolError("a continuation frame with no message to continue") }
            // Let go of the stored copy first, so that the data grows in place instead of being
            // copied whole at each fragment.
            fragments = nil
            guard started.count < limits.maxFragments else {
                return close(CloseCode.policyViolation.rawValue, reason: "a message is limited to \(limits.maxFragments) frames")
            }
            var more = frame.unmaskedData
            started.data.writeBuffer(&more)
            receive(started.opcode, started.data, fin: frame.fin, count: started.count + 1)
        case .ping:
            guard !closeSent else { return }
            // Answered like any write: a client that pings and never reads the pongs is closed
            // once they pass the budget, instead of piling them up in the node. Flushed once the
            // read is over, so that a burst of pings costs one write to the socket.
            write(context: context, data: wrapOutboundOut(WebSocketFrame(fin: true, opcode: .pong, data: frame.unmaskedData)), promise: nil)
            pongsUnflushed = true
        case .pong:
            break
        case .connectionClose:
            receivedClose(frame.unmaskedData)
        default:
            protocolError("an unknown opcode")
        }
    }

    /// A data frame, or a message so far: delivered when complete, kept while fragments follow.
    private func receive(_ opcode: WebSocketOpcode, _ data: ByteBuffer, fin: Bool, count: Int) {
        guard data.readableBytes <= limits.maxMessageSize else {
            return close(CloseCode.messageTooBig.rawValue, reason: "a message is limited to \(limits.maxMessageSize) bytes")
        }
        guard fin else {
            fragments = (opcode, data, count)
            return
        }
        // After the server's close, only the client's close matters.
        guard !closeSent else { return }
        if opcode == .text {
            guard let text = String(validating: data.readableBytesView, as: UTF8.self) else {
                return close(Self.invalidPayloadCode, reason: "a text message must be valid UTF-8")
            }
            events.text(text)
        } else {
            events.binary()
        }
    }

    private func receivedClose(_ data: ByteBuffer) {
        var data = data
        let code = data.readInteger(as: UInt16.self)
        ending.clientCode = code
        if closeSent {
            // The answer to the server's close: the handshake is complete.
            context?.close(promise: nil)
            return
        }
        // The client closes first: answer with its code (1000 when it gave none) and end, once
        // the answer is written or after the close timeout, whichever comes first: a client that
        // stopped reading never lets the answer be written.
        fragments = nil
        guard let context else { return }
        startClosing(context)
        var answer = ByteBuffer()
        answer.writeInteger(code ?? CloseCode.normal.rawValue)
        context.writeAndFlush(wrapOutboundOut(WebSocketFrame(fin: true, opcode: .connectionClose, data: answer))).assumeIsolated().whenComplete { _ in
            self.context?.close(promise: nil)
        }
    }

    /// RFC 6455's code for a frame the protocol does not allow; no API close code of its own.
    static let protocolErrorCode: UInt16 = 1002
    /// RFC 6455's code for a text message that is not UTF-8.
    static let invalidPayloadCode: UInt16 = 1007

    private func protocolError(_ reason: String) {
        close(Self.protocolErrorCode, reason: reason)
    }

    // MARK: Outbound

    /// Writes a frame (a pong, or one written to the channel), unless a close was sent.
    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        let frame = unwrapOutboundIn(data)
        guard admits(frame.length) else {
            promise?.fail(ChannelError.outputClosed)
            return
        }
        context.write(wrapOutboundOut(frame), promise: promise)
    }

    /// Whether `bytes` more may be written: not after a close, and not past the budget of
    /// bytes written while the channel is not writable (past it the client is closed as too
    /// slow a reader).
    private func admits(_ bytes: Int) -> Bool {
        guard !closeSent else { return false }
        if !writable {
            unwritableBytes += bytes
            if unwritableBytes > limits.unwritableBytes {
                close(CloseCode.policyViolation.rawValue, reason: "the client does not read fast enough")
                return false
            }
        }
        return true
    }

    private func write(_ frame: WebSocketFrame) {
        context?.writeAndFlush(wrapOutboundOut(frame), promise: nil)
    }

    /// Sends a text message, unless the session is closing.
    func send(_ frame: TextFrame) {
        if enqueue(frame) { flush() }
    }

    /// Writes a text message without flushing it, unless the session is closing. Returns true
    /// when this write is the first since the last ``flush()``: the caller owes one.
    func enqueue(_ frame: TextFrame) -> Bool {
        guard let context, admits(frame.bytes.readableBytes) else { return false }
        if let rawContext {
            rawContext.write(NIOAny(frame.bytes), promise: nil)
        } else {
            context.write(wrapOutboundOut(WebSocketFrame(fin: true, opcode: .text, data: frame.payload)), promise: nil)
        }
        defer { unflushed = true }
        return !unflushed
    }

    /// Flushes what ``enqueue(_:)`` wrote, from the encoder's context where there is one: a
    /// flush only passes the encoder, and every handler it passes costs each connection of a
    /// fan-out.
    func flush() {
        unflushed = false
        (rawContext ?? context)?.flush()
    }

    /// Codes that fail the connection (RFC 6455 7.1.7): the client broke the protocol or a limit
    /// (a bad frame, a text that is not UTF-8, too many fragments, too big, too slow a reader,
    /// a flood). The close frame is written and the connection closed at once: waiting the
    /// close timeout for its answer would only let it go on sending what the node must decode.
    static let failingCodes: Set<UInt16> = [
        protocolErrorCode, invalidPayloadCode, CloseCode.policyViolation.rawValue, CloseCode.messageTooBig.rawValue,
        CloseCode.rateLimited.rawValue,
    ]

    /// Sends a close frame with `code` once, then waits for the client's close for the close
    /// timeout; a client that sends none, or reads nothing, has its connection dropped then. A
    /// code of ``failingCodes`` waits for nothing: the connection ends once the frame is written
    /// (at once when the client reads nothing and it cannot be).
    func close(_ code: UInt16, reason: String) {
        guard !closeSent, let context else { return }
        let failing = Self.failingCodes.contains(code)
        // A failing code whose frame cannot be written (the client reads nothing) drops the
        // connection at once; otherwise the close timeout bounds the wait.
        startClosing(context, dropping: failing && !writable)
        ending.serverCode = code
        fragments = nil
        var data = ByteBuffer()
        data.writeInteger(code)
        // A close frame's payload is at most 125 bytes, the code's 2 included.
        var reason = Substring(reason)
        while reason.utf8.count > 123 { reason = reason.dropLast() }
        data.writeString(String(reason))
        let written = context.writeAndFlush(wrapOutboundOut(WebSocketFrame(fin: true, opcode: .connectionClose, data: data)))
        guard failing else { return }
        guard case .closing(.some) = phase else {
            context.close(promise: nil)
            return
        }
        written.assumeIsolated().whenComplete { _ in self.context?.close(promise: nil) }
    }

    /// Closes the session with 4001 at `deadline` (when its token expires).
    func expire(at deadline: NIODeadline) {
        guard let context else { return }
        expiry?.cancel()
        expiry = context.eventLoop.assumeIsolated().scheduleTask(deadline: deadline) {
            self.close(CloseCode.unauthorized.rawValue, reason: "the token has expired")
        }
    }

    private func schedulePing() {
        pinger = context?.eventLoop.assumeIsolated().scheduleTask(in: limits.pingInterval) { self.ping() }
    }

    /// The client sent something: the ping under way is answered, and the next one is due a
    /// whole interval from now (a moment kept, not a timer moved: frames may come by the thousand).
    private func heard() {
        lastHeard = context?.eventLoop.now
        if case .awaitingPong(let timer) = phase {
            timer.cancel()
            phase = .open
        }
    }

    private func ping() {
        guard case .open = phase, let context else { return }
        // Heard from within the interval: no ping needed yet.
        if let lastHeard, context.eventLoop.now < lastHeard + limits.pingInterval {
            pinger = context.eventLoop.assumeIsolated().scheduleTask(deadline: lastHeard + limits.pingInterval) { self.ping() }
            return
        }
        phase = .awaitingPong(context.eventLoop.assumeIsolated().scheduleTask(in: limits.pongTimeout) {
            guard case .awaitingPong = self.phase else { return }
            self.close(CloseCode.goingAway.rawValue, reason: "Ping timeout")
            self.context?.close(promise: nil)
        })
        schedulePing()
        write(WebSocketFrame(fin: true, opcode: .ping, data: ByteBuffer(string: "presence")))
    }
}

/// A session's handle on its connection, usable from any thread: each call is posted to the
/// mailbox of the connection's event loop, and runs there in the order the calls were made (a
/// session sends under its lock), even when made on the loop itself.
struct SessionConnection: Sendable {
    /// Carried to the loop by `mailbox`, and touched only there.
    private nonisolated(unsafe) let handler: SessionChannelHandler
    private let mailbox: LoopMailbox

    /// `mailbox` is the one of the event loop `handler`'s channel is on.
    init(_ handler: SessionChannelHandler, mailbox: LoopMailbox) {
        self.handler = handler
        self.mailbox = mailbox
    }

    var eventLoop: any EventLoop { mailbox.eventLoop }

    /// Runs the session's work on its connection's loop.
    var executor: EventLoopTaskExecutor { mailbox.executor }

    /// Sends one text message (a ready frame; one may go to many sessions).
    func send(_ frame: TextFrame) {
        mailbox.post(.send(frame), to: handler)
    }

    /// Closes with `code` (see ``SessionChannelHandler/close(_:reason:)``).
    func close(_ code: UInt16, reason: String) {
        mailbox.post(.close(code: code, reason: reason), to: handler)
    }

    /// Closes with 4001 at `deadline`.
    func expire(at deadline: NIODeadline) {
        mailbox.post(.expire(at: deadline), to: handler)
    }

    /// Returns once what was sent before is taken by the socket (the channel is writable), or
    /// the connection is gone.
    func drained() async {
        let promise = mailbox.eventLoop.makePromise(of: Void.self)
        mailbox.post(.drained(promise), to: handler)
        try? await promise.futureResult.get()
    }
}
