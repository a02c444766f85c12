import NIOConcurrencyHelpers
import PresenceEngine

/// Membership changes, applied off the event path: the event that announces one only queues it,
/// so presence and typing events keep flowing while members and contacts are read again. Queued
/// changes merge (one entry per conversation and per user), and each is read once for every
/// session it concerns: a change to a conversation followed by 2,000 sessions on this node is one
/// read of its members, not 2,000.
extension SessionHub {
    /// The users whose contacts, and the conversations whose members, are to be read again.
    struct PendingMembership {
        var users: Set<String> = []
        var conversations: Set<String> = []
        /// Users removed from a large group: whoever watches them checks they may still.
        var departed: Set<String> = []

        var isEmpty: Bool { users.isEmpty && conversations.isEmpty && departed.isEmpty }
    }

    /// A membership change concerning `user` (their conversations changed): their sessions'
    /// contacts are read again.
    func queueMembership(user: String) {
        pendingMembership.withLockedValue { _ = $0.users.insert(user) }
        membershipWakeups.yield()
    }

    /// `user` left a large group: the sessions watching them check whether they may still.
    func queueDeparture(_ user: String) {
        pendingMembership.withLockedValue { _ = $0.departed.insert(user) }
        membershipWakeups.yield()
    }

    /// A membership change of `conversation`: the sessions following it read its members again.
    func queueMembership(conversation: String) {
        pendingMembership.withLockedValue { _ = $0.conversations.insert(conversation) }
        membershipWakeups.yield()
    }

    /// Applies queued membership changes, all that queued meanwhile at each turn, until cancelled.
    func runMembershipWork() async {
        for await _ in membershipWakeups.stream {
            while !Task.isCancelled {
                let work = pendingMembership.withLockedValue { pending in
                    defer { pending = PendingMembership() }
                    return pending
                }
                guard !work.isEmpty else { break }
                await applyMembershipChanges(work)
            }
        }
    }

    /// Reads each conversation's members once for its followers, each user's contacts once for
    /// their sessions, and for each user who left a large group, whether each user watching
    /// them here may still. A read that fails is left to the catch-up that follows a reconnect.
    func applyMembershipChanges(_ work: PendingMembership) async {
        if let probe = beforeMembershipWork.withLockedValue({ $0 }) { await probe() }
        for conversation in work.conversations.sorted() {
            let followers = followers(of: conversation)
            guard !followers.isEmpty, let read = try? await engine.members(of: conversation) else { continue }
            for session in followers where !session.isClosing { await applyMembers(session, conversation, read) }
        }
        // Whose conversations changed: their sessions receive the messages of the new ones, and
        // none of those they left.
        for user in work.users.sorted() {
            let own = sessions(of: user)
            if !own.isEmpty { await refreshMessageRoutes(of: own) }
        }
        guard engine.configuration.visibility == .conversations else { return }
        for user in work.users.sorted() {
            let own = sessions(of: user)
            guard !own.isEmpty else { continue }
            // Begun before the read: a watch that read visibility earlier checks it again.
            for session in own { session.visibilityCheck(ended: false) }
            if let contacts = try? await engine.contacts(of: user) {
                for session in own where !session.isClosing { await applyContacts(session, contacts) }
            }
            for session in own { session.visibilityCheck(ended: true) }
        }
        for departed in work.departed.sorted() {
            // One read per watching user, for all of that user's sessions here.
            for (user, sessions) in Dictionary(grouping: watchers(of: departed), by: \.userID).sorted(by: { $0.key < $1.key }) {
                for session in sessions { session.visibilityCheck(ended: false) }
                if let still = try? await engine.visible(to: user, among: [departed]), !still.contains(departed) {
                    for session in sessions { await unwatch(session, [departed]) }
                }
                for session in sessions { session.visibilityCheck(ended: true) }
            }
        }
    }

    /// Reads a followed conversation's members again and applies what changed: new members are
    /// watched and caught up on, and a session whose user left stops following it. After a
    /// membership event, after following (a change between the first read and the session's
    /// view being set up), and after events may have been missed.
    func refreshMembers(_ session: Session, _ conversation: String) async {
        let read: [String]?
        do {
            read = try await engine.members(of: conversation)
        } catch {
            return
        }
        await applyMembers(session, conversation, read)
    }

    /// Applies a read of a followed conversation's members (nil: it is gone) to `session`.
    func applyMembers(_ session: Session, _ conversation: String, _ read: [String]?) async {
        // Gone, or the user left it: the subscription ends.
        guard let members = read, members.contains(session.userID) else {
            await unfollow(session, conversation)
            return
        }
        let added = await watch(session, members)
        session.updateMembers(conversation, Set(members), large: members.count > engine.configuration.largeGroup, quiet: added)
        await catchUp(session, added)
        session.sendGroupCounts(involving: nil)
    }

    /// Re-checks who `session` may see after a membership change: new contacts become watched,
    /// users it may no longer see stop producing events.
    func refreshVisibility(_ session: Session) async {
        guard engine.configuration.visibility == .conversations else { return }
        session.visibilityCheck(ended: false)
        defer { session.visibilityCheck(ended: true) }
        guard let contacts = try? await engine.contacts(of: session.userID) else { return }
        await applyContacts(session, contacts)
    }

    /// Applies a read of `session`'s user's automatic contacts (see ``refreshVisibility(_:)``).
    func applyContacts(_ session: Session, _ contacts: [String]) async {
        let contactSet = Set(contacts)
        let doubtful = session.watched.filter { $0 != session.userID && !contactSet.contains($0) }
        if !doubtful.isEmpty, let still = try? await engine.visible(to: session.userID, among: Array(doubtful)) {
            await unwatch(session, Array(Set(doubtful).subtracting(still)))
        }
        let added = await watch(session, contacts)
        await catchUp(session, added)
    }
}
