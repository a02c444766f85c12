// Set commands.

/// `SADD key member...`: how many were not members before.
public struct SADD: RedisCommand {
    public var key: String
    public var members: [String]
    public init(key: String, members: [String]) { (self.key, self.members) = (key, members) }
    public var arguments: [RedisArgument] { ["SADD", RedisArgument(key)] + members.map { RedisArgument($0) } }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}

/// `SREM key member...`: how many were members.
public struct SREM: RedisCommand {
    public var key: String
    public var members: [String]
    public init(key: String, members: [String]) { (self.key, self.members) = (key, members) }
    public var arguments: [RedisArgument] { ["SREM", RedisArgument(key)] + members.map { RedisArgument($0) } }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}

/// `SMEMBERS key`: every member, in no order.
public struct SMEMBERS: RedisCommand {
    public var key: String
    public init(key: String) { self.key = key }
    public var arguments: [RedisArgument] { ["SMEMBERS", RedisArgument(key)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> [String] { try strings(reply) }
}

/// `SCARD key`: how many members.
public struct SCARD: RedisCommand {
    public var key: String
    public init(key: String) { self.key = key }
    public var arguments: [RedisArgument] { ["SCARD", RedisArgument(key)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}

/// `SISMEMBER key member`: whether it is a member.
public struct SISMEMBER: RedisCommand {
    public var key: String
    public var member: String
    public init(key: String, member: String) { (self.key, self.member) = (key, member) }
    public var arguments: [RedisArgument] { ["SISMEMBER", RedisArgument(key), RedisArgument(member)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Bool { try integer(reply) == 1 }
}

/// `SMISMEMBER key member...`: whether each is a member, in order.
public struct SMISMEMBER: RedisCommand {
    public var key: String
    public var members: [String]
    public init(key: String, members: [String]) { (self.key, self.members) = (key, members) }
    public var arguments: [RedisArgument] { ["SMISMEMBER", RedisArgument(key)] + members.map { RedisArgument($0) } }
    public func decode(_ reply: RESPValue) throws(RedisError) -> [Bool] {
        var answers: [Bool] = []
        for element in try elements(of: reply) { answers.append(try integer(element) == 1) }
        guard answers.count == members.count else { throw unexpected(reply) }
        return answers
    }
}

/// `SSCAN key cursor COUNT count`: one page of members and the cursor of the next ("0": done).
public struct SSCAN: RedisCommand {
    public var key: String
    public var cursor: String
    public var count: Int
    public init(key: String, cursor: String, count: Int) { (self.key, self.cursor, self.count) = (key, cursor, count) }
    public var arguments: [RedisArgument] { ["SSCAN", RedisArgument(key), RedisArgument(cursor), "COUNT", RedisArgument(count)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> (cursor: String, members: [String]) {
        let parts = try elements(of: reply)
        guard parts.count == 2, let next = parts[0].string else { throw unexpected(reply) }
        return (next, try strings(parts[1]))
    }
}
