import Foundation
import NIOCore
import NIOEmbedded
import Testing

@testable import RedisClient

@Suite("Reply matching in the channel handler")
struct RedisChannelHandlerTests {
    private func makeChannel(push: (@Sendable (RedisPush) -> Void)? = nil) throws -> EmbeddedChannel {
        let channel = EmbeddedChannel()
        try channel.pipeline.syncOperations.addHandler(RedisChannelHandler(maxReplyBytes: 1 << 20, stallTimeout: .seconds(5), onPush: push))
        try channel.connect(to: .init(ipAddress: "127.0.0.1", port: 6379)).wait()
        return channel
    }

    private func request(_ channel: EmbeddedChannel, _ words: [RedisArgument], replies: Int = 1) throws -> EventLoopFuture<RESPValue> {
        var buffer = ByteBuffer()
        RESPEncoder.encode(words, into: &buffer)
        let promise = channel.eventLoop.makePromise(of: RESPValue.self)
        try channel.writeOutbound(RedisRequest(encoded: buffer, expectedReplies: replies, promise: promise))
        #expect(try channel.readOutbound(as: ByteBuffer.self) == buffer)
        return promise.futureResult
    }

    @Test("replies complete requests in FIFO order; an error reply only its own")
    func fifo() throws {
        let channel = try makeChannel()
        let first = try request(channel, ["GET", "a"])
        let second = try request(channel, ["BAD"])
        let third = try request(channel, ["INCR", "n"])
        try channel.writeInbound(ByteBuffer(string: "$1\r\n1\r\n-ERR unknown\r\n:3\r\n"))
        #expect(try first.outcome(on: channel) == .bulkString([49]))
        #expect(try second.outcome(on: channel) == .error("ERR unknown"))
        #expect(try third.outcome(on: channel) == .integer(3))
        _ = try? channel.finish()
    }

    @Test("a reply nobody waits for closes the connection")
    func unsolicited() throws {
        let channel = try makeChannel()
        try channel.writeInbound(ByteBuffer(string: "+OK\r\n"))
        #expect(!channel.isActive)
    }

    @Test("a lost connection fails every pending request")
    func lostConnection() throws {
        let channel = try makeChannel()
        let first = try request(channel, ["GET", "a"])
        let second = try request(channel, ["GET", "b"])
        channel.pipeline.fireChannelInactive()
        #expect(throws: RedisError.self) { try first.outcome(on: channel) }
        #expect(throws: RedisError.self) { try second.outcome(on: channel) }
    }

    @Test("a command written after the connection failed fails with that failure's reason (a TLS handshake refused before the first command)")
    func writtenAfterFailure() throws {
        let channel = try makeChannel()
        struct HandshakeRefused: Error, CustomStringConvertible { var description: String { "CERTIFICATE_VERIFY_FAILED" } }
        channel.pipeline.fireErrorCaught(HandshakeRefused())
        var buffer = ByteBuffer()
        RESPEncoder.encode(["PING"], into: &buffer)
        let promise = channel.eventLoop.makePromise(of: RESPValue.self)
        _ = try? channel.writeOutbound(RedisRequest(encoded: buffer, expectedReplies: 1, promise: promise))
        #expect { try promise.futureResult.outcome(on: channel) } throws: { error in
            "\(error)".contains("CERTIFICATE_VERIFY_FAILED")
        }
    }

    @Test("a malformed reply fails pending requests and closes")
    func malformed() throws {
        let channel = try makeChannel()
        let pending = try request(channel, ["GET", "a"])
        _ = try? channel.writeInbound(ByteBuffer(string: "!!!\r\n"))
        #expect(throws: RedisError.self) { try pending.outcome(on: channel) }
        #expect(!channel.isActive)
    }

    @Test("a multi-reply request collects all its replies; pushes go aside")
    func subscribeReplies() throws {
        let received = PushBox()
        let channel = try makeChannel { received.append($0) }
        let subscribed = try request(channel, ["SUBSCRIBE", "a", "b"], replies: 2)
        try channel.writeInbound(ByteBuffer(string: "*3\r\n$9\r\nsubscribe\r\n$1\r\na\r\n:1\r\n"))
        try channel.writeInbound(ByteBuffer(string: "*3\r\n$7\r\nmessage\r\n$1\r\na\r\n$2\r\nhi\r\n"))
        try channel.writeInbound(ByteBuffer(string: "*3\r\n$9\r\nsubscribe\r\n$1\r\nb\r\n:2\r\n"))
        let reply = try subscribed.outcome(on: channel)
        #expect(reply.array?.count == 2)
        #expect(received.all.map(\.channel) == ["a"])
        #expect(received.all.first?.payload == Array("hi".utf8))
        _ = try? channel.finish()
    }

    @Test("with a heartbeat, an idle connection sends PING; answered it stays, unanswered past the stall timeout it is dropped; a waiting command or no heartbeat sends none")
    func heartbeat() throws {
        let channel = EmbeddedChannel()
        try channel.pipeline.syncOperations.addHandler(RedisChannelHandler(maxReplyBytes: 1 << 20, stallTimeout: .milliseconds(60), heartbeat: .milliseconds(10), onPush: nil))
        try channel.connect(to: .init(ipAddress: "127.0.0.1", port: 6379)).wait()
        var ping = ByteBuffer()
        RESPEncoder.encode(["PING"], into: &ping)
        // The handler's looks are scheduled in the loop's time and read the real clock.
        func idle(_ milliseconds: UInt32) {
            usleep(milliseconds * 1000)
            (channel.eventLoop as! EmbeddedEventLoop).advanceTime(by: .milliseconds(100))
        }
        idle(20)
        #expect(try channel.readOutbound(as: ByteBuffer.self) == ping, "idle for longer than the heartbeat: a PING")
        try channel.writeInbound(ByteBuffer(string: "+PONG\r\n"))
        #expect(channel.isActive)
        // A command under way: no PING beside it.
        let pending = try request(channel, ["GET", "a"])
        idle(20)
        #expect(try channel.readOutbound(as: ByteBuffer.self) == nil, "no PING while a command waits")
        try channel.writeInbound(ByteBuffer(string: "$-1\r\n"))
        #expect(try pending.outcome(on: channel) == .null)
        idle(20)
        #expect(try channel.readOutbound(as: ByteBuffer.self) == ping)
        // No answer: the PING is timed like any command.
        idle(80)
        #expect(!channel.isActive, "a PING unanswered for the stall timeout drops the connection")

        let quiet = try makeChannel()
        idle(20)
        (quiet.eventLoop as! EmbeddedEventLoop).advanceTime(by: .milliseconds(100))
        #expect(try quiet.readOutbound(as: ByteBuffer.self) == nil, "no heartbeat configured: nothing sent")
        _ = try? quiet.finish()
    }

    @Test("a command unanswered is given up on at its stall deadline, not at a later look")
    func stallAtDeadline() throws {
        let channel = EmbeddedChannel()
        try channel.pipeline.syncOperations.addHandler(RedisChannelHandler(maxReplyBytes: 1 << 20, stallTimeout: .milliseconds(60), onPush: nil))
        try channel.connect(to: .init(ipAddress: "127.0.0.1", port: 6379)).wait()
        let pending = try request(channel, ["GET", "a"])
        usleep(70_000)
        // The loop's clock reaches the deadline (and no further): the look due then finds the
        // real clock past it.
        (channel.eventLoop as! EmbeddedEventLoop).advanceTime(by: .milliseconds(61))
        #expect(!channel.isActive, "dropped at the deadline")
        #expect(throws: RedisError.self) { try pending.outcome(on: channel) }
    }
}

extension EventLoopFuture where Value == RESPValue {
    /// The outcome on an embedded loop, without blocking: runs the loop, then reads the result.
    func outcome(on channel: EmbeddedChannel) throws -> RESPValue {
        let box = ResultBox()
        whenComplete { box.result = $0 }
        channel.embeddedEventLoop.run()
        guard let result = box.result else { throw RedisError(.timeout, "the request is still pending") }
        return try result.get()
    }
}

final class ResultBox: @unchecked Sendable {
    // Safe: EmbeddedChannel runs everything on the test's thread.
    var result: Result<RESPValue, any Error>?
}

final class PushBox: @unchecked Sendable {
    // Safe: EmbeddedChannel runs everything on the test's thread.
    private(set) var all: [RedisPush] = []
    func append(_ push: RedisPush) { all.append(push) }
}
