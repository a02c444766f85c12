import ArgumentParser
import Foundation
import NIOConcurrencyHelpers
import PresenceProtocol

/// The instructions one node executes per status change and per delivery, and per message sent
/// and per delivered message, counted by valgrind's callgrind over a fixed scenario. CPU time on
/// a shared machine moves by tens of percent from one run to the next and this VM has no hardware
/// counters; an instruction count of the same scenario moves by little, so a 5 % change of the
/// code shows.
struct InstructionScenario: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "instructions",
        abstract: "Instructions of one node (valgrind's callgrind) per status change and per delivery, over a fixed scenario.",
        discussion: """
        One node runs under callgrind. --users users each watched by one session, then --users
        users each watched by --watchers sessions (all on the node), change status --changes
        times, a group's users together, one round at a time. The node's instructions are read
        before and after each series, and over an idle stretch to take out what timers cost
        meanwhile; a change's instructions (its frame, its script's reply, the event heard back)
        and a delivery's (one more watcher) come apart by the difference of the two series.
        Messages the same way: --users conversations of two members (a sender and a reader),
        then --users of a sender and --watchers readers, each sender sending --changes messages.
        Slow: under callgrind the node runs tens of times slower than natively.
        """
    )
    @OptionGroup var options: ScenarioOptions
    @Option(help: "valgrind's unpacked tree, holding usr/bin/valgrind.bin (scripts/fetch-valgrind puts Debian's 3.24 in .tools/valgrind).")
    var valgrind = ".tools/valgrind"
    @Option(help: "Users in each of the two groups; a group's users change status together.") var users = 4
    @Option(help: "Sessions watching each user of the second group.") var watchers = 25
    @Option(help: "Status changes of each user.") var changes = 40
    @Option(help: "Keep callgrind's dump of each stretch (solo, star, idle) in this folder, for callgrind_annotate.")
    var profile: String?

    func run() async throws {
        guard users >= 1, watchers >= 2, changes >= 1 else { throw BenchError("--users and --changes must be at least 1, --watchers at least 2") }
        let tree = URL(fileURLWithPath: valgrind).standardizedFileURL
        let launcher = tree.appendingPathComponent("usr/bin/valgrind.bin")
        guard FileManager.default.isExecutableFile(atPath: launcher.path) else {
            throw BenchError("no valgrind at \(launcher.path): run scripts/fetch-valgrind, or pass --valgrind")
        }
        let gateway = URL(fileURLWithPath: options.gatewayBinary ?? NodeProcesses.defaultBinary).standardizedFileURL
        let work = FileManager.default.temporaryDirectory.appendingPathComponent("presence-instructions-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: work, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: work) }
        guard FileManager.default.isExecutableFile(atPath: "/usr/bin/vgdb") else {
            throw BenchError("no /usr/bin/vgdb: apt-get install valgrind (its vgdb talks to the valgrind the node runs under)")
        }
        let vgdbPrefix = work.appendingPathComponent("vgdb").path
        // The node's launcher: valgrind in place of the process, so that its pid is the node's.
        // Names written whole in every dump, so that each kept one can be read on its own.
        let wrapper = work.appendingPathComponent("node.sh")
        try """
            #!/bin/sh
            VALGRIND_LIB='\(tree.path)/usr/libexec/valgrind' exec '\(launcher.path)' --tool=callgrind --vgdb=yes --compress-strings=no \
              --vgdb-prefix='\(vgdbPrefix)' --callgrind-out-file='\(work.path)/callgrind.out' '\(gateway.path)' "$@"

            """.write(to: wrapper, atomically: true, encoding: .utf8)
        try FileManager.default.setAttributes([.posixPermissions: 0o755], ofItemAtPath: wrapper.path)

        progress("instructions: starting a node under callgrind")
        // The node's audit (every three lease lives: 30 s by default) reads all of its devices at
        // once, and its lease renewal (every third of a life) refreshes every user's keys: each
        // millions of instructions under callgrind, landing in one series and not in another.
        // With an hour's lease both come at the start and not again during the run.
        let nodes = try await NodeProcesses(count: 1, redisURL: options.common.redisURL, binary: wrapper.path,
                                            environment: ["PRESENCE_LEASE_TTL": "3600"], readyWithin: .seconds(300))
        defer { nodes.stop() }
        endProgress()
        let counter = InstructionCounter(
            vgdb: "/usr/bin/vgdb", prefix: vgdbPrefix, pid: nodes.pids[0], output: work.appendingPathComponent("callgrind.out")
        )
        let fleet = Fleet(nodes: nodes, threads: options.threads)
        // Two groups of `users` users: "solo-i" each watched by one session, "star-i" each by
        // `watchers`. A group changes together, so that the changes stand out of the timers.
        let solos = (0..<users).map { "solo-\($0)" }
        let stars = (0..<users).map { "star-\($0)" }
        let snapshots = FrameCounter()
        let heard = ["solo": FrameCounter(), "star": FrameCounter()]
        let watching = solos.map { ("\($0)-watcher", "w", 0) } + stars.flatMap { star in (0..<watchers).map { ("\(star)-watcher-\($0)", "w", 0) } }
        let sockets = try await fleet.connect(watching, concurrency: 16, label: "instructions") { index, text in
            switch serverFrame(text) {
            case .initialState: snapshots.add(index)
            case .presenceUpdate(let presence): heard[String(presence.userID.prefix { $0 != "-" })]?.add(index)
            default: break
            }
        }
        for (index, socket) in sockets.enumerated() {
            let user = index < users ? solos[index] : stars[(index - users) / watchers]
            socket.send(clientText(.subscribe(.users([user])), id: "s"))
        }
        // Each watcher's opening `initial_state`, then the one its subscribe answers.
        guard await snapshots.wait(for: 2 * sockets.count, timeout: .seconds(300), label: "instructions: watchers") else {
            throw BenchError("instructions: only \(snapshots.count) of \(2 * sockets.count) initial states arrived")
        }
        let changers = try await fleet.connect((solos + stars).map { ($0, "d", 0) }, label: "instructions") { _, _ in }
        guard await heard["solo"]!.wait(for: users, timeout: .seconds(120)), await heard["star"]!.wait(for: users * watchers, timeout: .seconds(120)) else {
            throw BenchError("instructions: the watchers did not hear the users come online")
        }
        try await Task.sleep(for: .seconds(2))

        /// `changes` status changes of each user of a group, the group's at once, each round
        /// waited for at every watcher and followed by a pause the status rate allows (5 a
        /// second per session by default).
        func series(_ group: String, _ sockets: ArraySlice<BenchSocket>, watchers: Int) async throws {
            let updates = heard[group]!
            let start = updates.count
            let perRound = sockets.count * watchers
            for change in 1...changes {
                for socket in sockets { socket.send(clientText(.status(change % 2 == 1 ? .away : .online))) }
                guard await updates.wait(for: start + change * perRound, timeout: .seconds(120)) else {
                    throw BenchError("instructions: round \(change) of the \(group) changes reached \(updates.count - start - (change - 1) * perRound) of \(perRound) watchers")
                }
                try await Task.sleep(for: .milliseconds(300))
            }
        }
        let solo = try await counter.measure("solo") { try await series("solo", changers[..<users], watchers: 1) }
        let star = try await counter.measure("star") { try await series("star", changers[users...], watchers: watchers) }
        // Timers (pings, lease renewals, upkeep) run during the series too: their rate, taken
        // over a stretch with nothing sent as long as the longer series, is taken out of both.
        let idle = try await counter.measure("idle") { try await Task.sleep(for: max(solo.duration, star.duration)) }
        let idleRate = Double(idle.instructions) / seconds(idle.duration)
        // The members' sessions of the message series add timers of their own: their series
        // get an idle stretch of their own, after them.
        let messages = try await messageSeries(fleet: fleet, nodes: nodes, counter: counter)
        let membersIdle = try await counter.measure("members-idle") { try await Task.sleep(for: max(messages.pair.duration, messages.room.duration)) }
        let membersIdleRate = Double(membersIdle.instructions) / seconds(membersIdle.duration)
        let net = { (window: InstructionCounter.Window, rate: Double) in Double(window.instructions) - rate * seconds(window.duration) }
        let count = Double(changes * users)
        let perDelivery = (net(star, idleRate) - net(solo, idleRate)) / (count * Double(watchers - 1))
        let perChange = net(solo, idleRate) / count - perDelivery
        // A pair's message reaches two sessions (the sender's own and the reader's).
        let perMessageDelivery = (net(messages.room, membersIdleRate) - net(messages.pair, membersIdleRate)) / (count * Double(watchers - 1))
        let perSend = net(messages.pair, membersIdleRate) / count - 2 * perMessageDelivery
        // Each series' own figure per message is steadier than the split above (BENCHMARKS).
        let perPairMessage = net(messages.pair, membersIdleRate) / count
        let perRoomMessage = net(messages.room, membersIdleRate) / count
        await fleet.shutdown()
        if let profile { try counter.keepDumps(in: URL(fileURLWithPath: profile)) }
        let millions = { (value: Double) in String(format: "%.1f M", value / 1e6) }
        try report("instructions: one node under callgrind; \(changes) changes of \(users) users each watched by 1 session, of \(users) each watched by \(watchers)", [
            ("per change (its one delivery taken out)", String(format: "%.0f", perChange)),
            ("per delivery (one more watcher)", String(format: "%.0f", perDelivery)),
            ("series, 1 watcher each", "\(millions(Double(solo.instructions))) in \(String(format: "%.1f", seconds(solo.duration))) s"),
            ("series, \(watchers) watchers each", "\(millions(Double(star.instructions))) in \(String(format: "%.1f", seconds(star.duration))) s"),
            ("per message sent (its two deliveries taken out)", String(format: "%.0f", perSend)),
            ("per delivered message (one more member)", String(format: "%.0f", perMessageDelivery)),
            ("a message to 2 sessions (the series' own)", String(format: "%.0f", perPairMessage)),
            ("a message to \(watchers + 1) sessions (the series' own)", String(format: "%.0f", perRoomMessage)),
            ("messages, conversations of 2", "\(millions(Double(messages.pair.instructions))) in \(String(format: "%.1f", seconds(messages.pair.duration))) s"),
            ("messages, conversations of \(watchers + 1)", "\(millions(Double(messages.room.instructions))) in \(String(format: "%.1f", seconds(messages.room.duration))) s"),
            ("idle (timers)", String(format: "%.0f a second", idleRate)),
            ("idle with the members' sessions", String(format: "%.0f a second", membersIdleRate)),
        ], json: ["scenario": "instructions", "users": users, "watchers": watchers, "changes": changes,
                  "instructions_per_change": perChange, "instructions_per_delivery": perDelivery,
                  "instructions_per_message_sent": perSend, "instructions_per_message_delivery": perMessageDelivery,
                  "instructions_per_message_to_2": perPairMessage, "instructions_per_message_to_\(watchers + 1)": perRoomMessage,
                  "idle_instructions_per_second": idleRate, "members_idle_instructions_per_second": membersIdleRate,
                  "series": ["solo": ["instructions": solo.instructions, "seconds": seconds(solo.duration)],
                             "star": ["instructions": star.instructions, "seconds": seconds(star.duration)],
                             "pair": ["instructions": messages.pair.instructions, "seconds": seconds(messages.pair.duration)],
                             "room": ["instructions": messages.room.instructions, "seconds": seconds(messages.room.duration)],
                             "idle": ["instructions": idle.instructions, "seconds": seconds(idle.duration)],
                             "members-idle": ["instructions": membersIdle.instructions, "seconds": seconds(membersIdle.duration)]]], to: options.json)
    }
}

/// Reads the instructions callgrind counts in a running node through valgrind's gdbserver: a
/// dump (`vgdb … dump`) writes the counts since the last one and starts them again, exited
/// threads' included.
struct InstructionCounter: Sendable {
    /// Debian 12's vgdb: the one of valgrind 3.24 needs a newer glibc, and 3.19's speaks to it.
    let vgdb: String
    let prefix: String
    let pid: Int32
    /// The `--callgrind-out-file` the node was given; dumps are written beside it.
    let output: URL

    struct Window: Sendable {
        var instructions: Int
        var duration: Duration
    }

    /// The instructions executed by the node (every thread) while `body` ran, and its duration.
    func measure(_ label: String, _ body: () async throws -> Void) async throws -> Window {
        _ = try await dump("\(label)-start")
        let start = ContinuousClock.now
        try await body()
        let duration = ContinuousClock.now - start
        return Window(instructions: try await dump("\(label)-end"), duration: duration)
    }

    /// Asks for a dump named `hint` and returns its total: the instructions since the last dump.
    private func dump(_ hint: String) async throws -> Int {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: vgdb)
        process.arguments = ["--vgdb-prefix=\(prefix)", "--pid=\(pid)", "dump", hint]
        process.standardOutput = FileHandle.nullDevice
        process.standardError = FileHandle.nullDevice
        try process.run()
        process.waitUntilExit()
        guard process.terminationStatus == 0 else { throw BenchError("vgdb could not ask the node for a dump (status \(process.terminationStatus))") }
        // The dump's file (`<output>.<part>`) is the one whose trigger is `hint`.
        let deadline = ContinuousClock.now + .seconds(30)
        while ContinuousClock.now < deadline {
            if let total = totalOfDump(hint) { return total }
            try await Task.sleep(for: .milliseconds(100))
        }
        throw BenchError("callgrind wrote no dump \(hint) beside \(output.path)")
    }

    /// Moves the dumps of the stretches (`<label>-end`) into `folder`, named `<label>.callgrind`.
    func keepDumps(in folder: URL) throws {
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        for (source, header) in dumps() {
            guard let trigger = header.first(where: { $0.hasPrefix("desc: Trigger: dump ") && $0.hasSuffix("-end") }) else { continue }
            let label = trigger.dropFirst("desc: Trigger: dump ".count).dropLast("-end".count)
            let target = folder.appendingPathComponent("\(label).callgrind")
            try? FileManager.default.removeItem(at: target)
            try FileManager.default.moveItem(at: source, to: target)
        }
    }

    /// The dump files written so far (`<output>.<part>`), each with its header.
    private func dumps() -> [(file: URL, header: [Substring])] {
        let directory = output.deletingLastPathComponent()
        let files = (try? FileManager.default.contentsOfDirectory(atPath: directory.path)) ?? []
        return files.filter { $0.hasPrefix(output.lastPathComponent + ".") }.map { name in
            let file = directory.appendingPathComponent(name)
            return (file, Self.header(of: file))
        }
    }

    /// The first lines of a dump: its trigger and its total are among them.
    private static func header(of file: URL) -> [Substring] {
        guard let handle = try? FileHandle(forReadingFrom: file) else { return [] }
        defer { try? handle.close() }
        return String(decoding: (try? handle.read(upToCount: 8192)) ?? Data(), as: UTF8.self).split(separator: "\n")
    }

    private func totalOfDump(_ hint: String) -> Int? {
        // The header holds both: "desc: Trigger: dump <hint>", then "summary: <Ir>".
        guard let header = dumps().first(where: { $0.header.contains("desc: Trigger: dump \(hint)") })?.header else { return nil }
        return header.first { $0.hasPrefix("summary: ") }.flatMap { Int($0.dropFirst("summary: ".count)) }
    }
}
