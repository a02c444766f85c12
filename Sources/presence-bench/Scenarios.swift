import ArgumentParser
import Foundation
import Logging
import NIOConcurrencyHelpers
import PresenceProtocol
import RedisClient
import RedisTestSupport

/// Options of the scenarios that run node processes.
struct ScenarioOptions: ParsableArguments {
    @OptionGroup var common: CommonOptions
    @Option(help: "The presence-gateway binary (default: beside presence-bench).") var gatewayBinary: String?
    @Option(help: "Also write the results as JSON to this file.") var json: String?
    @Option(help: "Event-loop threads of the load generator's WebSocket clients.") var threads = 1
}

/// Runs `body` with a Redis client on `url`.
func withRedis<T: Sendable>(_ url: String, _ body: (RedisClient) async throws -> T) async throws -> T {
    var logger = Logger(label: "presence-bench")
    logger.logLevel = .warning
    return try await RedisClient.withClient(configuration: try RedisConfiguration(url: url), logger: logger) { try await body($0) }
}

/// A field of `INFO section`, as a number.
func redisInfo(_ redis: RedisClient, _ section: String, _ field: String) async throws -> Double {
    let text = try await redis.execute(INFO(section: section))
    for line in text.split(whereSeparator: \.isNewline) where line.hasPrefix(field + ":") {
        return Double(line.dropFirst(field.count + 1)) ?? 0
    }
    return 0
}

/// Total calls of every command since the last `CONFIG RESETSTAT` (INFO commandstats).
func commandCalls(_ redis: RedisClient) async throws -> Double {
    try await callsByCommand(redis).values.reduce(0, +)
}

/// Calls of each command since the last `CONFIG RESETSTAT` (INFO commandstats), by name
/// (`evalsha`, `publish`; a script's own commands count under theirs).
func callsByCommand(_ redis: RedisClient) async throws -> [String: Double] {
    let text = try await redis.execute(INFO(section: "commandstats"))
    var calls: [String: Double] = [:]
    for line in text.split(whereSeparator: \.isNewline) where line.hasPrefix("cmdstat_") {
        let fields = line.dropFirst("cmdstat_".count).split(separator: ":", maxSplits: 1)
        guard fields.count == 2, let count = fields[1].split(separator: ",").first?.split(separator: "=").last else { continue }
        calls[String(fields[0]), default: 0] += Double(count) ?? 0
    }
    return calls
}

// MARK: - 2. churn

struct ChurnScenario: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "churn",
        abstract: "Status changes at a fixed rate on node A, watched on node B: latency to presence_update beside the Redis PUBLISH→SUBSCRIBE floor."
    )
    @OptionGroup var options: ScenarioOptions
    @Option(help: "Changes per second.") var rate = 1_000
    @Option(help: "Seconds to measure.") var duration = 10
    @Option(help: "Users changing, one session each on node A (default: rate/4, so that each stays under the gateway's 5 status changes/s per session).") var users: Int?

    func run() async throws {
        let users = self.users ?? max(10, rate / 4)
        guard Double(rate) / Double(users) <= 5 else {
            throw BenchError("\(rate) changes/s over \(users) users is more than the gateway's 5 status changes/s per session: use --users \(rate / 4) or more")
        }
        _ = raiseFileLimit()
        let nodes = try await NodeProcesses(count: 2, redisURL: options.common.redisURL, binary: options.gatewayBinary,
                                            environment: ["PRESENCE_LOG_LEVEL": "error"])
        defer { nodes.stop() }
        let fleet = Fleet(nodes: nodes, threads: options.threads)
        let names = (0..<users).map { "churn-\($0)" }
        let pending = NIOLockedValueBox<[String: ContinuousClock.Instant]>([:])
        let latency = LatencyRecorder()
        let ready = FrameCounter()
        let watcher = try await fleet.connect([("churn-watcher", "w", 1)], label: "churn") { _, text in
            switch serverFrame(text) {
            case .initialState:
                ready.add(0)
            case .presenceUpdate(let presence):
                let now = ContinuousClock.now
                if let sent = pending.withLockedValue({ $0.removeValue(forKey: "\(presence.userID)/\(presence.status.rawValue)") }) { latency.record(now - sent) }
            default:
                break
            }
        }[0]
        let senders = try await fleet.connect(names.map { ($0, "d", 0) }, label: "churn") { _, _ in }
        watcher.send(clientText(.subscribe(.users(names)), id: "s"))
        _ = await ready.wait(for: 2, timeout: .seconds(30))
        try await Task.sleep(for: .seconds(1))

        var away = [Bool](repeating: false, count: users)
        let total = rate * duration
        let interval = Duration.seconds(1) / rate
        let start = ContinuousClock.now
        for change in 0..<total {
            let index = change % users
            away[index].toggle()
            let status: PresenceStatus = away[index] ? .away : .online
            pending.withLockedValue { $0["\(names[index])/\(status.rawValue)"] = ContinuousClock.now }
            senders[index].send(clientText(.status(status)))
            if change % rate == 0 { progress("churn: \(change)/\(total) changes") }
            try await Task.sleep(until: start + interval * (change + 1))
        }
        try await Task.sleep(for: .seconds(2))
        endProgress()
        let floor = try await publishFloor(redisURL: options.common.redisURL, rate: rate, count: min(total, 10_000))
        let lost = pending.withLockedValue { $0.count }
        let ratio = latency.milliseconds(99) / max(floor.milliseconds(99), 0.001)
        try report("churn: \(rate) changes/s for \(duration) s, \(users) users on node A, one watcher on node B", [
            ("change → presence_update", latency.line),
            ("Redis PUBLISH → SUBSCRIBE floor", floor.line),
            ("p99 over the floor's p99", String(format: "%.1f×", ratio)),
            ("changes without an update", "\(lost) of \(total)"),
        ], json: ["scenario": "churn", "rate": rate, "duration": duration, "latency": latency.summary, "floor": floor.summary,
                  "p99_ratio": ratio, "lost": lost, "changes": total], to: options.json)
        await fleet.shutdown()
    }
}

/// The floor: PUBLISH on one connection to the message on a subscriber, at `rate`.
func publishFloor(redisURL: String, rate: Int, count: Int) async throws -> LatencyRecorder {
    let recorder = LatencyRecorder()
    var logger = Logger(label: "presence-bench")
    logger.logLevel = .warning
    let configuration = try RedisConfiguration(url: redisURL)
    let subscriber = RedisSubscriber(configuration: configuration, logger: logger)
    let sent = NIOLockedValueBox<[Int: ContinuousClock.Instant]>([:])
    let channel = "bench-floor-\(UInt32.random(in: 0...UInt32.max))"
    try await withRedis(redisURL) { redis in
        try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask { try await subscriber.run() }
            group.addTask {
                for await event in subscriber.events {
                    guard case .message(_, let payload) = event, let index = Int(String(decoding: payload, as: UTF8.self)) else { continue }
                    let now = ContinuousClock.now
                    if let at = sent.withLockedValue({ $0.removeValue(forKey: index) }) { recorder.record(now - at) }
                    if index == count - 1 { return }
                }
            }
            try await subscriber.waitUntilConnected()
            try await subscriber.subscribe([channel])
            let interval = Duration.seconds(1) / rate
            let start = ContinuousClock.now
            for index in 0..<count {
                sent.withLockedValue { $0[index] = ContinuousClock.now }
                _ = try await redis.execute(Publish(Array("\(index)".utf8), on: channel, mode: .classic))
                try await Task.sleep(until: start + interval * (index + 1))
            }
            try await Task.sleep(for: .milliseconds(500))
            subscriber.shutdown()
            group.cancelAll()
        }
    }
    return recorder
}

/// `subscribe` frames for `users`, 500 ids each (the gateway's limit per frame).
func subscribeFrames(_ users: [String]) -> [String] {
    stride(from: 0, to: users.count, by: 500).map { start in
        clientText(.subscribe(.users(Array(users[start..<min(start + 500, users.count)]))), id: "s\(start)")
    }
}

/// Watcher sessions on `node` that watch `users` between them (at most 5,000 each, the
/// gateway's limit per session), and a counter of the updates they get by status. Returns once
/// every snapshot arrived.
func watchers(
    of users: [String], on node: Int, fleet: Fleet, label: String, onUpdate: @escaping @Sendable (String, String) -> Void
) async throws {
    let groups = stride(from: 0, to: users.count, by: 5_000).map { Array(users[$0..<min($0 + 5_000, users.count)]) }
    let snapshots = FrameCounter()
    let sockets = try await fleet.connect(groups.indices.map { ("\(label)-watcher-\($0)", "w", node) }, label: label) { _, text in
        switch serverFrame(text) {
        case .initialState: snapshots.add(0)
        case .presenceUpdate(let presence): onUpdate(presence.userID, presence.status.rawValue)
        default: break
        }
    }
    var expected = groups.count
    for (socket, group) in zip(sockets, groups) {
        let frames = subscribeFrames(group)
        expected += frames.count
        for frame in frames {
            socket.send(frame)
            try await Task.sleep(for: .milliseconds(210))  // under the 5/s subscribe rate
        }
    }
    guard await snapshots.wait(for: expected, timeout: .seconds(120)) else { throw BenchError("\(label): the watchers' snapshots did not all arrive") }
}

// MARK: - 3. connect storm

struct StormScenario: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "storm",
        abstract: "N devices connect as fast as they can to one node; connects/s until a watcher on another node has seen all of them online."
    )
    @OptionGroup var options: ScenarioOptions
    @Option(help: "Devices.") var devices = 5_000
    @Option(help: "Connections opened at once.") var concurrency = 256

    func run() async throws {
        _ = raiseFileLimit()
        let nodes = try await NodeProcesses(count: 2, redisURL: options.common.redisURL, binary: options.gatewayBinary)
        defer { nodes.stop() }
        let fleet = Fleet(nodes: nodes, threads: options.threads)
        let users = (0..<devices).map { "storm-\($0)" }
        let online = FrameCounter()
        try await watchers(of: users, on: 1, fleet: fleet, label: "storm") { _, status in
            if status == "online" { online.add(0) }
        }
        let start = ContinuousClock.now
        try await fleet.connect(users.map { ($0, "d", 0) }, concurrency: concurrency, label: "storm") { _, _ in }
        let opened = ContinuousClock.now - start
        let seen = await online.wait(for: devices, timeout: .seconds(120), label: "storm: online seen")
        let all = ContinuousClock.now - start
        let rate = Double(devices) / seconds(all)
        try report("storm: \(devices) devices connecting to node A, \(concurrency) at a time; watched from node B", [
            ("sessions open", String(format: "%.2f s (%.0f/s)", seconds(opened), Double(devices) / seconds(opened))),
            ("all seen online by the watcher", seen ? String(format: "%.2f s", seconds(all)) : "NO: \(online.count) of \(devices)"),
            ("connects/s until all seen online", String(format: "%.0f", rate)),
        ], json: ["scenario": "storm", "devices": devices, "open_seconds": seconds(opened), "all_seen": seen,
                  "seen_seconds": seconds(all), "connects_per_second": rate], to: options.json)
        await fleet.shutdown()
    }
}

// MARK: - 4. fan-out

struct FanoutScenario: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "fanout",
        abstract: "One user watched by N sessions over two nodes changes status; time until every watcher got the update, and deliveries/s."
    )
    @OptionGroup var options: ScenarioOptions
    @Option(help: "Watcher sessions (half on each node).") var watchers = 10_000
    @Option(help: "Status changes of the watched user.") var changes = 5

    func run() async throws {
        let limit = raiseFileLimit()
        guard limit > watchers + 500 else {
            throw BenchError("the open-file limit is \(limit) and cannot be raised further here; \(watchers) watchers need about \(watchers + 500)")
        }
        let nodes = try await NodeProcesses(count: 2, redisURL: options.common.redisURL, binary: options.gatewayBinary)
        defer { nodes.stop() }
        let fleet = Fleet(nodes: nodes, threads: options.threads)
        let received = FrameCounter()
        let latency = LatencyRecorder()
        // When the change being measured was sent; nil while none is (the star's own connect).
        let changedAt = NIOLockedValueBox<ContinuousClock.Instant?>(nil)
        let snapshots = FrameCounter()
        let sockets = try await fleet.connect((0..<watchers).map { ("fan-\($0)", "w", $0 % 2) }, label: "fanout") { index, text in
            switch serverFrame(text) {
            case .initialState:
                snapshots.add(index)
                return
            case .presenceUpdate(let presence) where presence.userID == "star": break
            default: return
            }
            if let sent = changedAt.withLockedValue({ $0 }) { latency.record(ContinuousClock.now - sent) }
            received.add(index)
        }
        for (index, socket) in sockets.enumerated() {
            socket.send(clientText(.subscribe(.users(["star"])), id: "s"))
            if index % 500 == 499 { try await Task.sleep(for: .milliseconds(10)) }
        }
        _ = await snapshots.wait(for: watchers * 2, timeout: .seconds(120), label: "fanout: snapshots")
        let star = try await fleet.connect([("star", "d", 0)], label: "fanout") { _, _ in }[0]
        _ = await received.wait(for: watchers, timeout: .seconds(60))
        var completions: [Double] = []
        // CPU time of the nodes and of this generator, over the changes only (each measured
        // change: from the status sent to the last watcher's frame).
        var nodeCPU = 0.0
        var generatorCPU = 0.0
        for change in 1...changes {
            try await Task.sleep(for: .seconds(1))
            let target = watchers * (change + 1)
            let (nodesBefore, generatorBefore) = (nodes.cpuSeconds, processorSeconds(pid: getpid()) ?? 0)
            changedAt.withLockedValue { $0 = ContinuousClock.now }
            let start = ContinuousClock.now
            star.send(clientText(.status(change % 2 == 1 ? .away : .online)))
            guard await received.wait(for: target, timeout: .seconds(60)) else { throw BenchError("fanout: only \(received.count) of \(target) updates arrived") }
            let elapsed = seconds(ContinuousClock.now - start)
            completions.append(elapsed * 1000)
            nodeCPU += nodes.cpuSeconds - nodesBefore
            generatorCPU += (processorSeconds(pid: getpid()) ?? 0) - generatorBefore
        }
        let sorted = completions.sorted()
        let deliveries = Double(watchers) / (percentile(sorted, 0.5) / 1000)
        let measured = completions.reduce(0, +) / 1000
        let perDelivery = nodeCPU / Double(watchers * changes) * 1_000_000
        await fleet.shutdown()
        // The kernel's part no gateway avoids, in the same run: a frame written to each of as
        // many loopback connections (at most 4,000) by a writer that does nothing else.
        let floor = try FloorMeasurement(connections: min(watchers, 4_000), rounds: 20, payload: 150, pause: 20)
        try report("fanout: one user watched by \(watchers) sessions over two nodes, \(changes) changes", [
            ("time until every watcher had it", String(format: "median %.1f ms, worst %.1f ms", percentile(sorted, 0.5), sorted.last ?? 0)),
            ("per-watcher latency (all changes)", latency.line),
            ("deliveries/s (median change)", String(format: "%.0f", deliveries)),
            ("node CPU per delivery", String(format: "%.1f µs (both nodes, %.2f s in %.2f s of changes)", perDelivery, nodeCPU, measured)),
            ("kernel floor per delivery", "\(floor.line); the nodes at " + String(format: "%.2f× the floor", perDelivery / max(floor.perDelivery.total, 0.001))),
            ("generator CPU", String(format: "%.2f s in %.2f s of changes (%.0f%% of one core; %d event-loop threads)",
                                     generatorCPU, measured, generatorCPU / max(measured, 0.001) * 100, options.threads)),
        ], json: ["scenario": "fanout", "watchers": watchers, "changes": changes, "completion_ms": completions,
                  "latency": latency.summary, "deliveries_per_second": deliveries, "node_cpu_us_per_delivery": perDelivery,
                  "generator_cpu_seconds": generatorCPU, "generator_threads": options.threads,
                  "floor_cpu_us_per_delivery": floor.perDelivery.total], to: options.json)
    }
}

// MARK: - 5. node death

struct DeathScenario: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "death",
        abstract: "kill -9 of a node holding N sessions: time until watchers on another node saw all of them offline, against the lease."
    )
    @OptionGroup var options: ScenarioOptions
    @Option(help: "Sessions on the node that dies.") var sessions = 2_000
    @Option(help: "PRESENCE_LEASE_TTL of the nodes, seconds.") var lease = 5

    func run() async throws {
        _ = raiseFileLimit()
        let nodes = try await NodeProcesses(count: 2, redisURL: options.common.redisURL, binary: options.gatewayBinary,
                                            environment: ["PRESENCE_LEASE_TTL": "\(lease)"])
        defer { nodes.stop() }
        let fleet = Fleet(nodes: nodes, threads: options.threads)
        let users = (0..<sessions).map { "doomed-\($0)" }
        let online = FrameCounter()
        let offline = FrameCounter()
        try await watchers(of: users, on: 1, fleet: fleet, label: "death") { _, status in
            if status == "online" { online.add(0) }
            if status == "offline" { offline.add(0) }
        }
        try await fleet.connect(users.map { ($0, "d", 0) }, label: "death") { _, _ in }
        guard await online.wait(for: sessions, timeout: .seconds(60)) else { throw BenchError("death: not every session was seen online") }
        try await Task.sleep(for: .seconds(1))
        let killedAt = ContinuousClock.now
        nodes.kill(0)
        let seen = await offline.wait(for: sessions, timeout: .seconds(Int64(lease * 3 + 10)), label: "death: offline seen")
        let detected = seconds(ContinuousClock.now - killedAt)
        try report("death: kill -9 of a node holding \(sessions) sessions, lease \(lease) s", [
            ("all seen offline by the watchers", seen ? String(format: "%.2f s after the kill", detected) : "NO: \(offline.count) of \(sessions)"),
            ("bound (lease + 1 s)", "\(lease + 1) s"),
        ], json: ["scenario": "death", "sessions": sessions, "lease_seconds": lease, "all_seen": seen,
                  "detected_seconds": detected], to: options.json)
        await fleet.shutdown()
    }
}

// MARK: - 6. Redis cost

struct CostScenario: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "cost",
        abstract: "Redis commands per idle device per minute, and per status change (INFO commandstats), with N devices on one node."
    )
    @OptionGroup var options: ScenarioOptions
    @Option(help: "Devices.") var devices = 1_000
    @Option(help: "Seconds of idleness observed.") var idleSeconds = 60
    @Option(help: "Status changes measured.") var changes = 1_000

    func run() async throws {
        _ = raiseFileLimit()
        let nodes = try await NodeProcesses(count: 1, redisURL: options.common.redisURL, binary: options.gatewayBinary)
        defer { nodes.stop() }
        let fleet = Fleet(nodes: nodes, threads: options.threads)
        let acks = FrameCounter()
        let sockets = try await fleet.connect((0..<devices).map { ("cost-\($0)", "d", 0) }, label: "cost") { index, text in
            if case .ack = serverFrame(text) { acks.add(index) }
        }
        try await Task.sleep(for: .seconds(2))
        let idle = try await withRedis(options.common.redisURL) { redis in
            try await redis.execute(CONFIGRESETSTAT())
            for second in 0..<idleSeconds {
                progress("cost: idle \(second)/\(idleSeconds) s")
                try await Task.sleep(for: .seconds(1))
            }
            endProgress()
            return try await commandCalls(redis) - 1  // the INFO itself
        }
        let perDeviceMinute = idle / Double(devices) / (Double(idleSeconds) / 60)
        let idlePerSecond = idle / Double(idleSeconds)
        let change = try await withRedis(options.common.redisURL) { redis in
            try await redis.execute(CONFIGRESETSTAT())
            let start = ContinuousClock.now
            for index in 0..<changes {
                sockets[index % devices].send(clientText(.status(index / devices % 2 == 0 ? .away : .online), id: "c"))
                if index % 100 == 99 { try await Task.sleep(for: .milliseconds(50)) }
            }
            _ = await acks.wait(for: changes, timeout: .seconds(60))
            // The node's background work (lease, reaper) during the changes is not theirs.
            let background = idlePerSecond * seconds(ContinuousClock.now - start)
            return max(0, try await commandCalls(redis) - 1 - background)
        }
        try report("cost: Redis commands with \(devices) devices on one node", [
            ("idle", String(format: "%.0f commands in %d s: %.4f per device per minute", idle, idleSeconds, perDeviceMinute)),
            ("per status change", String(format: "%.2f commands (%d changes; the idle rate subtracted)", change / Double(changes), changes)),
        ], json: ["scenario": "cost", "devices": devices, "idle_seconds": idleSeconds, "idle_commands": idle,
                  "commands_per_device_minute": perDeviceMinute, "commands_per_change": change / Double(changes)], to: options.json)
        await fleet.shutdown()
    }
}
