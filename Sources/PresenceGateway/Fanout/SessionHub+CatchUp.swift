import NIOConcurrencyHelpers
import PresenceEngine

/// The catch-up of a hub's sessions: after a pub/sub reconnect, a data loss, or (on a cluster)
/// channels that moved, every session gets what it may have missed.
///
/// Each request is a scope to read again and a grace: a first pass at once (membership, then
/// presence, leaving users read offline as the sessions were told), and a second pass once the
/// grace is over, which may tell "offline". Requests queue; none cancels another, so a stream of
/// them (a long reshard moving one slot after another) never postpones an earlier request's
/// second pass, except for the users a later request holds back too.
extension SessionHub {
    /// The catch-up work waiting, and how long each user's "offline" is held back.
    struct CatchUps {
        /// What waits for its first pass (requests made while one ran are read together).
        var firstPass: ResyncScope?
        /// Second passes, each due when its grace is over.
        var secondPasses: [(due: ContinuousClock.Instant, scope: ResyncScope)] = []
        /// Until when every user read offline is left as told (a request for everything).
        var holdEveryone: ContinuousClock.Instant?
        /// The same for the users of requests that named them.
        var holdUsers: [String: ContinuousClock.Instant] = [:]
        /// The earliest moment a wake-up is already scheduled for.
        var wakeAt: ContinuousClock.Instant?
        /// Users a pass read offline with no record at all, whom a session was told are
        /// online or away: since when, and whether a pass is due once a grace has gone by.
        var unrecorded: [String: (since: ContinuousClock.Instant, scheduled: Bool)] = [:]

        /// Whether a user read offline is still to be left as told.
        func holdsOffline(_ user: String, now: ContinuousClock.Instant) -> Bool {
            max(holdEveryone ?? now, holdUsers[user] ?? now) > now
        }

        /// The next work due at `now`; otherwise when the next is due.
        mutating func next(now: ContinuousClock.Instant) -> (work: CatchUpWork?, wake: ContinuousClock.Instant?) {
            if let scope = firstPass {
                firstPass = nil
                return (.first(scope), nil)
            }
            let due = secondPasses.filter { $0.due <= now }
            if let first = due.first {
                secondPasses.removeAll { $0.due <= now }
                return (.second(due.dropFirst().reduce(first.scope) { $0.union($1.scope) }), nil)
            }
            let earliest = secondPasses.map(\.due).min()
            guard let earliest, wakeAt.map({ earliest < $0 || $0 <= now }) ?? true else { return (nil, nil) }
            wakeAt = earliest
            return (nil, earliest)
        }
    }

    /// A pass of the catch-up.
    enum CatchUpWork {
        /// Membership, then presence, holding back "offline".
        case first(ResyncScope)
        /// Presence again, once the grace is over.
        case second(ResyncScope)
    }

    /// Sends `session` the current presence of `users` it has not been told yet, as updates.
    /// A read that crossed an event about a user is repeated for that user, a few times at once,
    /// then again and again a moment later (off the caller's path) until a read is not crossed:
    /// the events held back during a crossed read are not told, and only a later read has them.
    /// Returns false when Redis could not be read. With `holdingBackOffline`, a user read as
    /// offline whom the session was told is online or away is left as told while a catch-up
    /// holds that user back (see ``startResync(grace:scope:)``), and, once that is over, while
    /// Redis has no record of them at all for less than a data-loss grace (see
    /// ``holdsUnrecorded(_:)``).
    @discardableResult
    func catchUp(
        _ session: Session, _ users: [String], holdingBackOffline: Bool = false, retryDelay: Duration = .milliseconds(20)
    ) async -> Bool {
        var pending = users
        for _ in 0..<4 where !pending.isEmpty {
            let mark = session.beginRead(pending)
            guard let reads = try? await engine.reads(of: pending) else {
                _ = session.endRead(pending, mark, snapshot: [])
                return false
            }
            if let probe = afterCatchUpRead.withLockedValue({ $0 }) { await probe(pending) }
            var presences: [Presence] = []
            for read in reads {
                let presence = read.views.seen(by: session.userID)
                if holdingBackOffline, presence.status == .offline, session.lastTold(presence.userID) != .offline {
                    if holdsOffline(presence.userID) {
                        if !read.recorded { noteUnrecorded(presence.userID) }
                        continue
                    }
                    if !read.recorded, holdsUnrecorded(presence.userID) { continue }
                }
                if read.recorded { catchUps.withLockedValue { _ = $0.unrecorded.removeValue(forKey: presence.userID) } }
                presences.append(presence)
            }
            var countsChanged: [String] = []
            let dirty = session.endRead(pending, mark, snapshot: presences) { remembered in
                zip(presences, remembered).compactMap { presence, change in
                    if change.statusChanged { countsChanged.append(presence.userID) }
                    return change.tell ? frames.text(.presenceUpdate(PresencePayload(presence))) : nil
                }
            }
            for user in countsChanged { session.sendGroupCounts(involving: user) }
            pending = dirty
        }
        if !pending.isEmpty, !session.isClosing {
            let again = pending
            Task {
                guard (try? await Task.sleep(for: retryDelay)) != nil, !session.isClosing else { return }
                await self.catchUp(session, again, holdingBackOffline: holdingBackOffline, retryDelay: min(retryDelay * 2, .seconds(1)))
            }
        }
        return true
    }

    /// Watches `users` and reads their presence, whether they were watched already or not:
    /// `snapshot` makes the frames to queue from what was read (an `initial_state` holding every
    /// one of them), queued before any event about them. Then catches up on users an event
    /// arrived for during the read.
    ///
    /// `users` were found visible to the session when `checks` were its visibility re-checks
    /// begun (``Session/visibilityChecks``). A membership change handled since, before they were
    /// watched, found them not watched and could not stop watching them: they are checked again
    /// once watched, and those no longer visible are neither watched nor read.
    func watchAndRead(
        _ session: Session, _ users: [String], visibleAsOf checks: Int, snapshot: ([Presence]) -> [String]
    ) async throws {
        // Marked before subscribing: an event that arrives between the two is held, not lost.
        let mark = session.beginRead(users)
        await watch(session, users)
        if session.visibilityChecks.begun != checks, engine.configuration.visibility == .conversations {
            do {
                let still = Set(try await engine.visible(to: session.userID, among: users))
                await unwatch(session, users.filter { !still.contains($0) })
            } catch {
                _ = session.endRead(users, mark, snapshot: [])
                throw error
            }
        }
        // A session unregistered meanwhile watches nothing: read only what it watches.
        let read = users.filter { session.isWatching($0) }
        let presences: [Presence]
        do {
            presences = try await engine.views(of: read).map { $0.seen(by: session.userID) }
        } catch {
            _ = session.endRead(users, mark, snapshot: [])
            throw error
        }
        _ = session.endRead(Array(Set(users).subtracting(read)), mark, snapshot: [])
        let dirty = session.endRead(read, mark, snapshot: presences) { _ in snapshot(presences) }
        if !dirty.isEmpty { await catchUp(session, dirty) }
    }

    /// How long after a data loss a re-read may tell watchers "offline": every live node finds
    /// its lease gone within a third of a lease and writes its sessions again; 2 s more for that.
    static func dataLossGrace(_ configuration: PresenceConfiguration) -> Duration {
        configuration.leaseTTL / 3 + .seconds(2)
    }

    /// Asks for a catch-up of every session, of what `scope` names: a first pass as soon as the
    /// running pass ends, and a second pass `grace` from now. Until then a user it names read as
    /// offline, whom a session was told is online, is left as told: Redis may have lost its data,
    /// and the nodes holding live sessions write them again within the grace. After an outage,
    /// the subscriber's reconnect asks for the recovery grace (other nodes may reach Redis seconds
    /// later) and this node's own finding of the data loss, a moment after, for a shorter one: a
    /// user's hold-back ends at the latest of the requests naming them.
    func startResync(grace: Duration, scope: ResyncScope = .everything) {
        catchUps.withLockedValue { catchUps in
            let now = ContinuousClock.now
            let until = now + grace
            if let users = scope.users {
                catchUps.holdUsers = catchUps.holdUsers.filter { $0.value > now }
                for user in users { catchUps.holdUsers[user] = max(catchUps.holdUsers[user] ?? until, until) }
            } else {
                catchUps.holdEveryone = max(catchUps.holdEveryone ?? until, until)
            }
            catchUps.firstPass = catchUps.firstPass.map { $0.union(scope) } ?? scope
            catchUps.secondPasses.append((until, scope))
        }
        catchUpWakeups.yield()
    }

    /// Runs the catch-up passes as they come due, one at a time, until cancelled.
    func runCatchUps() async {
        for await _ in catchUpWakeups.stream {
            while !Task.isCancelled {
                let (work, wake) = catchUps.withLockedValue { $0.next(now: .now) }
                if let wake {
                    Task {
                        try? await Task.sleep(until: wake, clock: .continuous)
                        self.catchUps.withLockedValue { if $0.wakeAt == wake { $0.wakeAt = nil } }
                        self.catchUpWakeups.yield()
                    }
                }
                guard let work else { break }
                switch work {
                case .first(let scope):
                    await refreshMembershipOfEverySession(scope)
                    await catchUpEverySession(scope, holdingBackOffline: true)
                case .second(let scope):
                    await catchUpEverySession(scope, holdingBackOffline: true)
                }
            }
        }
    }

    /// Whether a catch-up leaves `user`, read as offline, as the sessions were told.
    func holdsOffline(_ user: String) -> Bool {
        catchUps.withLockedValue { $0.holdsOffline(user, now: .now) }
    }

    /// Notes that a read found `user` with no record at all, from now unless noted before.
    private func noteUnrecorded(_ user: String) {
        let grace = Self.dataLossGrace(engine.configuration)
        catchUps.withLockedValue { catchUps in
            let now = ContinuousClock.now
            if let noted = catchUps.unrecorded[user], now - noted.since < grace * 4 { return }
            catchUps.unrecorded = catchUps.unrecorded.filter { now - $0.value.since < grace * 4 }
            catchUps.unrecorded[user] = (now, false)
        }
    }

    /// Whether `user`, read with no record at all once their hold-back was over, is still left
    /// as told. A loss that came just before that read (a FLUSHALL a moment before a pass is due)
    /// has not been found by anyone yet: until one data-loss grace has gone by since a read
    /// first found no record, the user is left as told, with a catch-up due at its end, for the
    /// node holding their session to write it again. A user still without a record then is
    /// offline; one found without a record long enough before (by reads the hold-back covered)
    /// is told at once.
    func holdsUnrecorded(_ user: String) -> Bool {
        noteUnrecorded(user)
        let grace = Self.dataLossGrace(engine.configuration)
        let due = catchUps.withLockedValue { catchUps -> Duration? in
            guard let noted = catchUps.unrecorded[user] else { return nil }
            let left = grace - (ContinuousClock.now - noted.since)
            guard left > .zero else { return nil }
            if noted.scheduled { return .zero }
            catchUps.unrecorded[user]?.scheduled = true
            return left
        }
        guard let due else { return false }
        if due > .zero { startResync(grace: due, scope: ResyncScope(users: [user], conversations: [])) }
        return true
    }

    /// Membership events missed too: whom each session may see (its user's conversations, which
    /// `scope` names by the user), and who is in each conversation it follows, are read again.
    private func refreshMembershipOfEverySession(_ scope: ResyncScope) async {
        // Each user's conversations once, for all of the user's sessions here (their messages).
        let byUser = Dictionary(grouping: allSessions.filter { !$0.isClosing && scope.contains(user: $0.userID) }, by: \.userID)
        for (_, sessions) in byUser.sorted(by: { $0.key < $1.key }) {
            guard !Task.isCancelled else { return }
            await refreshMessageRoutes(of: sessions)
        }
        for session in allSessions where !session.isClosing {
            guard !Task.isCancelled else { return }
            if scope.contains(user: session.userID) { await refreshVisibility(session) }
            for conversation in session.followed where scope.contains(conversation: conversation) {
                await refreshMembers(session, conversation)
            }
        }
    }

    /// Reads are retried until Redis answers: the command connection may come back later than
    /// the subscriber's.
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

/// Wakes a runner of queued work (catch-ups, membership changes): work came, or is due.
struct Wakeups: Sendable {
    let stream: AsyncStream<Void>
    private let continuation: AsyncStream<Void>.Continuation

    init() {
        (stream, continuation) = AsyncStream.makeStream(of: Void.self, bufferingPolicy: .bufferingNewest(1))
    }

    func yield() { continuation.yield() }
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
