/// Exponential backoff with full jitter: attempt n waits a random time up to min(max, min·2ⁿ),
/// never less than half of it, so a fleet of nodes does not reconnect in lockstep.
struct Backoff: Sendable {
    var minimum: Duration
    var maximum: Duration

    func delay(attempt: Int) -> Duration {
        let base = minimum * (1 << min(attempt, 20))
        let ceiling = min(base, maximum)
        let nanos = Self.nanoseconds(ceiling)
        return .nanoseconds(Int64.random(in: (nanos / 2)...max(nanos / 2, nanos)))
    }

    static func nanoseconds(_ duration: Duration) -> Int64 {
        duration.components.seconds * 1_000_000_000 + duration.components.attoseconds / 1_000_000_000
    }
}
