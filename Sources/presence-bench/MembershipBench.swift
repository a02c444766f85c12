import ArgumentParser
import Foundation
import NIOConcurrencyHelpers
import PresenceEngine
import PresenceProtocol

/// Membership changes beside delivery: sessions of a large group's members on one node, a
/// watcher of an unrelated user on the same node, and the group's membership changing while
/// that user's status does. Prints the unrelated change's delivery with and without the
/// membership changes, and how fast the members' sessions opened.
struct MembershipBench: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "membership",
        abstract: "Sessions of a large group's members on node B; an unrelated user's changes timed to a watcher on B, without and then with membership changes to the group."
    )

    @OptionGroup var common: CommonOptions
    @Option(help: "Members of the group.") var members = 4_000
    @Option(help: "Members with a session on node B.") var sessions = 2_000
    @Option(help: "Seconds of each phase (without, then with membership changes).") var phase = 8
    @Option(help: "Status changes per second of the unrelated user.") var rate = 20
    @Option(help: "Membership changes per second to the group in the second phase.") var membershipRate = 2

    func run() async throws {
        let nodes = try await TwoNodes.start(redisURL: common.redisURL, statusRate: 100, maxIDs: 500, visibility: .conversations)
        let names = (0..<members).map { "bench-member-\($0)" }
        let setup = try await BenchEngine.make(redisURL: common.redisURL, prefix: nodes.prefix)
        try await setup.use { engine in
            _ = try await engine.setMembers(of: "bench-big", to: names)
            _ = try await engine.setMembers(of: "bench-pair", to: ["bench-watcher", "bench-mover"])
            _ = try await engine.post(user: "bench-mover", device: "web", status: .online)
        }

        // The members' sessions, each waiting for its initial_state.
        let opened = NIOLockedValueBox(0)
        var tasks: [Task<Void, any Error>] = []
        let openStart = ContinuousClock.now
        for index in 0..<sessions {
            let (_, task) = try await nodes.connect(node: 1, user: names[index], device: "d") { text in
                if case .initialState = serverFrame(text) { opened.withLockedValue { $0 += 1 } }
            }
            tasks.append(task)
        }
        while opened.withLockedValue({ $0 }) < sessions {
            if ContinuousClock.now - openStart > .seconds(300) { break }
            try await Task.sleep(for: .milliseconds(20))
        }
        let openTime = seconds(ContinuousClock.now - openStart)
        let openedCount = opened.withLockedValue { $0 }

        // The watcher of the unrelated user, on the same node.
        let sent = NIOLockedValueBox<[ContinuousClock.Instant]>([])
        let latencies = NIOLockedValueBox<[Double]>([])
        let ready = NIOLockedValueBox(false)
        let (_, watcherTask) = try await nodes.connect(node: 1, user: "bench-watcher", device: "w") { text in
            switch serverFrame(text) {
            case .initialState: ready.withLockedValue { $0 = true }
            case .presenceUpdate(let update) where update.userID == "bench-mover":
                let now = ContinuousClock.now
                if let start = sent.withLockedValue({ $0.isEmpty ? nil : $0.removeFirst() }) {
                    latencies.withLockedValue { $0.append(seconds(now - start) * 1000) }
                }
            default: break
            }
        }
        tasks.append(watcherTask)
        while !ready.withLockedValue({ $0 }) { try await Task.sleep(for: .milliseconds(10)) }

        func timedPhase(_ name: String, churn: Bool) async throws -> [Double] {
            latencies.withLockedValue { $0 = [] }
            let changes = NIOLockedValueBox(0)
            let churner = Task {
                guard churn else { return }
                try await setup.use { engine in
                    while !Task.isCancelled {
                        let done = changes.withLockedValue { $0 }
                        let user = "bench-joiner-\(done / 2)"
                        if done % 2 == 0 { _ = try await engine.addMembers(to: "bench-big", [user]) } else { _ = try await engine.removeMember(from: "bench-big", user) }
                        changes.withLockedValue { $0 += 1 }
                        try await Task.sleep(for: .nanoseconds(1_000_000_000 / Int64(membershipRate)))
                    }
                }
            }
            try await setup.use { engine in
                let steps = phase * rate
                for step in 0..<steps {
                    sent.withLockedValue { $0.append(.now) }
                    _ = try await engine.post(user: "bench-mover", device: "web", status: step % 2 == 0 ? .away : .online)
                    if step % rate == 0 { progress("\(name): \(step)/\(steps)") }
                    try await Task.sleep(for: .nanoseconds(1_000_000_000 / Int64(rate)))
                }
            }
            churner.cancel()
            try await Task.sleep(for: .seconds(2))
            endProgress()
            if churn { print("  \(changes.withLockedValue { $0 }) membership changes to the group (\(membershipRate)/s; the group stays large, so each goes to the joining or leaving user's channel, not every member's)") }
            return latencies.withLockedValue { values in
                defer { values = [] }
                sent.withLockedValue { $0 = [] }
                return values
            }
        }
        let quiet = try await timedPhase("without", churn: false)
        let churned = try await timedPhase("with", churn: true)
        print("")
        print("\(openedCount) of \(sessions) sessions of a \(members)-member group opened on node B in \(String(format: "%.1f", openTime)) s (\(String(format: "%.0f", Double(openedCount) / openTime)) a second)")
        print("an unrelated user's status change → its watcher on node B, \(rate)/s for \(phase) s:")
        print("  without membership changes (\(quiet.count) timed): " + latencyLine(quiet))
        print("  with membership changes (\(churned.count) timed):    " + latencyLine(churned))
        for task in tasks { task.cancel() }
        try await setup.use { engine in
            _ = try await engine.deleteConversation("bench-big")
            _ = try await engine.deleteConversation("bench-pair")
        }
        await nodes.stop()
    }
}
