import PresenceProtocol

/// How many members of a conversation are online and away: "3 of 5 online". A session keeps
/// one for each conversation it follows and moves it by each change; REST counts a read.
struct GroupCounts: Equatable, Sendable {
    var total = 0
    var online = 0
    var away = 0

    /// Counts a list of statuses, one per member.
    init(_ statuses: some Sequence<PresenceStatus>) {
        for status in statuses {
            total += 1
            count(status, +1)
        }
    }

    /// Moves the online or away count by `delta` for a member with `status`; the total is the
    /// membership's, which a status does not change.
    mutating func count(_ status: PresenceStatus, _ delta: Int) {
        switch status {
        case .online: online += delta
        case .away: away += delta
        case .offline: break
        }
    }

    /// The counts as a `group_presence` frame carries them.
    func payload(_ conversation: String) -> GroupPresence {
        GroupPresence(conversationID: conversation, total: total, online: online, away: away)
    }
}
