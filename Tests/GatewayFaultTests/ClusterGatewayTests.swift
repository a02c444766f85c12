import ClientTestSupport
import Foundation
import PresenceClient
import PresenceEngine
import RedisClient
import RedisTestSupport
import Testing

/// Three gateway processes on the throwaway Redis Cluster of `scripts/with-redis-cluster`, with
/// users changing status throughout, through a `CLUSTER FAILOVER` and a kill -9 of the primary
/// that holds the node registry. Skipped without a cluster (`make test` starts one for it).
@Suite("Gateway nodes on a Redis Cluster", .serialized, .enabled(if: TestRedisCluster.isAvailable))
struct ClusterGatewayTests {
    /// The replica of the primary on `primary`, by asking each non-primary node for its role.
    static func replica(of primary: Int) throws -> Int? {
        for port in TestRedisCluster.ports where port != primary {
            let role = try TestRedisCluster.cli(port: port, "ROLE").split(whereSeparator: \.isNewline)
            if role.first == "slave", role.count > 2, Int(role[2]) == primary { return port }
        }
        return nil
    }

    /// A node of the cluster that answers (an earlier test may have killed one).
    static func livePort() -> Int? {
        TestRedisCluster.ports.first { (try? TestRedisCluster.cli(port: $0, "PING")) == "PONG" }
    }

    /// Three gateway processes on the cluster under `prefix`, a client of each user (spread over
    /// them), and a watcher on the third node that sees every user online.
    static func start(prefix: String, users: [String], lease: Int) async throws -> (nodes: [GatewayProcess], clients: [LiveClient], watcher: LiveClient) {
        let url = try #require(TestRedisCluster.url)
        let environment = nodeEnvironment(prefix: prefix, redisURL: url, extra: ["PRESENCE_VISIBILITY": "open", "PRESENCE_LEASE_TTL": "\(lease)"])
        var nodes: [GatewayProcess] = []
        for id in ["a", "b", "c"] { nodes.append(try await GatewayProcess(nodeID: id, environment: environment)) }
        var clients: [LiveClient] = []
        for (index, user) in users.enumerated() {
            clients.append(try await LiveClient(user, device: "phone", nodes: [nodes[index % 3]]))
        }
        let watcher = try await LiveClient("watcher", device: "laptop", nodes: [nodes[2]])
        for client in clients + [watcher] { #expect(await client.connected(), "\(client.user) is connected") }
        try await watcher.client.watch(users)
        for user in users { #expect(await watcher.sees(user, .online, within: .seconds(10)), "the watcher sees \(user) online") }
        try checkShardedChannels(prefix: prefix, users: users)
        return (nodes, clients, watcher)
    }

    /// Events go out on sharded channels: each watched user's channel is subscribed on the
    /// primary of its slot, and no node has a classic subscription of this run (a classic
    /// PUBLISH on a cluster goes to every node).
    static func checkShardedChannels(prefix: String, users: [String]) throws {
        let keys = PresenceKeys(prefix: prefix)
        var sharded = Set<String>()
        for port in TestRedisCluster.ports {
            guard (try? TestRedisCluster.cli(port: port, "PING")) == "PONG" else { continue }
            sharded.formUnion(try TestRedisCluster.cli(port: port, "PUBSUB", "SHARDCHANNELS", "\(prefix):*").split(whereSeparator: \.isNewline).map(String.init))
            let classic = try TestRedisCluster.cli(port: port, "PUBSUB", "CHANNELS", "\(prefix):*").trimmingCharacters(in: .whitespacesAndNewlines)
            #expect(classic.isEmpty, "no classic subscription on node \(port): \(classic)")
        }
        let missing = users.filter { !sharded.contains(keys.userChannel($0)) }
        #expect(missing.isEmpty, "every watched user's channel is a shard channel on some primary; missing: \(missing.prefix(5))")
    }

    /// After the faults: each churning user ends as last set, nobody was ever shown offline, and
    /// every node still holds its lease.
    static func checkAfterwards(_ churn: StatusChurn, churning: [LiveClient], users: [String], watcher: LiveClient, nodes: [GatewayProcess], since start: ContinuousClock.Instant) async {
        for client in churning {
            let wanted = churn.lastStatus(of: client.user) ?? .online
            #expect(await watcher.sees(client.user, wanted, within: .seconds(3)), "\(client.user) ends \(wanted): \(watcher.timeline(since: start, peer: client.user).suffix(6))")
        }
        for user in users {
            #expect(!watcher.statusesSinceOnline(of: user).contains(.offline), "\(user) was never shown offline: \(watcher.timeline(since: start, peer: user))")
        }
        for node in nodes { #expect(GatewayProcess.httpStatus(port: node.port, path: "/readyz") == 200, "node \(node.nodeID) is ready") }
        let listed = admin(nodes[0], "GET", "/api/admin/nodes")
        #expect(listed?.status == 200 && ["\"a\"", "\"b\"", "\"c\""].allSatisfy { listed?.body.contains($0) ?? false }, "every node still holds its lease: \(String(describing: listed))")
    }

    @Test("120 users on three nodes, 40 of them changing status throughout, through CLUSTER FAILOVER and a kill -9 of the registry's primary: nobody is shown offline, changes flow again after each, none is lost, no node is reaped or leaves the balancer")
    func failovers() async throws {
        let prefix = TestRedis.uniquePrefix("cluster-gw")
        // A lease longer than a promotion (about 4 s with cluster-node-timeout 2000), as
        // docs/configuration.md asks of an operator.
        let lease = 8
        let users = (0..<120).map { "user\($0)" }
        let (nodes, clients, watcher) = try await Self.start(prefix: prefix, users: users, lease: lease)
        let start = ContinuousClock.now
        // Load through both faults: users 80… change status in turn, 40 changes a second.
        let churning = Array(clients[80...])
        let churn = StatusChurn(churning, every: .milliseconds(25))

        /// A change made now reaches the watcher: writes and events flow.
        func changesFlow(_ index: Int, _ label: String) async {
            let changed = ContinuousClock.now
            await clients[index].client.setStatus(.away)
            let seen = await watcher.sees(users[index], .away, within: .seconds(10))
            #expect(seen, "after \(label): the watcher sees \(users[index]) away within 10 s: \(watcher.timeline(since: start, peer: users[index]))")
            print("cluster gateway, \(label): \(users[index]) → away seen after \(ContinuousClock.now - changed)")
        }

        let anyPort = try #require(Self.livePort())
        // A planned failover of the primary that holds the first user's keys.
        let firstSlot = Int(HashSlot(of: PresenceKeys(prefix: prefix).devices(users[0])).value)
        let planned = try #require(try TestRedisCluster.owner(of: firstSlot, askingPort: anyPort))
        let plannedReplica = try #require(try Self.replica(of: planned.port))
        let failedOver = ContinuousClock.now
        #expect(try TestRedisCluster.cli(port: plannedReplica, "CLUSTER", "FAILOVER").contains("OK"))
        #expect(await eventually(timeout: .seconds(10)) { (try? TestRedisCluster.owner(of: firstSlot, askingPort: plannedReplica))?.port == plannedReplica },
                "the replica takes over")
        print("cluster gateway: CLUSTER FAILOVER took \(ContinuousClock.now - failedOver)")
        await changesFlow(0, "CLUSTER FAILOVER")

        // kill -9 of the primary that holds the node registry: leases of nodes on the other
        // primaries renew, their registry entries cannot move until the replica takes over.
        let registrySlot = Int(HashSlot(of: PresenceKeys(prefix: prefix).nodes).value)
        let victim = try #require(try TestRedisCluster.owner(of: registrySlot, askingPort: anyPort))
        let survivor = try #require(TestRedisCluster.ports.first { $0 != victim.port && $0 != (try? Self.replica(of: victim.port)) })
        #expect(await eventually(timeout: .seconds(10)) { ((try? Self.replica(of: victim.port)) ?? nil) != nil }, "the registry's primary has a replica")
        // Each node's /readyz, every 50 ms from the kill until a second after the promotion.
        let polling = Task {
            var unready = [Duration](repeating: .zero, count: nodes.count)
            var since = [ContinuousClock.Instant?](repeating: nil, count: nodes.count)
            while !Task.isCancelled {
                for (index, node) in nodes.enumerated() {
                    let now = ContinuousClock.now
                    if GatewayProcess.httpStatus(port: node.port, path: "/readyz") == 200 {
                        since[index] = nil
                    } else {
                        since[index] = since[index] ?? now
                        unready[index] = max(unready[index], now - since[index]!)
                    }
                }
                try? await Task.sleep(for: .milliseconds(50))
            }
            return unready
        }
        let killed = ContinuousClock.now
        try TestRedisCluster.kill9(port: victim.port)
        #expect(await eventually(timeout: .seconds(20)) { (try? TestRedisCluster.owner(of: registrySlot, askingPort: survivor)).map { $0?.port != victim.port } ?? false },
                "the replica is promoted")
        print("cluster gateway: kill -9 of the registry's primary, promotion after \(ContinuousClock.now - killed)")
        try await Task.sleep(for: .seconds(1))
        polling.cancel()
        let unready = await polling.value
        print("cluster gateway: longest /readyz 503 of each node around the kill: \(unready)")
        // Only a node whose subscriber sat on the killed primary is unready, until it listens on
        // another; the other primaries serve their slots throughout.
        #expect(unready.allSatisfy { $0 < .milliseconds(1500) }, "no node leaves the balancer for the promotion: \(unready)")
        // A user whose keys were on the killed primary (one of the first 80, not churning).
        let moved = (1..<80).first { victim.serves(Int(HashSlot(of: PresenceKeys(prefix: prefix).devices(users[$0])).value)) } ?? 1
        await changesFlow(moved, "kill -9 of the registry's primary")

        // Past a lease and the grace after it, when a lost lease would have turned users offline.
        await churn.stop()
        try await Task.sleep(for: .seconds(lease + 3))
        await Self.checkAfterwards(churn, churning: churning, users: users, watcher: watcher, nodes: nodes, since: start)
        let sessions = clients.reduce(0) { $0 + $1.connections }
        print("cluster gateway: \(sessions) session opens for \(clients.count) clients over the run")
    }

    @Test(
        "the shard holding the node registry down (primary and replica stopped) for longer than a lease: the cluster refuses every command meanwhile, and afterwards nobody was shown offline, no node is reaped, changes flow again"
    )
    func registryShardDown() async throws {
        let prefix = TestRedis.uniquePrefix("cluster-down")
        let lease = 8
        let users = (0..<60).map { "user\($0)" }
        let (nodes, clients, watcher) = try await Self.start(prefix: prefix, users: users, lease: lease)
        let start = ContinuousClock.now
        let anyPort = try #require(Self.livePort())
        let registrySlot = Int(HashSlot(of: PresenceKeys(prefix: prefix).nodes).value)
        let owner = try #require(try TestRedisCluster.owner(of: registrySlot, askingPort: anyPort))
        // An earlier test may have killed this shard's replica's primary: then it has none.
        let replica = try Self.replica(of: owner.port)
        let stopped = try ([owner.port] + (replica.map { [$0] } ?? [])).map { try TestRedisCluster.processID(port: $0) }
        let witness = try #require(TestRedisCluster.ports.first { ![owner.port, replica].contains($0) && (try? TestRedisCluster.cli(port: $0, "PING")) == "PONG" })
        let churning = Array(clients[40...])
        let churn = StatusChurn(churning, every: .milliseconds(50))

        // SIGSTOP: the servers hold their data and their sockets, and answer nothing, as a
        // shard cut off by the network would; past the lease, then back.
        for pid in stopped { kill(pid, SIGSTOP) }
        let frozen = ContinuousClock.now
        #expect(await eventually(timeout: .seconds(10)) { (try? TestRedisCluster.cli(port: witness, "CLUSTER", "INFO"))?.contains("cluster_state:fail") ?? false },
                "the cluster goes down without the shard (full coverage required)")
        print("cluster gateway: registry shard stopped; cluster_state:fail after \(ContinuousClock.now - frozen)")
        try await Task.sleep(until: frozen + .seconds(lease + 2))
        for pid in stopped { kill(pid, SIGCONT) }
        let thawed = ContinuousClock.now
        #expect(await eventually(timeout: .seconds(20)) { (try? TestRedisCluster.cli(port: witness, "CLUSTER", "INFO"))?.contains("cluster_state:ok") ?? false },
                "the cluster is whole again")
        print("cluster gateway: registry shard back; cluster_state:ok after \(ContinuousClock.now - thawed)")

        let changed = ContinuousClock.now
        await clients[0].client.setStatus(.away)
        #expect(await watcher.sees(users[0], .away, within: .seconds(15)), "a change after the outage reaches the watcher: \(watcher.timeline(since: start, peer: users[0]))")
        print("cluster gateway: after the shard's return a change was seen after \(ContinuousClock.now - changed)")
        // Past the recovery grace, when a reaper that took the outage for dead nodes would have
        // turned their users offline.
        await churn.stop()
        try await Task.sleep(for: .seconds(lease + 3))
        await Self.checkAfterwards(churn, churning: churning, users: users, watcher: watcher, nodes: nodes, since: start)
    }

    /// Runs `redis-cli arguments...` (not against one port: `--cluster` commands); its output.
    static func redisCLI(_ arguments: [String]) throws -> String {
        try runProcess("/usr/bin/env", ["redis-cli"] + arguments).output
    }

    @Test("a slot of watched users moved by hand under load (ASK and TRYAGAIN while its keys are half moved), then 1,200 slots resharded under load: watchers see every change, nobody is shown offline, no node is reaped")
    func slotMoves() async throws {
        let prefix = TestRedis.uniquePrefix("cluster-move")
        let keys = PresenceKeys(prefix: prefix)
        let users = (0..<60).map { "mover\($0)" }
        let (nodes, clients, watcher) = try await Self.start(prefix: prefix, users: users, lease: 8)
        let start = ContinuousClock.now
        // Users 20… change status in turn, 40 changes a second, throughout.
        let churning = Array(clients[20...])
        let churn = StatusChurn(churning, every: .milliseconds(25))

        // By hand: the slot of mover0's keys, from its primary to another one.
        let anyPort = try #require(Self.livePort())
        let slot = Int(HashSlot(of: keys.devices(users[0])).value)
        let owner = try #require(try TestRedisCluster.owner(of: slot, askingPort: anyPort))
        let other = try #require(try TestRedisCluster.nodes(askingPort: anyPort).first { $0.isPrimary && !$0.isFailed && $0.port != owner.port })
        let move = try #require(try TestRedisCluster.SlotMove.begin(slot, to: other.port))
        let (source, target) = (move.source, move.target)
        let inSlot = try move.keysLeft()
        #expect(inSlot.contains(keys.devices(users[0])), "the slot holds mover0's devices: \(inSlot)")
        // Half of the keys moved: mover0's scripts now find their keys split (TRYAGAIN) or gone (ASK).
        try move.migrate(inSlot.filter { $0 == keys.devices(users[0]) })
        await clients[0].client.setStatus(.away)
        try await Task.sleep(for: .milliseconds(300))
        try move.migrateAll()
        try move.finish()
        let redirected = try TestRedisCluster.cli(port: source.port, "INFO", "errorstats").split(whereSeparator: \.isNewline).filter { $0.contains("TRYAGAIN") || $0.contains("ASK") }
        print("cluster gateway: the source of the hand-moved slot answered \(redirected)")
        #expect(!redirected.isEmpty, "the node's commands met the half-moved slot (TRYAGAIN or ASK)")
        #expect(await watcher.sees(users[0], .away, within: .seconds(10)), "the change made while the slot was half moved reaches the watcher: \(watcher.timeline(since: start, peer: users[0]))")
        await clients[0].client.setStatus(.online)
        #expect(await watcher.sees(users[0], .online, within: .seconds(10)), "a change after the move reaches the watcher")

        // redis-cli moves 1,200 slots from one primary to another, key by key, under the load.
        let from = try #require(try TestRedisCluster.nodes(askingPort: anyPort).first { $0.isPrimary && !$0.isFailed && $0.port != target.port })
        let moved = ContinuousClock.now
        let output = try Self.redisCLI(["--cluster", "reshard", "127.0.0.1:\(anyPort)", "--cluster-from", from.id, "--cluster-to", target.id,
                                         "--cluster-slots", "1200", "--cluster-yes"])
        #expect(!output.contains("ERR"), "redis-cli reshard: \(output.suffix(400))")
        print("cluster gateway: 1,200 slots resharded under load in \(ContinuousClock.now - moved)")
        let sample = (1..<20).first { from.serves(Int(HashSlot(of: keys.devices(users[$0])).value)) } ?? 1
        await clients[sample].client.setStatus(.away)
        #expect(await watcher.sees(users[sample], .away, within: .seconds(10)), "a change after the reshard reaches the watcher")

        await churn.stop()
        try await Task.sleep(for: .seconds(2))
        await Self.checkAfterwards(churn, churning: churning, users: users, watcher: watcher, nodes: nodes, since: start)
    }

    @Test("a conversation's slot moved by hand while its members send (its keys half moved for a moment): every device ends with the stream, each seq once, in order; every acknowledged message stored once")
    func messagesThroughSlotMove() async throws {
        let prefix = TestRedis.uniquePrefix("cluster-messages")
        let keys = PresenceKeys(prefix: prefix)
        let url = try #require(TestRedisCluster.url)
        let environment = nodeEnvironment(prefix: prefix, redisURL: url, extra: ["PRESENCE_VISIBILITY": "open"])
        var nodes: [GatewayProcess] = []
        for id in ["a", "b", "c"] { nodes.append(try await GatewayProcess(nodeID: id, environment: environment)) }
        let members = (0..<4).map { "member\($0)" }
        let body = #"{"member_ids":["# + members.map { "\"\($0)\"" }.joined(separator: ",") + "]}"
        #expect(admin(nodes[0], "PUT", "/api/admin/conversations/moving", body)?.status == 200)
        let devices = members.enumerated().map { MessageDevice(user: $0.element, device: "phone", conversations: ["moving"]) }
        for (index, device) in devices.enumerated() { try await device.connect(port: nodes[index % 3].port) }
        try await Task.sleep(for: .milliseconds(500))

        // Everyone sends in turn, 50 a second, while the conversation's slot moves.
        let sending = Task {
            var number = 0
            while !Task.isCancelled {
                number += 1
                let device = devices[number % devices.count]
                device.send("\(device.user) \(number)", to: "moving", clientID: "\(device.user)-\(number)")
                try? await Task.sleep(for: .milliseconds(20))
            }
        }
        try await Task.sleep(for: .seconds(1))
        let anyPort = try #require(Self.livePort())
        let slot = Int(HashSlot(of: keys.history("moving")).value)
        let owner = try #require(try TestRedisCluster.owner(of: slot, askingPort: anyPort))
        let other = try #require(try TestRedisCluster.nodes(askingPort: anyPort).first { $0.isPrimary && !$0.isFailed && $0.port != owner.port })
        let move = try #require(try TestRedisCluster.SlotMove.begin(slot, to: other.port))
        let inSlot = try move.keysLeft()
        #expect(inSlot.contains(keys.history("moving")), "the slot holds the history: \(inSlot)")
        // The history first, the members and meta after a moment: sends meet a split slot.
        try move.migrate(inSlot.filter { $0 == keys.history("moving") })
        try await Task.sleep(for: .milliseconds(300))
        try move.migrateAll()
        try move.finish()
        try await Task.sleep(for: .seconds(1))
        sending.cancel()
        _ = await sending.value

        let settled = await eventually(timeout: .seconds(20), poll: .milliseconds(200)) { devices.allSatisfy { $0.unacknowledged == 0 } }
        #expect(settled, "every message acknowledged: \(devices.map(\.unacknowledged)) left, errors \(devices.flatMap(\.errors).prefix(5))")
        let acknowledged = devices.flatMap { device in device.acknowledged.map { (device.user, $0.key, Int($0.value.seq)) } }
        let last = acknowledged.map(\.2).max() ?? 0
        let delivered = await eventually(timeout: .seconds(10)) { devices.allSatisfy { $0.received("moving").count >= last } }
        #expect(delivered, "every device got up to seq \(last): \(devices.map { $0.received("moving").count })")
        for device in devices {
            let seqs = device.received("moving").map { Int($0.seq) }
            #expect(seqs == Array(0..<seqs.count).map { $0 + 1 } && device.repeats.isEmpty, "\(device.user): \(device.repeats.prefix(3))")
        }
        // The stream: each acknowledged message once, at its seq; nothing stored twice.
        let history = try await offThePool { () throws -> String in
            try TestRedisCluster.cli(port: other.port, "XLEN", keys.history("moving")).trimmingCharacters(in: .whitespacesAndNewlines)
        }
        #expect(Int(history) == last && Set(acknowledged.map(\.2)).count == acknowledged.count,
                "\(history) entries, \(acknowledged.count) acknowledged (distinct seqs \(Set(acknowledged.map(\.2)).count)), last \(last)")
        let redirected = try TestRedisCluster.cli(port: owner.port, "INFO", "errorstats").split(whereSeparator: \.isNewline).filter { $0.contains("TRYAGAIN") || $0.contains("ASK") }
        print("cluster messages: \(acknowledged.count) acknowledged through the move, \(devices.reduce(0) { $0 + $1.acknowledged.values.count { $0.duplicate } }) as duplicates; the source answered \(redirected)")
        for node in nodes { node.terminate() }
    }
}
