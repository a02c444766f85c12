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

        var isEmpty: Bool { users.isEmpty && conversations.isEmpty }
    }

    /// A membership change concerning `user` (their conversations changed): their sessions'
    /// contacts are read again.
    func queueMembership(user: String) {
        pendingMembership.withLockedValue { _ = $0.users.insert(user) }
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

    /// Reads each conversation's members once for its followers, and each user's contacts once
    /// for their sessions. A read that fails is left to the catch-up that follows a reconnect.
    func applyMembershipChanges(_ work: PendingMembership) async {
        if let probe = beforeMembershipWork.withLockedValue({ $0 }) { await probe() }
        for conversation in work.conversations.sorted() {
            let followers = followers(of: conversation)
            guard !followers.isEmpty, let read = try? await engine.members(of: conversation) else { continue }
            for session in followers where !session.isClosing { await applyMembers(session, conversation, read) }
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
    }
}
