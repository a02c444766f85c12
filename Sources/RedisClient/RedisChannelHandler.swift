import NIOConcurrencyHelpers
import NIOCore
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// A command on its way to Redis: its encoded bytes, how many replies it produces and who waits.
package struct RedisRequest: Sendable {
    var encoded: ByteBuffer
    /// SUBSCRIBE with N channels answers with N replies; everything else with one.
    var expectedReplies: Int
    var promise: EventLoopPromise<RESPValue>
    /// How the replies are counted; see ``Counting``.
    var counting: Counting

    /// How a request's replies are told apart from the next request's.
    enum Counting: Sendable {
        /// Exactly `expectedReplies` replies, errors included.
        case replies
        /// `expectedReplies` confirmations, or one error reply that ends the request early:
        /// SSUBSCRIBE answers a refused command (`MOVED`, `CROSSSLOT`) once, not per channel.
        case confirmationsOrError
        /// No reply of its own on a subscriber connection: SUNSUBSCRIBE's per-channel answers are
        /// delivered as pushes (Redis sends the same array unasked when a slot moves). It
        /// completes with its error reply (`MOVED`), or with `.null` when the reply of the request
        /// written after it arrives; so the sender must always write one after it (a PING).
        case pushesOnly
    }

    package init(encoded: ByteBuffer, expectedReplies: Int, promise: EventLoopPromise<RESPValue>) {
        self.init(encoded: encoded, expectedReplies: expectedReplies, promise: promise, counting: .replies)
    }

    init(encoded: ByteBuffer, expectedReplies: Int, promise: EventLoopPromise<RESPValue>, counting: Counting) {
        self.encoded = encoded
        self.expectedReplies = expectedReplies
        self.promise = promise
        self.counting = counting
    }
}

/// A message pushed by Redis on a subscribed connection.
struct RedisPush: Sendable {
    /// What Redis pushed.
    enum Kind: Sendable, Equatable {
        /// A published message (`message`, `smessage`, `pmessage`).
        case message
        /// A `sunsubscribe` array: the answer to our SUNSUBSCRIBE, or Redis dropping a shard
        /// channel by itself after its slot moved to another primary (no payload).
        case shardUnsubscribed
    }

    var channel: String
    var payload: [UInt8]
    var kind: Kind = .message
}

/// Matches replies to requests in FIFO order, and on a subscriber connection sets pushes aside.
///
/// Protocol work only: one pending entry per request, completed by the replies that follow in
/// order. A broken connection fails every pending request; a reply nobody waits for is a protocol
/// violation that closes the connection.
final class RedisChannelHandler: ChannelDuplexHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = RedisRequest
    typealias OutboundOut = ByteBuffer

    private struct Pending {
        var promise: EventLoopPromise<RESPValue>
        var remaining: Int
        var counting: RedisRequest.Counting
        var collected: [RESPValue]
        var deadline: NIODeadline
    }

    private let parser: RESPParser
    private let stallTimeout: TimeAmount
    private let onPush: (@Sendable (RedisPush) -> Void)?
    private var pending = CircularBuffer<Pending>(initialCapacity: 64)
    private var closed = false
    /// What closed the connection, when it failed rather than ended: a command written after it
    /// fails with this reason (a TLS handshake refused before the first command was written),
    /// here or, once the channel is gone, in ``RedisConnection``, which shares the box.
    private let closedBy: NIOLockedValueBox<RedisError?>
    /// The earliest look at the deadlines that is scheduled, if any. A look is never cancelled
    /// (NIO cancels a scheduled task by a search of its loop's whole timer heap, which holds every
    /// session's timers too), so later ones may be scheduled as well; each does what is due when
    /// it runs and schedules the next one needed.
    private var nextLook: NIODeadline?
    /// How long an idle connection stays silent before it sends a `PING`; nil: never.
    private let heartbeat: TimeAmount?
    /// When a reply last arrived, or the connection opened.
    private var lastHeard = NIODeadline.now()

    init(
        maxReplyBytes: Int, stallTimeout: Duration, heartbeat: Duration? = nil, closedBy: NIOLockedValueBox<RedisError?> = NIOLockedValueBox(nil),
        onPush: (@Sendable (RedisPush) -> Void)?
    ) {
        self.closedBy = closedBy
        self.parser = RESPParser(maxPendingBytes: maxReplyBytes)
        self.stallTimeout = TimeAmount(stallTimeout)
        self.heartbeat = heartbeat.map(TimeAmount.init)
        self.onPush = onPush
    }

    func handlerAdded(context: ChannelHandlerContext) {
        scheduleNextLook(context: context)
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        closed = true
        failAll(RedisError(.connectionClosed, "the connection to Redis was closed"))
    }

    func channelInactive(context: ChannelHandlerContext) {
        closed = true
        failAll(RedisError(.connectionClosed, "the connection to Redis was closed"))
        context.fireChannelInactive()
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        let request = unwrapOutboundIn(data)
        guard !closed else {
            request.promise.fail(closedBy.withLockedValue { $0 } ?? RedisError(.connectionClosed, "the connection to Redis is closed"))
            promise?.fail(ChannelError.ioOnClosedChannel)
            return
        }
        let deadline = NIODeadline.now() + stallTimeout
        pending.append(Pending(promise: request.promise, remaining: request.expectedReplies, counting: request.counting, collected: [], deadline: deadline))
        look(by: deadline, context: context)
        context.write(wrapOutboundOut(request.encoded), promise: promise)
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let buffer = unwrapInboundIn(data)
        lastHeard = .now()
        do {
            try parser.feed(buffer)
            while let reply = try parser.next() {
                try deliver(reply)
            }
            if pending.isEmpty, let heartbeat { look(by: lastHeard + heartbeat, context: context) }
        } catch {
            fail(context: context, error)
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        fail(context: context, RedisError(.connectionClosed, "the connection to Redis failed", underlying: error))
    }

    private func deliver(_ reply: RESPValue) throws(RedisError) {
        if let onPush, let push = Self.push(from: reply) {
            onPush(push)
            return
        }
        let isError = if case .error = reply { true } else { false }
        // A SUNSUBSCRIBE whose answers all went by as pushes: this reply is its error, or the
        // next request's, which means the SUNSUBSCRIBE is done.
        while let front = pending.first, front.counting == .pushesOnly {
            pending.removeFirst()
            guard !isError else {
                front.promise.succeed(reply)
                return
            }
            front.promise.succeed(.null)
        }
        guard var front = pending.first else {
            throw RedisError(.protocolViolation, "Redis sent a reply that no command was waiting for")
        }
        if isError, front.counting == .confirmationsOrError {
            pending.removeFirst()
            front.promise.succeed(reply)
            return
        }
        front.remaining -= 1
        if front.remaining == 0 {
            pending.removeFirst()
            if front.collected.isEmpty {
                front.promise.succeed(reply)
            } else {
                front.collected.append(reply)
                front.promise.succeed(.array(front.collected))
            }
        } else {
            front.collected.append(reply)
            pending[pending.startIndex] = front
        }
    }

    /// `message` and `smessage` pushes carry (kind, channel, payload); `pmessage` adds the pattern;
    /// `sunsubscribe` carries (kind, channel, count).
    private static func push(from reply: RESPValue) -> RedisPush? {
        guard case .array(let parts) = reply, let kind = parts.first?.string else { return nil }
        switch (kind, parts.count) {
        case ("sunsubscribe", 3):
            guard let channel = parts[1].string else { return nil }
            return RedisPush(channel: channel, payload: [], kind: .shardUnsubscribed)
        case ("message", 3), ("smessage", 3):
            guard let channel = parts[1].string, case .bulkString(let payload) = parts[2] else { return nil }
            return RedisPush(channel: channel, payload: payload)
        case ("pmessage", 4):
            guard let channel = parts[2].string, case .bulkString(let payload) = parts[3] else { return nil }
            return RedisPush(channel: channel, payload: payload)
        default:
            return nil
        }
    }

    /// Makes sure the deadlines are looked at by `deadline`.
    private func look(by deadline: NIODeadline, context: ChannelHandlerContext) {
        if let nextLook, nextLook <= deadline { return }
        nextLook = deadline
        let loopBound = NIOLoopBound((self, context), eventLoop: context.eventLoop)
        // In an amount of time, not at the deadline: a test's embedded loop keeps time of its own.
        context.eventLoop.scheduleTask(in: max(.zero, deadline - .now())) {
            let (handler, context) = loopBound.value
            if handler.nextLook == deadline { handler.nextLook = nil }
            handler.checkDeadlines(context: context)
            handler.scheduleNextLook(context: context)
        }
    }

    /// Schedules the look the connection needs next: at the oldest command's deadline, or, with
    /// nothing waiting, when the heartbeat falls due. Looking only then, not every 100 ms, spares
    /// an idle node most of its wake-ups (it has a connection per event loop), and a stalled
    /// command is found at its deadline, not up to 100 ms after.
    private func scheduleNextLook(context: ChannelHandlerContext) {
        guard !closed else { return }
        if let front = pending.first {
            look(by: front.deadline, context: context)
        } else if let heartbeat {
            look(by: lastHeard + heartbeat, context: context)
        }
    }

    /// The oldest command waited past the stall timeout: the connection is dropped, not waited on.
    /// An idle connection silent for the heartbeat interval sends a `PING` of its own, which the
    /// same rule then times.
    private func checkDeadlines(context: ChannelHandlerContext) {
        guard !closed else { return }
        let now = NIODeadline.now()
        if let heartbeat, pending.isEmpty, now - lastHeard >= heartbeat {
            var buffer = context.channel.allocator.buffer(capacity: 14)
            RESPEncoder.encode(["PING"], into: &buffer)
            let answered = context.eventLoop.makePromise(of: RESPValue.self)
            // Its reply only proves the connection alive (an error reply does too).
            answered.futureResult.whenComplete { _ in }
            pending.append(Pending(promise: answered, remaining: 1, counting: .replies, collected: [], deadline: now + stallTimeout))
            context.writeAndFlush(wrapOutboundOut(buffer), promise: nil)
            return
        }
        guard let front = pending.first, front.deadline <= now else { return }
        fail(context: context, RedisError(.timeout, "Redis did not answer within \(stallTimeout.nanoseconds / 1_000_000) ms"), abort: true)
    }

    /// Fails every command waiting and closes. `abort` (a connection given up on as stalled) closes
    /// with a reset: the kernel would otherwise go on resending what it had not delivered yet, and
    /// a command its caller was told had failed could run once the network came back (a status
    /// written after its session's close, say), so nothing unsent may outlive the connection.
    private func fail(context: ChannelHandlerContext, _ error: RedisError, abort: Bool = false) {
        closed = true
        closedBy.withLockedValue { if $0 == nil { $0 = error } }
        failAll(error)
        if abort, let socket = context.channel as? any SocketOptionProvider {
            // On the event loop, the option is set at once, before the close below.
            _ = socket.setSoLinger(linger(l_onoff: 1, l_linger: 0))
        }
        context.close(promise: nil)
    }

    private func failAll(_ error: RedisError) {
        while let entry = pending.popFirst() {
            entry.promise.fail(error)
        }
    }
}

/// The reply handler of a connection (a subscriber's when `subscriber`), for fuzzing from
/// another module of the package.
package func makeRedisReplyHandler(maxReplyBytes: Int, subscriber: Bool) -> any ChannelHandler {
    var onPush: (@Sendable (RedisPush) -> Void)?
    if subscriber { onPush = { _ in } }
    return RedisChannelHandler(maxReplyBytes: maxReplyBytes, stallTimeout: .seconds(5), onPush: onPush)
}
