import NIOConcurrencyHelpers
import NIOCore

/// Bounds how many pieces of session work (an opening, a session's queued frames, its end) run
/// at once on a node; the rest wait in order.
///
/// Each piece awaits Redis. Without a bound, a burst (thousands of sessions opening or
/// subscribing in the same second, a node's sessions reconnecting after a restart) puts all of
/// their Redis calls, replies and tasks in flight together, and the allocator keeps the peak long
/// after the burst. Work that waits here is only a closure: no task exists for it until a slot
/// frees, and a finishing task runs the next waiting piece itself rather than starting another.
/// A piece must never wait for another piece of the same gate (none does: each awaits Redis, the
/// hub or the engine only).
///
/// A piece may name the executor it runs on (a session's piece, its connection's event loop);
/// one task runs pieces of several sessions in turn, each on its own executor.
final class WorkGate: Sendable {
    typealias Work = @Sendable () async -> Void

    private struct Piece: Sendable {
        let executor: (any TaskExecutor)?
        let work: Work
    }

    /// Pieces that may run at once.
    let limit: Int
    private let state: NIOLockedValueBox<State>

    private struct State {
        var running = 0
        var waiting = CircularBuffer<Piece>()
    }

    init(limit: Int) {
        precondition(limit > 0, "a gate needs at least one slot")
        self.limit = limit
        state = NIOLockedValueBox(State())
    }

    /// Pieces running now, and waiting.
    var load: (running: Int, waiting: Int) { state.withLockedValue { ($0.running, $0.waiting.count) } }

    /// Runs `work` in a task now if a slot is free, else once one is; on `executor` if given,
    /// else on the concurrency runtime's pool.
    func start(on executor: (any TaskExecutor)? = nil, _ work: @escaping Work) {
        let piece = Piece(executor: executor, work: work)
        let runsNow = state.withLockedValue { state -> Bool in
            guard state.running < limit else {
                state.waiting.append(piece)
                return false
            }
            state.running += 1
            return true
        }
        guard runsNow else { return }
        Task(executorPreference: executor) {
            var next: Piece? = piece
            while let piece = next {
                // `nil` would keep the task's preference, the executor of the piece before.
                await withTaskExecutorPreference(piece.executor ?? globalConcurrentExecutor) { await piece.work() }
                next = self.state.withLockedValue { state in
                    if let following = state.waiting.popFirst() { return following }
                    state.running -= 1
                    return nil
                }
            }
        }
    }
}
