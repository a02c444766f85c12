#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// The API's timestamp format: ISO 8601 UTC with milliseconds, `2026-11-21T12:00:00.123Z`.
/// Moments are milliseconds since 1970 everywhere else.
public enum PresenceTimestamp {
    /// The text for milliseconds since 1970.
    public static func iso8601(_ milliseconds: Int64) -> String {
        var bytes: [UInt8] = []
        write(milliseconds, into: &bytes)
        return String(decoding: bytes, as: UTF8.self)
    }

    /// Appends the text for milliseconds since 1970 to `bytes`, digit by digit (frames write
    /// it so, with no string made in between).
    static func write(_ milliseconds: Int64, into bytes: inout [UInt8]) {
        var seconds = time_t(milliseconds / 1000)
        var parts = tm()
        gmtime_r(&seconds, &parts)
        func digits(_ value: Int, _ width: Int, then separator: Unicode.Scalar) {
            var divisor = 1
            var count = 1
            while value / divisor >= 10 { divisor *= 10; count += 1 }
            for _ in count..<max(count, width) { bytes.append(UInt8(ascii: "0")) }
            while divisor > 0 {
                bytes.append(UInt8(ascii: "0") + UInt8(value / divisor % 10))
                divisor /= 10
            }
            bytes.append(UInt8(ascii: separator))
        }
        digits(Int(parts.tm_year) + 1900, 4, then: "-")
        digits(Int(parts.tm_mon) + 1, 2, then: "-")
        digits(Int(parts.tm_mday), 2, then: "T")
        digits(Int(parts.tm_hour), 2, then: ":")
        digits(Int(parts.tm_min), 2, then: ":")
        digits(Int(parts.tm_sec), 2, then: ".")
        digits(Int(milliseconds % 1000), 3, then: "Z")
    }

    /// Milliseconds since 1970 for `2026-11-21T12:00:00.123Z`; the fraction may be left out or
    /// have 1 to 9 digits (past milliseconds they are cut). `nil` for any other text.
    public static func milliseconds(_ text: some StringProtocol) -> Int64? {
        let bytes = Array(text.utf8)
        guard bytes.count >= 20, bytes.last == UInt8(ascii: "Z") else { return nil }
        func number(_ start: Int, _ count: Int) -> Int32? {
            var value: Int32 = 0
            for byte in bytes[start..<start + count] {
                guard byte >= UInt8(ascii: "0"), byte <= UInt8(ascii: "9") else { return nil }
                value = value * 10 + Int32(byte - UInt8(ascii: "0"))
            }
            return value
        }
        let separators = [(4, "-"), (7, "-"), (10, "T"), (13, ":"), (16, ":")]
        guard separators.allSatisfy({ bytes[$0.0] == UInt8(ascii: Unicode.Scalar($0.1)!) }),
              let year = number(0, 4), let month = number(5, 2), let day = number(8, 2),
              let hour = number(11, 2), let minute = number(14, 2), let second = number(17, 2),
              (1...12).contains(month), (1...31).contains(day), hour < 24, minute < 60, second < 61 else { return nil }
        var milliseconds: Int64 = 0
        if bytes.count > 20 {
            let digits = bytes.count - 21
            guard bytes[19] == UInt8(ascii: "."), (1...9).contains(digits), let fraction = number(20, min(digits, 3)),
                  digits <= 3 || number(23, digits - 3) != nil else { return nil }
            milliseconds = Int64(fraction) * [1, 100, 10, 1][min(digits, 3)]
        }
        var parts = tm()
        parts.tm_year = year - 1900
        parts.tm_mon = month - 1
        parts.tm_mday = day
        parts.tm_hour = hour
        parts.tm_min = minute
        parts.tm_sec = second
        return Int64(timegm(&parts)) * 1000 + milliseconds
    }
}
