import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOEmbedded
import RedisTestSupport
import Testing

@testable import RedisClient

/// Serializes the suites that change the live cluster's topology (migrations, failovers,
/// kill -9): two of them at once could kill two primaries of three, and no replica could be
/// promoted without a majority.
struct LiveClusterExclusive: SuiteTrait, TestScoping {
    var isRecursive: Bool { false }

    private actor Gate {
        private var busy = false
        private var waiters: [CheckedContinuation<Void, Never>] = []

        func enter() async {
            guard busy else {
                busy = true
                return
            }
            await withCheckedContinuation { waiters.append($0) }
        }

        func leave() {
            if waiters.isEmpty { busy = false } else { waiters.removeFirst().resume() }
        }
    }

    private static let gate = Gate()

    func provideScope(for test: Test, testCase: Test.Case?, performing function: @Sendable () async throws -> Void) async throws {
        await Self.gate.enter()
        do {
            try await function()
        } catch {
            await Self.gate.leave()
            throw error
        }
        await Self.gate.leave()
    }
}

extension Trait where Self == LiveClusterExclusive {
    /// Runs the suite while no other topology-changing suite runs.
    static var liveClusterExclusive: Self { LiveClusterExclusive() }
}

/// Against the live cluster of `scripts/with-redis-cluster`, one at a time: a migration, a
/// manual failover, then a kill -9 (the killed node is started again as a replica, so the
/// cluster stays whole for later tests).
@Suite(
    "Sharded pub/sub over a live Redis Cluster",
    .serialized,
    .liveClusterExclusive,
    .enabled(if: TestRedisCluster.isAvailable, "no Redis Cluster: run with scripts/with-redis-cluster to set PRESENCE_TEST_REDIS_CLUSTER_URL")
)
struct ClusterSubscriberTests {
    let logger = TestRedis.logger()

    /// What the subscriber delivered, in order.
    private final class Received: Sendable {
        private let events = NIOLockedValueBox<[RedisSubscriberEvent]>([])

        func append(_ event: RedisSubscriberEvent) { events.withLockedValue { $0.append(event) } }
        var all: [RedisSubscriberEvent] { events.withLockedValue { $0 } }

        /// Payloads received per channel, as text.
        var messages: [String: [String]] {
            var byChannel: [String: [String]] = [:]
            for case .message(let channel, let payload) in all { byChannel[channel, default: []].append(String(decoding: payload, as: UTF8.self)) }
            return byChannel
        }

        /// Every channel named by a `resubscribed` event.
        var resubscribed: Set<String> {
            var channels: Set<String> = []
            for case .resubscribed(let named) in all { channels.formUnion(named) }
            return channels
        }

        func count(_ channel: String, _ payload: String) -> Int {
            messages[channel]?.count { $0 == payload } ?? 0
        }
    }

    private func withSubscriber<Result: Sendable>(
        _ configuration: RedisConfiguration = TestRedisCluster.configuration(),
        _ body: (RedisClusterClient, RedisClusterSubscriber, Received) async throws -> Result
    ) async throws -> Result {
        try await RedisClusterClient.withClient(seeds: TestRedisCluster.seeds, configuration: configuration, logger: logger) { router in
            try await RedisClusterSubscriber.withSubscriber(router: router, logger: logger) { subscriber in
                let received = Received()
                let collector = Task {
                    for await event in subscriber.events { received.append(event) }
                }
                defer { collector.cancel() }
                return try await body(router, subscriber, received)
            }
        }
    }

    /// A channel whose slot the router sends to `node`.
    private func channel(on node: ClusterNodeAddress, _ router: RedisClusterClient, prefix: String, skipping: Int = 0) -> String {
        var skipped = 0
        for index in 0..<100_000 where router.primary(for: HashSlot(of: "\(prefix)-\(index)")) == node {
            if skipped == skipping { return "\(prefix)-\(index)" }
            skipped += 1
        }
        fatalError("no channel found for \(node)")
    }

    /// SPUBLISH through the router; how many subscribers got it on the receiving node.
    @discardableResult
    /// Where `channel` is subscribed, by node with its role, and where the router sends its slot:
    /// what a failed expectation shows.
    static func whereSubscribed(_ channel: String, _ router: RedisClusterClient) -> String {
        let nodes = TestRedisCluster.ports.map { port in
            let role = (try? TestRedisCluster.cli(port: port, "ROLE").split(whereSeparator: \.isNewline).first.map(String.init)) ?? nil
            let count = (try? TestRedisCluster.cli(port: port, "PUBSUB", "SHARDNUMSUB", channel).split(whereSeparator: \.isNewline).last.map(String.init)) ?? nil
            return "\(port) \(role ?? "down") \(count ?? "?")"
        }
        return "router sends slot \(HashSlot(of: channel)) to \(router.primary(for: HashSlot(of: channel)).map { "\($0)" } ?? "none"); nodes: \(nodes.joined(separator: ", "))"
    }

    private func publish(_ router: RedisClusterClient, _ channel: String, _ payload: String) async throws -> Int {
        try await router.send("SPUBLISH", RedisArgument(channel), RedisArgument(payload)).int ?? -1
    }

    /// The live primaries that have a live, synced replica, with that replica's port.
    private func primariesWithReplica() throws -> [(primary: TestRedisCluster.Node, replica: Int)] {
        let witness = TestRedisCluster.ports.first { (try? TestRedisCluster.cli(port: $0, "PING")) == "PONG" } ?? 0
        let nodes = try TestRedisCluster.nodes(askingPort: witness)
        return nodes.filter { $0.isPrimary && !$0.isFailed && !$0.slots.isEmpty }.compactMap { primary in
            let replicas = (try? TestRedisCluster.cli(port: primary.port, "CLUSTER", "REPLICAS", primary.id)) ?? ""
            for line in replicas.split(separator: "\n") {
                let fields = line.split(separator: " ")
                guard fields.count > 2, !fields[2].contains("fail"), let colon = fields[1].firstIndex(of: ":"),
                      let port = Int(fields[1][fields[1].index(after: colon)...].prefix { $0.isNumber }),
                      let info = try? TestRedisCluster.cli(port: port, "INFO", "replication"), info.contains("master_link_status:up")
                else { continue }
                return (primary, port)
            }
            return nil
        }
    }

    @Test("300 channels over every primary: each SPUBLISH arrives once on its channel; released channels go quiet", .timeLimit(.minutes(1)))
    func manyChannels() async throws {
        let prefix = TestRedis.uniquePrefix("ssub")
        try await withSubscriber { router, subscriber, received in
            let channels = (0..<300).map { "\(prefix):\($0)" }
            let owners = Set(channels.compactMap { router.primary(for: HashSlot(of: $0)) })
            #expect(owners.count == router.primaries.count)
            try await subscriber.retain(channels)
            #expect(subscriber.isConnected)
            #expect(subscriber.channels == Set(channels))

            for (index, channel) in channels.enumerated() {
                #expect(try await publish(router, channel, "first-\(index)") == 1)
            }
            #expect(await eventually(timeout: .seconds(10)) { received.messages.values.reduce(0) { $0 + $1.count } >= 300 })
            try await Task.sleep(for: .milliseconds(300))
            let firstRound = received.messages
            #expect(firstRound.count == 300)
            for (index, channel) in channels.enumerated() {
                #expect(firstRound[channel] == ["first-\(index)"])
            }

            let released = channels.indices.filter { $0 % 2 == 0 }.map { channels[$0] }
            let kept = channels.indices.filter { $0 % 2 == 1 }.map { channels[$0] }
            try await subscriber.release(released)
            #expect(subscriber.channels == Set(kept))
            for (index, channel) in channels.enumerated() {
                let receivers = try await publish(router, channel, "second-\(index)")
                #expect(receivers == (index % 2 == 0 ? 0 : 1))
            }
            #expect(await eventually(timeout: .seconds(10)) { kept.allSatisfy { received.count($0, "second-\(channels.firstIndex(of: $0)!)") == 1 } })
            try await Task.sleep(for: .milliseconds(300))
            let secondRound = received.messages
            for channel in released { #expect(secondRound[channel]?.count == 1) }
            for channel in kept { #expect(secondRound[channel]?.count == 2) }
            #expect(!received.all.contains(.disconnected))
            #expect(received.resubscribed.isEmpty)

            // A second retain counts: one release leaves it subscribed.
            try await subscriber.retain([kept[0]])
            try await subscriber.release([kept[0]])
            #expect(try await publish(router, kept[0], "third") == 1)
            try await subscriber.unsubscribe(kept)
            #expect(subscriber.channels.isEmpty)
            #expect(try await publish(router, kept[1], "fourth") == 0)
        }
    }

    @Test("a slot migrated by hand: Redis drops the channel, it is subscribed at the new primary and announced", .timeLimit(.minutes(1)))
    func migratedSlot() async throws {
        let prefix = TestRedis.uniquePrefix("ssub-moved")
        try await withSubscriber { router, subscriber, received in
            let primaries = router.primaries
            let source = primaries[0]
            let target = primaries[1]
            let moving = channel(on: source, router, prefix: prefix)
            let staying = channel(on: source, router, prefix: prefix + "-stay")
            let slot = HashSlot(of: moving)
            #expect(HashSlot(of: staying) != slot)
            try await subscriber.subscribe([moving, staying])
            #expect(subscriber.isConnected)

            // The slot's keys (none here) would move between these two steps.
            let move = try #require(try TestRedisCluster.SlotMove.begin(Int(slot.value), to: target.port))
            var moved = ContinuousClock.now
            try move.finish { moved = ContinuousClock.now }
            #expect(await eventually(timeout: .seconds(10)) { received.resubscribed.contains(moving) })
            let elapsed = ContinuousClock.now - moved
            print("migration: channel subscribed again at the new primary \(elapsed) after SETSLOT NODE on the old one")
            #expect(!received.resubscribed.contains(staying))
            #expect(await eventually { subscriber.isConnected })
            #expect(router.primary(for: slot) == target)

            #expect(try await publish(router, moving, "after") == 1)
            #expect(try await publish(router, staying, "still") == 1)
            #expect(await eventually { received.count(moving, "after") == 1 && received.count(staying, "still") == 1 })
            #expect(try TestRedisCluster.cli(port: target.port, "PUBSUB", "SHARDNUMSUB", moving) .hasSuffix("1"))
            try await subscriber.unsubscribe([moving, staying])
        }
    }

    @Test("a channel subscribed while its slot is half moved: the probe is sent on (ASK) to the importing node, which refuses (MOVED); it is subscribed at the owner", .timeLimit(.minutes(1)))
    func subscribedMidMigration() async throws {
        let prefix = TestRedis.uniquePrefix("ssub-half")
        try await withSubscriber { router, subscriber, received in
            let primaries = router.primaries
            let source = primaries[0]
            let target = primaries[1]
            let channel = channel(on: source, router, prefix: prefix)
            let slot = HashSlot(of: channel)
            let move = try #require(try TestRedisCluster.SlotMove.begin(Int(slot.value), to: target.port))
            defer { move.abandon() }
            // The slot's owner still serves it; the subscribe may report the refusal it met on
            // the way, but the channel must end up subscribed there.
            var outcome = "ok"
            do { try await subscriber.subscribe([channel]) } catch { outcome = "\(error)" }
            let subscribed = await eventually(timeout: .seconds(10)) {
                (try? TestRedisCluster.cli(port: source.port, "PUBSUB", "SHARDNUMSUB", channel).hasSuffix("1")) == true
            }
            print("half-moved slot: subscribe answered \(outcome); subscribed at the owner: \(subscribed)")
            #expect(subscribed, "subscribed at the slot's owner")
            #expect(try await publish(router, channel, "heard") == 1)
            #expect(await eventually { received.count(channel, "heard") == 1 })
            try? await subscriber.unsubscribe([channel])
        }
    }

    @Test("CLUSTER FAILOVER on a replica: its primary's channels are subscribed at the promoted node, later messages arrive", .timeLimit(.minutes(1)))
    func manualFailover() async throws {
        let prefix = TestRedis.uniquePrefix("ssub-failover")
        try await withSubscriber { router, subscriber, received in
            let pair = try #require(try primariesWithReplica().first)
            let oldPrimary = ClusterNodeAddress(host: "127.0.0.1", port: pair.primary.port)
            let survivor = try #require(router.primaries.first { $0 != oldPrimary })
            let moving = (0..<5).map { channel(on: oldPrimary, router, prefix: prefix, skipping: $0) }
            let staying = (0..<5).map { channel(on: survivor, router, prefix: prefix + "-stay", skipping: $0) }
            try await subscriber.subscribe(moving + staying)
            #expect(subscriber.isConnected)

            let started = ContinuousClock.now
            #expect(try TestRedisCluster.cli(port: pair.replica, "CLUSTER", "FAILOVER") == "OK")
            #expect(await eventually(timeout: .seconds(15)) { (try? TestRedisCluster.cli(port: pair.replica, "ROLE").hasPrefix("master")) ?? false })
            let promoted = ContinuousClock.now - started
            #expect(await eventually(timeout: .seconds(15)) { received.resubscribed.isSuperset(of: moving) })
            let elapsed = ContinuousClock.now - started
            print("manual failover: replica took over after \(promoted); channels subscribed again \(elapsed) after CLUSTER FAILOVER")
            #expect(received.resubscribed.isDisjoint(with: staying))
            #expect(await eventually { subscriber.isConnected })

            // The router may still send a moved slot's SPUBLISH to the demoted primary: a replica
            // of the slot's shard takes it, passes it on within the shard and counts only its own
            // subscribers (none), so the count may be 0; the message must still arrive.
            for channel in moving + staying {
                let heard = try await publish(router, channel, "after")
                #expect(heard == 1 || (heard == 0 && moving.contains(channel)), "\(channel) heard by \(heard): \(Self.whereSubscribed(channel, router))")
            }
            #expect(await eventually { (moving + staying).allSatisfy { received.count($0, "after") == 1 } })
            #expect(try TestRedisCluster.cli(port: pair.replica, "PUBSUB", "SHARDNUMSUB", moving[0]).hasSuffix("1"))
            try await subscriber.unsubscribe(moving + staying)
        }
    }

    @Test("kill -9 of a primary: its channels come back at the promoted replica; other primaries' channels miss nothing", .timeLimit(.minutes(2)))
    func killedPrimary() async throws {
        let prefix = TestRedis.uniquePrefix("ssub-kill")
        var configuration = TestRedisCluster.configuration()
        configuration.waitForConnection = .seconds(5)
        try await withSubscriber(configuration) { router, subscriber, received in
            let pair = try #require(try primariesWithReplica().first)
            let victim = ClusterNodeAddress(host: "127.0.0.1", port: pair.primary.port)
            let survivors = router.primaries.filter { $0 != victim }
            #expect(survivors.count == 2)
            let lost = (0..<5).map { channel(on: victim, router, prefix: prefix, skipping: $0) }
            let kept = survivors.flatMap { node in (0..<5).map { channel(on: node, router, prefix: prefix + "-\(node.port)", skipping: $0) } }
            try await subscriber.subscribe(lost + kept)
            #expect(subscriber.isConnected)
            // To start it again afterwards with the same node ID and configuration.
            let directory = try TestRedisCluster.cli(port: victim.port, "CONFIG", "GET", "dir").split(separator: "\n").last.map(String.init) ?? ""

            let killed = ContinuousClock.now
            try TestRedisCluster.kill9(port: victim.port)
            // Meanwhile the other primaries' channels get a message every 20 ms each.
            async let publishedToSurvivors: [String: [String]] = {
                var published: [String: [String]] = [:]
                var sequence = 0
                while ContinuousClock.now - killed < .seconds(8) {
                    for channel in kept {
                        if (try? await publish(router, channel, "m\(sequence)")) == 1 { published[channel, default: []].append("m\(sequence)") }
                    }
                    sequence += 1
                    try? await Task.sleep(for: .milliseconds(20))
                }
                return published
            }()
            let back = await eventually(timeout: .seconds(15)) { received.resubscribed.isSuperset(of: lost) }
            let elapsed = ContinuousClock.now - killed
            #expect(back)
            for channel in lost {
                #expect(try await publish(router, channel, "after") == 1)
            }
            #expect(await eventually { lost.allSatisfy { received.count($0, "after") == 1 } })
            let published = await publishedToSurvivors
            #expect(await eventually { kept.allSatisfy { received.messages[$0]?.count == published[$0]?.count } })
            let messages = received.messages
            var missed = 0
            for channel in kept {
                #expect(messages[channel] == published[channel])
                missed += (published[channel]?.count ?? 0) - (messages[channel]?.count ?? 0)
            }
            let total = published.values.reduce(0) { $0 + $1.count }
            print("kill -9: channels subscribed again \(elapsed) after the kill; other primaries: \(total) messages published, \(missed) missed")
            #expect(total > 100)
            #expect(received.all.contains(.disconnected))
            #expect(received.resubscribed.isDisjoint(with: kept))
            #expect(subscriber.isConnected)
            try await subscriber.unsubscribe(lost + kept)

            // The killed node comes back as a replica of the one promoted in its place.
            try startAgain(port: victim.port, directory: directory)
            let restarted = ContinuousClock.now
            #expect(await eventually(timeout: .seconds(20), poll: .milliseconds(100)) {
                let info = (try? TestRedisCluster.cli(port: victim.port, "INFO", "replication")) ?? ""
                return info.contains("role:slave") && info.contains("master_link_status:up")
            })
            print("kill -9: the killed node is a synced replica again \(ContinuousClock.now - restarted) after its restart")
        }
    }

    /// Starts the cluster node that listened on `port` again, as `scripts/with-redis-cluster` did.
    private func startAgain(port: Int, directory: String) throws {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        process.arguments = [
            "redis-server", "--port", "\(port)", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", directory,
            "--daemonize", "yes", "--pidfile", "\(directory)/redis.pid", "--logfile", "\(directory)/redis.log",
            "--cluster-enabled", "yes", "--cluster-config-file", "\(directory)/nodes.conf", "--cluster-node-timeout", "2000",
        ]
        // Not waited for: Foundation does not reap a child of a test process here (NOTES), and
        // the daemon's answer on its port is what matters.
        try process.run()
    }
}
