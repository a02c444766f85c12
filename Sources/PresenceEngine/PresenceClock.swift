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

/// API.md's timestamp format: ISO 8601 UTC with milliseconds, `2026-11-21T12:00:00.123Z`.
public enum PresenceTimestamp {
    /// The text for milliseconds since 1970.
    public static func iso8601(_ milliseconds: Int64) -> String {
        var seconds = time_t(milliseconds / 1000)
        var parts = tm()
        gmtime_r(&seconds, &parts)
        func pad(_ value: Int32, _ width: Int) -> String {
            let text = String(value)
            return String(repeating: "0", count: max(0, width - text.count)) + text
        }
        return "\(pad(parts.tm_year + 1900, 4))-\(pad(parts.tm_mon + 1, 2))-\(pad(parts.tm_mday, 2))T"
            + "\(pad(parts.tm_hour, 2)):\(pad(parts.tm_min, 2)):\(pad(parts.tm_sec, 2)).\(pad(Int32(milliseconds % 1000), 3))Z"
    }
}
