import Foundation
import Histogram
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix

/// Many bench sessions against node processes, with counters of what they received.
final class Fleet: Sendable {
    let nodes: NodeProcesses
    let group: MultiThreadedEventLoopGroup
    private let sockets = NIOLockedValueBox<[BenchSocket]>([])
    /// Source addresses used in turn; each carries at most `perSource` sessions.
    private let perSource = 20_000

    init(nodes: NodeProcesses, threads: Int = 1) {
        self.nodes = nodes
        group = MultiThreadedEventLoopGroup(numberOfThreads: max(1, threads))
    }

    /// Opens one session per `(user, device, node)`, `concurrency` at a time, with a progress
    /// line; `onText` gets (index, frame), `onClose` (index, the server's close code) once a
    /// session ends. Returns the sockets in order.
    @discardableResult
    func connect(
        _ sessions: [(user: String, device: String, node: Int)], concurrency: Int = 128, label: String,
        onText: @escaping @Sendable (Int, String) -> Void, onClose: @escaping @Sendable (Int, UInt16?) -> Void = { _, _ in }
    ) async throws -> [BenchSocket] {
        let base = sockets.withLockedValue { $0.count }
        var opened = [BenchSocket?](repeating: nil, count: sessions.count)
        let started = ContinuousClock.now
        try await withThrowingTaskGroup(of: (Int, BenchSocket).self) { tasks in
            var next = 0
            func add() async throws {
                let index = next
                next += 1
                let session = sessions[index]
                let global = base + index
                let source = "127.0.0.\(2 + global / perSource)"
                let path = try await nodes.path(user: session.user, device: session.device)
                tasks.addTask {
                    let socket = try await BenchSocket.connect(
                        port: self.nodes.ports[session.node], path: path, source: source, group: self.group,
                        onText: { onText(index, $0) }, onClose: { onClose(index, $0) }
                    )
                    return (index, socket)
                }
            }
            while next < min(concurrency, sessions.count) { try await add() }
            var done = 0
            while let (index, socket) = try await tasks.next() {
                opened[index] = socket
                done += 1
                if done % 500 == 0 || done == sessions.count {
                    let rate = Double(done) / max(seconds(ContinuousClock.now - started), 0.001)
                    progress("\(label): \(done)/\(sessions.count) sessions open, \(Int(rate))/s")
                }
                if next < sessions.count { try await add() }
            }
        }
        endProgress()
        let result = opened.compactMap { $0 }
        sockets.withLockedValue { $0 += result }
        return result
    }

    /// Drops every session and stops the event loop.
    func shutdown() async {
        for socket in sockets.withLockedValue({ $0 }) { socket.abort() }
        try? await group.shutdownGracefully()
    }
}

/// Counts frames of one type per session and wakes waiters when a target is reached.
final class FrameCounter: Sendable {
    private let counts = NIOLockedValueBox<[Int: Int]>([:])
    private let total = NIOLockedValueBox(0)

    func add(_ index: Int) {
        counts.withLockedValue { $0[index, default: 0] += 1 }
        total.withLockedValue { $0 += 1 }
    }

    var count: Int { total.withLockedValue { $0 } }

    /// Waits until `target` frames were counted or `timeout` passes; returns whether reached.
    func wait(for target: Int, timeout: Duration, label: String? = nil) async -> Bool {
        let deadline = ContinuousClock.now + timeout
        while count < target {
            if ContinuousClock.now > deadline { return false }
            if let label { progress("\(label): \(count)/\(target)") }
            try? await Task.sleep(for: .milliseconds(20))
        }
        if label != nil { endProgress() }
        return true
    }
}

/// Latencies in microseconds, recorded into an HdrHistogram.
final class LatencyRecorder: Sendable {
    private let histogram = NIOLockedValueBox(Histogram<UInt64>(highestTrackableValue: 60_000_000, numberOfSignificantValueDigits: .three))

    func record(_ duration: Duration) {
        let micros = UInt64(max(1, seconds(duration) * 1_000_000))
        _ = histogram.withLockedValue { $0.record(micros) }
    }

    var count: Int { Int(histogram.withLockedValue { $0.totalCount }) }

    /// Milliseconds at a percentile (0–100).
    func milliseconds(_ percentile: Double) -> Double {
        Double(histogram.withLockedValue { $0.valueAtPercentile(percentile) }) / 1000
    }

    /// p50, p99, p99.9 and max, in milliseconds.
    var summary: [String: Double] {
        ["p50_ms": milliseconds(50), "p99_ms": milliseconds(99), "p999_ms": milliseconds(99.9),
         "max_ms": Double(histogram.withLockedValue { $0.max }) / 1000, "count": Double(count)]
    }

    var line: String {
        String(format: "p50 %.2f ms, p99 %.2f ms, p99.9 %.2f ms, max %.2f ms (n=%d)", milliseconds(50), milliseconds(99), milliseconds(99.9), summary["max_ms"] ?? 0, count)
    }
}

/// Prints `rows` as a two-column table and writes `json` to `path` when given.
func report(_ title: String, _ rows: [(String, String)], json: [String: Any], to path: String?) throws {
    print("\n\(title)")
    let width = rows.map(\.0.count).max() ?? 0
    for (name, value) in rows { print("  \(name.padding(toLength: width, withPad: " ", startingAt: 0))  \(value)") }
    guard let path else { return }
    let data = try JSONSerialization.data(withJSONObject: json, options: [.prettyPrinted, .sortedKeys])
    try data.write(to: URL(fileURLWithPath: path))
    print("  (written to \(path))")
}
