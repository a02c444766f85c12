// The engine speaks in the protocol's statuses and ids: its users get them with it.
@_exported import PresenceProtocol

/// What a viewer is allowed to know of a user right now.
public struct Presence: Sendable, Equatable, Codable {
    /// The user.
    public var userID: String
    /// The aggregate status as this viewer may see it.
    public var status: PresenceStatus
    /// Milliseconds since 1970 of the last moment the user was known online or away; `nil` if never.
    public var lastSeen: Int64?

    /// Makes a presence value.
    public init(userID: String, status: PresenceStatus, lastSeen: Int64?) {
        self.userID = userID
        self.status = status
        self.lastSeen = lastSeen
    }
}

/// A user's presence both as it is and as others see it (they differ while the user hides).
public struct PresenceViews: Sendable, Equatable {
    /// The truth, for the user's own devices.
    public var real: Presence
    /// What everyone else sees.
    public var shown: Presence
    /// Whether `show_online_status` is off.
    public var hidden: Bool

    /// The view for `viewer`.
    public func seen(by viewer: String) -> Presence {
        viewer == real.userID ? real : shown
    }
}

/// A user as read from Redis.
public struct UserRead: Sendable, Equatable {
    /// The real and shown presence.
    public var views: PresenceViews
    /// Whether Redis holds the user's state at all. A user whose devices ever connected keeps
    /// it (offline, with `last_seen`), so none for such a user means Redis lost it (a FLUSHALL,
    /// a failover to an empty replica) and the nodes holding their sessions have not yet
    /// written them again.
    public var recorded: Bool
}

/// The outcome of a change: whether the aggregate moved, and the views after it.
public struct PresenceChange: Sendable, Equatable {
    /// The real aggregate changed (an event went to the user's own devices).
    public var changed: Bool
    /// What others see changed (an event went to every watcher).
    public var shownChanged: Bool
    /// The state after the change.
    public var views: PresenceViews
}

/// One event published on a user's channel by the presence scripts.
public struct PresenceEvent: Sendable, Equatable, Codable {
    /// The views after the change.
    public var views: PresenceViews
    /// Whether the real aggregate changed.
    public var changed: Bool
    /// Whether what others see changed.
    public var shownChanged: Bool
    /// When the change happened (ms since 1970).
    public var at: Int64

    /// The update `viewer` should get, or `nil` if nothing they can see changed.
    public func update(for viewer: String) -> Presence? {
        if viewer == views.real.userID { return changed || shownChanged ? views.real : nil }
        return shownChanged ? views.shown : nil
    }
}

extension PresenceViews: Codable {}

/// One device of a user, as `presencectl user` shows it.
public struct DeviceRecord: Sendable, Equatable, Codable {
    /// The device id.
    public var deviceID: String
    /// Its own status.
    public var status: PresenceStatus
    /// The node whose session holds it; empty for a REST device or one lingering after a drop.
    public var node: String
    /// Since when it has had this status (ms).
    public var since: Int64
    /// When it goes offline unless renewed (ms); `nil` while a live session holds it.
    public var deadline: Int64?
    /// The last moment it was known alive (ms).
    public var lastAlive: Int64
}

/// Who may see whom (docs/API.md, "Who may see whom").
public enum Visibility: String, Sendable, CaseIterable {
    /// Users sharing at least one conversation, and oneself.
    case conversations
    /// Any authenticated user sees anyone.
    case open
}

/// An error of the presence engine: a code the gateway maps to an HTTP answer, and words.
public struct PresenceError: Error, Sendable, CustomStringConvertible {
    /// What kind of failure this is.
    public enum Code: String, Sendable {
        /// The presence store is unreachable (503).
        case unavailable
        /// An id or a value is not acceptable (422).
        case invalidRequest = "invalid_request"
        /// A per-user limit was reached (429).
        case limitReached = "limit_reached"
        /// The caller is not allowed to do this (403), e.g. typing in a conversation they are not in.
        case forbidden
        /// No such thing (404), e.g. a conversation that does not exist.
        case notFound = "not_found"
        /// A value over its size limit (413), e.g. a message's text.
        case payloadTooLarge = "payload_too_large"
        /// Something that should not happen (500).
        case `internal`
    }

    /// What kind of failure this is.
    public let code: Code
    /// A human readable explanation.
    public let message: String
    /// The error that caused this one, if any.
    public let underlying: (any Error)?

    /// Makes an error.
    public init(_ code: Code, _ message: String, underlying: (any Error)? = nil) {
        self.code = code
        self.message = message
        self.underlying = underlying
    }

    public var description: String { message }
}
