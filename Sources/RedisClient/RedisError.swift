/// An error from the Redis client: what went wrong, in words, and the cause where there is one.
public struct RedisError: Error, Sendable, CustomStringConvertible {
    /// What kind of failure this is.
    public struct Code: Hashable, Sendable, CustomStringConvertible {
        private enum Base: String { case server, connectionClosed, unavailable, timeout, protocolViolation, authentication, invalidURL, unsupported }
        private let base: Base
        private init(_ base: Base) { self.base = base }

        /// Redis answered the command with an error reply; only that command failed.
        public static let server = Code(.server)
        /// The connection broke while the command was pending; it may or may not have run.
        public static let connectionClosed = Code(.connectionClosed)
        /// There is no connection to Redis right now; the command was not sent.
        public static let unavailable = Code(.unavailable)
        /// Redis did not answer in time; the connection was dropped.
        public static let timeout = Code(.timeout)
        /// Redis sent something that is not valid RESP, or a reply nobody asked for.
        public static let protocolViolation = Code(.protocolViolation)
        /// AUTH was refused.
        public static let authentication = Code(.authentication)
        /// The `redis://` URL could not be understood.
        public static let invalidURL = Code(.invalidURL)
        /// The client's mode cannot do this (a pattern subscription with sharded pub/sub).
        public static let unsupported = Code(.unsupported)

        public var description: String { base.rawValue }
    }

    /// What kind of failure this is.
    public let code: Code
    /// A human readable explanation; never contains command arguments.
    public let message: String
    /// The error that caused this one, if any.
    public let underlying: (any Error)?

    /// Makes an error.
    public init(_ code: Code, _ message: String, underlying: (any Error)? = nil) {
        self.code = code
        self.message = message
        self.underlying = underlying
    }

    public var description: String {
        if let underlying { return "\(message) (\(underlying))" }
        return message
    }

    /// For a `.server` error, the first word of the reply, such as `NOSCRIPT` or `WRONGTYPE`.
    public var serverErrorPrefix: Substring? {
        guard code == .server else { return nil }
        return message.split(separator: " ", maxSplits: 1).first
    }
}
