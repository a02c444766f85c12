// Sorted set commands.

/// `ZADD key [NX] score member ...`: how many members are new. With `onlyNew` (`NX`), members
/// already there keep their scores.
public struct ZADD: RedisCommand {
    public var key: String
    public var entries: [(score: Int64, member: String)]
    public var onlyNew: Bool
    public init(key: String, entries: [(score: Int64, member: String)], onlyNew: Bool = false) {
        (self.key, self.entries, self.onlyNew) = (key, entries, onlyNew)
    }
    public var arguments: [RedisArgument] {
        ["ZADD", RedisArgument(key)] + (onlyNew ? ["NX"] : []) + entries.flatMap { [RedisArgument(String($0.score)), RedisArgument($0.member)] }
    }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}

/// `ZREM key member...`: how many were members.
public struct ZREM: RedisCommand {
    public var key: String
    public var members: [String]
    public init(key: String, members: [String]) { (self.key, self.members) = (key, members) }
    public var arguments: [RedisArgument] { ["ZREM", RedisArgument(key)] + members.map { RedisArgument($0) } }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}

/// `ZSCORE key member`: its score, nil when it is not a member.
public struct ZSCORE: RedisCommand {
    public var key: String
    public var member: String
    public init(key: String, member: String) { (self.key, self.member) = (key, member) }
    public var arguments: [RedisArgument] { ["ZSCORE", RedisArgument(key), RedisArgument(member)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Double? {
        if reply.isNull { return nil }
        guard let score = reply.double else { throw unexpected(reply) }
        return score
    }
}

/// `ZRANGE key start stop`: the members by rank, lowest score first.
public struct ZRANGE: RedisCommand {
    public var key: String
    public var start: Int
    public var stop: Int
    /// Every member: ranks 0 to -1.
    public init(key: String, start: Int = 0, stop: Int = -1) { (self.key, self.start, self.stop) = (key, start, stop) }
    public var arguments: [RedisArgument] { ["ZRANGE", RedisArgument(key), RedisArgument(start), RedisArgument(stop)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> [String] { try strings(reply) }

    /// The same range with each member's score: `ZRANGE key start stop WITHSCORES`.
    public struct WithScores: RedisCommand {
        public var range: ZRANGE
        public init(key: String, start: Int = 0, stop: Int = -1) { range = ZRANGE(key: key, start: start, stop: stop) }
        public var arguments: [RedisArgument] { range.arguments + ["WITHSCORES"] }
        public func decode(_ reply: RESPValue) throws(RedisError) -> [(member: String, score: Double)] {
            let flat = try strings(reply)
            var pairs: [(member: String, score: Double)] = []
            for index in stride(from: 0, to: flat.count - 1, by: 2) {
                guard let score = Double(flat[index + 1]) else { throw unexpected(reply) }
                pairs.append((flat[index], score))
            }
            guard pairs.count * 2 == flat.count else { throw unexpected(reply) }
            return pairs
        }
    }
}
