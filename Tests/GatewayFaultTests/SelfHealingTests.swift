import ClientTestSupport
import Foundation
import PresenceClient
import PresenceEngine
import RedisTestSupport
import Testing

/// Redis loses data under live nodes without dropping a connection: what a failover to an empty
/// or lagging replica looks like to them. The nodes must find out and heal, and every watcher
/// must come to the truth.
///
/// Run with the heavy tests: two nodes and a Redis of their own.
@Suite("Presence that heals itself", .serialized)
struct SelfHealingTests {
    /// The nodes' lease in seconds (`nodeEnvironment`'s).
    static let lease = 3

    /// Nodes a and b on `redis` with open visibility; node a may reach it by another URL.
    static func twoNodes(_ redis: RedisServerProcess, prefix: String, redisURLOfA: String? = nil) async throws -> (a: GatewayProcess, b: GatewayProcess) {
        let environment = nodeEnvironment(prefix: prefix, redisURL: redis.url(), extra: ["PRESENCE_VISIBILITY": "open", "PRESENCE_LEASE_TTL": "\(lease)"])
        let a = try await GatewayProcess(nodeID: "a", environment: environment.merging(["PRESENCE_REDIS_URL": redisURLOfA ?? redis.url()]) { _, new in new })
        let b = try await GatewayProcess(nodeID: "b", environment: environment)
        return (a, b)
    }

    @Test("FLUSHALL, then a lost devices hash: live users stay online, a REST user no device holds any more goes offline for every watcher within a lease + 2 s, and a lost device is written again")
    func dataLoss() async throws {
        let redis = try RedisServerProcess()
        let prefix = TestRedis.uniquePrefix("heal")
        let (a, b) = try await Self.twoNodes(redis, prefix: prefix)
        let alice = try await LiveClient("alice", device: "phone", nodes: [a])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [b])
        let dora = try await LiveClient("dora", device: "tablet", nodes: [a])
        let carolToken = try await mint("carol")
        let posted = GatewayProcess.http(port: b.port, method: "POST", path: "/api/presence/status",
                                         headers: ["Authorization": "Bearer \(carolToken)"], body: #"{"status":"online","device_id":"web"}"#)
        #expect(posted?.status == 200)
        // Every session is open before anyone watches, so that no answer can say offline for a
        // user whose session was still opening: from here on, an offline heard is a flicker.
        for client in [alice, bob, dora] { #expect(await client.connected(), "\(client.user) is connected") }
        try await bob.client.watch(["alice", "carol", "dora"])
        try await dora.client.watch(["alice", "carol"])
        for peer in ["alice", "carol"] {
            #expect(await bob.sees(peer, .online), "bob sees \(peer) online")
            #expect(await dora.sees(peer, .online), "dora sees \(peer) online")
        }
        #expect(await bob.sees("dora", .online))
        let reader = try await mint("reader")
        func rest(_ user: String) -> String? {
            guard let read = GatewayProcess.httpGet(port: a.port, path: "/api/presence/users/\(user)", headers: ["Authorization": "Bearer \(reader)"]),
                  let body = try? JSONSerialization.jsonObject(with: Data(read.body.utf8)) as? [String: Any] else { return nil }
            return body["status"] as? String
        }

        // Everything is gone at once; no connection drops.
        let flushed = ContinuousClock.now
        #expect(try redis.cli("FLUSHALL").contains("OK"))
        // carol's REST device is gone for good: every watcher on either node hears it.
        for watcher in [bob, dora] {
            #expect(await watcher.sees("carol", .offline, within: .seconds(Self.lease + 2)), "\(watcher.user) sees carol offline within a lease + 2 s: \(watcher.timeline(since: flushed, peer: "carol"))")
        }
        print("FLUSHALL: bob heard carol offline after \(bob.arrivals(of: "carol").first { $0.at >= flushed && $0.status == .offline }.map { $0.at - flushed } ?? .zero)")
        // alice and dora are connected: their nodes write them again, and nobody is told otherwise.
        #expect(await eventually(timeout: .seconds(Self.lease + 2), poll: .milliseconds(100)) { rest("alice") == "online" && rest("dora") == "online" },
                "REST has alice and dora online again")
        try await Task.sleep(for: .seconds(2))
        for (watcher, peer) in [(bob, "alice"), (bob, "dora"), (dora, "alice")] {
            #expect(!watcher.statuses(of: peer).contains(.offline), "\(watcher.user) never heard \(peer) go offline: \(watcher.timeline(since: flushed, peer: peer))")
        }

        // A partial loss that leaves the leases: alice's devices hash alone. Her node's audit
        // (every three leases) finds it and writes her device again.
        let lost = ContinuousClock.now
        #expect(try redis.cli("DEL", "\(prefix):{u:alice}:devices").contains("1"))
        #expect(rest("alice") == "offline", "the loss is real")
        #expect(await eventually(timeout: .seconds(3 * Self.lease + 3), poll: .milliseconds(100)) { rest("alice") == "online" }, "alice is written again")
        print("partial loss: alice online again in REST after \(ContinuousClock.now - lost)")
        #expect(!bob.statuses(of: "alice").contains(.offline), "bob never heard alice go offline")
        #expect(await alice.client.connectionState == .connected, "alice's session was never closed")
    }

    /// After an outage, nodes reach Redis one after another, up to a reconnect backoff apart. A
    /// node's subscriber reconnects first and holds back "offline" for the recovery grace
    /// (lease + 5 s); finding its own lease gone a moment later must not cut that short to the
    /// data-loss grace (lease / 3 + 2 s), or its watchers are told "offline" for the users of a
    /// node that is still on its way back. Node a is frozen through the loss to be that late node.
    @Test("Redis comes back empty and one node reaches it 4.5 s after the other: the other node's watchers never hear that node's users go offline")
    func lateNode() async throws {
        let redis = try RedisServerProcess()
        let (a, b) = try await Self.twoNodes(redis, prefix: TestRedis.uniquePrefix("late"))
        defer { a.resume() }
        let alice = try await LiveClient("alice", device: "phone", nodes: [a])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [b])
        for client in [alice, bob] { #expect(await client.connected(), "\(client.user) is connected") }
        try await bob.client.watch(["alice"])
        try #require(await bob.sees("alice", .online), "bob sees alice online")

        let started = ContinuousClock.now
        a.pause()
        // Every subscriber is dropped, as in an outage: b's reconnects at once and starts its
        // catch-up with the recovery grace.
        #expect(try redis.cli("CLIENT", "KILL", "TYPE", "pubsub").trimmingCharacters(in: .whitespacesAndNewlines) != "0")
        try await Task.sleep(for: .milliseconds(500))
        // Redis is back, empty: b finds its lease gone within a third of a lease.
        #expect(try redis.cli("FLUSHALL").contains("OK"))
        try await Task.sleep(for: .milliseconds(4500))
        a.resume()
        let reader = try await mint("reader")
        let restOnline = await eventually(timeout: .seconds(Self.lease + 2), poll: .milliseconds(100)) {
            GatewayProcess.httpGet(port: b.port, path: "/api/presence/users/alice", headers: ["Authorization": "Bearer \(reader)"])?.body.contains(#""status":"online""#) == true
        }
        #expect(restOnline, "a wrote alice again once it ran")
        // Past the recovery grace, when a catch-up could tell bob offline at the latest.
        try await Task.sleep(for: .seconds(Self.lease + 5) - (ContinuousClock.now - started) + .seconds(1))
        #expect(!bob.statuses(of: "alice").contains(.offline), "bob never heard alice go offline: \(bob.timeline(since: started, peer: "alice"))")
        #expect(await bob.sees("alice", .online), "bob sees alice online")
        #expect(await alice.client.connectionState == .connected, "alice's session was never closed")
    }

    /// A loss that reaches a cluster's shards one by one: the shard of node a's lease first (a
    /// finds its lease gone, writes its sessions again and tells b, whose watchers re-read at the
    /// end of the data-loss grace), then, once a has written alice again, the shard of alice's
    /// devices. a's lease stands after that second loss, so only an audit finds it; one on a's
    /// schedule (every three leases) comes after b's re-read has told bob "offline". One
    /// Redis stands in for the shards: each loss is a `DEL` of what that shard held.
    @Test("a node's lease lost, then, after it wrote its sessions again, a user's devices: the node audits within the data-loss grace and no watcher on another node hears that user go offline")
    func lossReachingShardsOneByOne() async throws {
        let redis = try RedisServerProcess()
        let prefix = TestRedis.uniquePrefix("shards")
        let keys = PresenceKeys(prefix: prefix)
        let (a, b) = try await Self.twoNodes(redis, prefix: prefix)
        let alice = try await LiveClient("alice", device: "phone", nodes: [a])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [b])
        for client in [alice, bob] { #expect(await client.connected(), "\(client.user) is connected") }
        try await bob.client.watch(["alice"])
        try #require(await bob.sees("alice", .online), "bob sees alice online")
        let reader = try await mint("reader")
        func restOnline() -> Bool {
            GatewayProcess.httpGet(port: b.port, path: "/api/presence/users/alice", headers: ["Authorization": "Bearer \(reader)"])?.body.contains(#""status":"online""#) == true
        }

        let started = ContinuousClock.now
        #expect(try redis.cli("DEL", keys.lease("a")).contains("1"), "a's lease is lost")
        let registered = await eventually(timeout: .seconds(Self.lease + 2), poll: .milliseconds(20)) {
            (try? redis.cli("EXISTS", keys.lease("a")))?.contains("1") == true
        }
        try #require(registered, "a finds its lease gone within a third of a lease and takes it again")
        // a writes its sessions again right after its lease: the second loss comes after that,
        // and before a's next lease tick (a third of a lease on).
        try await Task.sleep(for: .milliseconds(300))
        #expect(try redis.cli("DEL", keys.devices("alice")).contains("1"), "alice's devices are lost after a wrote them again")
        let lost = ContinuousClock.now
        #expect(!restOnline(), "the second loss is real")
        #expect(await eventually(timeout: .seconds(Self.lease + 1), poll: .milliseconds(100)) { restOnline() },
                "a writes alice again within a lease: \(ContinuousClock.now - lost) after the second loss")
        print("shard by shard: alice online again in REST \(ContinuousClock.now - lost) after the second loss")
        // Past a's scheduled audit, by which time the old behaviour had told bob "offline" at the
        // end of b's data-loss grace, then "online" again.
        try await Task.sleep(until: started + .seconds(3 * Self.lease + 2))
        #expect(!bob.statuses(of: "alice").contains(.offline), "bob never heard alice go offline: \(bob.timeline(since: started, peer: "alice"))")
        #expect(await bob.sees("alice", .online), "bob sees alice online")
        #expect(await alice.client.connectionState == .connected, "alice's session was never closed")
    }

    /// A half-open pub/sub connection: the node's subscriber hears nothing and nothing tells it
    /// so, while its commands go through. Its PING (every 2 s, answered within the command
    /// timeout of 5 s) finds out; the connection is made again and every watcher re-read.
    @Test("a node's pub/sub connection goes deaf without a FIN: it is dropped and made again within 10 s, and its watcher gets the change it missed, then live events again")
    func deafSubscriber() async throws {
        let redis = try RedisServerProcess()
        let proxy = try RedisProxy(upstreamPort: redis.port)
        defer { proxy.stop() }
        // Node a reaches Redis through the proxy; b directly.
        let (a, b) = try await Self.twoNodes(redis, prefix: TestRedis.uniquePrefix("deaf"), redisURLOfA: proxy.url)
        let alice = try await LiveClient("alice", device: "phone", nodes: [b])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [a])
        for client in [alice, bob] { #expect(await client.connected(), "\(client.user) is connected") }
        try await bob.client.watch(["alice"])
        try #require(await bob.sees("alice", .online), "bob sees alice online")
        let connectionsBefore = [alice.connections, bob.connections]

        #expect(proxy.deafenSubscribers() == 1, "node a's one subscriber connection goes deaf")
        let deafened = ContinuousClock.now
        await alice.client.setStatus(.away)
        #expect(await !bob.sees("alice", .away, within: .seconds(1)), "the change does not reach bob while his node is deaf")
        #expect(await bob.sees("alice", .away, within: .seconds(10)), "bob gets the change once his node's subscriber is made again: \(bob.timeline(since: deafened, peer: "alice"))")
        print("deaf subscriber: bob heard alice away \(ContinuousClock.now - deafened) after the connection went deaf")
        await alice.client.setStatus(.online)
        #expect(await bob.sees("alice", .online, within: .seconds(2)), "live events reach bob again")
        #expect(GatewayProcess.httpStatus(port: a.port, path: "/readyz") == 200, "node a is ready again")
        #expect(!bob.statuses(of: "alice").contains(.offline), "bob never heard alice go offline")
        #expect([alice.connections, bob.connections] == connectionsBefore, "no session was dropped")
    }
}
