extension HashSlot {
    /// The keys of `command` by which a cluster routes it (shard channels for `SPUBLISH` and
    /// `SSUBSCRIBE`); empty for a command that names no key and may go to any node.
    ///
    /// Ordinary commands have their key first; multi-key commands (`DEL`, `MGET`, `SUNION`, ...)
    /// take every argument as a key; `EVAL`, `FCALL`, `ZUNION`, `LMPOP` and the like count
    /// theirs with a `numkeys` argument; `XREAD` names them after `STREAMS`.
    public static func keys(of command: [RedisArgument]) -> [[UInt8]] {
        guard let name = command.first else { return [] }
        let arguments = command.dropFirst()
        switch KeyPositions.of(commandName: name.bytes) {
        case .none:
            return []
        case .first:
            return arguments.first.map { [$0.bytes] } ?? []
        case .firstTwo:
            return arguments.prefix(2).map(\.bytes)
        case .all:
            return arguments.map(\.bytes)
        case .allButLast:
            return arguments.dropLast().map(\.bytes)
        case .alternate:
            return arguments.enumerated().compactMap { index, argument in index % 2 == 0 ? argument.bytes : nil }
        case .second:
            return arguments.dropFirst().prefix(1).map(\.bytes)
        case .fromSecond:
            return arguments.dropFirst().map(\.bytes)
        case .counted(let position):
            return counted(arguments, at: position)
        case .destinationAndCounted:
            return arguments.prefix(1).map(\.bytes) + counted(arguments, at: 2)
        case .afterStreams:
            guard let streams = arguments.firstIndex(where: { uppercased($0.bytes) == "STREAMS" }) else { return [] }
            let rest = arguments[(streams + 1)...]
            // Keys first, then as many IDs.
            return rest.prefix(rest.count / 2).map(\.bytes)
        case .memoryUsage:
            guard arguments.first.map({ uppercased($0.bytes) }) == "USAGE" else { return [] }
            return arguments.dropFirst().prefix(1).map(\.bytes)
        }
    }

    /// The slot every key of `command` maps to, or nil when the command names no key.
    ///
    /// Throws a ``RedisError/Code/server`` error starting with `CROSSSLOT` when the keys map to
    /// several slots, as Redis would answer; the message names the command, never its keys.
    public static func slot(of command: [RedisArgument]) throws(RedisError) -> HashSlot? {
        var slot: HashSlot?
        for key in keys(of: command) {
            let next = HashSlot(of: key)
            if let slot, slot != next {
                throw RedisError(
                    .server,
                    "CROSSSLOT the keys of \(commandName(command)) map to different hash slots; keys used together need the same {hash tag}, as in {user1}.a and {user1}.b"
                )
            }
            slot = next
        }
        return slot
    }

    /// The command's name in capitals, for messages (never its arguments, which may be secret).
    static func commandName(_ command: [RedisArgument]) -> String {
        guard let name = command.first else { return "an empty command" }
        return uppercased(name.bytes)
    }

    /// `numkeys` at `position` (1 is the argument after the name), then that many keys.
    private static func counted(_ arguments: ArraySlice<RedisArgument>, at position: Int) -> [[UInt8]] {
        let countIndex = arguments.startIndex + position - 1
        guard arguments.indices.contains(countIndex),
              let count = Int(String(decoding: arguments[countIndex].bytes, as: UTF8.self)), count > 0
        else { return [] }
        // A count larger than the arguments is Redis's error to report; route by what is there.
        return arguments[(countIndex + 1)...].prefix(count).map(\.bytes)
    }

    static func uppercased(_ bytes: [UInt8]) -> String {
        String(decoding: bytes.map { (UInt8(ascii: "a")...UInt8(ascii: "z")).contains($0) ? $0 - 32 : $0 }, as: UTF8.self)
    }
}

/// Where a command's keys are among its arguments (the name excluded).
enum KeyPositions: Equatable {
    /// No key: any node can answer (`PING`, `INFO`, `SCAN`, `CLUSTER ...`).
    case none
    /// The first argument (`GET key`, `HSET key ...`); the default for unknown commands.
    case first
    /// The first two (`RENAME source destination`, `LMOVE`, `COPY`).
    case firstTwo
    /// Every argument (`DEL`, `MGET`, `SUNION`, `SSUBSCRIBE`).
    case all
    /// Every argument but the last, a timeout (`BLPOP key... timeout`).
    case allButLast
    /// Every other argument from the first (`MSET key value ...`).
    case alternate
    /// The second argument, after a subcommand (`OBJECT ENCODING key`, `XINFO STREAM key`).
    case second
    /// Every argument from the second (`BITOP operation destination source...`).
    case fromSecond
    /// A `numkeys` count at this argument (1-based), then that many keys (`EVAL script numkeys`).
    case counted(at: Int)
    /// A destination, then `numkeys` and the keys (`ZUNIONSTORE destination numkeys key...`).
    case destinationAndCounted
    /// The first half of the arguments after `STREAMS` (`XREAD`, `XREADGROUP`).
    case afterStreams
    /// `MEMORY USAGE key` has a key; other `MEMORY` subcommands have none.
    case memoryUsage

    static func of(commandName: [UInt8]) -> KeyPositions {
        table[HashSlot.uppercased(commandName)] ?? .first
    }

    private static let table: [String: KeyPositions] = {
        var table: [String: KeyPositions] = [:]
        func set(_ positions: KeyPositions, _ names: String) {
            for name in names.split(separator: " ") { table[String(name)] = positions }
        }
        set(.none, """
            PING ECHO TIME INFO DBSIZE SCAN RANDOMKEY KEYS FLUSHALL FLUSHDB SCRIPT FUNCTION CLUSTER \
            CONFIG CLIENT COMMAND PUBSUB LASTSAVE SAVE BGSAVE BGREWRITEAOF SLOWLOG LATENCY MODULE ACL \
            ROLE DEBUG WAIT WAITAOF LOLWUT SWAPDB READONLY READWRITE ASKING MULTI EXEC DISCARD UNWATCH \
            AUTH HELLO SELECT QUIT RESET SUBSCRIBE PSUBSCRIBE UNSUBSCRIBE PUNSUBSCRIBE MONITOR FAILOVER \
            REPLICAOF SLAVEOF SHUTDOWN SYNC PSYNC
            """)
        set(.all, "DEL UNLINK EXISTS TOUCH MGET SUNION SINTER SDIFF SUNIONSTORE SINTERSTORE SDIFFSTORE PFCOUNT PFMERGE WATCH SSUBSCRIBE SUNSUBSCRIBE")
        set(.firstTwo, "RENAME RENAMENX SMOVE LMOVE BLMOVE RPOPLPUSH BRPOPLPUSH COPY LCS GEOSEARCHSTORE ZRANGESTORE")
        set(.allButLast, "BLPOP BRPOP BZPOPMIN BZPOPMAX")
        set(.alternate, "MSET MSETNX")
        set(.second, "OBJECT XINFO XGROUP")
        set(.fromSecond, "BITOP")
        set(.counted(at: 2), "EVAL EVALSHA EVAL_RO EVALSHA_RO FCALL FCALL_RO BLMPOP BZMPOP")
        set(.counted(at: 1), "SINTERCARD ZINTERCARD ZUNION ZINTER ZDIFF LMPOP ZMPOP")
        set(.destinationAndCounted, "ZUNIONSTORE ZINTERSTORE ZDIFFSTORE")
        set(.afterStreams, "XREAD XREADGROUP")
        set(.memoryUsage, "MEMORY")
        // PUBLISH, SPUBLISH and everything else not named here: the first argument.
        return table
    }()
}
