import PresenceProtocol
import RedisClient

/// Totals under the key prefix, for `presencectl stats`.
public struct PresenceStats: Sendable, Codable, Equatable {
    /// Users whose aggregate is online.
    public var usersOnline = 0
    /// Users whose aggregate is away.
    public var usersAway = 0
    /// Devices stored (live, lingering or REST).
    public var devices = 0
    /// Nodes with a live lease.
    public var nodes = 0
    /// Keys under the prefix.
    public var keys = 0
    /// Bytes those keys use, by `MEMORY USAGE`.
    public var memoryBytes = 0
    /// Conversations with a message history kept.
    public var histories = 0
    /// Messages kept in those histories.
    public var messagesKept = 0
    /// Bytes the histories use, by `MEMORY USAGE` (part of `memoryBytes`).
    public var historyBytes = 0
    /// Retry records of sent messages (one per message within `PRESENCE_MESSAGE_DEDUP_TTL`).
    public var retryRecords = 0
}

extension PresenceEngine {
    /// One page of users that have at least one device, by SCAN (every primary of a cluster in
    /// turn); pass the returned cursor back until it is "0".
    public func usersWithDevices(cursor: String = "0", count: Int = 1000) async throws(PresenceError) -> (cursor: String, users: [String]) {
        let page = try await run { try await self.redis.scanPage(cursor: cursor, matching: keys.allDevicesPattern, count: count) }
        return (page.cursor, page.keys.compactMap { keys.user(fromKey: $0, suffix: "devices") })
    }

    /// Counts users, devices, nodes, keys and memory under the prefix. Walks every key: for
    /// operators, not for a hot path.
    public func stats() async throws(PresenceError) -> PresenceStats {
        var stats = PresenceStats()
        var cursor = "0"
        repeat {
            let page = try await usersWithDevices(cursor: cursor)
            cursor = page.cursor
            let views = try await views(of: page.users)
            stats.usersOnline += views.count { $0.real.status == .online }
            stats.usersAway += views.count { $0.real.status == .away }
            let lengths = try await run { try await self.redis.pipeline(page.users.map { HLEN(key: keys.devices($0)) }) }
            stats.devices += lengths.reduce(0) { $0 + ((try? $1.get()) ?? 0) }
        } while cursor != "0"
        stats.nodes = try await nodes().count { !$0.lapsed }
        repeat {
            let page = try await run { try await self.redis.scanPage(cursor: cursor, matching: keys.allKeysPattern, count: 1000) }
            cursor = page.cursor
            let names = page.keys
            stats.keys += names.count
            let sizes = try await run { try await self.redis.pipeline(names.map { MEMORYUSAGE(key: $0) }) }.map { (try? $0.get()) ?? nil ?? 0 }
            stats.memoryBytes += sizes.reduce(0, +)
            let histories = names.indices.filter { names[$0].hasPrefix("\(keys.prefix):{c:") && names[$0].hasSuffix("}:history") }
            stats.histories += histories.count
            stats.historyBytes += histories.reduce(0) { $0 + sizes[$1] }
            let lengths = try await run { try await self.redis.pipeline(histories.map { XLEN(key: names[$0]) }) }
            stats.messagesKept += lengths.reduce(0) { $0 + ((try? $1.get()) ?? 0) }
            stats.retryRecords += names.count { $0.hasPrefix("\(keys.prefix):{c:") && $0.contains("}:sent:") }
        } while cursor != "0"
        return stats
    }

    /// Whether Redis holds anything of this user (state or devices).
    public func userExists(_ user: String) async throws(PresenceError) -> Bool {
        try await run { try await self.redis.execute(EXISTS(keys: [keys.state(user), keys.devices(user)])) } > 0
    }
}

/// What an operator's dashboard shows at one moment: who is present, the live nodes and the
/// conversations' counts (real statuses: an operator sees through `show_online_status`).
public struct PresenceOverview: Sendable, Equatable {
    /// A conversation's counts.
    public struct Conversation: Sendable, Equatable {
        public var conversationID: String
        public var total: Int
        public var online: Int
        public var away: Int
    }

    /// Users whose aggregate is online, and away: all of them, not only those listed.
    public var usersOnline = 0
    public var usersAway = 0
    /// The first present (online or away) users by id.
    public var present: [Presence] = []
    /// Whether more users are present than `present` lists.
    public var presentTruncated = false
    /// Nodes with a live lease.
    public var nodes: [NodeRecord] = []
    /// The first conversations by id, with their counts.
    public var conversations: [Conversation] = []
    /// Whether more conversations exist than listed.
    public var conversationsTruncated = false
    /// When it was read (ms since 1970, Redis's clock).
    public var at: Int64 = 0
}

extension PresenceEngine {
    /// Reads an overview: every user with a device (SCAN) for the counts, `userLimit` of them
    /// listed, and `conversationLimit` conversations with their counts. Walks every user: for
    /// operators, not for a hot path (the gateway reads it at most once a second).
    public func overview(userLimit: Int = 500, conversationLimit: Int = 200) async throws(PresenceError) -> PresenceOverview {
        var overview = PresenceOverview()
        overview.at = try await storeNow()
        var present: [Presence] = []
        var cursor = "0"
        repeat {
            let page = try await usersWithDevices(cursor: cursor)
            cursor = page.cursor
            for view in try await views(of: page.users) where view.real.status != .offline {
                if view.real.status == .online { overview.usersOnline += 1 } else { overview.usersAway += 1 }
                present.append(view.real)
            }
        } while cursor != "0"
        present.sort { $0.userID < $1.userID }
        overview.present = Array(present.prefix(userLimit))
        overview.presentTruncated = present.count > userLimit
        overview.nodes = try await nodes().filter { !$0.lapsed }
        let conversations = try await allConversations()
        overview.conversationsTruncated = conversations.count > conversationLimit
        // Two round trips for them all: every member set, then every member's state.
        let chosen = Array(conversations.prefix(conversationLimit))
        let memberSets = try await run { try await self.redis.pipeline(chosen.map { SMEMBERS(key: keys.members($0)) }) }
        let members = try memberSets.map { (result) throws(PresenceError) -> [String] in
            guard case .success(let members) = result else { throw PresenceError(.unavailable, "the presence store is unreachable") }
            return members
        }
        let everyone = Array(Set(members.joined()))
        let statuses = Dictionary(uniqueKeysWithValues: zip(everyone, try await views(of: everyone).map(\.real.status)))
        for (conversation, members) in zip(chosen, members) {
            overview.conversations.append(.init(
                conversationID: conversation, total: members.count,
                online: members.count { statuses[$0] == .online }, away: members.count { statuses[$0] == .away }
            ))
        }
        return overview
    }
}
