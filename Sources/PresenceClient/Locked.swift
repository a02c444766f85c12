import Foundation

/// A value behind a lock, for the client's few states shared across tasks. The client has no
/// SwiftNIO on Apple platforms, so it keeps its own.
final class Locked<Value: Sendable>: @unchecked Sendable {
    // Unchecked: `value` is read and written only inside `withLock`, under `lock`.
    private let lock = NSLock()
    private var value: Value

    init(_ value: Value) {
        self.value = value
    }

    /// Runs `body` with the value, holding the lock.
    func withLock<Result>(_ body: (inout Value) throws -> Result) rethrows -> Result {
        lock.lock()
        defer { lock.unlock() }
        return try body(&value)
    }
}
