import Foundation

/// The words apps show for presence: "Online", "Last seen 5m ago", "3 of 5 online",
/// "Alice is typing…". English; apps with other languages build theirs from the same values.
public enum PresenceText {
    /// "Online", "Away", "Last seen just now / 5m ago / 3h ago / 2d ago / on 2026-11-01",
    /// or "Offline" for a user never seen.
    public static func status(_ presence: PresenceSnapshot?, now: Date) -> String {
        guard let presence else { return "Offline" }
        switch presence.status {
        case .online: return "Online"
        case .away: return "Away"
        case .offline: return lastSeen(presence.lastSeen, now: now)
        }
    }

    /// "Last seen 5m ago" and its kin; "Offline" for `nil`.
    public static func lastSeen(_ lastSeen: Date?, now: Date) -> String {
        guard let lastSeen else { return "Offline" }
        let seconds = max(0, now.timeIntervalSince(lastSeen))
        switch seconds {
        case ..<60: return "Last seen just now"
        case ..<3600: return "Last seen \(Int(seconds / 60))m ago"
        case ..<86_400: return "Last seen \(Int(seconds / 3600))h ago"
        case ..<(7 * 86_400): return "Last seen \(Int(seconds / 86_400))d ago"
        default:
            let day = lastSeen.formatted(Date.ISO8601FormatStyle(timeZone: .gmt).year().month().day())
            return "Last seen on \(day)"
        }
    }

    /// When `lastSeen(_:now:)` next reads differently, so a label can be refreshed then and not
    /// every second; `nil` when it never will.
    public static func nextChange(of lastSeen: Date?, after now: Date) -> Date? {
        guard let lastSeen else { return nil }
        let seconds = max(0, now.timeIntervalSince(lastSeen))
        let step: TimeInterval
        switch seconds {
        case ..<3600: step = 60
        case ..<86_400: step = 3600
        case ..<(7 * 86_400): step = 86_400
        default: return nil
        }
        return lastSeen.addingTimeInterval((seconds / step).rounded(.down) * step + step)
    }

    /// A status label that stays current: the text now, then each time it changes, until the
    /// consumer stops.
    public static func updatingStatus(_ presence: PresenceSnapshot?, clock: any PresenceClientClock = SystemPresenceClock()) -> AsyncStream<String> {
        AsyncStream { continuation in
            let task = Task {
                var now = clock.now
                continuation.yield(status(presence, now: now))
                while presence?.status == .offline, let next = nextChange(of: presence?.lastSeen, after: now) {
                    do { try await clock.sleep(until: next) } catch { break }
                    now = clock.now
                    continuation.yield(status(presence, now: now))
                }
                continuation.finish()
            }
            continuation.onTermination = { _ in task.cancel() }
        }
    }

    /// "3 of 5 online" (members away are not counted as online).
    public static func group(_ group: GroupPresence) -> String {
        "\(group.online) of \(group.total) online"
    }

    /// "Alice is typing…", "Alice and Bob are typing…", "Alice, Bob and 2 others are typing…";
    /// empty when nobody is.
    public static func typing(_ names: [String]) -> String {
        switch names.count {
        case 0: return ""
        case 1: return "\(names[0]) is typing…"
        case 2: return "\(names[0]) and \(names[1]) are typing…"
        case 3: return "\(names[0]), \(names[1]) and \(names[2]) are typing…"
        default: return "\(names[0]), \(names[1]) and \(names.count - 2) others are typing…"
        }
    }
}
