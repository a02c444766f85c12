// Commands to the server itself, and pub/sub.

/// `TIME`: the server's clock, as microseconds since 1970.
public struct TIME: RedisCommand {
    public init() {}
    public var arguments: [RedisArgument] { ["TIME"] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int64 {
        let parts = try strings(reply)
        guard parts.count == 2, let seconds = Int64(parts[0]), let micros = Int64(parts[1]) else { throw unexpected(reply) }
        return seconds * 1_000_000 + micros
    }
}

/// `INFO section`: the section's text, `name:value` lines.
public struct INFO: RedisCommand {
    public var section: String
    public init(section: String) { self.section = section }
    public var arguments: [RedisArgument] { ["INFO", RedisArgument(section)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> String {
        guard let text = reply.string else { throw unexpected(reply) }
        return text
    }
}

/// `CONFIG RESETSTAT`: zeroes the counters `INFO` reports.
public struct CONFIGRESETSTAT: RedisCommand {
    public init() {}
    public var arguments: [RedisArgument] { ["CONFIG", "RESETSTAT"] }
    public func decode(_ reply: RESPValue) throws(RedisError) {
        guard reply.string == "OK" else { throw unexpected(reply) }
    }
}

/// `DBSIZE`: how many keys the current database holds.
public struct DBSIZE: RedisCommand {
    public init() {}
    public var arguments: [RedisArgument] { ["DBSIZE"] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}

/// `PUBLISH channel message`, or `SPUBLISH` with sharded pub/sub: how many subscribers got it
/// (see ``RedisCommands/publish(_:on:)`` for what a cluster counts).
public struct Publish: RedisCommand {
    public var channel: String
    public var message: [UInt8]
    public var mode: RedisPubSub
    public init(_ message: [UInt8], on channel: String, mode: RedisPubSub) { (self.message, self.channel, self.mode) = (message, channel, mode) }
    public var arguments: [RedisArgument] { [mode.publishCommand, RedisArgument(channel), RedisArgument(bytes: message)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> Int { try integer(reply) }
}

/// `PUBSUB CHANNELS pattern`: the classic channels with a subscriber, matching `pattern`.
public struct PUBSUBCHANNELS: RedisCommand {
    public var pattern: String
    public init(pattern: String) { self.pattern = pattern }
    public var arguments: [RedisArgument] { ["PUBSUB", "CHANNELS", RedisArgument(pattern)] }
    public func decode(_ reply: RESPValue) throws(RedisError) -> [String] { try strings(reply) }
}
