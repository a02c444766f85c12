#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Wall-clock time in milliseconds since 1970, injectable so tests can drive it.
///
/// Every moment that one node writes and another compares (lease ends, linger and heartbeat
/// deadlines, typing expiry, `last_seen`) is taken inside the Lua scripts from Redis's own clock
/// (`TIME`), which every node shares: a node whose wall clock is off by seconds writes the same
/// moments as any other. ``scriptTime`` is how a test replaces that clock: a manual clock hands its
/// time to the scripts, so advancing it drives linger, heartbeat and lease expiry without sleeping.
public protocol PresenceClock: Sendable {
    /// Now, in milliseconds since 1970, by this process's clock: for local timers, logs and
    /// metrics only.
    func nowMilliseconds() -> Int64
    /// The moment the scripts take as now; `nil` makes them read Redis's clock.
    var scriptTime: Int64? { get }
}

extension PresenceClock {
    /// A clock other than the system's drives the scripts with its own time.
    public var scriptTime: Int64? { nowMilliseconds() }
}

/// The system's real-time clock; the scripts use Redis's.
public struct SystemPresenceClock: PresenceClock {
    /// Makes the system clock.
    public init() {}

    public func nowMilliseconds() -> Int64 {
        var spec = timespec()
        clock_gettime(CLOCK_REALTIME, &spec)
        return Int64(spec.tv_sec) * 1000 + Int64(spec.tv_nsec) / 1_000_000
    }

    public var scriptTime: Int64? { nil }
}
