import PresenceProtocol

/// How the presence engine behaves; the defaults are docs/API.md's.
public struct PresenceConfiguration: Sendable {
    /// Prefix of every key and channel, so that deployments can share a Redis.
    public var keyPrefix: String
    /// This node's id (its lease, its sessions' devices).
    public var nodeID: String
    /// Who may see whom.
    public var visibility: Visibility
    /// How long a node's lease lives without renewal; renewed every third of it.
    public var leaseTTL: Duration
    /// How long an abruptly disconnected device stays live.
    public var linger: Duration
    /// How long a REST device stays live after its last status post.
    public var heartbeatTTL: Duration
    /// How long a typing state lives without refresh.
    public var typingTTL: Duration
    /// How often the reaper looks for lapsed leases and deadlines (at least once a second).
    public var reaperInterval: Duration
    /// Most devices one user may have at once (0: no limit).
    public var maxDevicesPerUser: Int
    /// Above this many members a conversation adds nothing to its members' automatic contacts,
    /// and a session following it gets counts, not each member's presence.
    public var largeGroup: Int
    /// Safety-net TTL on a user's devices and a node's keys: nothing live outlasts every node by
    /// more than this. Nodes refresh it for the devices they hold every third of it.
    public var deviceKeyTTL: Duration
    /// Messages kept per conversation; older ones are trimmed.
    public var messageHistory: Int
    /// How long a conversation's history lives after its last message.
    public var messageTTL: Duration
    /// How long a sender's `client_message_id` is remembered.
    public var messageDedupTTL: Duration
    /// The largest message `text`, in UTF-8 bytes.
    public var messageMaxBytes: Int
    /// Replicas an acknowledged message must have reached (`WAIT`), 0 for none.
    public var messageReplicas: Int

    /// After Redis was unreachable, how long a node leaves lapsed nodes unreaped and keeps from
    /// telling watchers "offline" on a re-read: time for every live node to reconnect (the Redis
    /// client's longest backoff, 5 s) and to renew its lease or register its sessions again (a
    /// third of a lease). A lease TTL plus 5 s.
    public var recoveryGrace: Duration { leaseTTL + .seconds(5) }

    /// How often a node compares devices its sessions hold with what Redis has, 500 at a time
    /// (``PresenceEngine/audit(all:)``): every three lease TTLs, 30 s by default, at least 5 s.
    public var auditInterval: Duration { max(.seconds(5), leaseTTL * 3) }

    /// A configuration; every value is checked by ``validate()``.
    public init(
        keyPrefix: String = "presence",
        nodeID: String,
        visibility: Visibility = .conversations,
        leaseTTL: Duration = .seconds(10),
        linger: Duration = .seconds(3),
        heartbeatTTL: Duration = .seconds(60),
        typingTTL: Duration = .seconds(5),
        reaperInterval: Duration = .milliseconds(500),
        maxDevicesPerUser: Int = 32,
        deviceKeyTTL: Duration = .seconds(24 * 3600),
        largeGroup: Int = 1_000,
        messageHistory: Int = 10_000,
        messageTTL: Duration = .seconds(30 * 86_400),
        messageDedupTTL: Duration = .seconds(7 * 86_400),
        messageMaxBytes: Int = 16_384,
        messageReplicas: Int = 0
    ) {
        self.keyPrefix = keyPrefix
        self.nodeID = nodeID
        self.visibility = visibility
        self.leaseTTL = leaseTTL
        self.linger = linger
        self.heartbeatTTL = heartbeatTTL
        self.typingTTL = typingTTL
        self.reaperInterval = reaperInterval
        self.maxDevicesPerUser = maxDevicesPerUser
        self.deviceKeyTTL = deviceKeyTTL
        self.largeGroup = largeGroup
        self.messageHistory = messageHistory
        self.messageTTL = messageTTL
        self.messageDedupTTL = messageDedupTTL
        self.messageMaxBytes = messageMaxBytes
        self.messageReplicas = messageReplicas
    }

    /// Throws ``PresenceError/Code/invalidRequest`` naming the first value out of range.
    public func validate() throws(PresenceError) {
        guard !keyPrefix.isEmpty, !keyPrefix.contains(where: { $0 == " " || $0 == "{" || $0 == "}" }) else {
            throw PresenceError(.invalidRequest, "the key prefix must be non-empty, without spaces or braces")
        }
        guard PresenceID.isValid(nodeID) else { throw PresenceError(.invalidRequest, "the node id must be \(PresenceID.rule)") }
        guard leaseTTL >= .seconds(1) else { throw PresenceError(.invalidRequest, "the lease TTL must be at least 1 second") }
        guard linger >= .zero else { throw PresenceError(.invalidRequest, "the linger must not be negative") }
        guard heartbeatTTL >= .seconds(1) else { throw PresenceError(.invalidRequest, "the heartbeat TTL must be at least 1 second") }
        guard typingTTL >= .seconds(1) else { throw PresenceError(.invalidRequest, "the typing TTL must be at least 1 second") }
        guard reaperInterval > .zero, reaperInterval <= .seconds(1) else {
            throw PresenceError(.invalidRequest, "the reaper interval must be between 0 and 1 second")
        }
        guard maxDevicesPerUser >= 0 else { throw PresenceError(.invalidRequest, "the device limit must not be negative") }
        guard deviceKeyTTL >= leaseTTL * 3 else { throw PresenceError(.invalidRequest, "the device key TTL must be at least 3 lease TTLs") }
        guard (1...1_000_000).contains(messageHistory) else { throw PresenceError(.invalidRequest, "the message history must keep 1 to 1,000,000 messages") }
        guard messageTTL >= .seconds(1) else { throw PresenceError(.invalidRequest, "the message TTL must be at least 1 second") }
        guard messageDedupTTL >= .seconds(1) else { throw PresenceError(.invalidRequest, "the message dedup TTL must be at least 1 second") }
        guard (1...1_048_576).contains(messageMaxBytes) else { throw PresenceError(.invalidRequest, "the largest message must be 1 to 1,048,576 bytes") }
        guard (0...16).contains(messageReplicas) else { throw PresenceError(.invalidRequest, "message replicas must be 0 to 16") }
    }
}

extension Duration {
    /// The duration in whole milliseconds.
    var milliseconds: Int64 {
        components.seconds * 1000 + components.attoseconds / 1_000_000_000_000_000
    }
}
