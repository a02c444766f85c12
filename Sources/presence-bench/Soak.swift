import ArgumentParser
import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import PresenceEngine
import PresenceProtocol
import RedisClient

// MARK: - soak

struct SoakScenario: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "soak",
        abstract: "Random connect, status, typing, subscribe and disconnect churn over 2 nodes, then the checks: node memory flat, no session or subscription left, and only conversations and last seen left in Redis.",
        discussion: "Exits with status 1 when a check fails. Example: presence-bench soak --duration 600"
    )
    @OptionGroup var options: ScenarioOptions
    @Option(help: "Seconds of churn.") var duration = 600
    @Option(help: "Clients at once; each connects, does a few things, leaves, and starts over.") var clients = 60
    @Option(help: "Users the clients sign in as (10 to a conversation).") var users = 200
    @Option(help: "Seed of the random choices (default: random, printed).") var seed: UInt64?

    func run() async throws {
        guard duration >= 10, clients >= 1, users >= 10 else { throw BenchError("--duration must be at least 10, --clients at least 1, --users at least 10") }
        _ = raiseFileLimit()
        let seed = self.seed ?? UInt64.random(in: 0...UInt64(UInt32.max))
        print("soak: seed \(seed), \(duration) s, \(clients) clients, \(users) users")
        // Short TTLs, so that what a client leaves behind is due within seconds of the end.
        let nodes = try await NodeProcesses(count: 2, redisURL: options.common.redisURL, binary: options.gatewayBinary, environment: [
            "PRESENCE_VISIBILITY": "conversations", "PRESENCE_LINGER": "1", "PRESENCE_TYPING_TTL": "2", "PRESENCE_LEASE_TTL": "3",
            // Warnings kept, so that a key left over can be traced in what the nodes said.
            "PRESENCE_LOG_LEVEL": "warning",
        ])
        defer { nodes.stop() }
        let names = (0..<users).map { "soak-\($0)" }
        for start in stride(from: 0, to: users, by: 10) {
            let members = names[start..<min(start + 10, users)].map { "\"\($0)\"" }.joined(separator: ",")
            try await nodes.admin("PUT", "/api/admin/conversations/room-\(start / 10)", body: #"{"member_ids":[\#(members)]}"#)
        }
        let baseline = try await withRedis(options.common.redisURL) { try await RedisKeys.read($0, prefix: nodes.prefix) }

        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let tally = SoakTally()
        let started = ContinuousClock.now
        let deadline = started + .seconds(duration)
        var samples: [SoakSample] = []
        let sampleEvery = Duration.seconds(max(2, duration / 30))
        try await withThrowingTaskGroup(of: Void.self) { workers in
            for index in 0..<clients {
                workers.addTask {
                    var random = SplitMix(seed: seed &+ UInt64(index))
                    while ContinuousClock.now < deadline {
                        await self.oneSession(&random, names: names, nodes: nodes, group: group, tally: tally)
                    }
                }
            }
            while ContinuousClock.now < deadline {
                try await Task.sleep(for: min(sampleEvery, deadline - ContinuousClock.now))
                var sample = try await SoakSample.take(nodes: nodes, redisURL: options.common.redisURL, at: ContinuousClock.now - started)
                sample.sessionsOpened = tally.sessions
                samples.append(sample)
                progress("soak: \(Int(seconds(ContinuousClock.now - started)))/\(duration) s, \(tally.sessions) sessions so far, \(sample.sessions) open, node RSS \(sample.rss.map { $0 / 1_048_576 }) MiB, \(sample.keys) keys")
            }
            try await workers.waitForAll()
        }
        endProgress()
        try await group.shutdownGracefully()

        // Every client has gone. What they left is due within the linger, the typing TTL and a
        // reaper pass; wait for it, bounded.
        let settleStarted = ContinuousClock.now
        var end = try await SoakSample.take(nodes: nodes, redisURL: options.common.redisURL, at: .zero)
        var left = try await withRedis(options.common.redisURL) { try await RedisKeys.read($0, prefix: nodes.prefix) }
        while end.sessions > 0 || end.eventChannels > 0 || !left.transient.isEmpty || left.other != baseline.other,
              ContinuousClock.now - settleStarted < .seconds(30) {
            try await Task.sleep(for: .milliseconds(500))
            end = try await SoakSample.take(nodes: nodes, redisURL: options.common.redisURL, at: .zero)
            left = try await withRedis(options.common.redisURL) { try await RedisKeys.read($0, prefix: nodes.prefix) }
        }
        let settled = ContinuousClock.now - settleStarted

        // Memory: the first sample after a quarter of the run (warm) against the last. A node may
        // grow by 4 MiB, or by 2 KiB for each session it had since: a session that leaks its
        // connection (about 5 KiB) exceeds that, and the allocator's own drift does not.
        let warm = samples.first { $0.at >= .seconds(duration / 4) } ?? samples.first
        let last = samples.last
        let growth = zip(warm?.rss ?? [], last?.rss ?? []).map { $1 - $0 }
        let sessionsPerNode = (tally.sessions - (warm?.sessionsOpened ?? 0)) / max(1, nodes.ports.count)
        let allowance = max(4 * 1_048_576, 2048 * sessionsPerNode)
        let flat = growth.allSatisfy { $0 <= allowance }
        let perSession = growth.map { sessionsPerNode > 0 ? $0 / sessionsPerNode : 0 }
        let noSessions = end.sessions == 0
        let noSubscriptions = end.eventChannels == 0
        let keysBack = left.transient.isEmpty && left.other == baseline.other
        try report("soak: \(duration) s of churn over 2 nodes, seed \(seed)", [
            ("sessions opened / frames sent / errors", "\(tally.sessions) / \(tally.frames) / \(tally.errorSummary)"),
            ("node RSS warm → end", "\(warm?.rss.map { $0 / 1_048_576 } ?? []) → \(last?.rss.map { $0 / 1_048_576 } ?? []) MiB: \(flat ? "flat" : "GROWING") (\(perSession) bytes per session over \(sessionsPerNode) sessions a node; allowed \(allowance / 1024) KiB)"),
            ("sessions left after the clients went", noSessions ? "0" : "\(end.sessions) LEAKED"),
            ("user and conversation channels still subscribed", noSubscriptions ? "0" : "\(end.eventChannels) LEAKED"),
            ("Redis keys before / after", "\(baseline.total) / \(left.total) (last seen of \(left.lastSeen) users kept)"),
            ("keys that should be gone", left.transient.isEmpty ? "none" : "\(left.transient.count) LEFT: \(left.transient.prefix(5))"),
            ("settled in", String(format: "%.1f s", seconds(settled))),
        ], json: [
            "scenario": "soak", "seed": seed, "duration": duration, "clients": clients, "users": users,
            "sessions": tally.sessions, "frames": tally.frames, "errors": tally.errors,
            "rss_samples": samples.map { ["at_s": seconds($0.at), "rss_bytes": $0.rss, "sessions": $0.sessions, "keys": $0.keys] },
            "memory_flat": flat, "memory_growth_bytes": growth, "memory_growth_bytes_per_session": perSession, "sessions_left": end.sessions, "channels_left": end.eventChannels,
            "keys_before": baseline.total, "keys_after": left.total, "transient_keys_left": left.transient.count,
            "keys_back_to_baseline": keysBack,
        ], to: options.json)
        if !left.transient.isEmpty {
            try await explainLeftovers(left.transient.prefix(5), nodes: nodes)
        }
        guard flat, noSessions, noSubscriptions, keysBack else { throw ExitCode(1) }
    }

    /// Whether `line` names `user` (as a whole id: `soak-15` is not in `soak-152`).
    static func mentions(_ line: Substring, _ user: String) -> Bool {
        var rest = line[...]
        while let found = rest.range(of: user) {
            if found.upperBound == rest.endIndex || !rest[found.upperBound].isNumber { return true }
            rest = rest[found.upperBound...]
        }
        return false
    }

    /// Prints what each key left over holds, whether the indexes a reaper goes by name it, and
    /// what the nodes logged about its user: enough to tell a device held by a session that is
    /// gone from a linger nobody looks at.
    private func explainLeftovers(_ leftover: ArraySlice<String>, nodes: NodeProcesses) async throws {
        let keys = PresenceKeys(prefix: nodes.prefix)
        print("\nwhat the keys left over hold:")
        try await withRedis(options.common.redisURL) { redis in
            for key in leftover {
                let ttl = try await redis.execute(PTTL(key: key))
                print("  \(key) (expires in \(ttl.map { "\($0) ms" } ?? "-"))")
                guard key.hasSuffix(":devices"), let user = keys.user(fromKey: key, suffix: "devices") else { continue }
                let now = try await redis.execute(TIME()) / 1000
                for (device, record) in try await redis.execute(HGETALL(key: key)) {
                    let member = keys.deviceMember(user: user, device: device)
                    let deadline = try await redis.execute(ZSCORE(key: keys.deadlines(ofUser: user), member: member))
                    var indexed: [String] = []
                    for node in nodes.nodeIDs where try await redis.execute(SISMEMBER(key: keys.nodeDevices(node), member: member)) {
                        indexed.append(node)
                    }
                    print("    \(device) = \(record) (status|node|session|since|deadline|alive; Redis now \(now)); deadline index \(deadline.map { String(Int64($0)) } ?? "none"), node index \(indexed)")
                }
                for index in nodes.ports.indices {
                    let lines = nodes.output(node: index).split(separator: "\n").filter { Self.mentions($0, user) }
                    print("    \(nodes.nodeIDs[index]) logged \(lines.count) lines about \(user)\(lines.isEmpty ? "" : ":")")
                    for line in lines.suffix(10) { print("      \(line)") }
                }
            }
        }
    }

    /// One client's visit: connect to a random node as a random user and device, do one to eight
    /// random things, and leave in one of three ways.
    private func oneSession(_ random: inout SplitMix, names: [String], nodes: NodeProcesses, group: any EventLoopGroup, tally: SoakTally) async {
        let index = random.below(names.count)
        let user = names[index]
        let room = "room-\(index / 10)"
        let path: String
        let socket: BenchSocket
        do {
            path = try await nodes.path(user: user, device: "d\(random.below(3))")
            socket = try await BenchSocket.connect(port: nodes.ports[random.below(2)], path: path, group: group) { text in
                tally.received(text)
            }
        } catch {
            tally.failedConnect()
            try? await Task.sleep(for: .milliseconds(100))
            return
        }
        tally.opened()
        for _ in 0..<(1 + random.below(8)) {
            let frame: ClientFrame
            switch random.below(6) {
            case 0: frame = .status(PresenceStatus.allCases[random.below(3)])
            case 1: frame = .typing(conversationID: room, isTyping: true)
            case 2: frame = .typing(conversationID: room, isTyping: false)
            case 3: frame = .subscribe(.conversation(room))
            case 4: frame = .subscribe(.users([names[random.below(names.count)], names[random.below(names.count)]]))
            default: frame = .ping
            }
            socket.send(clientText(frame))
            tally.sent()
            try? await Task.sleep(for: .milliseconds(50 + random.below(350)))
        }
        switch random.below(10) {
        case 0..<5: await socket.closeNormally()
        case 5..<8: socket.abort()
        default:
            socket.send(clientText(.status(.offline)))
            await socket.closeNormally()
        }
    }
}

/// What the soak's clients did and heard.
final class SoakTally: Sendable {
    private let state = NIOLockedValueBox((sessions: 0, frames: 0, failedConnects: 0, errors: [String: Int]()))

    var sessions: Int { state.withLockedValue { $0.sessions } }
    var frames: Int { state.withLockedValue { $0.frames } }
    var errors: [String: Int] { state.withLockedValue { $0.errors.merging(["connect": $0.failedConnects]) { $0 + $1 } } }
    var errorSummary: String {
        let errors = self.errors.filter { $0.value > 0 }
        return errors.isEmpty ? "none" : errors.sorted { $0.key < $1.key }.map { "\($0.key) \($0.value)" }.joined(separator: ", ")
    }

    func opened() { state.withLockedValue { $0.sessions += 1 } }
    func sent() { state.withLockedValue { $0.frames += 1 } }
    func failedConnect() { state.withLockedValue { $0.failedConnects += 1 } }

    /// Counts `error` frames by code (rate limits are expected: the clients do not pace typing).
    func received(_ text: String) {
        guard case .error(let error) = serverFrame(text) else { return }
        state.withLockedValue { $0.errors[error.code.rawValue, default: 0] += 1 }
    }
}

/// One look at the nodes and Redis during the soak.
struct SoakSample {
    var at: Duration
    var rss: [Int]
    /// Open sessions on both nodes (`presence_sessions`).
    var sessions: Int
    /// Subscribed user and conversation event channels (the nodes' control channels left out).
    var eventChannels: Int
    var keys: Int
    /// Sessions the clients had opened by then.
    var sessionsOpened = 0

    static func take(nodes: NodeProcesses, redisURL: String, at: Duration) async throws -> SoakSample {
        var sessions = 0
        for index in nodes.ports.indices {
            let metrics = await nodes.get("/metrics", node: index) ?? ""
            let line = metrics.split(separator: "\n").first { $0.hasPrefix("presence_sessions ") }
            sessions += line.flatMap { Double($0.split(separator: " ").last ?? "") }.map { Int($0) } ?? 0
        }
        let (channels, keys) = try await withRedis(redisURL) { redis in
            let channels = try await redis.execute(PUBSUBCHANNELS(pattern: "\(nodes.prefix):*"))
            let keys = try await RedisKeys.read(redis, prefix: nodes.prefix).total
            return (channels.filter { $0.hasSuffix(":events") }.count, keys)
        }
        return SoakSample(at: at, rss: nodes.ports.indices.map { nodes.residentBytes($0) }, sessions: sessions, eventChannels: channels, keys: keys)
    }
}

/// The keys under a prefix, by what they hold.
struct RedisKeys {
    var total = 0
    /// Users' `state` keys: their last seen, kept for good.
    var lastSeen = 0
    /// Keys that exist only while someone is live or typing: devices, typing states, deadlines.
    var transient: [String] = []
    /// Everything else: conversations, memberships, the nodes' registry.
    var other = 0

    static func read(_ redis: RedisClient, prefix: String) async throws -> RedisKeys {
        var keys = RedisKeys()
        var cursor = "0"
        repeat {
            let page = try await redis.execute(SCAN(cursor: cursor, matching: "\(prefix):*", count: 1000))
            cursor = page.cursor
            for key in page.keys {
                keys.total += 1
                if key.hasPrefix("\(prefix):{u:") && key.hasSuffix(":state") {
                    keys.lastSeen += 1
                } else if key.hasSuffix(":devices") || key.hasSuffix(":typing") || key.hasSuffix(":deadlines") || key.hasSuffix(":typing_deadlines") {
                    keys.transient.append(key)
                } else {
                    keys.other += 1
                }
            }
        } while cursor != "0"
        return keys
    }
}

/// A small seeded generator (splitmix64), so that a run's choices can be replayed (its timing
/// cannot): a soak's, a reconnect storm's memberships and jitter.
struct SplitMix: RandomNumberGenerator {
    private var state: UInt64
    init(seed: UInt64) { state = seed }

    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }

    /// A number in 0..<bound.
    mutating func below(_ bound: Int) -> Int { Int(next() % UInt64(bound)) }
}
