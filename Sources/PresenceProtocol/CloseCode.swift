/// Why a WebSocket session was closed: the close codes of the API, and the two this service
/// adds (4009 and 1013).
public enum CloseCode: UInt16, Sendable, Hashable, CaseIterable {
    /// The session ended normally; a client's 1000 takes its device offline at once.
    case normal = 1000
    /// The node is shutting down: reconnect to another one.
    case goingAway = 1001
    /// Bad frames past the limit.
    case policyViolation = 1008
    /// A frame over the size limit.
    case messageTooBig = 1009
    /// The session could not be set up.
    case internalError = 1011
    /// The node holds as many sessions as it may: try again later, or another node.
    case tryAgainLater = 1013
    /// A bad or expired token: get a new one before reconnecting.
    case unauthorized = 4001
    /// An administrator disconnected the user: do not reconnect on your own.
    case disconnectedByAdmin = 4003
    /// A newer session took this device over: reconnecting would only take it back.
    case replaced = 4009
    /// Rate limited past a limit.
    case rateLimited = 4029
}
