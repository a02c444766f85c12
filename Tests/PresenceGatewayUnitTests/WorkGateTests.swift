import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import Testing

@testable import PresenceGateway

/// The gate that bounds sessions' Redis-bound work.
@Suite("Session work gate")
struct WorkGateTests {
    /// Pieces that record how many run at once and the order they started in; each waits until
    /// the test lets it go.
    final class Recorder: Sendable {
        private let state = NIOLockedValueBox((running: 0, most: 0, started: [Int](), finished: 0))
        var most: Int { state.withLockedValue { $0.most } }
        var started: [Int] { state.withLockedValue { $0.started } }
        var finished: Int { state.withLockedValue { $0.finished } }

        func piece(_ index: Int, until release: @escaping @Sendable () async -> Void) -> WorkGate.Work {
            {
                self.state.withLockedValue {
                    $0.running += 1
                    $0.most = max($0.most, $0.running)
                    $0.started.append(index)
                }
                await release()
                self.state.withLockedValue {
                    $0.running -= 1
                    $0.finished += 1
                }
            }
        }
    }

    static func waitUntil(_ condition: () -> Bool) async throws {
        let deadline = ContinuousClock.now + .seconds(10)
        while !condition() {
            guard ContinuousClock.now < deadline else { Issue.record("timed out"); return }
            try await Task.sleep(for: .milliseconds(5))
        }
    }

    @Test("at most `limit` pieces run at once, the rest start in order as slots free, and all run")
    func bound() async throws {
        let gate = WorkGate(limit: 3)
        let recorder = Recorder()
        // Places the test has opened: each piece takes one before it ends.
        let open = NIOLockedValueBox(0)
        for index in 0..<10 {
            gate.start(recorder.piece(index) {
                while true {
                    let may = open.withLockedValue { opened -> Bool in
                        guard opened > 0 else { return false }
                        opened -= 1
                        return true
                    }
                    if may { return }
                    try? await Task.sleep(for: .milliseconds(2))
                }
            })
        }
        try await Self.waitUntil { recorder.started.count == 3 }
        #expect(gate.load.running == 3)
        #expect(gate.load.waiting == 7)
        try await Task.sleep(for: .milliseconds(50))
        #expect(recorder.started.count == 3, "a fourth piece started while three held the gate")
        for step in 1...10 {
            open.withLockedValue { $0 += 1 }
            try await Self.waitUntil { recorder.finished == step }
        }
        try await Self.waitUntil { gate.load.running == 0 }
        #expect(recorder.most == 3)
        #expect(recorder.finished == 10)
        #expect(Array(recorder.started[3...]) == Array(3..<10), "waiting pieces start in the order they came")
        #expect(gate.load.waiting == 0)
    }

    @Test("each piece runs on the executor it names, across its awaits, even one that waited behind another loop's")
    func executors() async throws {
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 2)
        let loops = Array(group.makeIterator())
        let executors = loops.map { EventLoopTaskExecutor(eventLoop: $0) }
        // One slot: the pieces run one after the other in the first piece's task.
        let gate = WorkGate(limit: 1)
        let placed: [Int?] = [0, 1, 0, nil, 1]
        // For each piece, the loops it ran on before and after an await (nil: on neither).
        let seen = NIOLockedValueBox([Int: [Int?]]())
        let release = NIOLockedValueBox(false)
        @Sendable func onLoop() -> Int? { loops.firstIndex { $0.inEventLoop } }
        for (index, loop) in placed.enumerated() {
            gate.start(on: loop.map { executors[$0] }) {
                let before = onLoop()
                while !release.withLockedValue({ $0 }) { try? await Task.sleep(for: .milliseconds(2)) }
                let after = onLoop()
                seen.withLockedValue { $0[index] = [before, after] }
            }
        }
        try await Self.waitUntil { gate.load.waiting == placed.count - 1 }
        release.withLockedValue { $0 = true }
        try await Self.waitUntil { seen.withLockedValue { $0.count } == placed.count }
        for (index, loop) in placed.enumerated() {
            #expect(seen.withLockedValue { $0[index] } == [loop, loop], "piece \(index)")
        }
        try await group.shutdownGracefully()
    }
}
