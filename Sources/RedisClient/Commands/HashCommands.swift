// Hash commands.

/// `HGET key field`: the field's value, nil when it or the key is missing.
public struct HGET: RedisCommand {
    public var key: String
    public var field: String
    public init(key: String, field: String) { (self.key, self.field) = (key, field) }
    public var arguments: [RedisArgument] { ["HGET", RedisArgument(key), RedisArgument(field)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> String? { try optionalString(reply) }
}

/// `HMGET key field...`: each field's value in order, nil where it is missing.
public struct HMGET: RedisCommand {
    public var key: String
    public var fields: [String]
    public init(key: String, fields: [String]) { (self.key, self.fields) = (key, fields) }
    public var arguments: [RedisArgument] { ["HMGET", RedisArgument(key)] + fields.map { RedisArgument($0) } }
    public func decode(_ reply: RESPValue) throws(RedisError) -> [String?] {
        let values = try elements(of: reply)
        guard values.count == fields.count else { throw unexpected(reply) }
        return values.map(\.string)
    }
}

/// `HGETALL key`: every field and value, in the order Redis gives them (empty for no key).
public struct HGETALL: RedisCommand {
    public var key: String
    public init(key: String) { self.key = key }
    public var arguments: [RedisArgument] { ["HGETALL", RedisArgument(key)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> [(field: String, value: String)] {
        let flat = try strings(reply)
        guard flat.count % 2 == 0 else { throw unexpected(reply) }
        return stride(from: 0, to: flat.count, by: 2).map { (flat[$0], flat[$0 + 1]) }
    }
}

/// `HLEN key`: how many fields the hash has.
public struct HLEN: RedisCommand {
    public var key: String
    public init(key: String) { self.key = key }
    public var arguments: [RedisArgument] { ["HLEN", RedisArgument(key)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}
