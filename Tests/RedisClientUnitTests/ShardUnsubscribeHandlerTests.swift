import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOEmbedded
import Testing
@testable import RedisClient

@Suite("sunsubscribe on a subscriber connection")
struct ShardUnsubscribeHandlerTests {
    private final class Pushes: Sendable {
        let all = NIOLockedValueBox<[RedisPush]>([])
    }

    private func makeChannel(_ pushes: Pushes) throws -> EmbeddedChannel {
        let channel = EmbeddedChannel()
        let handler = RedisChannelHandler(maxReplyBytes: 1 << 20, stallTimeout: .seconds(5)) { push in
            pushes.all.withLockedValue { $0.append(push) }
        }
        try channel.pipeline.syncOperations.addHandler(handler)
        try channel.connect(to: .init(ipAddress: "127.0.0.1", port: 6379)).wait()
        return channel
    }

    private func request(_ channel: EmbeddedChannel, _ words: [RedisArgument], replies: Int, counting: RedisRequest.Counting) throws -> EventLoopFuture<RESPValue> {
        var buffer = ByteBuffer()
        RESPEncoder.encode(words, into: &buffer)
        let promise = channel.eventLoop.makePromise(of: RESPValue.self)
        try channel.writeOutbound(RedisRequest(encoded: buffer, expectedReplies: replies, promise: promise, counting: counting))
        _ = try channel.readOutbound(as: ByteBuffer.self)
        return promise.futureResult
    }

    private static func sunsubscribe(_ channel: String, _ count: Int) -> String {
        "*3\r\n$12\r\nsunsubscribe\r\n$\(channel.utf8.count)\r\n\(channel)\r\n:\(count)\r\n"
    }

    @Test("an unasked sunsubscribe is a push, not a reply, between or during commands")
    func unsolicited() throws {
        let pushes = Pushes()
        let channel = try makeChannel(pushes)
        try channel.writeInbound(ByteBuffer(string: Self.sunsubscribe("a", 0)))
        #expect(channel.isActive)
        let subscribe = try request(channel, ["SSUBSCRIBE", "b", "c"], replies: 2, counting: .confirmationsOrError)
        try channel.writeInbound(ByteBuffer(string: "*3\r\n$10\r\nssubscribe\r\n$1\r\nb\r\n:1\r\n" + Self.sunsubscribe("a", 1) + "*3\r\n$10\r\nssubscribe\r\n$1\r\nc\r\n:2\r\n"))
        let reply = try subscribe.wait()
        #expect(reply.array?.count == 2)
        #expect(pushes.all.withLockedValue { $0.map(\.kind) } == [.shardUnsubscribed, .shardUnsubscribed])
        #expect(pushes.all.withLockedValue { $0.map(\.channel) } == ["a", "a"])
        #expect(channel.isActive)
    }

    @Test("SSUBSCRIBE refused once (MOVED) ends with that error; SUNSUBSCRIBE ends with the next reply or its error")
    func refusedAndUnsubscribe() throws {
        let pushes = Pushes()
        let channel = try makeChannel(pushes)
        let subscribe = try request(channel, ["SSUBSCRIBE", "b", "c"], replies: 2, counting: .confirmationsOrError)
        let unsubscribe = try request(channel, ["SUNSUBSCRIBE", "d", "e"], replies: 1, counting: .pushesOnly)
        let ping = try request(channel, ["PING"], replies: 1, counting: .replies)
        let refused = try request(channel, ["SUNSUBSCRIBE", "f"], replies: 1, counting: .pushesOnly)
        let second = try request(channel, ["PING"], replies: 1, counting: .replies)
        try channel.writeInbound(ByteBuffer(string: "-MOVED 1 127.0.0.1:7000\r\n" + Self.sunsubscribe("d", 1) + Self.sunsubscribe("e", 0) + "+PONG\r\n-MOVED 2 127.0.0.1:7001\r\n+PONG\r\n"))
        #expect(try subscribe.wait() == .error("MOVED 1 127.0.0.1:7000"))
        #expect(try unsubscribe.wait() == .null)
        #expect(try ping.wait() == .simpleString("PONG"))
        #expect(try refused.wait() == .error("MOVED 2 127.0.0.1:7001"))
        #expect(try second.wait() == .simpleString("PONG"))
        #expect(pushes.all.withLockedValue { $0.map(\.channel) } == ["d", "e"])
        #expect(channel.isActive)
    }
}
