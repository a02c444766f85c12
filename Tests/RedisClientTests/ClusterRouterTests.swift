import Foundation
import Logging
import RedisTestSupport
import Testing

@testable import RedisClient

/// Against the live cluster of `scripts/with-redis-cluster`. One at a time and in this order:
/// the migrations move slots by hand and the last test kills a primary for good.
@Suite(
    "Redis Cluster router against a live cluster",
    .serialized,
    .liveClusterExclusive,
    .enabled(if: TestRedisCluster.isAvailable, "no Redis Cluster: run with scripts/with-redis-cluster to set PRESENCE_TEST_REDIS_CLUSTER_URL")
)
struct ClusterRouterTests {
    let logger = TestRedis.logger()

    private func withRouter<Result: Sendable>(_ body: (RedisClusterClient) async throws -> Result) async throws -> Result {
        try await RedisClusterClient.withClient(seeds: TestRedisCluster.seeds, configuration: TestRedisCluster.configuration(), logger: logger, body)
    }

    /// A hash tag whose slot the router sends to `node`.
    private func tag(on node: ClusterNodeAddress, _ router: RedisClusterClient, prefix: String) -> String {
        for index in 0..<100_000 where router.primary(for: HashSlot(of: "\(prefix)-\(index)")) == node {
            return "\(prefix)-\(index)"
        }
        fatalError("no tag found for \(node)")
    }

    @Test("10,000 keys written and read back land on all 3 primaries, in the slots Redis computes", .timeLimit(.minutes(1)))
    func keysOnEveryPrimary() async throws {
        let prefix = TestRedis.uniquePrefix("spread")
        let keys = (0..<10_000).map { "\(prefix):\($0)" }
        try await withRouter { router in
            #expect(router.primaries.count == 3)
            #expect(router.isConnected)
            // Half one by one from 50 tasks, half in pipelines.
            try await withThrowingTaskGroup(of: Void.self) { group in
                for task in 0..<50 {
                    group.addTask {
                        for index in stride(from: task, to: 5_000, by: 50) {
                            try await router.send("SET", RedisArgument(keys[index]), RedisArgument(index))
                        }
                    }
                }
                try await group.waitForAll()
            }
            for chunk in stride(from: 5_000, to: 10_000, by: 1_000) {
                let results = try await router.pipeline((chunk..<chunk + 1_000).map { ["SET", RedisArgument(keys[$0]), RedisArgument($0)] })
                #expect(results.allSatisfy { (try? $0.get()) == .simpleString("OK") })
            }
            let values = try await router.pipeline(keys.map { ["GET", RedisArgument($0)] })
            let wrong = zip(values, 0...).filter { (try? $0.get().int) != $1 }.count
            #expect(wrong == 0)

            // Each primary, asked directly, holds its share: EXISTS answers 1 for its own keys
            // and MOVED for the others'.
            var total = 0
            for node in router.primaries {
                var configuration = TestRedisCluster.configuration()
                configuration.host = node.host
                configuration.port = node.port
                let here = try await RedisClient.withClient(configuration: configuration, logger: logger) { client in
                    try await client.pipeline(keys.map { ["EXISTS", RedisArgument($0)] }).count { (try? $0.get()) == .integer(1) }
                }
                #expect(here > 2_500, "primary \(node) holds \(here) of 10,000 keys")
                total += here
            }
            #expect(total == 10_000)

            // Our slots are Redis's.
            let sample = try await router.pipeline(keys.prefix(200).map { ["CLUSTER", "KEYSLOT", RedisArgument($0)] })
            #expect(zip(sample, keys).allSatisfy { (try? $0.get().int) == HashSlot(of: $1).value })

            let deleted = try await router.pipeline(keys.map { ["DEL", RedisArgument($0)] })
            #expect(deleted.allSatisfy { (try? $0.get()) == .integer(1) })
        }
    }

    @Test("a pipeline with a key in every slot returns each result in its place", .timeLimit(.minutes(1)))
    func pipelineOverAllSlots() async throws {
        let prefix = TestRedis.uniquePrefix("slots")
        // One key per slot.
        var keyOfSlot = [String?](repeating: nil, count: HashSlot.count)
        var found = 0
        var index = 0
        while found < HashSlot.count {
            let key = "\(prefix):\(index)"
            index += 1
            let slot = HashSlot(of: key).value
            if keyOfSlot[slot] == nil {
                keyOfSlot[slot] = key
                found += 1
            }
        }
        let keys = keyOfSlot.map { $0! }
        try await withRouter { router in
            let set = try await router.pipeline(keys.enumerated().map { ["SET", RedisArgument($1), RedisArgument($0)] })
            #expect(set.allSatisfy { (try? $0.get()) == .simpleString("OK") })
            // Reads and increments, with keyless commands and a cross-slot one among them.
            var commands: [[RedisArgument]] = []
            for (slot, key) in keys.enumerated() {
                commands.append(slot % 2 == 0 ? ["GET", RedisArgument(key)] : ["INCRBY", RedisArgument(key), "1000000"])
                if slot % 4096 == 0 { commands.append(["PING"]) }
                if slot == 8000 { commands.append(["MGET", RedisArgument(keys[0]), RedisArgument(keys[1])]) }
            }
            let results = try await router.pipeline(commands)
            #expect(results.count == commands.count)
            var position = 0
            var mismatches = 0
            for (slot, _) in keys.enumerated() {
                let expected = slot % 2 == 0 ? slot : slot + 1_000_000
                if (try? results[position].get().int) != expected { mismatches += 1 }
                position += 1
                if slot % 4096 == 0 {
                    #expect((try? results[position].get()) == .simpleString("PONG"))
                    position += 1
                }
                if slot == 8000 {
                    guard case .failure(let error) = results[position] else {
                        Issue.record("MGET over two slots should fail locally")
                        continue
                    }
                    #expect(error.serverErrorPrefix == "CROSSSLOT")
                    position += 1
                }
            }
            #expect(mismatches == 0)
            _ = try await router.pipeline(keys.map { ["DEL", RedisArgument($0)] })
        }
    }

    @Test("EVALSHA after SCRIPT FLUSH loads the script on the node that lacked it, alone and pipelined", .timeLimit(.minutes(1)))
    func scriptReload() async throws {
        let script = RedisScript("return redis.call('INCRBY', KEYS[1], ARGV[1]) -- \(UUID().uuidString)")
        let prefix = TestRedis.uniquePrefix("lua")
        try await withRouter { router in
            let flushed = try await router.sendToEachPrimary(["SCRIPT", "FLUSH"])
            #expect(flushed.count == 3)
            #expect(flushed.allSatisfy { (try? $0.result.get()) == .simpleString("OK") })
            let primaries = router.primaries
            let first = "{\(tag(on: primaries[0], router, prefix: prefix))}:n"
            #expect(try await router.evaluate(script, keys: [first], arguments: ["5"]) == .integer(5))
            #expect(try await router.evaluate(script, keys: [first], arguments: ["2"]) == .integer(7))
            // Loaded where it ran, and only there.
            let known = try await router.sendToEachPrimary(["SCRIPT", "EXISTS", RedisArgument(script.sha1)])
            #expect(known.map { try? $0.result.get() } == primaries.map { .array([.integer($0 == primaries[0] ? 1 : 0)]) })

            // Pipelined over every node: the two that lack it load it, all calls succeed.
            let keys = primaries.flatMap { node in (0..<3).map { "{\(tag(on: node, router, prefix: prefix + "-\(node.port)"))}:\($0)" } }
            let results = try await router.evaluate(script, calls: keys.map { (keys: [$0], arguments: ["1"]) })
            #expect(results.map { try? $0.get() } == keys.map { _ in .integer(1) })
            let everywhere = try await router.sendToEachPrimary(["SCRIPT", "EXISTS", RedisArgument(script.sha1)])
            #expect(everywhere.allSatisfy { (try? $0.result.get()) == .array([.integer(1)]) })
            _ = try await router.pipeline((keys + [first]).map { ["DEL", RedisArgument($0)] })
        }
    }

    @Test("pipelines over every primary while the script caches keep being flushed: every call runs exactly once", .timeLimit(.minutes(1)))
    func scriptsUnderFlush() async throws {
        let script = RedisScript("return redis.call('INCR', KEYS[1]) -- \(UUID().uuidString)")
        let prefix = TestRedis.uniquePrefix("flush")
        try await withRouter { router in
            let keys = router.primaries.map { "{\(tag(on: $0, router, prefix: prefix + "-\($0.port)"))}:n" }
            let flushing = Task {
                while !Task.isCancelled { _ = try? await router.sendToEachPrimary(["SCRIPT", "FLUSH"]) }
            }
            let calls = (0..<300).map { (keys: [keys[$0 % keys.count]], arguments: [RedisArgument]()) }
            var failures = 0
            for _ in 0..<10 {
                failures += try await router.evaluate(script, calls: calls).filter { if case .failure = $0 { true } else { false } }.count
            }
            flushing.cancel()
            _ = await flushing.value
            #expect(failures == 0)
            let counts = try await router.pipeline(keys.map { ["GET", RedisArgument($0)] }).map { try $0.get().int }
            #expect(counts == keys.map { _ in 10 * 100 }, "each call ran once on its primary")
            _ = try await router.pipeline(keys.map { ["DEL", RedisArgument($0)] })
        }
    }

    /// Moves `slot` from the primary on `source` to the one on `target` as `redis-cli --cluster
    /// reshard` would, in steps: `beforeFinishing` runs while the slot is half migrated (only
    /// `migrateFirst` moved).
    private func migrate(slot: Int, from source: Int, to target: Int, migrateFirst: [String], rest: [String], beforeFinishing: () async throws -> Void = {}) async throws {
        let move = try #require(try TestRedisCluster.SlotMove.begin(slot, to: target))
        #expect(move.source.port == source)
        try move.migrate(migrateFirst)
        try await beforeFinishing()
        try move.migrate(rest)
        try move.finish()
    }

    @Test("MOVED: after a slot migrates by hand, its keys are read and written on the new primary and the map follows", .timeLimit(.minutes(1)))
    func movedSlot() async throws {
        let prefix = TestRedis.uniquePrefix("moved")
        try await withRouter { router in
            let primaries = router.primaries
            let key = "{\(tag(on: primaries[0], router, prefix: prefix))}:k"
            let slot = HashSlot(of: key)
            try await router.send("SET", RedisArgument(key), "before")
            let source = primaries[0].port
            let target = primaries[1].port
            try await migrate(slot: slot.value, from: source, to: target, migrateFirst: [key], rest: [])
            #expect(router.primary(for: slot)?.port == source, "the router cannot know yet")

            #expect(try await router.send("GET", RedisArgument(key)).string == "before")
            #expect(router.primary(for: slot)?.port == target, "MOVED updates the slot at once")
            try await router.send("SET", RedisArgument(key), "after")
            #expect(try TestRedisCluster.cli(port: target, "GET", key) == "after")
            // The full refresh that MOVED scheduled agrees.
            #expect(await eventually(timeout: .seconds(3)) { router.primary(for: slot)?.port == target && router.primaries.count == 3 })
            let piped = try await router.pipeline([["GET", RedisArgument(key)], ["DEL", RedisArgument(key)]])
            #expect(try piped[0].get().string == "after")
            #expect(try piped[1].get() == .integer(1))
        }
    }

    @Test("ASK: mid-migration, moved and unmoved keys are readable, new keys go to the target, a pipeline succeeds", .timeLimit(.minutes(1)))
    func askDuringMigration() async throws {
        let prefix = TestRedis.uniquePrefix("ask")
        try await withRouter { router in
            let primaries = router.primaries
            let tag = tag(on: primaries[2], router, prefix: prefix)
            let moved = "{\(tag)}:moved"
            let stays = "{\(tag)}:stays"
            let fresh = "{\(tag)}:new"
            let piped = "{\(tag)}:piped"
            let slot = HashSlot(of: moved)
            let source = primaries[2].port
            let target = primaries[0].port
            let other = "{\(self.tag(on: primaries[1], router, prefix: prefix + "-o"))}:k"
            try await router.send("SET", RedisArgument(moved), "m")
            try await router.send("SET", RedisArgument(stays), "s")
            try await router.send("SET", RedisArgument(other), "o")
            try await migrate(slot: slot.value, from: source, to: target, migrateFirst: [moved], rest: [stays, fresh, piped]) {
                #expect(try TestRedisCluster.cli(port: target, "CLUSTER", "COUNTKEYSINSLOT", "\(slot.value)") == "1")
                #expect(try await router.send("GET", RedisArgument(moved)).string == "m", "ASK to the target")
                #expect(try await router.send("GET", RedisArgument(stays)).string == "s", "still on the source")
                try await router.send("SET", RedisArgument(fresh), "n")
                #expect(try TestRedisCluster.cli(port: target, "CLUSTER", "COUNTKEYSINSLOT", "\(slot.value)") == "2", "the new key went to the target")
                let results = try await router.pipeline([
                    ["GET", RedisArgument(moved)], ["GET", RedisArgument(other)], ["GET", RedisArgument(stays)],
                    ["SET", RedisArgument(piped), "p"], ["EXISTS", RedisArgument(moved)], ["PING"],
                ])
                #expect(results.map { try? $0.get() } == [.bulkString(Array("m".utf8)), .bulkString(Array("o".utf8)), .bulkString(Array("s".utf8)), .simpleString("OK"), .integer(1), .simpleString("PONG")])
                // ASKING and its command go out as one write: callers sharing the target's
                // connection cannot slip a command between them (it would then get MOVED).
                let native = "{\(self.tag(on: primaries[0], router, prefix: prefix + "-t"))}:k"
                try await router.send("SET", RedisArgument(native), "t")
                try await withThrowingTaskGroup(of: Void.self) { group in
                    for task in 0..<20 {
                        group.addTask {
                            for _ in 0..<25 {
                                let key = task % 2 == 0 ? moved : native
                                let value = try await router.send("GET", RedisArgument(key))
                                #expect(value.string == (task % 2 == 0 ? "m" : "t"))
                            }
                        }
                    }
                    try await group.waitForAll()
                }
                try await router.send("DEL", RedisArgument(native))
                // ASK changes nothing in the map.
                #expect(router.primary(for: slot)?.port == source)
            }
            for (key, value) in [(moved, "m"), (stays, "s"), (fresh, "n"), (piped, "p"), (other, "o")] {
                #expect(try await router.send("GET", RedisArgument(key)).string == value, "\(key) after the migration")
            }
            #expect(router.primary(for: slot)?.port == target)
            _ = try await router.pipeline([moved, stays, fresh, piped, other].map { ["DEL", RedisArgument($0)] })
        }
    }

    @Test("a command whose primary is out of reach goes out the moment a connection to it opens, not at the end of its backoff", .timeLimit(.minutes(1)))
    func sentOnceReachable() async throws {
        let prefix = TestRedis.uniquePrefix("reach")
        var configuration = TestRedisCluster.configuration()
        // Each attempt waits 10 ms for a connection: the command spends its wait in the pauses
        // between attempts (50 ms doubling to 400 ms), where the connection's return finds it.
        configuration.waitForConnection = .milliseconds(10)
        configuration.clientName = prefix
        try await RedisClusterClient.withClient(seeds: TestRedisCluster.seeds, configuration: configuration, logger: logger) { router in
            let node = router.primaries[0]
            let key = RedisArgument("{\(tag(on: node, router, prefix: prefix))}:n")
            var nodeConfiguration = RedisConfiguration(host: node.host, port: node.port)
            nodeConfiguration.clientName = prefix + "-admin"
            try await RedisClient.withClient(configuration: nodeConfiguration, logger: logger) { admin in
                var late: [Duration] = []
                for _ in 0..<5 {
                    _ = try await router.send("INCR", key)
                    // At once on the primary: the router's connection killed, and every client's
                    // commands (a new connection's HELLO too) held for 800 ms.
                    // Every connection of that name is killed: one the router is closing (the
                    // loser of a raced connect) may still be listed beside the live one.
                    let ids = try await TestRedis.clientIDs(admin, name: prefix)
                    let kills: [[RedisArgument]] = ids.map { ["CLIENT", "KILL", "ID", RedisArgument($0)] }
                    let replies = try await admin.pipeline([["MULTI"]] + kills + [["CLIENT", "PAUSE", "800", "ALL"], ["EXEC"]])
                    let results = try replies.last?.get().array ?? []
                    #expect(results.last == .simpleString("OK"), "\(results)")
                    #expect(results.dropLast().compactMap(\.int).reduce(0, +) >= 1, "no connection named \(prefix) was killed: \(results)")
                    // The admin's own PING is held too: its answer marks the pause's end (Redis
                    // ends a pause on its next cron tick, up to 100 ms after the 800).
                    async let reachable: ContinuousClock.Instant = {
                        _ = try? await admin.send("PING")
                        return ContinuousClock.now
                    }()
                    #expect(await eventually(timeout: .seconds(1)) { !router.isConnected })
                    let answer = try await router.send("INCR", key)
                    let answered = ContinuousClock.now
                    if case .integer = answer {} else { Issue.record("INCR answered \(answer)") }
                    late.append(answered - (await reachable))
                }
                print("sentOnceReachable: INCR answered \(late) after the pause ended")
                // Woken by the connection: 0-4 ms in most runs, 57 ms at worst seen. Asleep until
                // the end of the pause between attempts: 26-299 ms, 7 of 10 over 100 (two runs).
                #expect(late.allSatisfy { $0 < .milliseconds(150) }, "\(late)")
            }
        }
    }

    @Test("run() as a service: shutdown ends it at once and later commands fail fast", .timeLimit(.minutes(1)))
    func shutdownEndsRun() async throws {
        let router = try RedisClusterClient(seeds: TestRedisCluster.seeds, configuration: TestRedisCluster.configuration(), logger: logger)
        try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask { try await router.run() }
            // The first command waits for the discovery that run() starts.
            #expect(try await router.send("PING") == .simpleString("PONG"))
            #expect(router.primaries.count == 3)
            #expect(await eventually(timeout: .seconds(3)) { router.isConnected })
            await #expect(throws: RedisError.self) { try await router.run() }
            let stopping = ContinuousClock.now
            router.shutdown()
            try await group.waitForAll()
            #expect(ContinuousClock.now - stopping < .seconds(1))
        }
        let started = ContinuousClock.now
        let error = await #expect(throws: RedisError.self) { try await router.send("GET", "k") }
        #expect(error?.code == .unavailable)
        #expect(ContinuousClock.now - started < .milliseconds(500))
        #expect(!router.isConnected)
    }

    @Test("kill -9 of a primary: its slots wait for the replica's promotion, the others keep working", .timeLimit(.minutes(1)))
    func primaryFailover() async throws {
        let prefix = TestRedis.uniquePrefix("failover")
        var configuration = TestRedisCluster.configuration()
        // A 10 s budget per command (5 + 5): a promotion takes about 3.4 s here.
        configuration.waitForConnection = .seconds(5)
        let events = EventLog()
        try await RedisClusterClient.withClient(seeds: TestRedisCluster.seeds, configuration: configuration, logger: logger) { router in
            router.addConnectionObserver { events.append($0) }
            let primaries = router.primaries
            let victim = primaries[1]
            let victimKey = "{\(tag(on: victim, router, prefix: prefix))}:k"
            let victimSlot = HashSlot(of: victimKey)
            let survivorKeys = [primaries[0], primaries[2]].map { "{\(tag(on: $0, router, prefix: prefix + "-\($0.port)"))}:k" }
            try await router.send("SET", RedisArgument(victimKey), "0")

            let witness = primaries[0].port
            let killed = ContinuousClock.now
            try TestRedisCluster.kill9(port: victim.port)
            // When the cluster itself has promoted the replica, as a surviving primary sees it.
            async let promoted: Duration? = {
                while ContinuousClock.now - killed < .seconds(20) {
                    if let owner = try? TestRedisCluster.owner(of: victimSlot.value, askingPort: witness), owner.port != victim.port {
                        return ContinuousClock.now - killed
                    }
                    try? await Task.sleep(for: .milliseconds(25))
                }
                return nil
            }()
            // Writes to the dead primary's slot: each either fails or waits for the promotion.
            async let victimWrites: (firstSuccess: Duration?, failures: Int) = {
                var failures = 0
                while ContinuousClock.now - killed < .seconds(20) {
                    do {
                        try await router.send("SET", RedisArgument(victimKey), "1")
                        return (ContinuousClock.now - killed, failures)
                    } catch {
                        failures += 1
                        try? await Task.sleep(for: .milliseconds(50))
                    }
                }
                return (nil, failures)
            }()
            // Meanwhile the other primaries' slots answer every write.
            var survivorFailures = 0
            var slowest = Duration.zero
            var writes = 0
            while ContinuousClock.now - killed < .seconds(6) {
                for key in survivorKeys {
                    let started = ContinuousClock.now
                    do {
                        try await router.send("INCR", RedisArgument(key))
                    } catch {
                        survivorFailures += 1
                    }
                    slowest = max(slowest, ContinuousClock.now - started)
                    writes += 1
                }
                try await Task.sleep(for: .milliseconds(20))
            }
            let (firstSuccess, victimFailures) = await victimWrites
            let promotion = await promoted
            print("failover: replica promoted \(promotion.map { "\($0)" } ?? "never") after kill -9; first write to the dead primary's slot succeeded after \(firstSuccess.map { "\($0)" } ?? "never") (\(victimFailures) failed attempts); other slots: \(writes) writes, \(survivorFailures) failed, slowest \(slowest)")
            #expect(promotion != nil)
            #expect(firstSuccess != nil)
            #expect(firstSuccess.map { $0 < .seconds(15) } ?? false)
            #expect(survivorFailures == 0)

            // Afterwards the promoted replica serves the slot, and everything works.
            let newOwner = router.primary(for: victimSlot)
            #expect(newOwner != nil && newOwner != victim)
            #expect(!router.primaries.contains(victim))
            #expect(router.primaries.count == 3)
            #expect(try await router.send("GET", RedisArgument(victimKey)).string == "1")
            let keys = (0..<300).map { "\(prefix):after:\($0)" }
            let set = try await router.pipeline(keys.map { ["SET", RedisArgument($0), "v"] })
            #expect(set.allSatisfy { (try? $0.get()) == .simpleString("OK") })
            let deleted = try await router.pipeline((keys + survivorKeys + [victimKey]).map { ["DEL", RedisArgument($0)] })
            #expect(deleted.allSatisfy { (try? $0.get()) == .integer(1) })
            #expect(await eventually(timeout: .seconds(3)) { router.isConnected })
            let seen = events.all
            #expect(seen.contains(.disconnected))
            #expect(seen.last == .connected(reconnect: true))
        }
    }
}

/// Connection events as observed, in order.
private final class EventLog: @unchecked Sendable {
    // Safe: `events` is only touched with `lock` held.
    private let lock = NSLock()
    private var events: [RedisConnectionEvent] = []
    func append(_ event: RedisConnectionEvent) { lock.withLock { events.append(event) } }
    var all: [RedisConnectionEvent] { lock.withLock { events } }
}
