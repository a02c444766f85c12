import ClientTestSupport
import Foundation
import PresenceClient
import RedisClient
import RedisTestSupport
import Testing

/// Node a's link to Redis cut without a reset: iptables drops every packet between a and Redis,
/// as a partition does, while node b and the test reach Redis as before. Node a reaches Redis at
/// 127.0.0.2 (Redis listens there too), so that only its packets match the rules.
///
/// Needs root and iptables (CI runs as root; elsewhere the suite is skipped, and says so). Run
/// with the heavy tests: two node processes and a Redis of their own.
@Suite("Partitions between a node and Redis", .serialized, .enabled(if: Partition.available, "needs root and a working /usr/sbin/iptables"))
struct PartitionTests {
    /// Redis on 127.0.0.1 and 127.0.0.2; node a on the second address, node b on the first.
    static func start() async throws -> (redis: RedisServerProcess, a: GatewayProcess, b: GatewayProcess, partition: Partition, prefix: String) {
        let redis = try RedisServerProcess(arguments: ["--bind", "127.0.0.1", "127.0.0.2"])
        let prefix = TestRedis.uniquePrefix("cut")
        let (a, b) = try await SelfHealingTests.twoNodes(redis, prefix: prefix, redisURLOfA: "redis://127.0.0.2:\(redis.port)/0")
        return (redis, a, b, Partition(port: redis.port), prefix)
    }

    /// Runs `body` with a Redis of its own, nodes a and b, and the partition between a and
    /// Redis, healed afterwards.
    static func withCut(_ body: (GatewayProcess, GatewayProcess, Partition) async throws -> Void) async throws {
        let (redis, a, b, partition, _) = try await start()
        defer { partition.heal() }
        try await body(a, b, partition)
        _ = redis
    }

    /// Alice on node a, watched by bob on node b.
    static func aliceAndBob(_ a: GatewayProcess, _ b: GatewayProcess) async throws -> (alice: LiveClient, bob: LiveClient) {
        let alice = try await LiveClient("alice", device: "phone", nodes: [a])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [b])
        for client in [alice, bob] { #expect(await client.connected(), "\(client.user) is connected") }
        try await bob.client.watch(["alice"])
        try #require(await bob.sees("alice", .online), "bob sees alice online")
        return (alice, bob)
    }

    /// A REST read of alice on `node`: its status code (nil: no answer within 5 s), the status it
    /// gave, and how long it took.
    static func readAlice(_ node: GatewayProcess, token: String) async -> (code: Int?, status: String?, took: Duration) {
        let started = ContinuousClock.now
        let read = try? await offThePool {
            GatewayProcess.httpGet(port: node.port, path: "/api/presence/users/alice", headers: ["Authorization": "Bearer \(token)"])
        }
        let body = read.flatMap { try? JSONSerialization.jsonObject(with: Data($0.body.utf8)) as? [String: Any] }
        return (read?.status, body?["status"] as? String, ContinuousClock.now - started)
    }

    /// Fails before the change (a plain close): the kernel resent the SET once the network was
    /// back, and Redis ran it after its caller had been told it failed.
    @Test("a command whose connection was given up on during a cut never runs once the network is back")
    func abandonedCommandStaysUnsent() async throws {
        let redis = try RedisServerProcess(arguments: ["--bind", "127.0.0.1", "127.0.0.2"])
        let partition = Partition(port: redis.port)
        defer { partition.heal() }
        var configuration = try RedisConfiguration(url: "redis://127.0.0.2:\(redis.port)/0")
        configuration.stallTimeout = .milliseconds(750)
        configuration.maximumBackoff = .seconds(1)
        let key = "abandoned:\(UUID().uuidString)"
        try await RedisClient.withClient(configuration: configuration, logger: TestRedis.logger()) { client in
            _ = try await client.send("PING")
            try partition.cut()
            let sent = ContinuousClock.now
            await #expect(throws: RedisError.self) { try await client.send("SET", RedisArgument(key), "late") }
            let failedAfter = ContinuousClock.now - sent
            #expect(failedAfter < .seconds(2), "the stall rule gave up on it (\(failedAfter))")
            partition.heal()
            // TCP resends an unacknowledged segment within about 1.6 s on loopback (RTO from 200 ms,
            // doubling); 4 s leave room for it.
            try await Task.sleep(for: .seconds(4))
        }
        #expect(try redis.cli("EXISTS", key).trimmingCharacters(in: .whitespacesAndNewlines) == "0", "the SET never ran")
    }

    /// Fails before `scripts/clear-stale-cuts` and the tag on each rule: a chaos run killed by
    /// hand left its cut of a Redis port on 127.0.0.2 in place, and a later `presence-bench
    /// storm` failed `make test` when one of its clients drew that port as its source port (its
    /// SYNs dropped until the 10 s connect timeout).
    @Test("a cut left by a test process that died is removed before the next test command; a live process's cut stays")
    func staleCutsCleared() async throws {
        let redis = try RedisServerProcess()
        let (stale, live) = (try RefusingPort(), try RefusingPort())  // two port numbers no one else uses now
        // The rule as a process killed mid-cut leaves it: tagged with a pid that is gone (the
        // shell prints its pid and execs iptables, which exits). Removed at the end whatever
        // the script did.
        let rule = { (action: String, pid: String) in
            "/usr/sbin/iptables -w \(action) INPUT -p tcp -s 127.0.0.2 --sport \(stale.port) -m comment --comment presence-test-\(pid) -j DROP"
        }
        let killed = try runProcess("/bin/sh", ["-c", "echo $$; exec " + rule("-I", "$$")])
        try #require(killed.status == 0, "\(killed.output)")
        let pid = killed.output.split(separator: "\n").first.map(String.init) ?? "?"
        defer { _ = try? runProcess("/bin/sh", ["-c", rule("-D", pid) + " 2>/dev/null"]) }
        let partition = Partition(port: live.port)
        try partition.cut()
        defer { partition.heal() }
        let from = { (port: Int) -> Bool in
            guard let fd = connectLoopback(port: redis.port, source: ("127.0.0.2", port), timeout: .seconds(1)) else { return false }
            close(fd)
            return true
        }
        #expect(!from(stale.port), "the stale rule drops a client whose source port it names")

        let cleared = try runProcess(LocalCluster.root.appendingPathComponent("scripts/clear-stale-cuts").path, [])
        #expect(cleared.status == 0 && cleared.output.contains("which is gone"), "\(cleared.output)")
        #expect(from(stale.port), "the same client connects once the stale rule is gone")
        #expect(!from(live.port), "this process's cut, tagged \(Partition.tag), is still in place")
    }

    /// 1.7 s: within the lease less one renewal period (2 s), with room for the reconnect. At
    /// 1.5 s the code that waited on the stalled connection passed too (three seeds); at 1.7 s it
    /// showed alice offline in 2 of 5 cuts (two seeds), and at 1.9 s in 8 of 10.
    @Test("cuts of 1.7 s (a 3 s lease, renewed every second): nobody is shown offline, on either node")
    func shortCuts() async throws {
        try await Self.withCut { a, b, partition in try await Self.shortCuts(a, b, partition, label: "shortCuts") }
    }

    @Test("a handoff to a node cut off from Redis: the client goes on to the next URL at once, and nobody hears the device offline")
    func handoffToCutNode() async throws {
        let (redis, a, b, partition, _) = try await Self.start()
        defer { partition.heal() }
        let before = try await LiveClient("alice", device: "phone", nodes: [b])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [b])
        for client in [before, bob] { #expect(await client.connected(), "\(client.user) is connected") }
        try await bob.client.watch(["alice"])
        try #require(await bob.sees("alice", .online), "bob sees alice online")
        // The network changes: the connection drops without a close (the device lingers 2 s),
        // and the device comes back through node a, which has just lost Redis. A backoff longer
        // than the linger: a client that waited on a's refusal would be seen offline.
        let dropped = ContinuousClock.now
        await before.client.networkChanged(available: false)
        try partition.cut()
        let after = try await LiveClient("alice", device: "phone", nodes: [a, b]) {
            $0.backoff = ReconnectBackoff(initial: 3, maximum: 3, jitter: 0)
        }
        let connected = await after.connected(.seconds(8))
        let took = after.connectedAt.first.map { $0 - dropped }
        try await Task.sleep(for: .seconds(1))
        partition.heal()
        let refusal = await after.client.lastCloseCode
        print("handoffToCutNode: connected again \(took.map { "\($0)" } ?? "never") after the drop, node a closed with \(refusal.map(String.init) ?? "nothing"); bob's timeline of alice: \(bob.timeline(since: dropped, peer: "alice"))")
        #expect(connected, "alice's device is back")
        #expect(refusal == 1011, "node a could not register the session")
        #expect(took.map { $0 < .seconds(2) } ?? false, "back within the linger")
        #expect(!bob.statuses(of: "alice").contains(.offline), "bob never heard alice offline: \(bob.timeline(since: dropped, peer: "alice"))")
        _ = redis
    }

    /// A session that ends while its node cannot reach Redis must not be written back as
    /// connected when the node returns (its release is owed and retried; the node's restore
    /// writes only live sessions). The cluster chaos run with cuts once ended with a user away in
    /// REST 18 s after her connection dropped 0.7 s before a 5 s cut of her node (seed 21, not
    /// reproduced by this test, which passes on the code it was written against).
    @Test("a connection that drops during a long cut is let go of: when the node reaches Redis again, the user does not come back online")
    func dropDuringCut() async throws {
        try await Self.withCut { a, b, partition in try await Self.dropDuringCut(a, b, partition, label: "dropDuringCut") }
    }

    /// Alice's connection to `a` drops 0.3 s into a 5 s cut between `a` and Redis, and never
    /// returns; 6 s after the cut she must be offline, to bob on `b` and in REST.
    static func dropDuringCut(_ a: GatewayProcess, _ b: GatewayProcess, _ partition: Partition, label: String) async throws {
        let (alice, bob) = try await Self.aliceAndBob(a, b)
        let reader = try await mint("reader")
        try partition.cut()
        try await Task.sleep(for: .milliseconds(300))
        // The device's network goes: the connection ends without a close, and it never returns.
        await alice.client.networkChanged(available: false)
        try await Task.sleep(for: .seconds(5))
        partition.heal()
        let healed = ContinuousClock.now
        // Past the linger (2 s) and a lease (3 s) after the node is back: offline, and for good.
        try await Task.sleep(for: .seconds(6))
        let read = await Self.readAlice(b, token: reader)
        print("\(label): bob's timeline of alice: \(bob.timeline(since: healed - .seconds(6), peer: "alice")); REST on b: \(read.status ?? "no answer")")
        #expect(read.status == "offline", "REST on b says \(read.status ?? "nothing") of alice 6 s after the cut")
        #expect(bob.statuses(of: "alice").last == .offline, "bob last heard alice \(bob.statuses(of: "alice").last.map(\.rawValue) ?? "nothing")")
    }

    @Test("a cut of 8 s: REST on the node answers 503 within a second, /readyz follows within a second, and after it never says offline for a user connected there")
    func longCut() async throws {
        try await Self.withCut { a, b, partition in try await Self.longCut(a, b, partition, label: "longCut") }
    }

    /// Five cuts of 1.7 s between `a` and Redis while bob, on `b`, watches alice, on `a`, and
    /// reads her over REST on `b`.
    static func shortCuts(_ a: GatewayProcess, _ b: GatewayProcess, _ partition: Partition, label: String) async throws {
        let (alice, bob) = try await Self.aliceAndBob(a, b)
        let reader = try await mint("reader")
        let seed = UInt64(ProcessInfo.processInfo.environment["PRESENCE_PARTITION_SEED"] ?? "") ?? 20_261_126
        var random = SeededRandom(seed: seed)
        print("\(label): seed \(seed) (PRESENCE_PARTITION_SEED)")
        let started = ContinuousClock.now
        var offlineReads: [String] = []
        for round in 1...5 {
            // A random phase against the node's renewals, which come every second.
            try await Task.sleep(for: .milliseconds(Int(random.next() % 1000)))
            let cutAt = ContinuousClock.now
            try partition.cut()
            // Healed 1.7 s after the cut by a task of its own: healed between reads, a cut ran
            // on for up to a read and a pause more (330 ms more in a traced run).
            let healing = Task {
                try? await Task.sleep(until: cutAt + .milliseconds(1700))
                partition.heal()
            }
            // Reads of alice on b through the cut and the second after it.
            while ContinuousClock.now < cutAt + .milliseconds(2700) {
                let read = await Self.readAlice(b, token: reader)
                if read.status == "offline" { offlineReads.append("round \(round): b read alice offline \(ContinuousClock.now - cutAt) after the cut") }
                try await Task.sleep(for: .milliseconds(100))
            }
            await healing.value
            try await Task.sleep(for: .seconds(2))
        }
        print("\(label): bob's timeline of alice: \(bob.timeline(since: started, peer: "alice"))")
        if bob.statuses(of: "alice").contains(.offline) {
            print("\(label): node a's log:\n\(a.output.split(separator: "\n").suffix(60).joined(separator: "\n"))")
            print("\(label): node b's log:\n\(b.output.split(separator: "\n").suffix(30).joined(separator: "\n"))")
        }
        #expect(offlineReads.isEmpty, "\(offlineReads)")
        #expect(!bob.statuses(of: "alice").contains(.offline), "bob never heard alice go offline: \(bob.timeline(since: started, peer: "alice"))")
        #expect(await alice.client.connectionState == .connected, "alice's session was never closed")
    }

    /// A cut of 8 s between `a` and Redis, alice on `a` and bob on `b`, with reads of alice on `a`
    /// throughout and for 4 s after.
    static func longCut(_ a: GatewayProcess, _ b: GatewayProcess, _ partition: Partition, label: String) async throws {
        let (alice, bob) = try await Self.aliceAndBob(a, b)
        let reader = try await mint("reader")
        // Three readers of alice on a, from the cut until 4 s after it ends: one of them is
        // waiting for a connection when the network returns, and must not answer from Redis
        // before a wrote its sessions again.
        let cutAt = ContinuousClock.now
        try partition.cut()
        let healAt = cutAt + .seconds(8)
        let reads = try await withThrowingTaskGroup(of: [(sent: Duration, took: Duration, code: Int?, status: String?)].self) { group in
            for _ in 0..<3 {
                group.addTask {
                    var reads: [(sent: Duration, took: Duration, code: Int?, status: String?)] = []
                    while ContinuousClock.now < healAt + .seconds(4) {
                        let sent = ContinuousClock.now - cutAt
                        let read = await Self.readAlice(a, token: reader)
                        reads.append((sent, read.took, read.code, read.status))
                        try await Task.sleep(for: .milliseconds(20))
                    }
                    return reads
                }
            }
            var readyzUnready: Duration?
            while ContinuousClock.now < healAt {
                if readyzUnready == nil, GatewayProcess.httpStatus(port: a.port, path: "/readyz") == 503 { readyzUnready = ContinuousClock.now - cutAt }
                try await Task.sleep(for: .milliseconds(100))
            }
            #expect(readyzUnready.map { $0 < .milliseconds(1500) } ?? false, "/readyz 503 within a second of the cut (+ the poll): \(readyzUnready.map { "\($0)" } ?? "never")")
            print("\(label): /readyz 503 after \(readyzUnready.map { "\($0)" } ?? "never")")
            #expect(await bob.sees("alice", .offline, within: .seconds(1)), "node a's users are offline once its lease ran out")
            partition.heal()
            var all: [(sent: Duration, took: Duration, code: Int?, status: String?)] = []
            for try await some in group { all += some }
            return all.sorted { $0.sent < $1.sent }
        }
        let during = reads.filter { $0.sent < .seconds(8) }
        // docs/API.md: a 503 within a second (with 200 ms for the test's own request to be made).
        let slow = during.filter { $0.took > .milliseconds(1200) }.map { "sent at \($0.sent): \($0.code.map(String.init) ?? "no answer") after \($0.took)" }
        let codes = Dictionary(during.map { ($0.code ?? 0, 1) }, uniquingKeysWith: +)
        // Alice is connected to a throughout: any answer but "online" is stale.
        let stale = reads.filter { $0.code == 200 && $0.status != "online" }.map { "sent \($0.sent) after the cut, answered \($0.status ?? "?") after \($0.took)" }
        let firstOnline = reads.first { $0.sent >= .seconds(8) && $0.status == "online" }.map { $0.sent + $0.took - .seconds(8) }
        print("\(label): \(reads.count) reads of alice on a; during the cut \(codes), the slowest \(during.map(\.took).max() ?? .zero); online again \(firstOnline.map { "\($0)" } ?? "never") after the cut ended")
        #expect(slow.isEmpty, "REST on a answered late: \(slow)")
        #expect(codes[503, default: 0] > 0 && codes[0] == nil, "503s, and no read unanswered: \(codes)")
        #expect(stale.isEmpty, "a answered for alice, connected to it, from a stale state: \(stale)")
        #expect(firstOnline != nil, "alice is online in REST on a again")
        #expect(await bob.sees("alice", .online, within: .seconds(3)), "bob sees alice online again")
        #expect(await alice.client.connectionState == .connected, "alice's session stayed open")
    }
}

/// The iptables rules that cut one node off from Redis: every packet between them dropped, both
/// ways, as a partition does (no reset).
struct Partition: Sendable {
    /// One rule: its table, and its chain with the match and the target.
    struct Rule: Sendable {
        var table = "filter"
        let spec: [String]

        /// The spec with this process's tag before its target.
        var tagged: [String] {
            let target = spec.firstIndex(of: "-j") ?? spec.endIndex
            return Array(spec[..<target]) + ["-m", "comment", "--comment", Partition.tag] + spec[target...]
        }
    }

    /// The comment on every rule this process puts in place. Should the process die before it
    /// heals a cut (killed by a timeout, or by hand), `scripts/clear-stale-cuts`, run before each
    /// test command, finds the rule by it and removes it: left in place, it would go on dropping
    /// whatever later uses the port, a client's source port among them.
    static let tag = "presence-test-\(getpid())"

    /// Dropping while the cut lasts.
    private let cutRules: [Rule]
    /// In place from ``prepare()`` to ``remove()``: what the cut rules need to find the node's
    /// connections.
    private let standingRules: [Rule]
    /// The node's own address for Redis, for a cut by address.
    let address: String?
    /// The group id the node must run with, for a cut by owner.
    let group: UInt32?

    /// Root, and an iptables that can read its INPUT chain (a kernel with netfilter).
    static let available: Bool = getuid() == 0 && (try? iptables(["-L", "INPUT", "-n"])) != nil

    /// A node that reaches Redis (on `port`) at an address of its own: its packets are those to
    /// or from that address.
    init(port: Int, address: String = "127.0.0.2") {
        cutRules = [
            Rule(spec: ["INPUT", "-p", "tcp", "-d", address, "--dport", "\(port)", "-j", "DROP"]),
            Rule(spec: ["INPUT", "-p", "tcp", "-s", address, "--sport", "\(port)", "-j", "DROP"]),
        ]
        standingRules = []
        self.address = address
        group = nil
    }

    /// A node that runs with group id `group` (``GatewayProcess``'s `group`) and reaches Redis
    /// on `ports` (a cluster's nodes all announce 127.0.0.1, so addresses cannot tell the node
    /// apart). Its connections to those ports are marked when they open (conntrack keeps the
    /// mark); the cut drops what the node sends to them and whatever comes back on a marked
    /// connection.
    init(group: UInt32, ports: [Int]) {
        let ports = ports.map(String.init).joined(separator: ",")
        let mark = String(format: "0x%x", group)
        let owned = ["OUTPUT", "-p", "tcp", "-m", "owner", "--gid-owner", "\(group)", "-m", "multiport", "--dports", ports]
        standingRules = [Rule(table: "mangle", spec: owned + ["-j", "CONNMARK", "--set-mark", mark])]
        address = nil
        self.group = group
        cutRules = [
            Rule(spec: owned + ["-j", "DROP"]),
            Rule(spec: ["INPUT", "-p", "tcp", "-m", "connmark", "--mark", mark, "-j", "DROP"]),
        ]
    }

    /// Puts the standing rules in place; call before the node connects.
    func prepare() throws {
        for rule in standingRules { try Self.iptables(["-t", rule.table, "-A"] + rule.tagged) }
    }

    /// Starts dropping the packets.
    func cut() throws {
        for rule in cutRules { try Self.iptables(["-t", rule.table, "-I"] + rule.tagged) }
    }

    /// Stops dropping them (each rule removed once; removing a missing rule does nothing).
    func heal() {
        Self.delete(cutRules)
    }

    /// Heals, and takes the standing rules away.
    func remove() {
        heal()
        Self.delete(standingRules)
    }

    private static func delete(_ rules: [Rule]) {
        for rule in rules {
            while (try? iptables(["-t", rule.table, "-C"] + rule.tagged)) != nil { try? iptables(["-t", rule.table, "-D"] + rule.tagged) }
        }
    }

    private static func iptables(_ arguments: [String]) throws {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/sbin/iptables")
        process.arguments = ["-w"] + arguments
        process.standardOutput = FileHandle.nullDevice
        process.standardError = FileHandle.nullDevice
        try process.run()
        process.waitUntilExit()
        guard process.terminationStatus == 0 else { throw GatewayProcessError("iptables \(arguments.joined(separator: " ")) exited \(process.terminationStatus)") }
    }
}
