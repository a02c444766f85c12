import Foundation
import NIOConcurrencyHelpers
import PresenceProtocol
import RedisClient

/// A typing change published on a conversation's channel.
public struct TypingEvent: Sendable, Equatable, Decodable {
    /// The conversation.
    public var conversationID: String
    /// Who is (or stopped) typing.
    public var userID: String
    /// Whether they are typing now.
    public var isTyping: Bool
    /// When it happened (ms since 1970).
    public var at: Int64

    enum CodingKeys: String, CodingKey, CaseIterable {
        case type, conversationID = "conversation_id", userID = "user_id", isTyping = "is_typing", at
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        guard try container.decode(String.self, forKey: .type) == "typing" else {
            throw DecodingError.dataCorruptedError(forKey: .type, in: container, debugDescription: "not a typing event")
        }
        conversationID = try container.decode(String.self, forKey: .conversationID)
        userID = try container.decode(String.self, forKey: .userID)
        isTyping = try container.decode(Bool.self, forKey: .isTyping)
        at = try container.decode(Int64.self, forKey: .at)
    }
}

extension PresenceEngine {
    /// Repeated `is_typing: true` from one user in one conversation within this window is
    /// forwarded once; each refresh still extends the expiry.
    public static let typingCoalescingMilliseconds: Int64 = 2000

    /// Sets whether `user` is typing in `conversation`. Only members may; a user who is offline
    /// or hidden is never shown typing (a start is ignored: it would show them active). Returns
    /// whether watchers were told.
    ///
    /// A start is checked against the user's state (in the user's slot) before it is written and
    /// again after: a change to offline or hidden ends the user's typing after it is stored
    /// (``settle(_:)``), so whichever of the two comes second sees the other, and a start racing it
    /// is ended at once rather than at its expiry.
    @discardableResult
    public func setTyping(user: String, conversation: String, isTyping: Bool) async throws(PresenceError) -> Bool {
        // A start from a user who may not be shown typing is taken as a stop: checked the same
        // way (a non-member is refused), and ending a state that raced the change.
        var starting: DeadlineEntry?
        if isTyping {
            starting = try await mayStartTyping(user, in: conversation)
            if let probe = afterDeadlineIndexed.withLockedValue({ $0 }) { await probe() }
        }
        switch try await evaluate(SetTyping(conversation: conversation, user: user, isTyping: starting != nil, checked: true)) {
        case .notMember: throw PresenceError(.forbidden, "you are not a member of this conversation")
        case .quiet: return false
        case .published:
            // Published, the start may have found no typing state running: a reaper may then
            // have dropped its entry meanwhile (see ``reindex(_:)``), which is written again
            // beside the check. (A refresh kept quiet found one running, whose entry a reaper
            // keeps.)
            if let entry = starting, try await !mayShowTyping(user, reindexing: entry) {
                _ = try await evaluate(SetTyping(conversation: conversation, user: user, isTyping: false, checked: false))
            }
            return true
        }
    }

    /// Whether `user` may be shown typing: online or away, and not hidden. Read in one round
    /// trip with `entry` written again (``reindex(_:)``; kept for the next upkeep tick if Redis
    /// does not take it).
    private func mayShowTyping(_ user: String, reindexing entry: DeadlineEntry) async throws(PresenceError) -> Bool {
        let index = entry.command
        let state: Result<[String?], RedisError>
        do {
            let indexed: Result<Int, RedisError>
            (state, indexed) = try await run { try await self.redis.pipeline(self.typingCheck(user), index) }
            if case .failure = indexed { keepPending([index]) }
        } catch {
            keepPending([index])
            throw error
        }
        switch state {
        case .success(let fields): return Self.mayShowTyping(fields)
        case .failure(let error): throw Self.presenceError(error)
        }
    }

    /// Whether `user` may be shown typing, before a start, in one round trip with the start's
    /// entry in its conversation's deadline bucket, which must be there before the start is
    /// written (see ``indexDeadline(of:devices:after:)``). A start then refused leaves an entry
    /// that the reaper finds with nothing to end, and drops. Returns the entry when the user may
    /// start.
    private func mayStartTyping(_ user: String, in conversation: String) async throws(PresenceError) -> DeadlineEntry? {
        let entry = DeadlineEntry(set: keys.typingDeadlines(ofConversation: conversation), member: "\(conversation)|\(user)",
                                  score: indexScore(after: configuration.typingTTL))
        let state = try await run { () async throws -> [String?] in
            let (state, indexed) = try await self.redis.pipeline(self.typingCheck(user), entry.command)
            _ = try indexed.get()
            return try state.get()
        }
        return Self.mayShowTyping(state) ? entry : nil
    }

    private func typingCheck(_ user: String) -> HMGET { HMGET(key: keys.state(user), fields: ["status", "hidden"]) }

    private static func mayShowTyping(_ state: [String?]) -> Bool {
        guard let status = state[0], status != PresenceStatus.offline.rawValue else { return false }
        return state[1] != "1"
    }

    /// Ends every typing state of `user`, as when they go offline.
    public func clearTyping(user: String) async throws(PresenceError) {
        try await clearTyping(users: [user])
    }

    /// Ends every typing state of `users` in two round trips (every user's conversations, then
    /// every stop), as a reaper taking a dead node's users offline needs.
    func clearTyping(users: [String]) async throws(PresenceError) {
        guard !users.isEmpty else { return }
        let lists = try await run { try await self.redis.pipeline(users.map { SMEMBERS(key: self.keys.conversationsOf($0)) }) }
        var stops: [SetTyping] = []
        for (user, list) in zip(users, lists) {
            for conversation in (try? list.get()) ?? [] {
                stops.append(SetTyping(conversation: conversation, user: user, isTyping: false, checked: false))
            }
        }
        _ = try await evaluate(stops)
    }

    /// Who is typing in a conversation now.
    public func typingUsers(in conversation: String) async throws(PresenceError) -> Set<String> {
        let all = try await run { try await self.redis.execute(HGETALL(key: keys.typing(conversation))) }
        let now = try await storeNow()
        var users = Set<String>()
        for (user, entry) in all {
            if let expiry = Int64(entry.prefix { $0 != "|" }), expiry > now { users.insert(user) }
        }
        return users
    }

    /// Whether `user` is typing in a conversation shared with `viewer`.
    public func isTyping(_ user: String, sharedWith viewer: String) async throws(PresenceError) -> Bool {
        try await typing(among: [user], sharedWith: viewer).contains(user)
    }

    /// Those of `users` typing in a conversation they share with `viewer`: three round trips
    /// however many users (the viewer's conversations; which of them each user is in; the typing
    /// entries there), each command on one slot.
    public func typing(among users: [String], sharedWith viewer: String) async throws(PresenceError) -> Set<String> {
        let own = try await conversations(of: viewer)
        guard !own.isEmpty, !users.isEmpty else { return [] }
        let memberships = try await run {
            try await self.redis.pipeline(users.map { SMISMEMBER(key: keys.conversationsOf($0), members: own) })
        }
        var pairs: [(user: String, conversation: String)] = []
        for (user, reply) in zip(users, memberships) {
            guard case .success(let flags) = reply else { throw PresenceError(.unavailable, "the presence store is unreachable") }
            for (conversation, member) in zip(own, flags) where member { pairs.append((user, conversation)) }
        }
        guard !pairs.isEmpty else { return [] }
        let entries = try await run { try await self.redis.pipeline(pairs.map { HGET(key: keys.typing($0.conversation), field: $0.user) }) }
        let now = try await storeNow()
        var typing = Set<String>()
        for (pair, entry) in zip(pairs, entries) {
            guard let raw = (try? entry.get()) ?? nil, let expiry = Int64(raw.prefix { $0 != "|" }), expiry > now else { continue }
            typing.insert(pair.user)
        }
        return typing
    }

    /// Ends typing states whose expiry passed; part of every reaper pass.
    func reapTyping(limit: Int) async throws(PresenceError) -> Int {
        var ended = 0
        try await forEachClaimed(try await claim(keys.allTypingDeadlines, limit: limit)) { key, due, member throws(PresenceError) in
            let parts = member.split(separator: "|", maxSplits: 1).map(String.init)
            var outcome = ExpireTyping.Outcome.none
            if parts.count == 2 {
                outcome = try await evaluate(ExpireTyping(conversation: parts[0], user: parts[1]))
            }
            // Refreshed since it was indexed, or indexed early: looked at again at its real expiry.
            var next: Int64?
            if case .running(let expiry) = outcome { next = expiry }
            _ = try await evaluate(ResolveClaim(key: key, member: member, score: due.retry, next: next))
            if outcome == .ended { ended += 1 }
        }
        return ended
    }

    /// Decodes a typing event; `nil` for other messages.
    public func decodeTyping(_ payload: [UInt8]) -> TypingEvent? {
        try? JSONDecoder().decode(TypingEvent.self, from: Data(payload))
    }

    /// After a change: a user who went offline, or whom others now see offline (privacy), stops
    /// typing everywhere.
    func settle(_ change: PresenceChange) async {
        await settle([change])
    }

    /// ``settle(_:)`` for many changes at once (see ``clearTyping(users:)``).
    func settle(_ changes: [PresenceChange]) async {
        let users = changes.filter { change in
            (change.changed && change.views.real.status == .offline) || (change.shownChanged && change.views.hidden)
        }.map(\.views.real.userID)
        try? await clearTyping(users: users)
    }
}
