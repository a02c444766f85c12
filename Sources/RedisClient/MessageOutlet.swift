import NIOConcurrencyHelpers

/// Where a subscriber's messages go: to the handler of
/// ``RedisChannelSubscriber/handleMessages(_:)`` when it takes them, else to the events.
///
/// The handler is kept in a plain variable under a lock, not in a `NIOLockedValueBox`: reading a
/// closure back out of the generic box cost some 400 µs per message in a debug build (measured
/// under a flood of 6,500 messages a second), enough for the connection to fall seconds behind.
final class MessageOutlet: @unchecked Sendable {
    typealias Handler = @Sendable (_ channel: String, _ payload: [UInt8]) -> Bool
    private let lock = NIOLock()
    /// Guarded by `lock`.
    private var handler: Handler?
    private let continuation: AsyncStream<RedisSubscriberEvent>.Continuation

    init(_ continuation: AsyncStream<RedisSubscriberEvent>.Continuation) {
        self.continuation = continuation
    }

    func set(_ handler: Handler?) {
        lock.withLockVoid { self.handler = handler }
    }

    func deliver(channel: String, payload: [UInt8]) {
        lock.lock()
        let handler = self.handler
        lock.unlock()
        if let handler, handler(channel, payload) { return }
        continuation.yield(.message(channel: channel, payload: payload))
    }
}
