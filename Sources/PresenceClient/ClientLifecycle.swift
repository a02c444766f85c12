import Foundation

/// The decisions of a client, apart from any I/O: which status the device should have, whether
/// to be connected, what to do after a close, and which status change is still owed to the
/// gateway (the offline queue: latest wins, sent once).
public struct ClientLifecycle: Sendable {
    /// Where the app is.
    public enum Phase: Sendable, Hashable {
        /// In the foreground.
        case active
        /// In the background: shown as away.
        case background
        /// Terminating: offline, connection closed cleanly.
        case terminated
        /// Signed out: offline, connection closed cleanly, for good.
        case signedOut
    }

    /// What the device shows while the app is in the background.
    public enum BackgroundPolicy: Sendable, Hashable {
        /// Away at once; the session stays while the system lets it (the default).
        case away
        /// Away at once, and after `after` seconds in the background the session closes
        /// cleanly (offline at once) until the app is active again. `after: 0` goes offline
        /// without showing away first.
        case offline(after: TimeInterval)
    }

    /// What to do once a session has ended.
    public enum AfterClose: Sendable, Hashable {
        /// Open a new session at once (another node is up; a new token may be needed).
        case reconnectNow(newToken: Bool)
        /// Wait for the backoff, then open a new session.
        case reconnectAfterBackoff(newToken: Bool)
        /// Do not reconnect.
        case stop(StopReason)
    }

    /// Where the app is.
    public private(set) var phase = Phase.active
    /// What the background means for presence.
    public var backgroundPolicy = BackgroundPolicy.away
    /// When the background's offline policy takes the session down, while it is still to come.
    public private(set) var backgroundDeadline: Date?
    /// Whether the background's offline policy has taken the session down.
    public private(set) var offlineInBackground = false
    /// Whether the device has a network path.
    public private(set) var networkAvailable = true
    /// The app's own offline switch (airplane mode for this client): offline, no session.
    public private(set) var offlineMode = false
    /// The status the person chose for when the app is active.
    public private(set) var chosenStatus = PresenceStatus.online
    /// Set once the client must not reconnect.
    public private(set) var stopReason: StopReason?
    /// The status the open session has on the gateway (opened with, or last sent); `nil` when
    /// there is no session or a change was refused.
    public private(set) var sessionStatus: PresenceStatus?
    /// Whether a session is open.
    public private(set) var inSession = false
    /// Not before this moment may a refused status change be sent again.
    public private(set) var statusRetryAt: Date?
    private var quickRetryUsed = false
    /// Nodes tried in a row, each closing with 1011 or 1013, or not reached at all.
    private var nodesThatCouldNotServe = 0

    /// A client in the foreground, online, with a network.
    public init(backgroundPolicy: BackgroundPolicy = .away) {
        self.backgroundPolicy = backgroundPolicy
    }

    /// The status the device should have now.
    public var desiredStatus: PresenceStatus {
        switch phase {
        case _ where offlineMode: .offline
        case .active: chosenStatus
        case .background where offlineInBackground: .offline
        case .background: chosenStatus == .online ? .away : chosenStatus
        case .terminated, .signedOut: .offline
        }
    }

    /// Whether a session should be open.
    public var shouldConnect: Bool {
        stopReason == nil && networkAvailable && !offlineMode && (phase == .active || phase == .background && !offlineInBackground)
    }

    /// Whether the device may send typing and be shown others' typing.
    public var canType: Bool { inSession && desiredStatus != .offline }

    // MARK: - Inputs from the app

    /// The app came to the foreground. Ignored after a sign-out or termination.
    public mutating func didBecomeActive() {
        guard phase == .background else { return }
        phase = .active
        backgroundDeadline = nil
        offlineInBackground = false
    }

    /// The app went to the background at `now`.
    public mutating func didEnterBackground(at now: Date = Date()) {
        guard phase == .active else { return }
        phase = .background
        if case .offline(let after) = backgroundPolicy {
            if after <= 0 {
                offlineInBackground = true
            } else {
                backgroundDeadline = now.addingTimeInterval(after)
            }
        }
    }

    /// Whether the background's offline policy is due at `now`: true once, when the session is
    /// to be closed cleanly.
    public mutating func backgroundTimeUp(at now: Date) -> Bool {
        guard phase == .background, let deadline = backgroundDeadline, deadline <= now else { return false }
        backgroundDeadline = nil
        offlineInBackground = true
        return true
    }

    /// The app is terminating.
    public mutating func willTerminate() {
        if phase != .signedOut { phase = .terminated }
    }

    /// The person signed out: offline now, and no reconnect.
    public mutating func signOut() {
        phase = .signedOut
        stopReason = stopReason ?? .signedOut
    }

    /// The network path went away or came back.
    public mutating func networkChanged(available: Bool) {
        networkAvailable = available
        if available {
            quickRetryUsed = false
            nodesThatCouldNotServe = 0
        }
    }

    /// The app's offline switch was turned on or off.
    public mutating func setOffline(_ offline: Bool) {
        offlineMode = offline
        if !offline { quickRetryUsed = false }
    }

    /// The person chose a status (`offline` appears offline while staying connected).
    public mutating func choose(_ status: PresenceStatus) {
        chosenStatus = status
    }

    // MARK: - Inputs from the connection

    /// The status to open the next session with: the latest wanted, so changes made while
    /// disconnected reach the gateway with the connection itself.
    public var openingStatus: PresenceStatus { desiredStatus }

    /// A session opened with `status` and caught up.
    public mutating func opened(with status: PresenceStatus) {
        inSession = true
        sessionStatus = status
        statusRetryAt = nil
        quickRetryUsed = false
        nodesThatCouldNotServe = 0
    }

    /// The status frame owed to the gateway at `now`, if any; it counts as sent.
    public mutating func statusToSend(at now: Date) -> PresenceStatus? {
        guard inSession, sessionStatus != desiredStatus else { return nil }
        if let retry = statusRetryAt, now < retry { return nil }
        statusRetryAt = nil
        sessionStatus = desiredStatus
        return desiredStatus
    }

    /// The gateway refused the last status frame: send the wanted status again at `retryAt`.
    public mutating func statusRefused(retryAt: Date) {
        sessionStatus = nil
        statusRetryAt = retryAt
    }

    /// The session ended with the server's close `code` (`nil`: no close frame, the connection
    /// dropped), or the upgrade was refused, or (`unreachable`) the attempt never became a
    /// session and nothing answered it: the node is down, not listening, or died while opening;
    /// the client knows `gateways` URLs. Says what to do next.
    public mutating func closed(code: UInt16?, upgradeRefused: Bool = false, unreachable: Bool = false, gateways: Int = 1) -> AfterClose {
        inSession = false
        sessionStatus = nil
        statusRetryAt = nil
        if let stopReason { return .stop(stopReason) }
        let known = code.flatMap(CloseCode.init(rawValue:))
        if code == nil, unreachable, !upgradeRefused {
            // A node that is down cannot serve either: the next URL at once, as for 1011. Waited
            // out, the backoff after such an attempt (2 s, after the drop's 1 s) outlasted the
            // linger of a device whose node died while the next one in its list was down too.
            return nodeCouldNotServe(gateways: gateways)
        }
        if known != .internalError && known != .tryAgainLater { nodesThatCouldNotServe = 0 }
        switch known {
        case .disconnectedByAdmin:
            stopReason = .disconnectedByAdmin
            return .stop(.disconnectedByAdmin)
        case .replaced:
            stopReason = .replaced
            return .stop(.replaced)
        case .goingAway, .unauthorized:
            // One quick retry: the node is draining (another takes over) or the token just
            // expired. A second in a row without a successful session backs off.
            let newToken = known == .unauthorized
            if quickRetryUsed { return .reconnectAfterBackoff(newToken: newToken) }
            quickRetryUsed = true
            return .reconnectNow(newToken: newToken)
        case .internalError, .tryAgainLater:
            return nodeCouldNotServe(gateways: gateways)
        default:
            // A refused upgrade is most often a token the gateway no longer accepts.
            return .reconnectAfterBackoff(newToken: upgradeRefused)
        }
    }

    /// This node cannot serve now (it cannot reach Redis, it is full, starting or down); another
    /// may. Each other URL is tried at once, so that a device handed off to such a node is back,
    /// elsewhere, within its linger; once every URL has said so, back off.
    private mutating func nodeCouldNotServe(gateways: Int) -> AfterClose {
        nodesThatCouldNotServe += 1
        if nodesThatCouldNotServe < gateways { return .reconnectNow(newToken: false) }
        nodesThatCouldNotServe = 0
        return .reconnectAfterBackoff(newToken: false)
    }
}
