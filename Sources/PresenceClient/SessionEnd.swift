import Foundation
import PresenceProtocol

/// How a session, or an attempt at one, ended, as ``PresenceClientEvent/sessionEnded(_:)``
/// announces it: enough for an app (or the terminal client) to say why it reconnects, which
/// ``ConnectionState/waiting(retryAt:)`` does not.
public struct SessionEnd: Sendable, Hashable {
    /// The gateway's close code; `nil` when there was none (the connection dropped, the upgrade
    /// was refused, or nothing answered).
    public var closeCode: UInt16?
    /// The HTTP upgrade was refused. The status is not known here (the transports do not pass it
    /// on): a node shutting down answers 400, and a gateway may answer a bad token with 401 (this
    /// one accepts the upgrade and closes with 4001, so that the client learns why).
    public var upgradeRefused: Bool
    /// Nothing answered: no node was reached, or the connection ended without a close code
    /// before the session opened (given up after `openTimeout` included).
    public var unreachable: Bool
    /// The session had opened (its `initial_state` came).
    public var opened: Bool
    /// What the client does next; `nil` when this device ended the session itself (sign-out,
    /// termination, the offline switch, the background policy, the network gone).
    public var next: ClientLifecycle.AfterClose?

    /// An end.
    public init(closeCode: UInt16?, upgradeRefused: Bool = false, unreachable: Bool = false, opened: Bool, next: ClientLifecycle.AfterClose?) {
        self.closeCode = closeCode
        self.upgradeRefused = upgradeRefused
        self.unreachable = unreachable
        self.opened = opened
        self.next = next
    }

    /// Whether the gateway refused the token: close 4001 (a bad or expired token).
    public var tokenRefused: Bool { closeCode == CloseCode.unauthorized.rawValue }

    /// Why, in a few words: "the gateway refused the token (4001)", "the node is starting or
    /// full (1013)", "no gateway answered", ...
    public var reason: String {
        if next == nil { return "ended by this device" }
        if upgradeRefused { return "the gateway refused the connection (HTTP upgrade refused: a node shutting down, or a refused token)" }
        guard let closeCode else {
            if unreachable { return "no gateway answered (connection refused or timed out, or dropped before the session opened)" }
            return "the connection dropped"
        }
        switch CloseCode(rawValue: closeCode) {
        case .normal?: return "the gateway closed the session (1000)"
        case .goingAway?: return "the node is going away (1001)"
        case .policyViolation?: return "the gateway closed the session for a broken rule (1008)"
        case .messageTooBig?: return "a frame was too large (1009)"
        case .internalError?: return "the node could not register the session (1011: it cannot reach Redis)"
        case .tryAgainLater?: return "the node is starting or full (1013)"
        case .unauthorized?: return "the gateway refused the token (4001)"
        case .disconnectedByAdmin?: return "an admin disconnected the user (4003)"
        case .replaced?: return "this device connected elsewhere (4009)"
        case .rateLimited?: return "rate limited past the limit (4029)"
        case nil: return "the gateway closed the session (\(closeCode))"
        }
    }

    /// What the client does next, in a few words: "reconnecting now", "reconnecting after the
    /// backoff", "not reconnecting"; empty when this device ended the session.
    public var outcome: String {
        switch next {
        case .reconnectNow(let newToken)?: newToken ? "reconnecting now with a new token" : "reconnecting now"
        case .reconnectAfterBackoff(let newToken)?: newToken ? "reconnecting after the backoff with a new token" : "reconnecting after the backoff"
        case .stop?: "not reconnecting"
        case nil: ""
        }
    }
}

/// Counts the gateway's refusals of the token in a row (close 4001), for a client whose token
/// source cannot do better than it did (the terminal client's `--token-command`, run again after
/// each refusal): after `limit` in a row, asking again is no use. Any other end starts the count
/// again.
public struct TokenRefusals: Sendable, Hashable {
    /// Refusals in a row that mean the token source cannot give an accepted token.
    public let limit: Int
    /// Refusals in a row so far.
    public private(set) var inARow = 0

    /// A count that gives up after `limit` refusals in a row.
    public init(limit: Int = 2) {
        precondition(limit >= 1, "a limit of at least one refusal")
        self.limit = limit
    }

    /// Counts an end; returns whether `limit` refusals have now come in a row.
    public mutating func record(_ end: SessionEnd) -> Bool {
        inARow = end.tokenRefused ? inARow + 1 : 0
        return inARow >= limit
    }
}
