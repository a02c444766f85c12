import Foundation
import Logging
import NIOConcurrencyHelpers
import PresenceProtocol
import RedisClient

/// A change of a conversation's members, as published on the conversation's channel and each
/// affected member's: every member's, or for a large group (above `largeGroup` members before
/// and after the change) only the added and removed users'.
public struct MembershipEvent: Sendable, Equatable, Codable {
    /// The conversation.
    public var conversationID: String
    /// Users who became members.
    public var added: [String]
    /// Users who stopped being members (all of them when the conversation is deleted).
    public var removed: [String]
    /// A large group's change, published only to the added and removed users: the sessions
    /// watching a removed user hear it on that user's channel, and check whether they may
    /// still see them. (Absent, from a node before this field: false.)
    public var large: Bool

    enum CodingKeys: String, CodingKey {
        case type, conversationID = "conversation_id", added, removed, large
    }

    public init(conversationID: String, added: [String], removed: [String], large: Bool = false) {
        self.conversationID = conversationID
        self.added = added
        self.removed = removed
        self.large = large
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        guard try container.decode(String.self, forKey: .type) == "membership" else {
            throw DecodingError.dataCorruptedError(forKey: .type, in: container, debugDescription: "not a membership event")
        }
        conversationID = try container.decode(String.self, forKey: .conversationID)
        added = try container.decode([String].self, forKey: .added)
        removed = try container.decode([String].self, forKey: .removed)
        large = try container.decodeIfPresent(Bool.self, forKey: .large) ?? false
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode("membership", forKey: .type)
        try container.encode(conversationID, forKey: .conversationID)
        try container.encode(added, forKey: .added)
        try container.encode(removed, forKey: .removed)
        if large { try container.encode(large, forKey: .large) }
    }
}

extension PresenceEngine {
    /// Creates the conversation or replaces its members.
    @discardableResult
    public func setMembers(of conversation: String, to members: [String]) async throws(PresenceError) -> MembershipEvent {
        let wanted = Set(members)
        let current = Set(try await self.members(of: conversation) ?? [])
        return try await applyMembership(conversation, adding: wanted.subtracting(current), removing: current.subtracting(wanted), notifying: current.union(wanted), create: true)
    }

    /// Adds members to an existing conversation (creating it if it does not exist).
    @discardableResult
    public func addMembers(to conversation: String, _ users: [String]) async throws(PresenceError) -> MembershipEvent {
        let current = Set(try await self.members(of: conversation) ?? [])
        return try await applyMembership(conversation, adding: Set(users).subtracting(current), removing: [], notifying: current.union(users), create: true)
    }

    /// Removes one member; `false` if they were not a member.
    @discardableResult
    public func removeMember(from conversation: String, _ user: String) async throws(PresenceError) -> Bool {
        let members = Set(try await self.members(of: conversation) ?? [])
        guard members.contains(user) else { return false }
        _ = try await applyMembership(conversation, adding: [], removing: [user], notifying: members, create: false)
        return true
    }

    /// Deletes a conversation; `false` if there was none.
    @discardableResult
    public func deleteConversation(_ conversation: String) async throws(PresenceError) -> Bool {
        guard let members = try await members(of: conversation) else { return false }
        _ = try await applyMembership(conversation, adding: [], removing: Set(members), notifying: Set(members), create: false)
        _ = try await run {
            try await self.redis.pipeline(
                DEL(keys: [keys.members(conversation), keys.typing(conversation), keys.history(conversation), keys.historyMeta(conversation), keys.cursors(conversation)]),
                SREM(key: keys.conversations, members: [conversation])
            )
        }
        return true
    }

    /// The members of a conversation, sorted; `nil` if there is no such conversation.
    public func members(of conversation: String) async throws(PresenceError) -> [String]? {
        let (exists, members) = try await run {
            try await self.redis.pipeline(SISMEMBER(key: keys.conversations, member: conversation), SMEMBERS(key: keys.members(conversation)))
        }
        guard case .success(true) = exists else { return nil }
        guard case .success(let members) = members else { throw PresenceError(.unavailable, "the presence store is unreachable") }
        return members.sorted()
    }

    /// The conversations a user is a member of, sorted.
    public func conversations(of user: String) async throws(PresenceError) -> [String] {
        try await run { try await self.redis.execute(SMEMBERS(key: keys.conversationsOf(user))) }.sorted()
    }

    /// Every conversation id, sorted.
    public func allConversations() async throws(PresenceError) -> [String] {
        try await run { try await self.redis.execute(SMEMBERS(key: keys.conversations)) }.sorted()
    }

    /// Whether `viewer` may see `target` under the configured visibility.
    public func canSee(viewer: String, target: String) async throws(PresenceError) -> Bool {
        try await visible(to: viewer, among: [target]) == [target]
    }

    /// Those of `targets` that `viewer` may see under the configured visibility, in order.
    ///
    /// Every command touches one user's keys: the viewer's conversations are read in the
    /// viewer's slot, then each target's set is asked about them in the target's (one pipeline
    /// for all targets), as a Redis Cluster needs.
    public func visible(to viewer: String, among targets: [String]) async throws(PresenceError) -> [String] {
        if configuration.visibility == .open { return targets }
        let others = targets.filter { $0 != viewer }
        guard !others.isEmpty else { return targets }
        let own = try await conversations(of: viewer)
        guard !own.isEmpty else { return targets.filter { $0 == viewer } }
        let shared = try await sharing(own, with: others)
        return targets.filter { $0 == viewer || shared.contains($0) }
    }

    /// Those of `users` who are members of at least one of `conversations`.
    private func sharing(_ conversations: [String], with users: [String]) async throws(PresenceError) -> Set<String> {
        let replies = try await run {
            try await self.redis.pipeline(users.map { SMISMEMBER(key: keys.conversationsOf($0), members: conversations) })
        }
        var sharing = Set<String>()
        for (user, reply) in zip(users, replies) {
            guard case .success(let memberships) = reply else { throw PresenceError(.unavailable, "the presence store is unreachable") }
            if memberships.contains(true) { sharing.insert(user) }
        }
        return sharing
    }

    /// `viewer`'s automatic contacts: the users sharing with them a conversation of at most
    /// ``PresenceConfiguration/largeGroup`` members (not `viewer`), sorted; `includingLarge`:
    /// everyone `viewer` may see, larger conversations too. Each conversation's members are read
    /// in its own slot (one pipeline), and joined here.
    public func contacts(of viewer: String, includingLarge: Bool = false) async throws(PresenceError) -> [String] {
        var conversations = try await conversations(of: viewer)
        guard !conversations.isEmpty else { return [] }
        if !includingLarge {
            // Conversations above the large-group size add no automatic contacts (docs/API.md, "Who
            // may see whom"): their sizes first, then the members of the others only.
            let sizes = try await run { try await self.redis.pipeline(conversations.map { SCARD(key: keys.members($0)) }) }
            var small: [String] = []
            for (conversation, size) in zip(conversations, sizes) {
                guard case .success(let count) = size else { throw PresenceError(.unavailable, "the presence store is unreachable") }
                if count <= configuration.largeGroup { small.append(conversation) }
            }
            conversations = small
            guard !conversations.isEmpty else { return [] }
        }
        let replies = try await run { try await self.redis.pipeline(conversations.map { SMEMBERS(key: keys.members($0)) }) }
        var contacts = Set<String>()
        for reply in replies {
            guard case .success(let members) = reply else { throw PresenceError(.unavailable, "the presence store is unreachable") }
            contacts.formUnion(members)
        }
        contacts.remove(viewer)
        return contacts.sorted()
    }

    /// Applies a change and publishes it on the conversation's channel and on the channel of
    /// every user in `notifying` (members before and after): their sessions re-check whom they
    /// may see, so new members become watched and removed ones stop producing events.
    ///
    /// Whom a user may see follows their own list of conversations (in their slot) and the
    /// conversation's member set (in its own): on a cluster no one command writes both. The
    /// steps are awaited in an order that leaves less visibility, never more, if this node dies
    /// between two: the removed users' lists first, then the member set, the added users' lists
    /// last, then the events.
    ///
    /// `notifying` is every member before and after the change. A change that leaves a group
    /// large (above `largeGroup` members before and after) changes no other member's automatic
    /// contacts, so only the added and removed users' channels carry it (with the
    /// conversation's): 2,000 members of a 4,000-member group on one node hear one event where
    /// they heard 2,000.
    private func applyMembership(_ conversation: String, adding: Set<String>, removing: Set<String>, notifying: Set<String>, create: Bool) async throws(PresenceError) -> MembershipEvent {
        let before = notifying.subtracting(adding)
        let after = before.union(adding).subtracting(removing)
        let large = min(before.count, after.count) > configuration.largeGroup
        let event = MembershipEvent(conversationID: conversation, added: adding.sorted(), removed: removing.sorted(), large: large)
        let recipients = large ? adding.union(removing) : notifying
        // Every step's commands answer a count: SADD and SREM, how many changed; a publish, how
        // many heard it.
        let revoke: [any RedisCommand<Int>] = event.removed.map { SREM(key: keys.conversationsOf($0), members: [conversation]) }
        var members: [any RedisCommand<Int>] = []
        if create { members.append(SADD(key: keys.conversations, members: [conversation])) }
        if !adding.isEmpty { members.append(SADD(key: keys.members(conversation), members: event.added)) }
        if !removing.isEmpty { members.append(SREM(key: keys.members(conversation), members: event.removed)) }
        let grant: [any RedisCommand<Int>] = event.added.map { SADD(key: keys.conversationsOf($0), members: [conversation]) }
        var events: [any RedisCommand<Int>] = []
        if !adding.isEmpty || !removing.isEmpty, let payload = try? JSONEncoder().encode(event) {
            let message = Array(payload)
            let mode = redis.pubSub
            events.append(Publish(message, on: keys.conversationChannel(conversation), mode: mode))
            for user in recipients.sorted() { events.append(Publish(message, on: keys.userChannel(user), mode: mode)) }
        }
        for (index, step) in [revoke, members, grant, events].enumerated() {
            for start in stride(from: 0, to: step.count, by: 1000) {
                let results = try await run { try await self.redis.pipeline(Array(step[start..<min(start + 1000, step.count)])) }
                for result in results {
                    if case .failure(let error) = result { throw Self.presenceError(error) }
                }
            }
            // New members' cursors start at the history's last seq, once they are members.
            if index == 1, !event.added.isEmpty {
                for start in stride(from: 0, to: event.added.count, by: 1000) {
                    try await evaluate(StartCursors(conversation: conversation, users: Array(event.added[start..<min(start + 1000, event.added.count)])))
                }
            }
        }
        // A removed member stops typing there, once no longer a member: a start that raced the
        // removal was refused, or is ended here.
        for user in event.removed { _ = try await evaluate(SetTyping(conversation: conversation, user: user, isTyping: false, checked: false)) }
        return event
    }

    /// Asks every node to close the sessions of `user` (close code 4003); returns how many nodes
    /// listened.
    @discardableResult
    public func requestDisconnect(user: String) async throws(PresenceError) -> Int {
        try await tell(.disconnectUser(userID: user))
    }

    /// Decodes a membership event published by a conversation change; `nil` for other messages.
    public func decodeMembership(_ payload: [UInt8]) -> MembershipEvent? {
        try? JSONDecoder().decode(MembershipEvent.self, from: Data(payload))
    }
}
