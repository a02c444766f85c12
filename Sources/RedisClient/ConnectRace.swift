import NIOConcurrencyHelpers

/// Overlapping connection attempts, one more every interval while fewer than a limit are under
/// way: the first connection is returned as soon as it is made (an attempt a partition swallowed
/// still waits for its connect timeout, and closes what it gets late). Fails with the last error
/// once every attempt failed and none is under way; with a deadline, no attempt starts after it.
final class ConnectRace: Sendable {
    private struct State {
        var continuation: CheckedContinuation<RedisConnection, any Error>?
        var underWay = 0
        var finished = false
    }

    private let state = NIOLockedValueBox(State())

    func run(interval: Duration, limit: Int, until deadline: ContinuousClock.Instant? = nil, _ attempt: @escaping @Sendable () async throws -> RedisConnection) async throws -> RedisConnection {
        try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<RedisConnection, any Error>) in
                let cancelled = state.withLockedValue { state -> Bool in
                    guard !state.finished else { return true }
                    state.continuation = continuation
                    return false
                }
                if cancelled {
                    continuation.resume(throwing: CancellationError())
                    return
                }
                Task {
                    while self.launch(limit: limit, attempt) {
                        try? await Task.sleep(for: interval)
                        if let deadline, ContinuousClock.now >= deadline { break }
                    }
                }
            }
        } onCancel: {
            self.finish(.failure(CancellationError()))
        }
    }

    /// Starts one more attempt unless the race is over or `limit` are under way; false once over.
    private func launch(limit: Int, _ attempt: @escaping @Sendable () async throws -> RedisConnection) -> Bool {
        let start = state.withLockedValue { state -> Bool? in
            guard !state.finished else { return nil }
            guard state.underWay < limit else { return false }
            state.underWay += 1
            return true
        }
        guard let start else { return false }
        if start {
            Task {
                do {
                    let connection = try await attempt()
                    if !self.finish(.success(connection)) { await connection.close() }
                } catch {
                    self.failed(error)
                }
            }
        }
        return true
    }

    private func failed(_ error: any Error) {
        let last = state.withLockedValue { state -> Bool in
            state.underWay -= 1
            return state.underWay == 0
        }
        if last { finish(.failure(error)) }
    }

    /// Ends the race with `result`; false if it was over already.
    @discardableResult
    private func finish(_ result: Result<RedisConnection, any Error>) -> Bool {
        let continuation = state.withLockedValue { state -> CheckedContinuation<RedisConnection, any Error>?? in
            guard !state.finished else { return nil }
            state.finished = true
            defer { state.continuation = nil }
            return .some(state.continuation)
        }
        guard let continuation else { return false }
        continuation?.resume(with: result)
        return true
    }
}
