import ArgumentParser
import Foundation
import NIOConcurrencyHelpers
import PresenceEngine
import PresenceProtocol

/// Time from a status change (or a typing frame) on node A to the watcher's update on node B.
struct LatencyBench: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "latency",
        abstract: "Two gateway nodes in this process; users on node A change status (or type) at a fixed rate over WebSocket; a watcher on node B times each update."
    )

    @OptionGroup var common: CommonOptions
    @Option(help: "Changes per second.") var rate = 1000
    @Option(help: "Seconds to measure.") var duration = 10
    @Option(help: "Users changing (one WebSocket session each, on node A).") var users = 100
    @Flag(help: "Time typing_update (start/stop typing in one conversation) instead of presence_update.") var typing = false

    func run() async throws {
        let nodes = try await TwoNodes.start(redisURL: common.redisURL, statusRate: Double(rate), maxIDs: users)
        let names = (0..<users).map { "bench-user-\($0)" }
        // Send times of pending changes, by "user/state", oldest first.
        let pending = NIOLockedValueBox<[String: [ContinuousClock.Instant]]>([:])
        let latencies = NIOLockedValueBox<[Double]>([])
        let ready = NIOLockedValueBox(0)

        let (watcher, watcherTask) = try await nodes.connect(node: 1, user: "bench-watcher", device: "w") { text in
            let user: String, state: String
            switch serverFrame(text) {
            case .initialState:
                ready.withLockedValue { $0 += 1 }
                return
            case .presenceUpdate(let presence) where !typing:
                (user, state) = (presence.userID, presence.status.rawValue)
            case .typingUpdate(let update) where typing:
                (user, state) = (update.userID, update.isTyping ? "typing" : "idle")
            default:
                return
            }
            let now = ContinuousClock.now
            if let sent = pending.withLockedValue({ $0["\(user)/\(state)"]?.isEmpty == false ? $0["\(user)/\(state)"]!.removeFirst() : nil }) {
                latencies.withLockedValue { $0.append(seconds(now - sent) * 1000) }
            }
        }
        var senders: [AsyncStream<String>.Continuation] = []
        var tasks = [watcherTask]
        for (index, name) in names.enumerated() {
            let (sender, task) = try await nodes.connect(node: 0, user: name, device: "d\(index)") { text in
                if case .initialState = serverFrame(text) { ready.withLockedValue { $0 += 1 } }
            }
            senders.append(sender)
            tasks.append(task)
        }
        while ready.withLockedValue({ $0 }) < users + 1 { try await Task.sleep(for: .milliseconds(20)) }
        if typing {
            let engine = try await BenchEngine.make(redisURL: common.redisURL, prefix: nodes.prefix)
            _ = try await engine.use { try await $0.setMembers(of: "bench-room", to: names + ["bench-watcher"]) }
            watcher.yield(clientText(.subscribe(.conversation("bench-room")), id: "s"))
        } else {
            watcher.yield(clientText(.subscribe(.users(names)), id: "s"))
        }
        try await Task.sleep(for: .seconds(1))

        // Each change flips one user: online ↔ away, or typing ↔ not typing.
        var flipped = [Bool](repeating: false, count: users)
        let total = rate * duration
        let start = ContinuousClock.now
        for step in 0..<total {
            let due = start + .nanoseconds(Int64(step) * 1_000_000_000 / Int64(rate))
            if due > ContinuousClock.now { try await Task.sleep(until: due) }
            let index = step % users
            flipped[index].toggle()
            let state: String, frame: String
            if typing {
                state = flipped[index] ? "typing" : "idle"
                frame = clientText(.typing(conversationID: "bench-room", isTyping: flipped[index]))
            } else {
                state = flipped[index] ? "away" : "online"
                frame = clientText(.status(flipped[index] ? .away : .online))
            }
            pending.withLockedValue { $0["\(names[index])/\(state)", default: []].append(.now) }
            senders[index].yield(frame)
            if step % rate == 0 { progress("latency: \(step / rate)/\(duration) s, \(latencies.withLockedValue { $0.count }) updates timed") }
        }
        try await Task.sleep(for: .seconds(2))
        endProgress()
        let measured = latencies.withLockedValue { $0 }
        let elapsed = seconds(ContinuousClock.now - start) - 2
        print("")
        print("\(typing ? "typing frame" : "status change") on node A → \(typing ? "typing_update" : "presence_update") at a watcher on node B, \(rate)/s for \(duration) s, \(users) users")
        print(String(format: "  sent %d, timed %d (%.0f/s achieved)", total, measured.count, Double(total) / elapsed))
        print("  " + latencyLine(measured))
        for task in tasks { task.cancel() }
        await nodes.stop()
    }
}
