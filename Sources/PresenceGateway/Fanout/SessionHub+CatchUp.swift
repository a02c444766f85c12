import NIOConcurrencyHelpers
import PresenceEngine

/// The catch-up of a hub's sessions: after a pub/sub reconnect, a data loss, or (on a cluster)
/// channels that moved, every session gets what it may have missed.
extension SessionHub {
    /// The running catch-up, if any, and the state a newer one takes over.
    struct CatchUps {
        /// The catch-up under way; a newer one replaces it.
        var running: Task<Void, Never>?
        /// What the running catch-up reads again (nil when none runs): a newer one reads this too.
        var scope: ResyncScope?
        /// Counts catch-ups started, so that one ending clears only its own scope.
        var generation = 0
        /// Until when catch-ups leave users told online or away as told when they read them
        /// offline; a newer catch-up may move it later, never earlier.
        var holdOfflineUntil: ContinuousClock.Instant?
    }

    /// How long after a data loss a re-read may tell watchers "offline": every live node finds
    /// its lease gone within a third of a lease and writes its sessions again; 2 s more for that.
    static func dataLossGrace(_ configuration: PresenceConfiguration) -> Duration {
        configuration.leaseTTL / 3 + .seconds(2)
    }

    /// Starts a catch-up of every session (see ``resync(holdingOfflineUntil:scope:)``), of what
    /// `scope` names; a newer one replaces it, reading what both name, and never ends the
    /// hold-back on offline sooner than the one it replaces.
    /// After an outage, the subscriber's reconnect asks for the recovery grace (other nodes may
    /// reach Redis seconds later) and this node's own finding of the data loss, a moment after,
    /// for a shorter one: taking the shorter would tell watchers "offline" for the users of a
    /// node that has not come back yet.
    func startResync(grace: Duration, scope: ResyncScope = .everything) {
        catchUps.withLockedValue { catchUps in
            let until = max(catchUps.holdOfflineUntil ?? .now, .now + grace)
            catchUps.holdOfflineUntil = until
            catchUps.running?.cancel()
            let scope = catchUps.scope.map { $0.union(scope) } ?? scope
            catchUps.scope = scope
            catchUps.generation += 1
            let generation = catchUps.generation
            catchUps.running = Task {
                await self.resync(holdingOfflineUntil: until, scope: scope)
                self.catchUps.withLockedValue { catchUps in
                    if catchUps.generation == generation { catchUps.scope = nil }
                }
            }
        }
    }

    /// After a pub/sub reconnect or a data loss: every session gets what changed while events
    /// could be missed, or what Redis no longer has: membership first, then presence.
    ///
    /// Reads are retried until Redis answers: the command connection may come back later than
    /// the subscriber's. A user read as offline whom a session was told is online is told so only
    /// at `until`, in a second pass. Redis may have lost its data, and the nodes holding live
    /// sessions write them again by then; the first read would show those users offline for a
    /// moment.
    private func resync(holdingOfflineUntil until: ContinuousClock.Instant, scope: ResyncScope) async {
        await refreshMembershipOfEverySession(scope)
        await catchUpEverySession(scope, holdingBackOffline: true)
        guard (try? await Task.sleep(until: until, clock: .continuous)) != nil else { return }
        await catchUpEverySession(scope, holdingBackOffline: false)
    }

    /// Membership events missed too: whom each session may see (its user's conversations, which
    /// `scope` names by the user), and who is in each conversation it follows, are read again.
    private func refreshMembershipOfEverySession(_ scope: ResyncScope) async {
        for session in allSessions where !session.isClosing {
            guard !Task.isCancelled else { return }
            if scope.contains(user: session.userID) { await refreshVisibility(session) }
            for conversation in session.followed where scope.contains(conversation: conversation) {
                await refreshMembers(session, conversation)
            }
        }
    }

    private func catchUpEverySession(_ scope: ResyncScope, holdingBackOffline: Bool) async {
        var pending = allSessions
        var delay = Duration.milliseconds(100)
        while !Task.isCancelled {
            var failed: [Session] = []
            for session in pending where !session.isClosing {
                let users = session.watched.filter { scope.contains(user: $0) }
                guard !users.isEmpty else { continue }
                if await !catchUp(session, Array(users), holdingBackOffline: holdingBackOffline) { failed.append(session) }
            }
            guard !failed.isEmpty else { return }
            pending = failed
            guard (try? await Task.sleep(for: delay)) != nil else { return }
            delay = min(delay * 2, .seconds(2))
        }
    }
}

/// What a catch-up reads again: everything (after a reconnect or a data loss), or what the
/// channels of some users and conversations carry (after those channels moved on a cluster).
struct ResyncScope: Sendable {
    /// The users whose presence and visibility are read again; nil: every user.
    var users: Set<String>?
    /// The conversations whose members are read again; nil: every conversation.
    var conversations: Set<String>?

    static let everything = ResyncScope(users: nil, conversations: nil)

    func contains(user: String) -> Bool { users?.contains(user) ?? true }
    func contains(conversation: String) -> Bool { conversations?.contains(conversation) ?? true }

    /// What both read again.
    func union(_ other: ResyncScope) -> ResyncScope {
        ResyncScope(
            users: users.flatMap { mine in other.users.map { mine.union($0) } },
            conversations: conversations.flatMap { mine in other.conversations.map { mine.union($0) } }
        )
    }
}
