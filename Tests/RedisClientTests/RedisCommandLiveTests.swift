import Foundation
import RedisClient
import RedisTestSupport
import Testing

/// The typed commands against a real redis-server: each one's reply as Redis gives it, and
/// pipelines of them.
@Suite("Typed Redis commands against a real redis-server")
struct RedisCommandLiveTests {
    let logger = TestRedis.logger()

    @Test("every command round-trips through Redis, and a pipeline of mixed commands fails only the one Redis refused")
    func roundTrips() async throws {
        let p = TestRedis.uniquePrefix("typed")
        // One hash tag: on a cluster every key of the test is on one slot.
        let (hash, set, zset, text, stream) = ("\(p):{t}:h", "\(p):{t}:s", "\(p):{t}:z", "\(p):{t}:k", "\(p):{t}:x")
        try await RedisClient.withClient(configuration: TestRedis.configuration(), logger: logger) { redis in
            try await redis.send("HSET", RedisArgument(hash), "a", "1", "b", "2")
            #expect(try await redis.execute(HGET(key: hash, field: "a")) == "1")
            #expect(try await redis.execute(HGET(key: hash, field: "zz")) == nil)
            #expect(try await redis.execute(HMGET(key: hash, fields: ["b", "zz", "a"])) == ["2", nil, "1"])
            #expect(Dictionary(uniqueKeysWithValues: try await redis.execute(HGETALL(key: hash)).map { ($0.field, $0.value) }) == ["a": "1", "b": "2"])
            #expect(try await redis.execute(HGETALL(key: "\(p):{t}:none")).isEmpty)
            #expect(try await redis.execute(HLEN(key: hash)) == 2)

            #expect(try await redis.execute(SADD(key: set, members: ["x", "y", "z"])) == 3)
            #expect(try await redis.execute(SADD(key: set, members: ["x"])) == 0)
            #expect(Set(try await redis.execute(SMEMBERS(key: set))) == ["x", "y", "z"])
            #expect(try await redis.execute(SCARD(key: set)) == 3)
            #expect(try await redis.execute(SISMEMBER(key: set, member: "y")))
            #expect(try await !redis.execute(SISMEMBER(key: set, member: "w")))
            #expect(try await redis.execute(SMISMEMBER(key: set, members: ["w", "x"])) == [false, true])
            var scanned: [String] = []
            var cursor = "0"
            repeat {
                let page = try await redis.execute(SSCAN(key: set, cursor: cursor, count: 1))
                cursor = page.cursor
                scanned += page.members
            } while cursor != "0"
            #expect(Set(scanned) == ["x", "y", "z"])
            #expect(try await redis.execute(SREM(key: set, members: ["x", "w"])) == 1)

            #expect(try await redis.execute(ZADD(key: zset, entries: [(20, "b"), (10, "a")])) == 2)
            #expect(try await redis.execute(ZSCORE(key: zset, member: "b")) == 20)
            #expect(try await redis.execute(ZSCORE(key: zset, member: "c")) == nil)
            #expect(try await redis.execute(ZRANGE(key: zset)) == ["a", "b"])
            let scored = try await redis.execute(ZRANGE.WithScores(key: zset))
            #expect(scored.map(\.member) == ["a", "b"] && scored.map(\.score) == [10, 20])
            #expect(try await redis.execute(ZREM(key: zset, members: ["a"])) == 1)

            try await redis.execute(SET(key: text, value: "v"))
            #expect(try await redis.execute(GET(key: text)) == "v")
            #expect(try await redis.execute(PEXPIRE(key: text, milliseconds: 60_000)))
            #expect(try await !redis.execute(PEXPIRE(key: "\(p):{t}:none", milliseconds: 1)))
            #expect(try await redis.execute(PTTL(key: text)).map { $0 > 50_000 && $0 <= 60_000 } == true)
            #expect(try await redis.execute(PTTL(key: "\(p):{t}:none")) == nil)
            #expect(try await redis.execute(EXISTS(keys: [text, hash, "\(p):{t}:none"])) == 2)
            #expect(try await redis.execute(MEMORYUSAGE(key: text, samples: 0)).map { $0 > 0 } == true)
            #expect(try await redis.execute(MEMORYUSAGE(key: "\(p):{t}:none")) == nil)
            try await redis.send("XADD", RedisArgument(stream), "*", "f", "v")
            #expect(try await redis.execute(XLEN(key: stream)) == 1)
            #expect(try await redis.execute(DBSIZE()) >= 5)
            let time = try await redis.execute(TIME())
            #expect(abs(time / 1000 - Int64(Date().timeIntervalSince1970 * 1000)) < 60_000, "TIME is now in microseconds: \(time)")
            #expect(try await redis.execute(INFO(section: "server")).contains("redis_version:"))
            #expect(try await redis.execute(Publish(Array("hello".utf8), on: "\(p):channel", mode: .classic)) == 0)
            #expect(try await redis.execute(PUBSUBCHANNELS(pattern: "\(p):*")).isEmpty)
            var keys: Set<String> = []
            cursor = "0"
            repeat {
                let page = try await redis.execute(SCAN(cursor: cursor, matching: "\(p):*", count: 100))
                cursor = page.cursor
                keys.formUnion(page.keys)
            } while cursor != "0"
            #expect(keys == [hash, set, zset, text, stream])

            // Mixed types in one pipeline: the SCARD of a string is refused (WRONGTYPE), and only it.
            let (length, wrong, members) = try await redis.pipeline(HLEN(key: hash), SCARD(key: text), SMEMBERS(key: set))
            #expect(try length.get() == 2)
            #expect(throws: RedisError.self) { try wrong.get() }
            #expect(Set(try members.get()) == ["y", "z"])
            // One reply type, several commands.
            let counts = try await redis.pipeline([SADD(key: set, members: ["q"]), HLEN(key: hash), SCARD(key: text)] as [any RedisCommand<Int>])
            #expect(try counts[0].get() == 1 && counts[1].get() == 2)
            #expect(throws: RedisError.self) { try counts[2].get() }
            #expect(try await redis.pipeline([GET(key: text), GET(key: "\(p):{t}:none")]).map { try $0.get() } == ["v", nil])

            #expect(try await redis.execute(UNLINK(keys: [stream])) == 1)
            #expect(try await redis.execute(DEL(keys: [hash, set, zset, text, "\(p):{t}:none"])) == 4)
        }
    }
}
