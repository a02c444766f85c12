import RedisClient

/// The key layout: the one place that knows how keys and channels are named.
///
/// Keys of one user share the hash tag `{u:ID}`, keys of one conversation `{c:ID}`, keys of one
/// node `{n:ID}`, so each script touches one hash slot, on one server or on a Redis Cluster. The
/// reapers' deadline sets are split into ``deadlineBuckets`` buckets whose tags sit one in each
/// sixteenth of the slot space, so that a cluster spreads them over its primaries; the node
/// registry and the conversation list are one key each.
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
    /// Stream: a conversation's kept messages, entry id `seq-0`.
    public func history(_ conversation: String) -> String { "\(prefix):{c:\(conversation)}:history" }
    /// Hash: `epoch`, `seq` (the last seq given), `life` (the run id of the server that last
    /// wrote it) and `forks` (the epochs it forked from) of a conversation's history.
    public func historyMeta(_ conversation: String) -> String { "\(prefix):{c:\(conversation)}:history_meta" }
    /// Hash: user → `epoch|delivered|read`, a member's cursors in a conversation.
    public func cursors(_ conversation: String) -> String { "\(prefix):{c:\(conversation)}:cursors" }
    /// Hash with a TTL: the whole message a sender's `client_message_id` made, for retries. The
    /// sender's id is written with its length, so that no two pairs make the same key.
    public func sent(_ conversation: String, sender: String, clientMessageID: String) -> String {
        "\(prefix):{c:\(conversation)}:sent:\(sender.utf8.count):\(sender):\(clientMessageID)"
    }
    /// Channel of a conversation's messages and receipts, which every node holding a member's
    /// session subscribes to.
    public func messageChannel(_ conversation: String) -> String { "\(prefix):{c:\(conversation)}:messages" }

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
    /// How many buckets the deadline sets are split into.
    public static let deadlineBuckets = 16
    /// The buckets' hash tags: bucket `i`'s slot lies in the middle of the `i`th sixteenth of the
    /// 16,384 slots (checked by a test), so that 2, 4, 8 or 16 primaries with even slot ranges
    /// each hold the same number of buckets.
    static let bucketTags = [
        "d:0.1181", "d:1.4948", "d:2.2714", "d:3.3255", "d:4.4295", "d:5.3287", "d:6.2372", "d:7.3633",
        "d:8.261", "d:9.4769", "d:10.295", "d:11.4595", "d:12.1208", "d:13.3568", "d:14.2256", "d:15.1681",
    ]

    /// The bucket of a user's or a conversation's deadlines: always the same one.
    public static func bucket(of id: String) -> Int { Int(HashSlot.crc16(id.utf8)) % deadlineBuckets }

    /// Sorted set: `user|device` scored by the moment the reaper looks at the device (its linger
    /// or REST heartbeat deadline, or earlier), for the users of one bucket.
    public func deadlines(bucket: Int) -> String { "\(prefix):{\(Self.bucketTags[bucket])}:deadlines" }
    /// The deadline set a user's devices are indexed in.
    public func deadlines(ofUser user: String) -> String { deadlines(bucket: Self.bucket(of: user)) }
    /// Sorted set: `conversation|user` scored by typing expiry (ms), for the conversations of one bucket.
    public func typingDeadlines(bucket: Int) -> String { "\(prefix):{\(Self.bucketTags[bucket])}:typing_deadlines" }
    /// The typing deadline set of a conversation.
    public func typingDeadlines(ofConversation conversation: String) -> String { typingDeadlines(bucket: Self.bucket(of: conversation)) }
    /// Every deadline set the reapers claim from: the buckets, and the single sets of the layout
    /// before buckets (`prefix:deadlines`, `prefix:typing_deadlines`), which nodes of an older
    /// version may still write during a rolling upgrade.
    public var allDeadlines: [String] { (0..<Self.deadlineBuckets).map(deadlines(bucket:)) + ["\(prefix):deadlines"] }
    /// Every typing deadline set, with the older layout's, as ``allDeadlines``.
    public var allTypingDeadlines: [String] { (0..<Self.deadlineBuckets).map(typingDeadlines(bucket:)) + ["\(prefix):typing_deadlines"] }
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
        id(in: key, tag: "u", suffix: suffix)
    }

    /// The conversation of a channel made by ``conversationChannel(_:)``.
    public func conversation(fromChannel channel: String) -> String? {
        id(in: channel, tag: "c", suffix: "events")
    }

    /// The conversation of a channel made by ``messageChannel(_:)``.
    public func conversation(fromMessageChannel channel: String) -> String? {
        id(in: channel, tag: "c", suffix: "messages")
    }

    /// The non-empty `ID` of a name `prefix:{tag:ID}:suffix`. Compared as UTF-8 bytes, as the
    /// name was made, not as characters: every message's channel is read here, and no id can
    /// join a character of the name to its own (a combining mark first would, with the `:`).
    private func id(in name: String, tag: String, suffix: String) -> String? {
        let bytes = name.utf8
        let tailCount = 2 + suffix.utf8.count
        guard bytes.count > prefix.utf8.count + 3 + tag.utf8.count + tailCount else { return nil }
        func skip(_ part: String.UTF8View, from index: inout String.UTF8View.Index) -> Bool {
            for byte in part {
                guard bytes[index] == byte else { return false }
                bytes.formIndex(after: &index)
            }
            return true
        }
        var start = bytes.startIndex
        guard skip(prefix.utf8, from: &start), skip(":{".utf8, from: &start), skip(tag.utf8, from: &start), skip(":".utf8, from: &start) else {
            return nil
        }
        let end = bytes.index(bytes.endIndex, offsetBy: -tailCount)
        var at = end
        guard skip("}:".utf8, from: &at), skip(suffix.utf8, from: &at) else { return nil }
        return String(decoding: bytes[start..<end], as: UTF8.self)
    }

    /// The member of `deadlines` / `nodeDevices` for a device.
    public func deviceMember(user: String, device: String) -> String { "\(user)|\(device)" }

    /// Splits a member made by ``deviceMember(user:device:)``.
    func splitDeviceMember(_ member: String) -> (user: String, device: String)? {
        let parts = member.split(separator: "|", maxSplits: 1)
        guard parts.count == 2 else { return nil }
        return (String(parts[0]), String(parts[1]))
    }
}
