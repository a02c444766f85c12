import ArgumentParser
import Foundation
import NIOConcurrencyHelpers
import NIOCore
import PresenceClient
import PresenceEngine
import PresenceProtocol
import RedisClient
import RedisTestSupport

/// kill -9 of a node that holds every device, while their conversations get messages: each
/// device comes back on another node as the SDK would (its own `ClientLifecycle` and
/// `ReconnectBackoff` decide when and where) and catches up with `sync`. Measured: the share back
/// before the dead node's lease lapses, offline flickers that watchers saw, the time until each
/// device has caught up, messages lost, repeated or out of order, sessions closed by the nodes,
/// and Redis CPU per device caught up.
struct ReconnectStormScenario: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "reconnect-storm",
        abstract: "kill -9 of the node holding N devices while their conversations get messages: every device back on the other nodes with the SDK's backoff and caught up by sync; lost, repeated, flickers, 1008 closes, Redis CPU per device."
    )
    @OptionGroup var options: ScenarioOptions
    @Option(help: "Devices (one a user), all on the node that is killed.") var sessions = 10_000
    @Option(help: "Conversations each user is a member of.") var conversations = 20
    @Option(help: "Members of each conversation.") var members = 10
    @Option(help: "Messages a second over all conversations (in turn), from before the kill until every device caught up.") var rate = 1_000
    @Option(help: "Node processes; the first is killed, the others take the devices.") var nodes = 3
    @Option(help: "PRESENCE_LEASE_TTL of the nodes, seconds: the devices of the dead node go offline after it.") var lease = 10
    @Option(help: "Seconds within which every device must have caught up (the goal).") var catchUpWithin = 30
    @Option(help: "Seed of the memberships and of the devices' backoff jitter.") var seed: UInt64 = 1

    func validate() throws {
        guard sessions >= 2, members >= 2, members <= sessions, conversations >= 1 else {
            throw ValidationError("--sessions and --members at least 2, --members at most --sessions, --conversations at least 1")
        }
        guard (sessions * conversations) % members == 0, sessions % members == 0 else {
            throw ValidationError("--sessions must be a multiple of --members, so that each user is in exactly --conversations conversations")
        }
        guard nodes >= 2, rate >= 1, lease >= 2, catchUpWithin >= 1 else { throw ValidationError("--nodes at least 2, --rate at least 1, --lease at least 2, --catch-up-within at least 1") }
    }

    func run() async throws {
        let limit = raiseFileLimit()
        // A device's old socket is closed when its node dies: one socket a device, and the watchers'.
        guard limit > sessions + 1_000 else {
            throw BenchError("the open-file limit is \(limit); \(sessions) devices need about \(sessions + 1_000)")
        }
        let processes = try await NodeProcesses(count: nodes, redisURL: options.common.redisURL, binary: options.gatewayBinary,
                                                environment: ["PRESENCE_LEASE_TTL": "\(lease)"])
        defer { processes.stop() }
        let users = (0..<sessions).map { "rs-\($0)" }
        var random = SplitMix(seed: seed)
        // Each round puts every user in one conversation of `members`: `conversations` rounds.
        var rooms: [(id: String, members: [Int])] = []
        for round in 0..<conversations {
            let order = Array(0..<sessions).shuffled(using: &random)
            for start in stride(from: 0, to: sessions, by: members) { rooms.append(("rs-\(round)-\(start / members)", Array(order[start..<start + members]))) }
        }
        var roomsOf = [[Int]](repeating: [], count: sessions)
        for (index, room) in rooms.enumerated() { for user in room.members { roomsOf[user].append(index) } }
        let setup = try await BenchEngine.make(redisURL: options.common.redisURL, prefix: processes.prefix)
        try await setup.use { engine in
            try await withThrowingTaskGroup(of: Void.self) { tasks in
                for (index, room) in rooms.enumerated() {
                    if index >= 64 { try await tasks.next() }
                    tasks.addTask { _ = try await engine.setMembers(of: room.id, to: room.members.map { users[$0] }) }
                    if index % 1_000 == 999 { progress("reconnect-storm: conversations \(index + 1)/\(rooms.count)") }
                }
                try await tasks.waitForAll()
            }
        }
        endProgress()

        // Watchers on a node that lives: any `offline` of a device's user after the kill is a flicker.
        let fleet = Fleet(nodes: processes, threads: options.threads)
        let presence = NIOLockedValueBox(WatchedPresence())
        try await watchers(of: users, on: 1, fleet: fleet, label: "reconnect-storm") { user, status in
            presence.withLockedValue { $0.saw(user, status) }
        }
        let devices = StormDevices(
            users: users, rooms: rooms.map(\.id), roomsOf: roomsOf, nodes: processes, fleet: fleet, seed: seed &+ 1
        )
        try await devices.connectAll()
        guard await eventually(timeout: .seconds(120), { presence.withLockedValue { $0.online.count } == sessions && devices.syncedCount == sessions }) else {
            throw BenchError("reconnect-storm: \(presence.withLockedValue { $0.online.count }) of \(sessions) users seen online, \(devices.syncedCount) synced")
        }

        // Messages from here on: each conversation in turn, from its first member.
        let sender = StormSender(rooms: rooms.map { ($0.id, users[$0.members[0]]) }, rate: rate)
        let sending = Task { try await setup.use { engine in try await sender.run(engine) } }
        try await Task.sleep(for: .seconds(3))
        // Redis CPU at this load before the kill, to take from what the storm costs.
        let baselineWindow = 3.0
        let baseline = try await withRedis(options.common.redisURL) { redis in
            let before = try await redisCPU(redis)
            try await Task.sleep(for: .seconds(baselineWindow))
            return (try await redisCPU(redis) - before) / baselineWindow
        }
        let cpuBefore = try await withRedis(options.common.redisURL) { try await redisCPU($0) }
        presence.withLockedValue { $0.killed = true }
        let killedAt = ContinuousClock.now
        devices.noteKill(at: killedAt)
        processes.kill(0)
        let bound = Duration.seconds(max(catchUpWithin, lease) + 30)
        _ = await eventually(timeout: bound, poll: .milliseconds(100)) {
            progress("reconnect-storm: \(devices.backCount) back, \(devices.caughtUpCount) caught up of \(sessions)")
            return devices.caughtUpCount == sessions
        }
        let stormSeconds = seconds(ContinuousClock.now - killedAt)
        let cpuAfter = try await withRedis(options.common.redisURL) { try await redisCPU($0) }
        // The messages stop; every device must end with every one of its conversations' messages.
        sender.stop()
        let sent = try await sending.value
        let finalSeqs = sender.lastSeqs
        _ = await eventually(timeout: .seconds(30), poll: .milliseconds(200)) { devices.lost(finalSeqs) == 0 }
        endProgress()
        let result = devices.summary(finalSeqs, killedAt: killedAt)
        let flickers = presence.withLockedValue { $0.offlineAfterKill }
        await fleet.shutdown()

        let back = result.backSeconds.sorted()
        let caught = result.caughtUpSeconds.sorted()
        let backBeforeLease = back.filter { $0 < Double(lease) }.count
        let share = Double(backBeforeLease) / Double(sessions)
        let stormCPU = cpuAfter - cpuBefore - baseline * stormSeconds
        let perDevice = stormCPU / Double(max(1, caught.count)) * 1_000_000
        func line(_ values: [Double]) -> String {
            String(format: "p50 %.2f s, p99 %.2f s, max %.2f s (n=%d)", percentile(values, 0.5), percentile(values, 0.99), values.last ?? .nan, values.count)
        }
        let failures = [
            result.lost > 0 ? "\(result.lost) messages lost" : nil,
            result.repeated > 0 ? "\(result.repeated) repeated" : nil,
            result.closeCodes[1008, default: 0] > 0 ? "\(result.closeCodes[1008, default: 0]) sessions closed with 1008" : nil,
            caught.count < sessions ? "\(sessions - caught.count) devices never caught up" : nil,
        ].compactMap { $0 }
        try report("reconnect-storm: \(sessions) devices, each in \(conversations) conversations of \(members), \(rate) messages/s; node 0 of \(nodes) killed (lease \(lease) s)", [
            ("back on another node (from the kill)", line(back)),
            ("back before the lease lapsed", String(format: "%d of %d (%.2f%%; goal ≥ 99%%)", backBeforeLease, sessions, share * 100)),
            ("offline flickers seen by watchers", "\(flickers)"),
            ("caught up (from the kill)", line(caught) + String(format: "; %d within %d s (goal: all)", caught.filter { $0 <= Double(catchUpWithin) }.count, catchUpWithin)),
            ("messages", String(format: "%d sent (%.0f/s asked %d/s); %d lost, %d repeated", sent.count, sent.perSecond, rate, result.lost, result.repeated)),
            ("gaps a sync named missing (for REST)", "\(result.named) seqs; \(result.early) live messages came ahead of them"),
            ("sessions closed by a node", result.closeCodes.isEmpty ? "none" : result.closeCodes.sorted { $0.key < $1.key }.map { "\($0.value) with \($0.key)" }.joined(separator: ", ")),
            ("syncs refused for the budget", "\(result.refusedSyncs)"),
            ("Redis CPU per device caught up", String(format: "%.0f µs (%.2f s in the %.1f s storm less %.2f/s before the kill)", perDevice, cpuAfter - cpuBefore, stormSeconds, baseline)),
        ], json: [
            "scenario": "reconnect-storm", "sessions": sessions, "conversations": conversations, "members": members, "rate": rate, "nodes": nodes,
            "lease_seconds": lease, "back_p50_s": percentile(back, 0.5), "back_p99_s": percentile(back, 0.99), "back_max_s": back.last ?? -1,
            "back_before_lease": backBeforeLease, "back_before_lease_share": share, "flickers": flickers,
            "caught_up_p50_s": percentile(caught, 0.5), "caught_up_p99_s": percentile(caught, 0.99), "caught_up_max_s": caught.last ?? -1,
            "caught_up": caught.count, "messages_sent": sent.count, "messages_per_second": sent.perSecond, "lost": result.lost,
            "repeated": result.repeated, "named_missing": result.named, "early": result.early, "closed_1008": result.closeCodes[1008, default: 0],
            "closed": Dictionary(uniqueKeysWithValues: result.closeCodes.map { ("\($0.key)", $0.value) }),
            "refused_syncs": result.refusedSyncs, "redis_cpu_us_per_device": perDevice,
        ], to: options.json)
        _ = try? await setup.use { engine in for room in rooms { _ = try await engine.deleteConversation(room.id) } }
        guard failures.isEmpty else { throw BenchError("reconnect-storm: " + failures.joined(separator: "; ")) }
    }
}

/// Redis's CPU seconds so far (user and system).
func redisCPU(_ redis: RedisClient) async throws -> Double {
    try await redisInfo(redis, "cpu", "used_cpu_user") + redisInfo(redis, "cpu", "used_cpu_sys")
}

/// What the watchers saw: who is online, and each `offline` after the kill.
private struct WatchedPresence {
    var online: Set<String> = []
    var killed = false
    var offlineAfterKill = 0

    mutating func saw(_ user: String, _ status: String) {
        if status == "offline" {
            online.remove(user)
            if killed { offlineAfterKill += 1 }
        } else {
            online.insert(user)
        }
    }
}

/// Messages into every conversation in turn at a steady rate through the engine, as the
/// conversations' other devices would send them; remembers each conversation's last seq.
private final class StormSender: Sendable {
    let rooms: [(id: String, sender: String)]
    let rate: Int
    private let state = NIOLockedValueBox((stopped: false, last: [String: Int64]()))

    init(rooms: [(id: String, sender: String)], rate: Int) {
        self.rooms = rooms
        self.rate = rate
    }

    func stop() { state.withLockedValue { $0.stopped = true } }

    var lastSeqs: [String: Int64] { state.withLockedValue { $0.last } }

    /// Sends until stopped, at most 64 at a time; returns how many and at what rate.
    func run(_ engine: PresenceEngine) async throws -> (count: Int, perSecond: Double) {
        let started = ContinuousClock.now
        let interval = Duration.seconds(1) / rate
        var count = 0
        try await withThrowingTaskGroup(of: (String, Int64).self) { tasks in
            var inFlight = 0
            while !state.withLockedValue({ $0.stopped }) {
                let room = rooms[count % rooms.count]
                let number = count
                if inFlight >= 64, let (id, seq) = try await tasks.next() {
                    inFlight -= 1
                    record(id, seq)
                }
                tasks.addTask {
                    let stored = try await engine.send(OutgoingMessage(clientMessageID: "s\(number)", text: "storm \(number)"), to: room.id, from: room.sender)
                    return (room.id, stored.message.seq)
                }
                inFlight += 1
                count += 1
                try await Task.sleep(until: started + interval * count)
            }
            for try await (id, seq) in tasks { record(id, seq) }
        }
        return (count, Double(count) / max(seconds(ContinuousClock.now - started), 0.001))
    }

    private func record(_ room: String, _ seq: Int64) {
        state.withLockedValue { $0.last[room] = max($0.last[room] ?? 0, seq) }
    }
}


/// The devices of a reconnect storm: one session each, reopened after a drop as the SDK decides
/// (`ClientLifecycle.closed`, `ReconnectBackoff` with its jitter), each URL list starting with
/// node 0 and going on to the other nodes in a turn of its own, as a balancer would spread them.
/// On each `initial_state` a device syncs all its conversations from the last seq it has, and
/// again while a `synced` says `more`; live messages are checked once and in order.
private final class StormDevices: Sendable {
    private struct Device {
        var generation = 0
        var socket: BenchSocket?
        /// The generation whose socket closed before it was stored.
        var closedEarly: (generation: Int, code: UInt16?)?
        var openedEarly = false
        var lifecycle = ClientLifecycle()
        var backoff = ReconnectBackoff()
        var random: SplitMix
        var urls: [Int]
        var urlIndex = 0
        /// Per conversation: the seq up to which every one was received (or named missing), and
        /// those received past it.
        var last: [Int: Int64] = [:]
        var ahead: [Int: Set<Int64>] = [:]
        /// Per conversation: the highest seq the current session was sent.
        var sessionLast: [Int: Int64] = [:]
        var epochs: [Int: String] = [:]
        var syncing: Set<Int> = []
        var again: Set<Int> = []
        var synced = false
        var backAt: ContinuousClock.Instant?
        var caughtUpAt: ContinuousClock.Instant?

        enum Arrival { case next, repeated, early }

        /// A message of `room` received: the next one, one seen before, or one past a gap (a live
        /// message ahead of what a sync is still to give or name).
        mutating func take(_ seq: Int64, in room: Int) -> Arrival {
            // A seq at or below one this session was sent is a repeat; one an earlier session
            // was sent may come again on this one (the SDK keeps it once).
            if seq <= (sessionLast[room] ?? 0) { return .repeated }
            sessionLast[room] = seq
            let at = last[room] ?? 0
            if seq <= at || ahead[room]?.contains(seq) == true { return .next }
            guard seq == at + 1 else {
                ahead[room, default: []].insert(seq)
                return .early
            }
            advance(room, to: seq)
            return .next
        }

        /// Seqs a `synced` named missing: counted as held; returns how many were not.
        mutating func name(_ seqs: ClosedRange<Int64>, in room: Int) -> Int {
            var named = 0
            for seq in seqs where seq > (last[room] ?? 0) && ahead[room]?.contains(seq) != true {
                ahead[room, default: []].insert(seq)
                named += 1
            }
            advance(room, to: last[room] ?? 0)
            return named
        }

        private mutating func advance(_ room: Int, to seq: Int64) {
            var top = seq
            while ahead[room]?.remove(top + 1) != nil { top += 1 }
            last[room] = top
        }
    }

    private struct State {
        var devices: [Device]
        var killedAt: ContinuousClock.Instant?
        var shuttingDown = false
        var repeated = 0
        var early = 0
        var named = 0
        var closeCodes: [UInt16: Int] = [:]
        var refusedSyncs = 0
        var syncRequests = 0
    }

    let users: [String]
    let rooms: [String]
    let roomsOf: [[Int]]
    let roomIndex: [String: Int]
    let nodes: NodeProcesses
    let fleet: Fleet
    private let state: NIOLockedValueBox<State>
    private let paths: NIOLockedValueBox<[String]> = NIOLockedValueBox([])

    init(users: [String], rooms: [String], roomsOf: [[Int]], nodes: NodeProcesses, fleet: Fleet, seed: UInt64) {
        self.users = users
        self.rooms = rooms
        self.roomsOf = roomsOf
        roomIndex = Dictionary(uniqueKeysWithValues: rooms.enumerated().map { ($0.element, $0.offset) })
        self.nodes = nodes
        self.fleet = fleet
        let others = Array(1..<nodes.ports.count)
        state = NIOLockedValueBox(State(devices: users.indices.map { index in
            let turn = index % others.count
            return Device(random: SplitMix(seed: seed &+ UInt64(index) &* 0x9E37_79B9), urls: [0] + others[turn...] + others[..<turn])
        }))
    }

    var syncedCount: Int { state.withLockedValue { $0.devices.count { $0.synced } } }
    var backCount: Int { state.withLockedValue { $0.devices.count { $0.backAt != nil } } }
    var caughtUpCount: Int { state.withLockedValue { $0.devices.count { $0.caughtUpAt != nil } } }

    func noteKill(at instant: ContinuousClock.Instant) { state.withLockedValue { $0.killedAt = instant } }

    /// Opens every device's first session on node 0, 128 at a time.
    func connectAll() async throws {
        var signed: [String] = []
        for user in users { signed.append(try await nodes.path(user: user, device: "d")) }
        paths.withLockedValue { $0 = signed }
        await withTaskGroup(of: Void.self) { tasks in
            for index in users.indices {
                if index >= 128 { await tasks.next() }
                tasks.addTask { await self.attempt(index) }
                if index % 500 == 499 { progress("reconnect-storm: \(index + 1)/\(self.users.count) devices connecting") }
            }
        }
        endProgress()
    }

    /// One attempt to open a session of device `index` at its current URL.
    private func attempt(_ index: Int) async {
        let (generation, node) = state.withLockedValue { state in
            state.devices[index].generation += 1
            let device = state.devices[index]
            return (device.generation, device.urls[device.urlIndex % device.urls.count])
        }
        let path = paths.withLockedValue { $0[index] }
        do {
            let socket = try await BenchSocket.connect(
                port: nodes.ports[node], path: path, source: "127.0.0.\(node == 0 ? 2 : 3)", group: fleet.group,
                onText: { self.received(index, generation, $0) }, onClose: { self.closed(index, generation, $0) }
            )
            let (sync, closedEarly) = state.withLockedValue { state -> (String?, (generation: Int, code: UInt16?)?) in
                guard state.devices[index].generation == generation else { return (nil, nil) }
                state.devices[index].socket = socket
                if let early = state.devices[index].closedEarly, early.generation == generation { return (nil, early) }
                guard state.devices[index].openedEarly else { return (nil, nil) }
                state.devices[index].openedEarly = false
                return (self.syncFrame(&state, index, Array(state.devices[index].syncing)), nil)
            }
            if let sync { socket.send(sync) }
            if let closedEarly { closed(index, closedEarly.generation, closedEarly.code) }
        } catch {
            // Never a session: refused, or nothing answered (a dead node).
            var refused = false
            if case BenchSocketError.refused = error { refused = true }
            let decision = state.withLockedValue { state -> ClientLifecycle.AfterClose? in
                guard state.devices[index].generation == generation, !state.shuttingDown else { return nil }
                let gateways = state.devices[index].urls.count
                return state.devices[index].lifecycle.closed(code: nil, upgradeRefused: refused, unreachable: !refused, gateways: gateways)
            }
            if let decision { follow(index, decision) }
        }
    }

    /// What the SDK does after a session or an attempt ended.
    private func follow(_ index: Int, _ decision: ClientLifecycle.AfterClose) {
        let delay = state.withLockedValue { state -> Double? in
            switch decision {
            case .stop: return nil
            case .reconnectNow:
                state.devices[index].urlIndex += 1
                return 0
            case .reconnectAfterBackoff:
                state.devices[index].urlIndex += 1
                var device = state.devices[index]
                let delay = device.backoff.nextDelay(using: &device.random)
                state.devices[index] = device
                return delay
            }
        }
        guard let delay else { return }
        Task {
            if delay > 0 { try? await Task.sleep(for: .seconds(delay)) }
            await self.attempt(index)
        }
    }

    private func closed(_ index: Int, _ generation: Int, _ code: UInt16?) {
        let decision = state.withLockedValue { state -> ClientLifecycle.AfterClose? in
            guard state.devices[index].generation == generation, !state.shuttingDown else { return nil }
            guard state.devices[index].socket != nil else {
                state.devices[index].closedEarly = (generation, code)
                return nil
            }
            if let code { state.closeCodes[code, default: 0] += 1 }
            state.devices[index].socket = nil
            state.devices[index].synced = false
            state.devices[index].syncing = []
            state.devices[index].again = []
            let gateways = state.devices[index].urls.count
            return state.devices[index].lifecycle.closed(code: code, unreachable: false, gateways: gateways)
        }
        if let decision { follow(index, decision) }
    }

    private func received(_ index: Int, _ generation: Int, _ text: String) {
        // Messages, most of the frames, are read by a look at their fields, not decoded: decoding
        // every one took the load generator's loops long enough that pongs came late and the
        // nodes closed sessions for a ping timeout.
        if text.contains("\"type\":\"message\""), let conversation = jsonString(text, "conversation_id"), let seq = jsonNumber(text, "seq") {
            let epoch = jsonString(text, "epoch")
            state.withLockedValue { state in
                guard state.devices[index].generation == generation, let room = roomIndex[String(conversation)] else { return }
                if let epoch { state.devices[index].epochs[room] = String(epoch) }
                switch state.devices[index].take(seq, in: room) {
                case .next: break
                case .repeated: state.repeated += 1
                case .early: state.early += 1
                }
            }
            return
        }
        guard let frame = serverFrame(text) else { return }
        var send: String?
        var retry = false
        state.withLockedValue { state in
            guard state.devices[index].generation == generation else { return }
            switch frame {
            case .initialState:
                state.devices[index].lifecycle.opened(with: .online)
                state.devices[index].sessionLast = [:]
                state.devices[index].backoff.reset()
                if state.killedAt != nil, state.devices[index].backAt == nil { state.devices[index].backAt = .now }
                let all = roomsOf[index]
                state.devices[index].syncing = Set(all)
                state.devices[index].again = []
                if state.devices[index].socket == nil {
                    state.devices[index].openedEarly = true
                } else {
                    send = self.syncFrame(&state, index, all)
                }
            case .synced(let synced):
                guard let room = roomIndex[synced.conversationID], state.devices[index].syncing.remove(room) != nil else { return }
                if !synced.epoch.isEmpty { state.devices[index].epochs[room] = synced.epoch }
                // What the sync names missing is the app's to read over REST, as the SDK leaves it.
                for range in synced.missing where range.epoch == nil || range.epoch == synced.epoch {
                    state.named += state.devices[index].name(range.fromSeq...(range.toSeq ?? synced.lastSeq), in: room)
                }
                if synced.more { state.devices[index].again.insert(room) }
                guard state.devices[index].syncing.isEmpty else { return }
                if state.devices[index].again.isEmpty {
                    state.devices[index].synced = true
                    if state.killedAt != nil, state.devices[index].backAt != nil, state.devices[index].caughtUpAt == nil {
                        state.devices[index].caughtUpAt = .now
                    }
                } else {
                    let next = Array(state.devices[index].again)
                    state.devices[index].syncing = Set(next)
                    state.devices[index].again = []
                    send = self.syncFrame(&state, index, next)
                }
            case .error(let error) where error.code == .rateLimited:
                // A sync over the budget: asked again a little later, as the SDK does.
                guard !state.devices[index].syncing.isEmpty else { return }
                state.refusedSyncs += 1
                retry = true
            default:
                break
            }
        }
        let socket = state.withLockedValue { $0.devices[index].socket }
        if let send { socket?.send(send) }
        if retry {
            Task {
                try? await Task.sleep(for: .milliseconds(250))
                let frame = self.state.withLockedValue { state -> String? in
                    guard state.devices[index].generation == generation, !state.devices[index].syncing.isEmpty else { return nil }
                    return self.syncFrame(&state, index, Array(state.devices[index].syncing))
                }
                if let frame { socket?.send(frame) }
            }
        }
    }

    /// A `sync` of `rooms` from the device's last seqs.
    private func syncFrame(_ state: inout State, _ index: Int, _ asked: [Int]) -> String {
        state.syncRequests += 1
        let device = state.devices[index]
        let positions = asked.sorted().map { room in
            SyncPosition(conversationID: rooms[room], afterSeq: device.last[room] ?? 0, epoch: device.epochs[room])
        }
        return clientText(.sync(positions), id: "sync-\(state.syncRequests)")
    }

    /// Messages stored but not received in order, over every device and conversation.
    func lost(_ final: [String: Int64]) -> Int {
        state.withLockedValue { state in
            var lost = 0
            for (index, device) in state.devices.enumerated() {
                for room in roomsOf[index] { lost += max(0, Int((final[rooms[room]] ?? 0) - (device.last[room] ?? 0))) }
            }
            return lost
        }
    }

    struct Summary {
        var backSeconds: [Double]
        var caughtUpSeconds: [Double]
        var lost: Int
        var repeated: Int
        var early: Int
        var named: Int
        var closeCodes: [UInt16: Int]
        var refusedSyncs: Int
    }

    /// Everything measured; the devices stop reconnecting from here on.
    func summary(_ final: [String: Int64], killedAt: ContinuousClock.Instant) -> Summary {
        let lost = lost(final)
        return state.withLockedValue { state in
            state.shuttingDown = true
            return Summary(
                backSeconds: state.devices.compactMap { $0.backAt.map { seconds($0 - killedAt) } },
                caughtUpSeconds: state.devices.compactMap { $0.caughtUpAt.map { seconds($0 - killedAt) } },
                lost: lost, repeated: state.repeated, early: state.early, named: state.named, closeCodes: state.closeCodes, refusedSyncs: state.refusedSyncs
            )
        }
    }
}
