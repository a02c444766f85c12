/// The key layout: the one place that knows how keys and channels are named.
///
/// Keys of one user share the hash tag `{u:ID}`, keys of one conversation `{c:ID}`, keys of one
/// node `{n:ID}`, so each script touches one hash slot.
public struct PresenceKeys: Sendable {
    /// The prefix of every key and channel.
    public let prefix: String

    /// A layout under `prefix`.
    public init(prefix: String) { self.prefix = prefix }

    /// Hash: device id → `status|node|session|since|deadline|alive`.
    public func devices(_ user: String) -> String { "\(prefix):{u:\(user)}:devices" }
    /// Hash: `status`, `last_seen`, `hidden`, `hidden_last_seen`.
    public func state(_ user: String) -> String { "\(prefix):{u:\(user)}:state" }
    /// Set: the conversations the user is a member of.
    public func conversationsOf(_ user: String) -> String { "\(prefix):{u:\(user)}:convs" }
    /// Channel of a user's presence events.
    public func userChannel(_ user: String) -> String { "\(prefix):{u:\(user)}:events" }

    /// Set: a conversation's members.
    public func members(_ conversation: String) -> String { "\(prefix):{c:\(conversation)}:members" }
    /// Hash: user → `expiry|forwarded` (ms) of who is typing in a conversation.
    public func typing(_ conversation: String) -> String { "\(prefix):{c:\(conversation)}:typing" }
    /// Channel of a conversation's events (membership changes, typing).
    public func conversationChannel(_ conversation: String) -> String { "\(prefix):{c:\(conversation)}:events" }

    /// String with a TTL: the node's lease; its value is the lease end its last renewal set (ms).
    public func lease(_ node: String) -> String { "\(prefix):{n:\(node)}:lease" }
    /// Set: `user|device` of every device the node's sessions hold, for reaping it.
    public func nodeDevices(_ node: String) -> String { "\(prefix):{n:\(node)}:devices" }
    /// Hash: the node's session count and start time, for `/api/admin/nodes` and presencectl.
    public func nodeInfo(_ node: String) -> String { "\(prefix):{n:\(node)}:info" }
    /// Channel of commands for one node (disconnect a user, close a taken-over session).
    public func nodeChannel(_ node: String) -> String { "\(prefix):{n:\(node)}:control" }
    /// Channel every node listens on (disconnect a user wherever their sessions are).
    public var broadcastChannel: String { "\(prefix):control" }

    /// Sorted set: node id scored by lease deadline (ms).
    public var nodes: String { "\(prefix):nodes" }
    /// Sorted set: `user|device` scored by deadline (linger, REST heartbeat).
    public var deadlines: String { "\(prefix):deadlines" }
    /// Sorted set: `conversation|user` scored by typing expiry (ms).
    public var typingDeadlines: String { "\(prefix):typing_deadlines" }
    /// Set: every conversation id, for listing.
    public var conversations: String { "\(prefix):conversations" }

    /// SCAN pattern of every user's devices hash (users with at least one device).
    public var allDevicesPattern: String { "\(prefix):{u:*}:devices" }
    /// SCAN pattern of every key under the prefix.
    public var allKeysPattern: String { "\(prefix):*" }
    /// PSUBSCRIBE pattern of every user's channel.
    public var allUserChannelsPattern: String { "\(prefix):{u:*}:events" }

    /// The user of a key or channel named `prefix:{u:ID}:suffix`.
    public func user(fromKey key: String, suffix: String) -> String? {
        let head = "\(prefix):{u:"
        let tail = "}:\(suffix)"
        guard key.hasPrefix(head), key.hasSuffix(tail), key.count > head.count + tail.count else { return nil }
        return String(key.dropFirst(head.count).dropLast(tail.count))
    }

    /// The conversation of a channel made by ``conversationChannel(_:)``.
    public func conversation(fromChannel channel: String) -> String? {
        let head = "\(prefix):{c:"
        let tail = "}:events"
        guard channel.hasPrefix(head), channel.hasSuffix(tail), channel.count > head.count + tail.count else { return nil }
        return String(channel.dropFirst(head.count).dropLast(tail.count))
    }

    /// The member of `deadlines` / `nodeDevices` for a device.
    func deviceMember(user: String, device: String) -> String { "\(user)|\(device)" }

    /// Splits a member made by ``deviceMember(user:device:)``.
    func splitDeviceMember(_ member: String) -> (user: String, device: String)? {
        let parts = member.split(separator: "|", maxSplits: 1)
        guard parts.count == 2 else { return nil }
        return (String(parts[0]), String(parts[1]))
    }
}
