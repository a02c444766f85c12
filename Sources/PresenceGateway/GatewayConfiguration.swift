import Foundation
import Logging
import PresenceEngine
import PresenceProtocol
import RedisClient

/// Everything a gateway node is configured with: docs/API.md's environment variables and the limits.
public struct GatewayConfiguration: Sendable {
    /// Listen address.
    public var host = "127.0.0.1"
    /// Listen port (0 picks a free one, for tests).
    public var port = 8080
    /// The presence store.
    public var redisURL = "redis://127.0.0.1:6379/0"
    /// Classic or sharded pub/sub on one server or through Sentinel (`PRESENCE_REDIS_PUBSUB`);
    /// nil: classic there, sharded on a cluster (its only mode).
    public var redisPubSub: String?
    /// Prefix of every Redis key and channel.
    public var keyPrefix = "presence"
    /// This node's id.
    public var nodeID = GatewayConfiguration.defaultNodeID()
    /// HS256 secret (at least 32 bytes).
    public var jwtSecret: String?
    /// RS256/ES256 public key, PEM.
    public var jwtPublicKey: String?
    /// Admin bearer token; admin routes answer 404 without it.
    public var adminToken: String?
    /// Who may see whom.
    public var visibility = Visibility.conversations
    /// What user and conversation ids look like in requests and answers.
    public var idFormat = PresenceIDFormat.string
    /// Node lease, seconds.
    public var leaseTTL = 10
    /// Linger after an abrupt drop, seconds.
    public var linger = 3
    /// REST heartbeat TTL, seconds.
    public var heartbeatTTL = 60
    /// Typing TTL, seconds.
    public var typingTTL = 5
    /// Above this many members a conversation gives counts, not member lists or automatic contacts.
    public var largeGroup = 1_000
    /// Messages kept per conversation.
    public var messageHistory = 10_000
    /// Seconds a conversation's history lives after its last message.
    public var messageTTL = 30 * 86_400
    /// Seconds a sender's `client_message_id` is remembered.
    public var messageDedupTTL = 7 * 86_400
    /// Largest message `text`, in UTF-8 bytes.
    public var messageMaxBytes = MessageSize.defaultMaxTextBytes
    /// Replicas an acknowledged message must have reached.
    public var messageReplicas = 0
    /// Messages per second per user, over REST and sessions (token bucket rate; burst is twice).
    public var messageRate = 100.0
    /// Pieces of session work (openings, frames; and apart, ends) run at once; no variable.
    public var sessionWorkLimit = 256
    /// Log level.
    public var logLevel = Logger.Level.info

    /// Most devices one user may have at once.
    public var maxDevicesPerUser = 32
    /// Most users one session may watch.
    public var maxWatchedUsers = 5_000
    /// Most members of a conversation a session may follow (counts and typing only above 1,000).
    public var maxGroupMembers = 100_000
    /// Most ids in one `subscribe` / `unsubscribe` or `user_ids` query.
    public var maxIDsPerRequest = 500
    /// Status changes per second per session or REST user (token bucket rate; burst is twice).
    public var statusRate = 5.0
    /// Subscribes per second per session (burst twice).
    public var subscribeRate = 5.0
    /// `sync` frames per second per session (burst twice), a budget apart from subscribes': a
    /// device following hundreds of groups must still catch up.
    public var syncRate = 5.0
    /// Typing frames or posts per second per session or REST user (burst twice).
    public var typingRate = 10.0
    /// Bytes written to a session while its connection is not writable (the socket's buffer
    /// and NIO's high-water mark are full) before it is closed as too slow (1008).
    public var outboundBufferLimit = 256 * 1024
    /// Bad frames in a row answered with `error` before the session is closed with 1008.
    public var maxBadFrames = 10
    /// Frames of any kind per second per session (burst twice): past it, `error` `rate_limited`.
    public var frameRate = 50.0
    /// `rate_limited` answers in a row before the session is closed with 4029.
    public var maxRateLimitedFrames = 50
    /// Most WebSocket sessions this node holds at once, counted from the upgrade (so sessions
    /// still being authenticated count too); one more is closed with 1013 (try again later).
    /// The default is the process's open-file limit less 256, kept for Redis, REST requests and
    /// the listening socket: past the limit a node could not accept connections at all.
    public var maxSessions = GatewayConfiguration.defaultMaxSessions()
    /// WebSocket ping interval: a session the node has heard nothing from for this long is pinged.
    public var pingInterval = Duration.seconds(10)
    /// How long a ping waits for its pong (or any other frame); past it the session is closed with
    /// 1001 at once and its device lingers. A client cut off without a FIN is offline within
    /// `pingInterval + pongTimeout` (15 s) plus the linger.
    public var pongTimeout = Duration.seconds(5)
    /// How long a connection may take to send a whole request head, from its start or from the
    /// end of the last response (keep-alive); past it the connection is closed.
    public var requestHeadTimeout = Duration.seconds(15)
    /// How long a session the server closes has to take the rest of its queue and the close
    /// frame; a client that reads nothing meanwhile has its connection shut.
    public var closeTimeout = Duration.seconds(2)

    /// The defaults.
    public init() {}

    /// Reads docs/API.md's `PRESENCE_*` variables over the defaults. Throws a message naming the
    /// variable for anything malformed.
    public init(environment: [String: String]) throws(GatewayConfigurationError) {
        self.init()
        try apply(environment)
    }

    /// Applies `PRESENCE_*` values (environment variables, or flags turned into them), each as
    /// its ``GatewaySetting`` allows. Other names are left alone: the environment holds more.
    public mutating func apply(_ values: [String: String]) throws(GatewayConfigurationError) {
        for setting in GatewaySetting.all {
            if let text = values[setting.name] { try setting.apply(text, to: &self) }
        }
    }

    /// Checks what cannot be checked one value at a time.
    public func validate() throws(GatewayConfigurationError) {
        guard jwtSecret != nil || jwtPublicKey != nil else {
            throw GatewayConfigurationError("set PRESENCE_JWT_SECRET (HS256, at least 32 bytes) or PRESENCE_JWT_PUBLIC_KEY (RS256/ES256 PEM)")
        }
        if let secret = jwtSecret, secret.utf8.count < 32 {
            throw GatewayConfigurationError("PRESENCE_JWT_SECRET must be at least 32 bytes long (it is \(secret.utf8.count))")
        }
        guard sessionWorkLimit >= 1 else { throw GatewayConfigurationError("sessionWorkLimit must be at least 1") }
        do {
            _ = try redisConfiguration()
            try engineConfiguration.validate()
        } catch let error as RedisError {
            let variable = error.code == .invalidURL ? "PRESENCE_REDIS_URL" : "PRESENCE_REDIS_PUBSUB=\(redisPubSub ?? "")"
            throw GatewayConfigurationError("\(variable): \(error.message)")
        } catch let error as GatewayConfigurationError {
            throw error
        } catch {
            throw GatewayConfigurationError("\(error)")
        }
    }

    /// The Redis client's part of this configuration: ``redisURL`` with ``redisPubSub``.
    public func redisConfiguration() throws(RedisError) -> RedisConfiguration {
        var configuration = try RedisConfiguration(url: redisURL)
        if let redisPubSub { configuration.pubSub = try RedisPubSub(setting: redisPubSub, topology: configuration.topology) }
        return configuration
    }

    /// The engine's part of this configuration.
    public var engineConfiguration: PresenceConfiguration {
        PresenceConfiguration(
            keyPrefix: keyPrefix, nodeID: nodeID, visibility: visibility,
            leaseTTL: .seconds(leaseTTL), linger: .seconds(linger), heartbeatTTL: .seconds(heartbeatTTL),
            typingTTL: .seconds(typingTTL), maxDevicesPerUser: maxDevicesPerUser, largeGroup: largeGroup,
            messageHistory: messageHistory, messageTTL: .seconds(messageTTL), messageDedupTTL: .seconds(messageDedupTTL),
            messageMaxBytes: messageMaxBytes, messageReplicas: messageReplicas
        )
    }

    /// The largest REST body: room for a `send` of a message of the largest size.
    public var maxBodySize: Int { MessageSize.maxFrameBytes(maxTextBytes: messageMaxBytes) }

    /// Largest WebSocket message accepted (over all its fragments); larger ones close the
    /// session with 1009. As large as a REST body, so that a `send` fits as a `POST` does.
    public var maxFrameSize: Int { maxBodySize }

    /// The open-file limit (soft) less 256 descriptors for everything that is not a session;
    /// at least 1. See ``raiseOpenFileLimit()``.
    public static func defaultMaxSessions() -> Int {
        var limit = rlimit()
        guard getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit) == 0 else { return 1_024 }
        guard limit.rlim_cur != rlim_t.max else { return 10_000_000 }
        return max(1, min(10_000_000, Int(limit.rlim_cur) - 256))
    }

    /// Raises this process's open-file limit to its hard limit, which an unprivileged process
    /// may do: the soft limit is often 1,024, a few hundred sessions short of what a node holds.
    /// Returns the limit in force afterwards.
    @discardableResult
    public static func raiseOpenFileLimit() -> Int? {
        var limit = rlimit()
        guard getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit) == 0 else { return nil }
        if limit.rlim_cur < limit.rlim_max {
            var raised = limit
            raised.rlim_cur = limit.rlim_max
            if setrlimit(Int32(RLIMIT_NOFILE.rawValue), &raised) == 0 { limit = raised }
        }
        return limit.rlim_cur == rlim_t.max ? Int.max : Int(limit.rlim_cur)
    }

    /// Host name plus a random suffix, so that two nodes on one host differ.
    public static func defaultNodeID() -> String {
        let host = ProcessInfo.processInfo.hostName.split(separator: ".").first.map(String.init) ?? "node"
        let clean = host.filter { PresenceID.isValid(String($0)) }
        return "\(clean.isEmpty ? "node" : String(clean.prefix(100)))-\(String(UInt32.random(in: 0...UInt32.max), radix: 36))"
    }
}

/// A configuration value that cannot be used, with a message that names it.
public struct GatewayConfigurationError: Error, CustomStringConvertible {
    /// What is wrong and how to fix it.
    public let description: String
    init(_ description: String) { self.description = description }
}
