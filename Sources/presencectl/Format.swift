import Foundation
import PresenceEngine

/// Formatting for tables and JSON.
enum Format {
    /// `2026-11-21T12:00:00.123Z`, or `-` for none.
    static func timestamp(_ milliseconds: Int64?) -> String {
        milliseconds.map { PresenceTimestamp.iso8601($0) } ?? "-"
    }

    /// JSON value of a timestamp: the string, or null.
    static func jsonTimestamp(_ milliseconds: Int64?) -> Any {
        milliseconds.map { timestamp($0) } ?? NSNull()
    }

    /// "5m ago", "in 3s" relative to now.
    static func relative(_ milliseconds: Int64?, now: Int64 = SystemPresenceClock().nowMilliseconds()) -> String {
        guard let milliseconds else { return "never" }
        let delta = (now - milliseconds) / 1000
        let magnitude = abs(delta)
        let text: String
        switch magnitude {
        case ..<60: text = "\(magnitude)s"
        case ..<3600: text = "\(magnitude / 60)m"
        case ..<86400: text = "\(magnitude / 3600)h"
        default: text = "\(magnitude / 86400)d"
        }
        return delta >= 0 ? "\(text) ago" : "in \(text)"
    }

    /// A table with a header row; columns padded to their widest cell.
    static func table(_ header: [String], _ rows: [[String]]) -> String {
        let all = [header] + rows
        let widths = header.indices.map { column in all.map { $0[column].count }.max() ?? 0 }
        return all.map { row in
            row.enumerated().map { index, cell in
                index == row.count - 1 ? cell : cell.padding(toLength: widths[index], withPad: " ", startingAt: 0)
            }.joined(separator: "  ")
        }.joined(separator: "\n")
    }

    /// A presence as JSON.
    static func json(_ presence: Presence) -> [String: Any] {
        ["user_id": presence.userID, "status": presence.status.rawValue, "last_seen": jsonTimestamp(presence.lastSeen)]
    }
}
