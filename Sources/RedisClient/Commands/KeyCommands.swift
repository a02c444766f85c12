// Commands on keys of any type.

/// `DEL key...`: how many existed. On a cluster the keys must share a slot.
public struct DEL: RedisCommand {
    public var keys: [String]
    public init(keys: [String]) { self.keys = keys }
    public var arguments: [RedisArgument] { ["DEL"] + keys.map { RedisArgument($0) } }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}

/// `UNLINK key...`: as `DEL`, the memory given back in the background.
public struct UNLINK: RedisCommand {
    public var keys: [String]
    public init(keys: [String]) { self.keys = keys }
    public var arguments: [RedisArgument] { ["UNLINK"] + keys.map { RedisArgument($0) } }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}

/// `EXISTS key...`: how many of them exist (a key named twice counts twice).
public struct EXISTS: RedisCommand {
    public var keys: [String]
    public init(keys: [String]) { self.keys = keys }
    public var arguments: [RedisArgument] { ["EXISTS"] + keys.map { RedisArgument($0) } }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}

/// `PEXPIRE key milliseconds`: whether the key existed and now expires then.
public struct PEXPIRE: RedisCommand {
    public var key: String
    public var milliseconds: Int64
    public init(key: String, milliseconds: Int64) { (self.key, self.milliseconds) = (key, milliseconds) }
    public var arguments: [RedisArgument] { ["PEXPIRE", RedisArgument(key), RedisArgument(String(milliseconds))] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Bool { try integer(reply) == 1 }
}

/// `PTTL key`: the milliseconds left before the key expires, -1 for a key that never does, nil
/// for no key.
public struct PTTL: RedisCommand {
    public var key: String
    public init(key: String) { self.key = key }
    public var arguments: [RedisArgument] { ["PTTL", RedisArgument(key)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int? {
        let left = try integer(reply)
        return left == -2 ? nil : left
    }
}

/// `MEMORY USAGE key SAMPLES samples`: the bytes the key and its value take, nil for no key.
/// `samples` 0 counts every element of a collection; Redis's default samples 5.
public struct MEMORYUSAGE: RedisCommand {
    public var key: String
    public var samples: Int?
    public init(key: String, samples: Int? = nil) { (self.key, self.samples) = (key, samples) }
    public var arguments: [RedisArgument] {
        ["MEMORY", "USAGE", RedisArgument(key)] + (samples.map { ["SAMPLES", RedisArgument($0)] } ?? [])
    }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int? {
        if reply.isNull { return nil }
        return try integer(reply)
    }
}

/// `SCAN cursor MATCH pattern COUNT count` on one server: a page of keys and the next cursor.
public struct SCAN: RedisCommand {
    public var cursor: String
    public var pattern: String
    public var count: Int
    public init(cursor: String, matching pattern: String, count: Int) { (self.cursor, self.pattern, self.count) = (cursor, pattern, count) }
    public var arguments: [RedisArgument] { ["SCAN", RedisArgument(cursor), "MATCH", RedisArgument(pattern), "COUNT", RedisArgument(count)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> (cursor: String, keys: [String]) {
        let parts = try elements(of: reply)
        guard parts.count == 2, let next = parts[0].string else { throw unexpected(reply) }
        return (next, try strings(parts[1]))
    }
}

/// `GET key`: the string value, nil for no key.
public struct GET: RedisCommand {
    public var key: String
    public init(key: String) { self.key = key }
    public var arguments: [RedisArgument] { ["GET", RedisArgument(key)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> String? { try optionalString(reply) }
}

/// `SET key value`.
public struct SET: RedisCommand {
    public var key: String
    public var value: String
    public init(key: String, value: String) { (self.key, self.value) = (key, value) }
    public var arguments: [RedisArgument] { ["SET", RedisArgument(key), RedisArgument(value)] }
    public func decode(_ reply: RESPValue) throws(RedisError) {
        guard reply.string == "OK" else { throw unexpected(reply) }
    }
}

/// `XLEN key`: how many entries the stream has (0 for no key).
public struct XLEN: RedisCommand {
    public var key: String
    public init(key: String) { self.key = key }
    public var arguments: [RedisArgument] { ["XLEN", RedisArgument(key)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}
