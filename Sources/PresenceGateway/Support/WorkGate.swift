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
final class WorkGate: Sendable {
    typealias Work = @Sendable () async -> Void

    /// Pieces that may run at once.
    let limit: Int
    private let state: NIOLockedValueBox<State>

    private struct State {
        var running = 0
        var waiting = CircularBuffer<Work>()
    }

    init(limit: Int) {
        precondition(limit > 0, "a gate needs at least one slot")
        self.limit = limit
        state = NIOLockedValueBox(State())
    }

    /// Pieces running now, and waiting.
    var load: (running: Int, waiting: Int) { state.withLockedValue { ($0.running, $0.waiting.count) } }

    /// Runs `work` in a task now if a slot is free, else once one is.
    func start(_ work: @escaping Work) {
        let runsNow = state.withLockedValue { state -> Bool in
            guard state.running < limit else {
                state.waiting.append(work)
                return false
            }
            state.running += 1
            return true
        }
        guard runsNow else { return }
        Task {
            var next: Work? = work
            while let piece = next {
                await piece()
                next = state.withLockedValue { state in
                    if let following = state.waiting.popFirst() { return following }
                    state.running -= 1
                    return nil
                }
            }
        }
    }
}
