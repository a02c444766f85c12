import Foundation
import Logging
import RedisTestSupport
import Testing
@testable import RedisClient

@Suite("Hash slots and command keys")
struct HashSlotTests {
    @Test("CRC16 (XMODEM) and slots match Redis's published values")
    func knownValues() {
        #expect(HashSlot.crc16(Array("123456789".utf8)) == 0x31C3)
        #expect(HashSlot.crc16([UInt8]()) == 0)
        #expect(HashSlot(of: "foo").value == 12182)
        #expect(HashSlot(of: "bar").value == 5061)
        #expect(HashSlot(of: "hello").value == 866)
        #expect(HashSlot(of: "").value == 0)
    }

    @Test("a {hash tag} picks the hashed part: first '{', first '}' after it, non-empty between")
    func hashTags() {
        #expect(HashSlot(of: "{user1000}.following") == HashSlot(of: "{user1000}.followers"))
        #expect(HashSlot(of: "{user1000}.following") == HashSlot(of: "user1000"))
        // An empty tag hashes the whole key.
        #expect(HashSlot(of: "foo{}{bar}").value == Int(HashSlot.crc16(Array("foo{}{bar}".utf8)) % 16384))
        #expect(HashSlot(of: "foo{}{bar}") != HashSlot(of: "bar"))
        #expect(HashSlot(of: "foo{{bar}}zap") == HashSlot(of: "{bar"))
        #expect(HashSlot(of: "foo{bar}{zap}") == HashSlot(of: "bar"))
        // No closing brace: the whole key.
        #expect(HashSlot(of: "foo{bar").value == Int(HashSlot.crc16(Array("foo{bar".utf8)) % 16384))
        #expect(HashSlot(16384) == nil)
        #expect(HashSlot(-1) == nil)
        #expect(HashSlot(16383)?.value == 16383)
    }

    private func keys(_ words: RedisArgument...) -> [String] {
        HashSlot.keys(of: words).map { String(decoding: $0, as: UTF8.self) }
    }

    @Test("keys of each command family")
    func commandKeys() {
        #expect(keys("GET", "k") == ["k"])
        #expect(keys("set", "k", "v", "EX", "10") == ["k"])
        #expect(keys("HSET", "h", "f", "v") == ["h"])
        #expect(keys("DEL", "a", "b", "c") == ["a", "b", "c"])
        #expect(keys("UNLINK", "a", "b") == ["a", "b"])
        #expect(keys("MGET", "a", "b") == ["a", "b"])
        #expect(keys("EXISTS", "a", "b") == ["a", "b"])
        #expect(keys("SUNION", "a", "b") == ["a", "b"])
        #expect(keys("SINTER", "a", "b") == ["a", "b"])
        #expect(keys("MSET", "a", "1", "b", "2") == ["a", "b"])
        #expect(keys("EVAL", "return 1", "2", "a", "b", "arg") == ["a", "b"])
        #expect(keys("EVALSHA", "abc", "1", "a", "arg") == ["a"])
        #expect(keys("EVAL_RO", "s", "0", "arg") == [])
        #expect(keys("EVALSHA_RO", "s", "1", "a") == ["a"])
        #expect(keys("FCALL", "f", "2", "a", "b", "x") == ["a", "b"])
        #expect(keys("SINTERCARD", "2", "a", "b", "LIMIT", "5") == ["a", "b"])
        #expect(keys("ZINTERCARD", "1", "a") == ["a"])
        #expect(keys("ZUNION", "2", "a", "b", "WITHSCORES") == ["a", "b"])
        #expect(keys("ZINTER", "2", "a", "b") == ["a", "b"])
        #expect(keys("ZDIFF", "2", "a", "b") == ["a", "b"])
        #expect(keys("LMPOP", "2", "a", "b", "LEFT") == ["a", "b"])
        #expect(keys("ZMPOP", "1", "a", "MIN") == ["a"])
        #expect(keys("BLMPOP", "0", "2", "a", "b", "LEFT") == ["a", "b"])
        #expect(keys("ZUNIONSTORE", "d", "2", "a", "b") == ["d", "a", "b"])
        #expect(keys("BLPOP", "a", "b", "0") == ["a", "b"])
        #expect(keys("RENAME", "a", "b") == ["a", "b"])
        #expect(keys("LMOVE", "a", "b", "LEFT", "RIGHT") == ["a", "b"])
        #expect(keys("XREAD", "COUNT", "2", "STREAMS", "s1", "s2", "0", "0") == ["s1", "s2"])
        #expect(keys("XREADGROUP", "GROUP", "g", "c", "STREAMS", "s1", ">") == ["s1"])
        #expect(keys("OBJECT", "ENCODING", "k") == ["k"])
        #expect(keys("MEMORY", "USAGE", "k") == ["k"])
        #expect(keys("MEMORY", "STATS") == [])
        #expect(keys("BITOP", "AND", "d", "a", "b") == ["d", "a", "b"])
        #expect(keys("PUBLISH", "channel", "message") == ["channel"])
        #expect(keys("SPUBLISH", "channel", "message") == ["channel"])
        #expect(keys("SSUBSCRIBE", "c1", "c2") == ["c1", "c2"])
        // A count beyond the arguments is Redis's error to give; route by what is there.
        #expect(keys("EVAL", "s", "5", "a") == ["a"])
        #expect(keys("EVAL", "s", "x", "a") == [])
        for keyless in ["PING", "TIME", "INFO", "SCAN", "DBSIZE", "SCRIPT", "CLUSTER", "CONFIG", "CLIENT", "ECHO", "PUBSUB", "FUNCTION"] {
            #expect(keys(RedisArgument(keyless), "x", "y") == [], "\(keyless) names no key")
        }
        #expect(keys() == [])
        #expect(keys("GET") == [])
    }

    @Test("keys in several slots fail locally with CROSSSLOT, naming the command and no key")
    func crossSlot() throws {
        #expect(try HashSlot.slot(of: ["PING"]) == nil)
        #expect(try HashSlot.slot(of: ["GET", "foo"]) == HashSlot(of: "foo"))
        #expect(try HashSlot.slot(of: ["DEL", "{u1}.a", "{u1}.b"]) == HashSlot(of: "u1"))
        #expect(try HashSlot.slot(of: ["EVAL", "s", "2", "{t}x", "{t}y", "not-a-key"]) == HashSlot(of: "t"))
        let error = #expect(throws: RedisError.self) { try HashSlot.slot(of: ["MGET", "secret-key-1", "secret-key-2"]) }
        #expect(error?.serverErrorPrefix == "CROSSSLOT")
        #expect(error?.message.contains("MGET") == true)
        #expect(error?.message.contains("secret") == false)
        // Arguments that are not keys never cause it.
        #expect(try HashSlot.slot(of: ["EVAL", "s", "1", "{t}x", "other", "args"]) == HashSlot(of: "t"))
        #expect(throws: RedisError.self) { try HashSlot.slot(of: ["ZUNIONSTORE", "dest", "1", "source"]) }
    }

    @Test("the router refuses commands that change one connection's state")
    func connectionStateCommands() throws {
        for name in ["MULTI", "exec", "WATCH", "SELECT", "AUTH", "SUBSCRIBE", "SSUBSCRIBE", "ASKING"] {
            let error = #expect(throws: RedisError.self) { try RedisClusterClient.route([RedisArgument(name), "k"]) }
            #expect(error?.message.contains(name.uppercased()) == true)
        }
        #expect(try RedisClusterClient.route(["INCR", "k"]) == HashSlot(of: "k"))
    }

    @Test("MOVED and ASK addresses, with the answering node's host when empty")
    func redirectionAddresses() {
        #expect(ClusterNodeAddress(redirection: "127.0.0.1:7001", defaultHost: "h") == ClusterNodeAddress(host: "127.0.0.1", port: 7001))
        #expect(ClusterNodeAddress(redirection: ":7001", defaultHost: "10.0.0.5") == ClusterNodeAddress(host: "10.0.0.5", port: 7001))
        #expect(ClusterNodeAddress(redirection: "::1:7001", defaultHost: "h") == ClusterNodeAddress(host: "::1", port: 7001))
        #expect(ClusterNodeAddress(redirection: "[::1]:7001", defaultHost: "h") == ClusterNodeAddress(host: "::1", port: 7001))
        #expect(ClusterNodeAddress(redirection: "host:0", defaultHost: "h") == nil)
        #expect(ClusterNodeAddress(redirection: "host", defaultHost: "h") == nil)
    }

    private static func node(_ port: Int, role: String, health: String = "online", endpoint: String = "127.0.0.1", tlsPort: Int? = nil) -> RESPValue {
        var fields: [RESPValue] = [
            .bulkString(Array("id".utf8)), .bulkString(Array("node\(port)".utf8)),
            .bulkString(Array("port".utf8)), .integer(Int64(port)),
            .bulkString(Array("ip".utf8)), .bulkString(Array("127.0.0.1".utf8)),
            .bulkString(Array("endpoint".utf8)), .bulkString(Array(endpoint.utf8)),
            .bulkString(Array("role".utf8)), .bulkString(Array(role.utf8)),
            .bulkString(Array("health".utf8)), .bulkString(Array(health.utf8)),
        ]
        if let tlsPort { fields += [.bulkString(Array("tls-port".utf8)), .integer(Int64(tlsPort))] }
        return .array(fields)
    }

    private static func shard(_ ranges: [Int], _ nodes: [RESPValue]) -> RESPValue {
        .array([.bulkString(Array("slots".utf8)), .array(ranges.map { .integer(Int64($0)) }), .bulkString(Array("nodes".utf8)), .array(nodes)])
    }

    @Test("a CLUSTER SHARDS reply becomes a slot map of its primaries")
    func parseShards() throws {
        let reply = RESPValue.array([
            Self.shard([0, 5460], [Self.node(7000, role: "master", tlsPort: 8000), Self.node(7003, role: "replica")]),
            Self.shard([5461, 10922], [Self.node(7004, role: "replica"), Self.node(7001, role: "master", endpoint: "?")]),
            Self.shard([10923, 12000, 12001, 16383], [Self.node(7002, role: "master", health: "failed"), Self.node(7005, role: "master")]),
        ])
        let map = try ClusterSlotMap.parse(shards: reply, tls: false, fallbackHost: "seed")
        #expect(map.primary(for: HashSlot(0)!) == ClusterNodeAddress(host: "127.0.0.1", port: 7000))
        #expect(map.primary(for: HashSlot(5460)!)?.port == 7000)
        #expect(map.primary(for: HashSlot(5461)!)?.port == 7001)
        // Unknown endpoint: the IP.
        #expect(map.primary(for: HashSlot(5461)!)?.host == "127.0.0.1")
        // Two primaries in a shard (mid-failover): the healthy one.
        #expect(map.primary(for: HashSlot(16383)!)?.port == 7005)
        #expect(map.primaries.map(\.port) == [7000, 7001, 7005])
        #expect(map.coveredSlots == 16384)
        #expect(map.isComplete)

        let tls = try ClusterSlotMap.parse(shards: reply, tls: true, fallbackHost: "seed")
        #expect(tls.primary(for: HashSlot(0)!)?.port == 8000)

        let partial = try ClusterSlotMap.parse(shards: .array([Self.shard([0, 99], [Self.node(7000, role: "master", health: "loading")])]), tls: false, fallbackHost: "seed")
        #expect(partial.coveredSlots == 100)
        #expect(partial.healthySlots == 0)
        #expect(partial.primary(for: HashSlot(100)!) == nil)
        #expect(!partial.isComplete)

        #expect(throws: RedisError.self) { try ClusterSlotMap.parse(shards: .integer(1), tls: false, fallbackHost: "seed") }
        #expect(throws: RedisError.self) {
            try ClusterSlotMap.parse(shards: .array([Self.shard([0, 16384], [Self.node(7000, role: "master")])]), tls: false, fallbackHost: "seed")
        }
    }

    @Test("a MOVED slot points at its new primary; maps compare slot by slot")
    func slotMapUpdates() throws {
        let reply = RESPValue.array([Self.shard([0, 16383], [Self.node(7000, role: "master")])])
        var map = try ClusterSlotMap.parse(shards: reply, tls: false, fallbackHost: "seed")
        let original = map
        #expect(map.sameAssignment(as: original))
        map.assign(HashSlot(42)!, to: ClusterNodeAddress(host: "127.0.0.1", port: 7009))
        #expect(map.primary(for: HashSlot(42)!)?.port == 7009)
        #expect(map.primary(for: HashSlot(43)!)?.port == 7000)
        #expect(map.primaries.map(\.port) == [7000, 7009])
        #expect(!map.sameAssignment(as: original))
    }

    @Test("configuration checks: seeds, database 0")
    func configurationChecks() {
        #expect(throws: RedisError.self) {
            try RedisClusterClient(seeds: [], configuration: RedisConfiguration(), logger: TestRedis.logger())
        }
        #expect(throws: RedisError.self) {
            try RedisClusterClient(seeds: [("127.0.0.1", 7000)], configuration: RedisConfiguration(database: 1), logger: TestRedis.logger())
        }
    }

    @Test("with no node reachable, withClient fails fast, naming what it could not do")
    func unreachable() async throws {
        let port = try RefusingPort()
        var configuration = RedisConfiguration(waitForConnection: .milliseconds(100))
        configuration.connectTimeout = .milliseconds(500)
        let started = ContinuousClock.now
        do {
            try await RedisClusterClient.withClient(seeds: [("127.0.0.1", port.port)], configuration: configuration, logger: TestRedis.logger()) { _ in }
            Issue.record("withClient should throw when no seed answers")
        } catch let error as RedisError {
            #expect(error.code == .unavailable)
            #expect(error.message.contains("127.0.0.1:\(port.port)"))
        }
        #expect(ContinuousClock.now - started < .seconds(2))
    }

    @Test("with its one primary refusing connections, commands being retried keep to their backoff: no storm of connects")
    func refusedPrimaryNoStorm() async throws {
        let port = try RefusingPort()
        let log = LogCounter()
        let router = try RedisClusterClient(
            seeds: [("127.0.0.1", port.port)], configuration: RedisConfiguration(waitForConnection: .milliseconds(10)),
            logger: Logger(label: "storm") { _ in LogCounter.Handler(counter: log) }
        )
        // Every slot on the refusing node, as if it had answered before it went down.
        router.install(try ClusterSlotMap.parse(shards: .array([Self.shard([0, 16_383], [Self.node(port.port, role: "master")])]), tls: false, fallbackHost: "127.0.0.1"))
        let started = ContinuousClock.now
        await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask { try await router.run() }
            defer { router.shutdown() }
            await withTaskGroup(of: Void.self) { commands in
                for index in 0..<20 {
                    commands.addTask {
                        _ = try? await RedisCommandDeadline.$current.withValue(.now + .milliseconds(1500)) { try await router.send("GET", RedisArgument("k\(index)")) }
                    }
                }
            }
        }
        // Each command tries again after up to 50, 100, 200, 400, 400... ms, never less than half:
        // at most 10 tries in 1.5 s, each of which may start a connect (97-117 in all, seen).
        // Pauses that a failed connect ended woke each other into over 500.
        let connects = log.count("cannot connect to a Redis cluster node")
        print("refusedPrimaryNoStorm: \(connects) refused connects in \(ContinuousClock.now - started) for 20 commands")
        #expect(connects > 0 && connects <= 20 * 10, "\(connects) connects")
    }

    @Test("a task's RedisCommandDeadline cuts a command's retries short; without one it waits the client's budget")
    func taskDeadline() async throws {
        let port = try RefusingPort()
        // The budget is long beside the deadline (3 s to 200 ms), so a busy machine's delays
        // (0.69 s seen for the bounded send) do not blur the two.
        var configuration = RedisConfiguration(commandTimeout: .milliseconds(500), waitForConnection: .seconds(3))
        configuration.connectTimeout = .milliseconds(200)
        let router = try RedisClusterClient(seeds: [("127.0.0.1", port.port)], configuration: configuration, logger: TestRedis.logger())
        await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask { try await router.run() }
            defer { router.shutdown() }
            let bounded = ContinuousClock.now
            await #expect(throws: RedisError.self) {
                try await RedisCommandDeadline.$current.withValue(.now + .milliseconds(200)) { try await router.send("GET", "k") }
            }
            let boundedTook = ContinuousClock.now - bounded
            #expect(boundedTook < .milliseconds(1500), "failed near the task's deadline, not the client's budget: \(boundedTook)")
            let unbounded = ContinuousClock.now
            await #expect(throws: RedisError.self) { try await router.send("GET", "k") }
            let unboundedTook = ContinuousClock.now - unbounded
            #expect(unboundedTook >= .milliseconds(2500), "waited for a slot map the client's own time: \(unboundedTook)")
        }
    }
}
