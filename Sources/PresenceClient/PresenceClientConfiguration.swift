import Foundation

/// How a `PresenceClient` connects and times its work.
public struct PresenceClientConfiguration: Sendable {
    /// Gateway base URLs (`ws://host:port` or `wss://host`), tried in turn: usually one load
    /// balancer, or several nodes.
    public var gatewayURLs: [URL]
    /// This device's stable id (the same across launches), so a reconnect takes its own device
    /// over rather than adding one.
    public var deviceID: String
    /// Delays between reconnect attempts.
    public var backoff = ReconnectBackoff()
    /// Least seconds between two typing starts sent for one conversation.
    public var typingRefreshInterval: TimeInterval = 2
    /// Seconds without a keystroke after which typing stops.
    public var typingIdleTimeout: TimeInterval = 3
    /// Seconds another user's typing indicator shows without an update (the gateway sends the
    /// stop; this only guards against one that is never heard).
    public var typingDisplayTimeout: TimeInterval = 8
    /// Seconds before a request the gateway refused as rate-limited is sent again.
    public var retryDelay: TimeInterval = 1
    /// Seconds `signOut()` and `willTerminate()` wait for the clean close to finish.
    public var closeTimeout: TimeInterval = 3
    /// Seconds from a connection attempt to the session's `initial_state`. An attempt that takes
    /// longer (a gateway that never answers the upgrade, a connection that went quiet on the
    /// way, a refusal whose close was lost) is given up and retried after the backoff.
    public var openTimeout: TimeInterval = 10
    /// What the device shows while the app is in the background: away (the default), or
    /// offline after some seconds there (`.offline(after:)`), which also closes the session.
    public var backgroundPolicy = ClientLifecycle.BackgroundPolicy.away

    /// A configuration for one gateway URL (or load balancer).
    public init(gatewayURL: URL, deviceID: String) throws(PresenceClientError) {
        try self.init(gatewayURLs: [gatewayURL], deviceID: deviceID)
    }

    /// A configuration for several gateway URLs, tried in turn.
    public init(gatewayURLs: [URL], deviceID: String) throws(PresenceClientError) {
        guard !gatewayURLs.isEmpty else { throw .invalid("at least one gateway URL is needed") }
        for url in gatewayURLs where !["ws", "wss", "http", "https"].contains(url.scheme?.lowercased() ?? "") || url.host == nil {
            throw .invalid("gateway URL \(url.absoluteString) must be ws://host[:port] or wss://host[:port]")
        }
        guard PresenceID.isValid(deviceID) else {
            throw .invalid("device id \(deviceID.debugDescription) is not 1-128 characters of A-Z a-z 0-9 . _ : @ -")
        }
        self.gatewayURLs = gatewayURLs
        self.deviceID = deviceID
    }

    /// The WebSocket URL of a session: `/api/presence/subscribe` with the token, the device and
    /// the status to open with.
    func sessionURL(base: URL, token: String, status: PresenceStatus) -> URL {
        var components = URLComponents(url: base, resolvingAgainstBaseURL: false) ?? URLComponents()
        switch components.scheme?.lowercased() {
        case "http": components.scheme = "ws"
        case "https": components.scheme = "wss"
        default: break
        }
        let path = components.path.hasSuffix("/") ? String(components.path.dropLast()) : components.path
        components.path = path + "/api/presence/subscribe"
        components.queryItems = [
            URLQueryItem(name: "token", value: token),
            URLQueryItem(name: "device_id", value: deviceID),
            URLQueryItem(name: "status", value: status.rawValue),
        ]
        // `+` would read as a space on the server; JWTs do not contain one, but be exact.
        components.percentEncodedQuery = components.percentEncodedQuery?.replacingOccurrences(of: "+", with: "%2B")
        return components.url ?? base
    }
}
