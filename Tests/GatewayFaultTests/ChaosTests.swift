import ClientTestSupport
import Foundation
import PresenceClient
import RedisClient
import RedisTestSupport
import Testing

/// Random faults over three gateway processes (one 2 s behind, one true, one 2 s ahead) and a
/// Redis of their own, with SDK clients that all watch each other: status changes, handoffs,
/// drops, reconnects, sign-outs, kill -9 of a node and its restart under the same id, FLUSHALL,
/// Redis restarted from a snapshot taken some steps before (on the single server), the loss of
/// single keys, and cuts between one node and Redis (packets dropped, no reset:
/// short ones within the lease, long ones past it). On a Redis Cluster, slot migrations too: a
/// user's or a node's slot moved with its keys to another primary; there a cut drops every packet
/// between the node and any cluster node (the node runs under a group id of its own). At quiet
/// checkpoints REST on every node and every connected watcher must agree with the truth (no
/// ghost, nobody lost), and no watcher may ever hear a user go offline whom nothing took offline
/// (no flicker).
///
/// The seed is printed; `PRESENCE_CHAOS_SEED` replays one, `PRESENCE_CHAOS_OPS` sets the length.
/// Run with the heavy tests (cuts need root and iptables; the cluster run needs
/// `scripts/with-redis-cluster`).
@Suite("Chaos over three nodes", .serialized)
struct ChaosTests {
    static let seed = UInt64(ProcessInfo.processInfo.environment["PRESENCE_CHAOS_SEED"] ?? "") ?? 20_261_124
    static let operations = Int(ProcessInfo.processInfo.environment["PRESENCE_CHAOS_OPS"] ?? "") ?? 320
    static let lease = 3
    static let linger = 2

    /// What a user is, by what the test did to them.
    enum Truth: Equatable {
        case connected(PresenceStatus)
        /// Dropped without a clean close, or signed out: offline (after the linger, for a drop).
        case gone
        var status: PresenceStatus {
            if case .connected(let status) = self { status } else { .offline }
        }
    }

    /// Where the nodes keep presence.
    enum Backend {
        /// A redis-server of the run's own; each node reaches it on an address of its own
        /// (127.0.0.2-4), so that iptables can cut one node off.
        case single
        /// The Redis Cluster of `scripts/with-redis-cluster`, whole to this run; each node runs
        /// under a group id of its own, so that iptables can cut it off by owner.
        case cluster
    }

    final class World: @unchecked Sendable {
        // Safe: touched only by the test's own task, one step at a time.
        let backend: Backend
        let redis: RedisServerProcess?
        /// Per node, the rules that cut it off from Redis (none without root).
        let partitions: [Partition]
        let environment: [String: String]
        let skews = [-2, 0, 2]
        var nodes: [GatewayProcess?] = []
        /// Each node's port, kept across restarts: clients keep the URLs they were given.
        var ports: [Int] = []
        var clients: [String: LiveClient] = [:]
        var truth: [String: Truth] = [:]
        /// Users something took offline since the last checkpoint: an offline heard about them is no flicker.
        var mayGoOffline: Set<String> = []
        /// Users whose only record Redis lost with nobody to write it back at once: their own
        /// devices hash deleted (until their node's audit), or every key flushed while the node
        /// holding them was killed before it wrote them again. Offline heard about them until the
        /// next checkpoint is what Redis held, counted apart from flickers.
        var recordLost: Set<String> = []
        var lossOffline: [String] = []
        var flushes: [ContinuousClock.Instant] = []
        /// When the snapshot the next restart goes back to was taken (single server only).
        var snapshot: ContinuousClock.Instant?
        var lastKill: ContinuousClock.Instant?
        /// When each user's client was made (a watcher's reads start then).
        var clientSince: [String: ContinuousClock.Instant] = [:]
        /// When a user who was gone had a session again: an offline read before that is no flicker.
        var backSince: [String: ContinuousClock.Instant] = [:]
        /// After a FLUSHALL, until every live node has written its sessions again, a watcher that
        /// starts reading sees what Redis holds: nobody.
        let flushWindow = Duration.seconds(ChaosTests.lease / 3 + 2)
        var flickers: [String] = []
        /// What the test did, when: to explain a failure.
        var log: [(at: ContinuousClock.Instant, what: String)] = []
        let started = ContinuousClock.now

        func note(_ what: String, at instant: ContinuousClock.Instant = .now) { log.append((instant, what)) }

        /// Seconds since the start, for the log.
        func time(_ instant: ContinuousClock.Instant) -> String {
            let elapsed = instant - started
            return String(format: "%.2f", Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18)
        }

        /// The steps about `user`, or faults of the whole system, up to `instant`.
        func history(of user: String, until instant: ContinuousClock.Instant) -> String {
            log.filter { $0.at <= instant && ($0.what.hasPrefix(user + " ") || $0.what.hasPrefix("*")) }.suffix(8)
                .map { "\(time($0.at)) \($0.what)" }.joined(separator: "; ")
        }
        var scanned: [ObjectIdentifier: Int] = [:]
        let users = (0..<12).map { "u\($0)" }

        init(_ backend: Backend) throws {
            self.backend = backend
            let url: String
            switch backend {
            case .single:
                let server = try RedisServerProcess(arguments: Partition.available ? ["--bind", "127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"] : [])
                redis = server
                url = server.url()
                partitions = Partition.available ? (0..<3).map { Partition(port: server.port, address: "127.0.0.\($0 + 2)") } : []
            case .cluster:
                redis = nil
                url = try TestRedisCluster.url ?? { throw GatewayProcessError("no cluster") }()
                partitions = Partition.available ? (0..<3).map { Partition(group: 47_200 + UInt32($0), ports: TestRedisCluster.ports) } : []
                for partition in partitions { try partition.prepare() }
            }
            environment = nodeEnvironment(prefix: TestRedis.uniquePrefix("chaos"), redisURL: url, extra: [
                "PRESENCE_VISIBILITY": "open", "PRESENCE_LEASE_TTL": "\(ChaosTests.lease)", "PRESENCE_LINGER": "\(ChaosTests.linger)",
            ])
        }

        deinit { for partition in partitions { partition.remove() } }

        var prefix: String { environment["PRESENCE_KEY_PREFIX"]! }

        /// The cluster's primaries now (failed ones left out).
        func primaries() throws -> [TestRedisCluster.Node] {
            try TestRedisCluster.nodes(askingPort: TestRedisCluster.seeds[0].port).filter { $0.isPrimary && !$0.isFailed }
        }

        /// Every key gone, on every primary.
        func flushAll() throws {
            if let redis { _ = try redis.cli("FLUSHALL"); return }
            for primary in try primaries() { try TestRedisCluster.cli(port: primary.port, "FLUSHALL") }
        }

        /// What Redis holds for `user` (devices and state), for a failure's message.
        func stored(_ user: String) -> String {
            let read = { (command: String, key: String) -> String in
                if let redis = self.redis { return (try? redis.cli(command, key)) ?? "?" }
                guard let owner = try? TestRedisCluster.owner(of: HashSlot(of: key).value, askingPort: TestRedisCluster.seeds[0].port) else { return "?" }
                return (try? TestRedisCluster.cli(port: owner.port, command, key)) ?? "?"
            }
            let devices = read("HGETALL", "\(prefix):{u:\(user)}:devices").split(separator: "\n").joined(separator: " ")
            let state = read("HGETALL", "\(prefix):{u:\(user)}:state").split(separator: "\n").joined(separator: " ")
            return "\(user) in Redis: devices [\(devices)], state [\(state)]"
        }

        /// The live nodes' log lines that name one of `users` or tell of the node's own upkeep (its
        /// lease, its sessions written again), the last 30 of each, for a failure's message.
        func nodeLogs(mentioning users: Set<String>) -> String {
            let upkeep = ["lease", "again", "catch", "resync", "lost"]
            return nodes.enumerated().compactMap { index, node -> String? in
                guard let node else { return nil }
                let lines = node.output.split(separator: "\n").filter { line in
                    users.contains { line.contains("\"\($0)\"") || line.contains("=\($0) ") || line.hasSuffix("=\($0)") } || upkeep.contains { line.contains($0) }
                }
                return "node\(index):\n" + lines.suffix(30).joined(separator: "\n")
            }.joined(separator: "\n")
        }

        /// One key gone.
        func delete(_ key: String) throws {
            if let redis { _ = try redis.cli("DEL", key); return }
            let owner = try TestRedisCluster.owner(of: HashSlot(of: key).value, askingPort: TestRedisCluster.seeds[0].port)
            if let owner { try TestRedisCluster.cli(port: owner.port, "DEL", key) }
        }

        /// Cuts node `index` off from Redis for `duration`, then lets it through again; false
        /// when that node is not running.
        func cut(_ index: Int, for duration: Duration) async throws -> Bool {
            guard nodes[index] != nil else { return false }
            try partitions[index].cut()
            note("* node\(index) cut from Redis for \(duration)")
            try await Task.sleep(for: duration)
            partitions[index].heal()
            note("* node\(index) reaches Redis again")
            return true
        }

        func startNode(_ index: Int) async throws {
            let skew = skews[index]
            var variables = skew == 0 ? environment : environment.merging(try SkewedClock.environment(offset: skew)) { _, new in new }
            if let redis, !partitions.isEmpty, let address = partitions[index].address { variables["PRESENCE_REDIS_URL"] = "redis://\(address):\(redis.port)/0" }
            let node = try await GatewayProcess(nodeID: "node\(index)", environment: variables, port: index < ports.count ? ports[index] : nil,
                                                group: partitions.isEmpty ? nil : partitions[index].group)
            if nodes.count <= index {
                nodes.append(node)
                ports.append(node.port)
            } else {
                nodes[index] = node
            }
        }

        var live: [GatewayProcess] { nodes.compactMap { $0 } }

        /// A client of `user` on `node` first, then the other live nodes.
        func connect(_ user: String, on node: GatewayProcess) async throws {
            if let old = clients[user] { scan(old) }
            let wasGone = (truth[user] ?? .gone) == .gone
            let client = try await LiveClient(user, device: "phone", nodes: [node] + live.filter { $0 !== node })
            clientSince[user] = .now
            note("\(user) connects on \(node.nodeID)")
            try await client.client.watch(users.filter { $0 != user })
            clients[user] = client
            truth[user] = .connected(.online)
            if wasGone {
                _ = await client.connected()
                backSince[user] = .now
            }
        }

        /// Records offline updates `client` heard since the last scan about users nothing took offline.
        func scan(_ client: LiveClient) {
            let key = ObjectIdentifier(client)
            let arrivals = client.arrivalsOfAll
            for (at, presence) in arrivals.dropFirst(scanned[key] ?? 0) {
                guard presence.status == .offline, !mayGoOffline.contains(presence.userID) else { continue }
                if let back = backSince[presence.userID], at < back { continue }
                // A session of the watcher that began after the flush read Redis as it was.
                let sessionStarts = [clientSince[client.user] ?? started] + client.connectedAt
                let readingSinceFlush = flushes.contains { flush in
                    // (The SDK reports a session as connected once it has handled its first answer.)
                    at >= flush && at < flush + flushWindow && sessionStarts.contains { $0 >= flush && $0 <= at + .seconds(1) }
                }
                if recordLost.contains(presence.userID) || readingSinceFlush {
                    lossOffline.append("\(time(at)) \(client.user) heard \(presence.userID) offline")
                } else if case .connected = truth[presence.userID] ?? .gone {
                    let sessions = client.connectedAt.map(time).joined(separator: ",")
                    flickers.append("\(time(at)) \(client.user) (sessions from \(sessions)) heard \(presence.userID) offline [\(history(of: presence.userID, until: at))]")
                }
            }
            scanned[key] = arrivals.count
        }

        func rest(_ user: String, on node: GatewayProcess, token: String) -> String? {
            guard let read = GatewayProcess.httpGet(port: node.port, path: "/api/presence/users/\(user)", headers: ["Authorization": "Bearer \(token)"]),
                  read.status == 200,
                  let body = try? JSONSerialization.jsonObject(with: Data(read.body.utf8)) as? [String: Any] else { return nil }
            return body["status"] as? String
        }

        /// Where REST and the watchers disagree with the truth; empty when all agree.
        func disagreements(token: String) async -> [String] {
            var found: [String] = []
            for user in users {
                let want = truth[user, default: .gone].status.rawValue
                for node in live {
                    let got = rest(user, on: node, token: token) ?? "no answer"
                    if got != want { found.append("REST on \(node.nodeID): \(user) \(got), truth \(want)") }
                }
                for (watcher, client) in clients where watcher != user {
                    guard case .connected = truth[watcher] ?? .gone, await client.client.connectionState == .connected else { continue }
                    let got = await client.client.presence(of: user)?.status.rawValue ?? "unknown"
                    if got != want { found.append("\(watcher) sees \(user) \(got), truth \(want)") }
                }
            }
            return found
        }
    }

    @Test("random faults, cuts between a node and Redis among them: no ghost, nobody lost, no flicker; watchers agree with REST at every quiet checkpoint")
    func chaos() async throws {
        try await run(World(.single))
    }

    @Test("random faults on a Redis Cluster, slot migrations among them: no ghost, nobody lost, no flicker; watchers agree with REST at every quiet checkpoint",
          .enabled(if: TestRedisCluster.isAvailable, "needs scripts/with-redis-cluster"))
    func chaosOnCluster() async throws {
        try await run(World(.cluster))
    }

    func run(_ world: World) async throws {
        print("chaos (\(world.backend)): seed \(Self.seed), \(Self.operations) operations (PRESENCE_CHAOS_SEED, PRESENCE_CHAOS_OPS)\(world.partitions.isEmpty ? "; no cuts: they need root and iptables" : "")")
        var random = SeededRandom(seed: Self.seed)
        for index in 0..<3 { try await world.startNode(index) }
        for (index, user) in world.users.enumerated() { try await world.connect(user, on: world.live[index % 3]) }
        let token = try await mint("chaos-reader")
        var counts: [String: Int] = [:]
        var convergence: [Duration] = []
        var checkpoints = 0

        func checkpoint() async throws {
            let start = ContinuousClock.now
            var last: [String] = []
            let agreed = await eventually(timeout: .seconds(4 * Self.lease + 6), poll: .milliseconds(250)) {
                last = await world.disagreements(token: token)
                return last.isEmpty
            }
            convergence.append(ContinuousClock.now - start)
            checkpoints += 1
            let wrongUsers = Set(last.compactMap { line in world.users.first { line.contains(" \($0) ") } })
            #expect(agreed, "checkpoint \(checkpoints): \(last.prefix(12)); \(wrongUsers.map { "\($0): \(world.history(of: $0, until: .now))" }); \(wrongUsers.map(world.stored))")
            if !agreed { print(world.nodeLogs(mentioning: Set(wrongUsers))) }
            for client in world.clients.values { world.scan(client) }
            world.mayGoOffline = Set(world.users.filter { world.truth[$0] == .gone })
            world.recordLost = []
        }

        var lastCheckpoint = 0
        for step in 1...Self.operations {
            // On a cluster, six more for slot migrations (the single server's rolls stay as they were).
            let roll = random.below(world.backend == .cluster ? 112 : 106)
            let user = random.pick(world.users)
            let state = world.truth[user] ?? .gone
            switch roll {
            case 0..<35:
                guard case .connected = state, let client = world.clients[user] else { continue }
                let status: PresenceStatus = random.below(2) == 0 ? .online : .away
                await client.client.setStatus(status)
                world.truth[user] = .connected(status)
                world.note("\(user) \(status.rawValue)")
                counts["status", default: 0] += 1
            case 35..<50:
                // A handoff: the connection drops, the same device is back 0.3 s later on another node.
                guard case .connected(let status) = state, let client = world.clients[user] else { continue }
                await client.client.networkChanged(available: false)
                world.note("\(user) handoff: dropped")
                try await Task.sleep(for: .milliseconds(300))
                let target = random.pick(world.live)
                try await world.connect(user, on: target)
                await world.clients[user]?.client.setStatus(status)
                world.truth[user] = .connected(status)
                counts["handoff", default: 0] += 1
            case 50..<58:
                guard case .connected = state, let client = world.clients[user] else { continue }
                await client.client.networkChanged(available: false)
                world.truth[user] = .gone
                world.mayGoOffline.insert(user)
                world.note("\(user) dropped")
                counts["drop", default: 0] += 1
            case 58..<63:
                guard case .connected = state, let client = world.clients[user] else { continue }
                await client.client.signOut()
                world.truth[user] = .gone
                world.mayGoOffline.insert(user)
                world.note("\(user) signed out")
                counts["sign-out", default: 0] += 1
            case 63..<80:
                guard state == .gone else { continue }
                try await world.connect(user, on: random.pick(world.live))
                counts["reconnect", default: 0] += 1
            case 80..<83:
                // kill -9 of a node while all three run; its clients move to the others.
                guard world.live.count == 3 else { continue }
                let index = random.below(3)
                world.nodes[index]?.kill()
                world.nodes[index] = nil
                world.lastKill = .now
                world.note("* kill -9 node\(index)")
                // Killed before it wrote its sessions back after a flush: their records are gone
                // until their clients reconnect elsewhere (which of them it held, the test does not know).
                if let flushed = world.flushes.last, ContinuousClock.now - flushed < .seconds(Self.lease / 3 + 2) {
                    world.recordLost.formUnion(world.users)
                }
                counts["kill -9", default: 0] += 1
            case 83..<90:
                guard let index = world.nodes.firstIndex(where: { $0 == nil }) else { continue }
                try await world.startNode(index)
                world.note("* node\(index) restarted")
                counts["restart under the same id", default: 0] += 1
            case 90..<92:
                // From the moment it is sent: redis-cli takes some 40 ms to start, and a session
                // opening meanwhile may read Redis already empty.
                let sent = ContinuousClock.now
                try world.flushAll()
                world.note("* FLUSHALL", at: sent)
                world.flushes.append(sent)
                // A node killed just before: its clients are still on their way to another node,
                // and their records are gone with nobody to write them back until they arrive.
                if let killed = world.lastKill, ContinuousClock.now - killed < .seconds(2) { world.recordLost.formUnion(world.users) }
                counts["FLUSHALL", default: 0] += 1
            case 92..<97:
                // One key lost: a user's devices hash, or a node's device index.
                if random.below(2) == 0 {
                    try world.delete("\(world.prefix):{u:\(user)}:devices")
                    world.note("\(user) devices hash lost")
                    world.recordLost.insert(user)
                } else if let node = world.live.first {
                    try world.delete("\(world.prefix):{n:\(node.nodeID)}:devices")
                    world.note("* \(node.nodeID) device index lost")
                }
                counts["partial loss", default: 0] += 1
            case 97..<100 where world.backend == .single:
                // Redis goes back in time: a snapshot now, and at a later roll a kill -9 and a
                // restart from it. What changed since is undone in Redis: devices connected
                // since are gone from it until their nodes write them back (their offline is what
                // Redis held, as after a FLUSHALL); devices gone since are back in it until their
                // nodes, seeing the new life, settle them (docs/operations.md).
                guard let redis = world.redis else { continue }
                guard let taken = world.snapshot else {
                    _ = try redis.cli("SAVE")
                    world.snapshot = .now
                    world.note("* snapshot")
                    counts["snapshot", default: 0] += 1
                    continue
                }
                let restarted = ContinuousClock.now
                redis.stop()
                try redis.start()
                world.note("* restart from the snapshot", at: restarted)
                world.flushes.append(restarted)
                world.recordLost.formUnion(world.users.filter { user in
                    world.log.contains { $0.at >= taken && $0.what.hasPrefix(user + " ") && ($0.what.contains("connects on") || $0.what.contains("handoff")) }
                })
                world.snapshot = nil
                counts["restart from a snapshot", default: 0] += 1
            case 100..<103 where !world.partitions.isEmpty:
                // Shorter than the lease minus one renewal period: nobody may be shown offline.
                guard try await world.cut(random.below(3), for: .milliseconds(1200)) else { continue }
                counts["short cut", default: 0] += 1
            case 103..<106 where !world.partitions.isEmpty:
                // Past the lease: other nodes reap the node's users (which of them it holds, the
                // test does not know); once it reaches Redis again it writes them back.
                let index = random.below(3)
                guard world.nodes[index] != nil else { continue }
                world.mayGoOffline.formUnion(world.users)
                _ = try await world.cut(index, for: .seconds(5))
                counts["long cut", default: 0] += 1
            case 100..<112 where world.backend == .cluster:
                // A user's slot (their devices and state) or a node's (its lease and index),
                // moved with its keys to another primary while everything runs.
                let tag = random.below(3) == 0 ? "{n:\(random.pick(world.live).nodeID)}" : "{u:\(user)}"
                let slot = HashSlot(of: tag).value
                let targets = try world.primaries().filter { !$0.serves(slot) }
                guard !targets.isEmpty else { continue }
                let target = random.pick(targets)
                let source = try TestRedisCluster.moveSlot(slot, to: target.port)
                world.note("* slot \(slot) (\(tag)) moved from \(source.map(String.init) ?? "?") to \(target.port)")
                counts["slot migration", default: 0] += 1
            default:
                try await Task.sleep(for: .milliseconds(200))
                counts["pause", default: 0] += 1
            }
            try await Task.sleep(for: .milliseconds(UInt64(random.below(150))))
            // Every 40 steps, or the first step after that is not skipped (a skipped step, one
            // whose user was in the wrong state, goes straight to the next).
            if step - lastCheckpoint >= 40 {
                lastCheckpoint = step
                world.note("* checkpoint")
                try await checkpoint()
            }
        }
        try await checkpoint()
        for client in world.clients.values { world.scan(client) }
        let slowest = convergence.max() ?? .zero
        print("chaos: \(counts.sorted { $0.key < $1.key }.map { "\($0.key) \($0.value)" }.joined(separator: ", "))")
        print("chaos: \(checkpoints) checkpoints, slowest convergence \(slowest), flickers \(world.flickers.count), offline heard while a user's record was lost \(world.lossOffline.count)")
        #expect(world.flickers.isEmpty, "flickers:\n\(world.flickers.prefix(20).joined(separator: "\n"))")
        if !world.flickers.isEmpty {
            print(world.nodeLogs(mentioning: Set(world.users.filter { user in world.flickers.contains { $0.contains(" heard \(user) offline") } })))
        }
        var kinds = ["kill -9", "FLUSHALL", "partial loss", "handoff"]
        if !world.partitions.isEmpty { kinds += ["short cut", "long cut"] }
        if world.backend == .cluster { kinds.append("slot migration") } else { kinds.append("restart from a snapshot") }
        #expect(kinds.allSatisfy { counts[$0, default: 0] > 0 }, "the run tried every kind of fault (\(kinds)): \(counts)")
    }
}
