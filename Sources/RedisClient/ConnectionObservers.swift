import NIOConcurrencyHelpers

/// Who listens to a client's ``RedisConnectionEvent``s.
final class ConnectionObservers: Sendable {
    private let state = NIOLockedValueBox((next: 0, observers: [Int: @Sendable (RedisConnectionEvent) -> Void]()))

    /// Adds `observer`; the token removes it.
    func add(_ observer: @escaping @Sendable (RedisConnectionEvent) -> Void) -> Int {
        state.withLockedValue { state in
            state.next += 1
            state.observers[state.next] = observer
            return state.next
        }
    }

    func remove(_ token: Int) {
        _ = state.withLockedValue { $0.observers.removeValue(forKey: token) }
    }

    /// Tells every observer, outside the lock.
    func notify(_ event: RedisConnectionEvent) {
        let observers = state.withLockedValue { Array($0.observers.values) }
        for observer in observers { observer(event) }
    }
}
