import Foundation

/// What the client knows of others: presences, conversation counts and who is typing. Every
/// change returns the events it causes, and only real changes cause one.
public struct PresenceCache: Sendable {
    /// Presences by user id.
    public private(set) var presences: [String: PresenceSnapshot] = [:]
    /// Counts by conversation id.
    public private(set) var groups: [String: GroupPresence] = [:]
    /// Conversation → user → when their typing indicator goes away if no update comes.
    private var typing: [String: [String: Date]] = [:]
    /// Users not yet confirmed by the session that is catching up after a (re)connect.
    private var unconfirmed: Set<String>?

    /// An empty cache.
    public init() {}

    /// Users typing in `conversation`, sorted.
    public func typingUsers(in conversation: String) -> [String] {
        (typing[conversation] ?? [:]).keys.sorted()
    }

    /// Whether `user` is typing in any conversation.
    public func isTyping(_ user: String) -> Bool {
        typing.values.contains { $0[user] != nil }
    }

    /// Takes in a presence: `initial_state` entries and `presence_update`s alike.
    public mutating func apply(_ snapshot: PresenceSnapshot) -> [PresenceClientEvent] {
        unconfirmed?.remove(snapshot.userID)
        guard presences[snapshot.userID] != snapshot else { return [] }
        presences[snapshot.userID] = snapshot
        var events: [PresenceClientEvent] = [.presence(snapshot)]
        // Someone who went offline stops typing everywhere.
        if snapshot.status == .offline {
            for conversation in typing.keys.sorted() where typing[conversation]?[snapshot.userID] != nil {
                events += setTyping(snapshot.userID, in: conversation, false, expiresAt: nil)
            }
        }
        return events
    }

    /// The answer to a `subscribe` of `requested` users: those left out are not visible.
    public mutating func applySnapshot(_ snapshots: [PresenceSnapshot], requested: [String]) -> [PresenceClientEvent] {
        var events = snapshots.flatMap { apply($0) }
        let answered = Set(snapshots.map(\.userID))
        events += remove(requested.filter { !answered.contains($0) })
        return events
    }

    /// Forgets users (unwatched, or not visible any more).
    public mutating func remove(_ users: [String]) -> [PresenceClientEvent] {
        var events: [PresenceClientEvent] = []
        for user in users where presences.removeValue(forKey: user) != nil {
            for conversation in typing.keys.sorted() where typing[conversation]?[user] != nil {
                events += setTyping(user, in: conversation, false, expiresAt: nil)
            }
            events.append(.removed(userID: user))
        }
        return events
    }

    /// Takes in a conversation's counts.
    public mutating func apply(_ group: GroupPresence) -> [PresenceClientEvent] {
        guard groups[group.conversationID] != group else { return [] }
        groups[group.conversationID] = group
        return [.group(group)]
    }

    /// Forgets a conversation that was left: its counts and its typing.
    public mutating func removeConversation(_ conversation: String) -> [PresenceClientEvent] {
        groups[conversation] = nil
        let users = typingUsers(in: conversation)
        typing[conversation] = nil
        return users.map { .typing(conversationID: conversation, userID: $0, isTyping: false) }
    }

    /// Takes in a `typing_update`. A start shows until a stop or until `expiresAt`, in case the
    /// stop is never heard.
    public mutating func setTyping(_ user: String, in conversation: String, _ isTyping: Bool, expiresAt: Date?) -> [PresenceClientEvent] {
        let wasTyping = typing[conversation]?[user] != nil
        if isTyping, let expiresAt {
            typing[conversation, default: [:]][user] = expiresAt
        } else {
            typing[conversation]?[user] = nil
            if typing[conversation]?.isEmpty == true { typing[conversation] = nil }
        }
        return wasTyping == isTyping ? [] : [.typing(conversationID: conversation, userID: user, isTyping: isTyping)]
    }

    /// Ends typing indicators whose time ran out by `now`.
    public mutating func expireTyping(at now: Date) -> [PresenceClientEvent] {
        var events: [PresenceClientEvent] = []
        for conversation in typing.keys.sorted() {
            for (user, expiry) in typing[conversation] ?? [:] where expiry <= now {
                events += setTyping(user, in: conversation, false, expiresAt: nil)
            }
        }
        return events
    }

    /// Ends every typing indicator (the connection dropped, or this device appears offline).
    public mutating func clearTyping() -> [PresenceClientEvent] {
        var events: [PresenceClientEvent] = []
        for conversation in typing.keys.sorted() {
            for user in typingUsers(in: conversation) {
                events.append(.typing(conversationID: conversation, userID: user, isTyping: false))
            }
        }
        typing = [:]
        return events
    }

    /// When the next typing indicator runs out.
    public var nextTypingExpiry: Date? {
        typing.values.flatMap(\.values).min()
    }

    /// A new session starts catching up: every presence known now must be confirmed by it.
    public mutating func beginCatchUp() {
        unconfirmed = Set(presences.keys)
    }

    /// The new session has answered everything it was asked: who it did not confirm is no
    /// longer visible.
    public mutating func endCatchUp() -> [PresenceClientEvent] {
        guard let stale = unconfirmed else { return [] }
        unconfirmed = nil
        return remove(stale.sorted())
    }
}
