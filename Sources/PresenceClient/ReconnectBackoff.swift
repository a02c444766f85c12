import Foundation

/// Delays between reconnect attempts: `initial`, doubling up to `maximum`, each moved by up to
/// ±`jitter` of itself so that a node's clients do not all come back in the same instant.
public struct ReconnectBackoff: Sendable {
    /// The first delay, seconds.
    public var initial: TimeInterval
    /// The largest delay, seconds.
    public var maximum: TimeInterval
    /// The fraction each delay may move by (0.2: ±20 %).
    public var jitter: Double
    /// Failed attempts since the last success.
    public private(set) var attempts = 0

    /// 1, 2, 4, 8, 16 s, then 16 s, each ±20 %.
    public init(initial: TimeInterval = 1, maximum: TimeInterval = 16, jitter: Double = 0.2) {
        precondition(initial > 0 && maximum >= initial && (0..<1).contains(jitter), "backoff: 0 < initial <= maximum, 0 <= jitter < 1")
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
    }

    /// The delay before the next attempt, counting this failure.
    public mutating func nextDelay(using generator: inout some RandomNumberGenerator) -> TimeInterval {
        let base = min(maximum, initial * pow(2, Double(min(attempts, 30))))
        attempts += 1
        guard jitter > 0 else { return base }
        return base * Double.random(in: (1 - jitter)...(1 + jitter), using: &generator)
    }

    /// The delay before the next attempt, with the system's random numbers.
    public mutating func nextDelay() -> TimeInterval {
        var generator = SystemRandomNumberGenerator()
        return nextDelay(using: &generator)
    }

    /// A connection succeeded: the next failure starts again from `initial`.
    public mutating func reset() { attempts = 0 }
}
