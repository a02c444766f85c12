import Foundation
import RedisClient
import Testing

/// The typed commands without a server: the words each sends, and how each reads a reply,
/// including replies of the wrong shape.
@Suite("Typed Redis commands: words and replies")
struct RedisCommandTests {
    /// The words of `command` as text.
    func words(_ command: some RedisCommand) -> [String] {
        command.arguments.map { String(decoding: $0.bytes, as: UTF8.self) }
    }

    func bulk(_ text: String) -> RESPValue { .bulkString(Array(text.utf8)) }

    @Test("each command sends its words in Redis's order")
    func arguments() {
        #expect(words(HGET(key: "h", field: "f")) == ["HGET", "h", "f"])
        #expect(words(HMGET(key: "h", fields: ["a", "b"])) == ["HMGET", "h", "a", "b"])
        #expect(words(HGETALL(key: "h")) == ["HGETALL", "h"])
        #expect(words(HLEN(key: "h")) == ["HLEN", "h"])
        #expect(words(SADD(key: "s", members: ["a", "b"])) == ["SADD", "s", "a", "b"])
        #expect(words(SREM(key: "s", members: ["a"])) == ["SREM", "s", "a"])
        #expect(words(SMEMBERS(key: "s")) == ["SMEMBERS", "s"])
        #expect(words(SCARD(key: "s")) == ["SCARD", "s"])
        #expect(words(SISMEMBER(key: "s", member: "a")) == ["SISMEMBER", "s", "a"])
        #expect(words(SMISMEMBER(key: "s", members: ["a", "b"])) == ["SMISMEMBER", "s", "a", "b"])
        #expect(words(SSCAN(key: "s", cursor: "7", count: 100)) == ["SSCAN", "s", "7", "COUNT", "100"])
        #expect(words(ZADD(key: "z", entries: [(5, "a"), (-1, "b")])) == ["ZADD", "z", "5", "a", "-1", "b"])
        #expect(words(ZREM(key: "z", members: ["a"])) == ["ZREM", "z", "a"])
        #expect(words(ZSCORE(key: "z", member: "a")) == ["ZSCORE", "z", "a"])
        #expect(words(ZRANGE(key: "z")) == ["ZRANGE", "z", "0", "-1"])
        #expect(words(ZRANGE.WithScores(key: "z", start: 1, stop: 2)) == ["ZRANGE", "z", "1", "2", "WITHSCORES"])
        #expect(words(DEL(keys: ["a", "b"])) == ["DEL", "a", "b"])
        #expect(words(UNLINK(keys: ["a"])) == ["UNLINK", "a"])
        #expect(words(EXISTS(keys: ["a", "b"])) == ["EXISTS", "a", "b"])
        #expect(words(PEXPIRE(key: "k", milliseconds: 1500)) == ["PEXPIRE", "k", "1500"])
        #expect(words(PTTL(key: "k")) == ["PTTL", "k"])
        #expect(words(MEMORYUSAGE(key: "k")) == ["MEMORY", "USAGE", "k"])
        #expect(words(MEMORYUSAGE(key: "k", samples: 0)) == ["MEMORY", "USAGE", "k", "SAMPLES", "0"])
        #expect(words(SCAN(cursor: "0", matching: "p:*", count: 10)) == ["SCAN", "0", "MATCH", "p:*", "COUNT", "10"])
        #expect(words(GET(key: "k")) == ["GET", "k"] && words(SET(key: "k", value: "v")) == ["SET", "k", "v"])
        #expect(words(XLEN(key: "x")) == ["XLEN", "x"])
        #expect(words(TIME()) == ["TIME"] && words(DBSIZE()) == ["DBSIZE"] && words(CONFIGRESETSTAT()) == ["CONFIG", "RESETSTAT"])
        #expect(words(INFO(section: "stats")) == ["INFO", "stats"])
        #expect(words(PUBSUBCHANNELS(pattern: "p:*")) == ["PUBSUB", "CHANNELS", "p:*"])
        #expect(words(Publish(Array("m".utf8), on: "c", mode: .classic)) == ["PUBLISH", "c", "m"])
        #expect(words(Publish(Array("m".utf8), on: "c", mode: .sharded)) == ["SPUBLISH", "c", "m"])
    }

    @Test("replies are read into their types: nil for a null, pairs for a flat list, microseconds for TIME")
    func replies() throws {
        #expect(try HGET(key: "h", field: "f").decode(.null) == nil)
        #expect(try HGET(key: "h", field: "f").decode(bulk("v")) == "v")
        #expect(try HMGET(key: "h", fields: ["a", "b"]).decode(.array([bulk("1"), .null])) == ["1", nil])
        let all = try HGETALL(key: "h").decode(.array([bulk("a"), bulk("1"), bulk("b"), bulk("2")]))
        #expect(all.map(\.field) == ["a", "b"] && all.map(\.value) == ["1", "2"])
        #expect(try SMISMEMBER(key: "s", members: ["a", "b"]).decode(.array([.integer(1), .integer(0)])) == [true, false])
        #expect(try SISMEMBER(key: "s", member: "a").decode(.integer(0)) == false)
        let page = try SSCAN(key: "s", cursor: "0", count: 10).decode(.array([bulk("12"), .array([bulk("x")])]))
        #expect(page.cursor == "12" && page.members == ["x"])
        #expect(try ZSCORE(key: "z", member: "a").decode(bulk("1.5")) == 1.5 && ZSCORE(key: "z", member: "a").decode(.null) == nil)
        let scored = try ZRANGE.WithScores(key: "z").decode(.array([bulk("a"), bulk("3"), bulk("b"), bulk("4")]))
        #expect(scored.map(\.member) == ["a", "b"] && scored.map(\.score) == [3, 4])
        #expect(try PEXPIRE(key: "k", milliseconds: 1).decode(.integer(1)) && !PEXPIRE(key: "k", milliseconds: 1).decode(.integer(0)))
        #expect(try PTTL(key: "k").decode(.integer(-2)) == nil && PTTL(key: "k").decode(.integer(-1)) == -1 && PTTL(key: "k").decode(.integer(900)) == 900)
        #expect(try MEMORYUSAGE(key: "k").decode(.null) == nil && MEMORYUSAGE(key: "k").decode(.integer(72)) == 72)
        #expect(try TIME().decode(.array([bulk("1700000000"), bulk("250")])) == 1_700_000_000_000_250)
        try SET(key: "k", value: "v").decode(.simpleString("OK"))
    }

    @Test("a reply of the wrong shape is a protocol violation naming the command, never a crash or a silent default")
    func wrongShapes() {
        func refused(_ body: () throws -> Void, _ name: String) {
            do {
                try body()
                Issue.record("\(name) took a reply of the wrong shape")
            } catch let error as RedisError {
                #expect(error.code == .protocolViolation && error.message.hasPrefix("\(name):"), "\(error)")
            } catch {
                Issue.record("\(name): \(error)")
            }
        }
        refused({ _ = try HMGET(key: "h", fields: ["a", "b"]).decode(.array([.null])) }, "HMGET")
        refused({ _ = try HMGET(key: "h", fields: ["a"]).decode(.integer(1)) }, "HMGET")
        refused({ _ = try HGETALL(key: "h").decode(.array([bulk("a")])) }, "HGETALL")
        refused({ _ = try SMEMBERS(key: "s").decode(.array([.null])) }, "SMEMBERS")
        refused({ _ = try SMISMEMBER(key: "s", members: ["a", "b"]).decode(.array([.integer(1)])) }, "SMISMEMBER")
        refused({ _ = try SCARD(key: "s").decode(bulk("3")) }, "SCARD")
        refused({ _ = try SSCAN(key: "s", cursor: "0", count: 1).decode(.array([bulk("0")])) }, "SSCAN")
        refused({ _ = try ZSCORE(key: "z", member: "a").decode(bulk("many")) }, "ZSCORE")
        refused({ _ = try ZRANGE.WithScores(key: "z").decode(.array([bulk("a"), bulk("x")])) }, "ZRANGE")
        refused({ _ = try ZRANGE.WithScores(key: "z").decode(.array([bulk("a")])) }, "ZRANGE")
        refused({ _ = try TIME().decode(.array([bulk("1")])) }, "TIME")
        refused({ try SET(key: "k", value: "v").decode(.null) }, "SET")
        refused({ _ = try INFO(section: "stats").decode(.array([])) }, "INFO")
    }
}
