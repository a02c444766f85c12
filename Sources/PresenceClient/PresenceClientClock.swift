import Foundation

/// Where the client reads the time and sleeps: the system clock in apps, a `ManualClock` in tests.
public protocol PresenceClientClock: Sendable {
    /// The current moment.
    var now: Date { get }
    /// Sleeps until `deadline`; throws `CancellationError` when the task is cancelled first.
    func sleep(until deadline: Date) async throws
}

/// The wall clock.
public struct SystemPresenceClock: PresenceClientClock {
    /// The wall clock.
    public init() {}

    public var now: Date { Date() }

    public func sleep(until deadline: Date) async throws {
        let seconds = deadline.timeIntervalSinceNow
        if seconds > 0 { try await Task.sleep(for: .milliseconds(Int64((seconds * 1000).rounded(.up)))) }
        try Task.checkCancellation()
    }
}

/// A clock that moves only when told to, so tests drive time without sleeping.
public final class ManualClock: PresenceClientClock {
    private struct Sleeper {
        let deadline: Date
        let continuation: CheckedContinuation<Void, any Error>
    }

    private struct State {
        var now: Date
        var sleepers: [UInt64: Sleeper] = [:]
        var nextID: UInt64 = 0
    }

    private let state: Locked<State>

    /// A clock standing at `start`.
    public init(start: Date = Date(timeIntervalSince1970: 1_800_000_000)) {
        state = Locked(State(now: start))
    }

    public var now: Date { state.withLock { $0.now } }

    /// How many tasks are sleeping on this clock.
    public var sleeperCount: Int { state.withLock { $0.sleepers.count } }

    /// Moves time forward and wakes every sleeper whose deadline has come.
    public func advance(by seconds: TimeInterval) {
        let due: [CheckedContinuation<Void, any Error>] = state.withLock { state in
            state.now += seconds
            let now = state.now
            let ids = state.sleepers.filter { $0.value.deadline <= now }.map(\.key)
            return ids.compactMap { state.sleepers.removeValue(forKey: $0)?.continuation }
        }
        for continuation in due { continuation.resume() }
    }

    public func sleep(until deadline: Date) async throws {
        let id = state.withLock { state -> UInt64 in
            state.nextID += 1
            return state.nextID
        }
        try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Void, any Error>) in
                let resumeNow: Bool = state.withLock { state in
                    if deadline <= state.now || Task.isCancelled { return true }
                    state.sleepers[id] = Sleeper(deadline: deadline, continuation: continuation)
                    return false
                }
                if resumeNow { continuation.resume() }
            }
        } onCancel: {
            let sleeper = state.withLock { $0.sleepers.removeValue(forKey: id) }
            sleeper?.continuation.resume(throwing: CancellationError())
        }
        try Task.checkCancellation()
    }
}

/// A wake-up call between tasks: `wait(after:)` returns once `signal()` has been called since
/// the generation the waiter last saw, so a signal sent just before the wait is never lost.
final class AsyncSignal: Sendable {
    private struct State {
        var generation = 0
        var waiters: [UInt64: CheckedContinuation<Void, Never>] = [:]
        var nextID: UInt64 = 0
    }

    private let state = Locked(State())

    /// The current generation; pass it to `wait(after:)`.
    var generation: Int { state.withLock { $0.generation } }

    /// Wakes every waiter.
    func signal() {
        let waiters = state.withLock { state in
            state.generation += 1
            defer { state.waiters = [:] }
            return Array(state.waiters.values)
        }
        for waiter in waiters { waiter.resume() }
    }

    /// Returns when the generation moves past `seen`, or when the task is cancelled.
    func wait(after seen: Int) async {
        let id = state.withLock { state -> UInt64 in
            state.nextID += 1
            return state.nextID
        }
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let resumeNow: Bool = state.withLock { state in
                    if state.generation != seen || Task.isCancelled { return true }
                    state.waiters[id] = continuation
                    return false
                }
                if resumeNow { continuation.resume() }
            }
        } onCancel: {
            let waiter = state.withLock { $0.waiters.removeValue(forKey: id) }
            waiter?.resume()
        }
    }

    /// Returns at `deadline` (if any) or when signalled after `seen`, whichever comes first.
    func wait(after seen: Int, until deadline: Date?, clock: any PresenceClientClock) async {
        guard let deadline else {
            await wait(after: seen)
            return
        }
        await withTaskGroup(of: Void.self) { group in
            group.addTask { try? await clock.sleep(until: deadline) }
            group.addTask { await self.wait(after: seen) }
            await group.next()
            group.cancelAll()
        }
    }
}
