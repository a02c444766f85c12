#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Wall-clock time in milliseconds since 1970, injectable so tests can drive it.
///
/// Every deadline and `last_seen` the engine writes comes from this clock, so a test that
/// advances a manual clock drives linger, heartbeat and lease expiry without sleeping.
public protocol PresenceClock: Sendable {
    /// Now, in milliseconds since 1970.
    func nowMilliseconds() -> Int64
}

/// The system's real-time clock.
public struct SystemPresenceClock: PresenceClock {
    /// Makes the system clock.
    public init() {}

    public func nowMilliseconds() -> Int64 {
        var spec = timespec()
        clock_gettime(CLOCK_REALTIME, &spec)
        return Int64(spec.tv_sec) * 1000 + Int64(spec.tv_nsec) / 1_000_000
    }
}
