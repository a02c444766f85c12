import Foundation
// Statuses, group counts and error codes are the protocol's own types: an app imports the SDK alone.
@_exported import PresenceProtocol

/// What is known of one user: their aggregate status and when they were last seen live.
public struct PresenceSnapshot: Sendable, Hashable {
    /// The user.
    public var userID: String
    /// Their aggregate status over every device.
    public var status: PresenceStatus
    /// The last moment they were online or away; `nil` if never seen.
    public var lastSeen: Date?

    /// A snapshot.
    public init(userID: String, status: PresenceStatus, lastSeen: Date?) {
        self.userID = userID
        self.status = status
        self.lastSeen = lastSeen
    }

    /// A snapshot of what a frame said.
    init(_ payload: PresencePayload) {
        self.init(userID: payload.userID, status: payload.status,
                  lastSeen: payload.lastSeen.map { Date(timeIntervalSince1970: Double($0) / 1000) })
    }
}

/// The client's link to the gateway.
public enum ConnectionState: Sendable, Hashable {
    /// Not connected, and not trying: the app is signed out, terminated, or has no network.
    case idle
    /// Opening a session.
    case connecting
    /// The session is open and the cache has caught up.
    case connected
    /// The session dropped; the next attempt is at `retryAt`.
    case waiting(retryAt: Date)
    /// The client stopped for good and will not reconnect.
    case stopped(StopReason)
}

/// Why the client stopped reconnecting.
public enum StopReason: Sendable, Hashable {
    /// The app signed out or terminated.
    case signedOut
    /// An admin disconnected the user (close code 4003).
    case disconnectedByAdmin
    /// Another session took this device over (close code 4009): the same `device_id` is in use
    /// elsewhere, and reconnecting would only take it back.
    case replaced
}

/// A change the client observed; every cache change is announced as one.
public enum PresenceClientEvent: Sendable, Hashable {
    /// The connection state changed.
    case connection(ConnectionState)
    /// A user's presence changed, or was learned.
    case presence(PresenceSnapshot)
    /// A user is no longer visible (or no longer watched).
    case removed(userID: String)
    /// A user started or stopped typing in a conversation.
    case typing(conversationID: String, userID: String, isTyping: Bool)
    /// A conversation's counts changed.
    case group(GroupPresence)
    /// The gateway answered a request with an error (`forbidden`, `invalid_request`,
    /// `rate_limited`, ...).
    case error(code: ErrorCode, message: String)
    /// A message joined ``PresenceClient/messages(in:)``: written here (`sending`), or
    /// delivered by the gateway (a message this device did not write). One written here
    /// announces its later changes (`sent` once stored, ...) as ``messageStatus(_:)``.
    case message(ChatMessage)
    /// A message's status changed.
    case messageStatus(MessageStatusChange)
    /// A `sync` could not give some messages (trimmed, or a history Redis lost).
    case messageGap(MessageGap)
    /// Messages this device held that Redis lost (it went back in time: the history forked, and
    /// `synced` named them in `truncated`). Other members' messages in the range left
    /// ``PresenceClient/messages(in:)``; this device's own went back to the outbox as `sending`
    /// (a ``messageStatus(_:)``) and are sent again with the same `client_message_id`.
    case messageTruncated(MessageGap)
    /// A session (or an attempt at one) ended: why, and what the client does next. Comes before
    /// the ``connection(_:)`` state that follows.
    case sessionEnded(SessionEnd)
}

/// An error of the client library.
public struct PresenceClientError: Error, Sendable, CustomStringConvertible {
    /// A machine-readable code.
    public var code: String
    /// A human message.
    public var message: String

    /// An error.
    public init(code: String, message: String) {
        self.code = code
        self.message = message
    }

    public var description: String { "\(code): \(message)" }

    static func invalid(_ message: String) -> Self { .init(code: "invalid_request", message: message) }
}

/// Ids as the gateway accepts them (``PresenceID``), checked before anything is sent.
enum ClientID {
    static func check(_ ids: [String], _ what: String) throws(PresenceClientError) {
        for id in ids where !PresenceID.isValid(id) {
            throw .invalid("\(what) \(id.debugDescription) is not \(PresenceID.rule)")
        }
    }
}
