import PresenceProtocol
import RedisClient

// The scripts of node leases and of the reapers' deadline sets.

/// Renews a node's lease, or with `register` takes it whether or not it exists. The lease's
/// value and the node's score in the registry become the new lease end, and the node's info
/// records the renewal (the last moment the node was known alive).
struct RenewLease: ScriptCall {
    enum Outcome {
        /// Renewed at this moment; the node's device index holds this many devices. An index
        /// smaller than the node's sessions says Redis lost some of it: the caller audits.
        case renewed(at: Int64, indexed: Int)
        /// A renewal found the lease gone (reaped, or Redis lost its data): the caller registers again.
        case gone
    }

    var node: String
    var register: Bool
    /// Live sessions on the node, for its info.
    var sessions: Int

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.lease(node), context.keys.nodes, context.keys.nodeInfo(node), context.keys.nodeDevices(node)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, ScriptContext.milliseconds(context.configuration.leaseTTL), RedisArgument(node), RedisArgument(sessions),
         context.deviceTTL, register ? "register" : "renew"]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        let values = reply.array ?? []
        guard let at = values.first?.int else { throw PresenceError(.internal, "unexpected reply from the lease script") }
        guard at > 0 else { return .gone }
        return .renewed(at: Int64(at), indexed: values.count == 2 ? values[1].int ?? 0 : 0)
    }

    /// Returns {the renewal's moment, how many devices the index holds}, or {0} when gone.
    static let script = RedisScript(ScriptLua.clock + """
    local now = clock(ARGV[1])
    local lease, node, sessions, ttl, mode = tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], ARGV[6]
    local ends = now + lease
    if mode ~= 'register' and not leaseLeft(KEYS[1], ARGV[1]) then return {0} end
    redis.call('SET', KEYS[1], ends, 'PX', lease)
    redis.call('ZADD', KEYS[2], ends, node)
    redis.call('HSET', KEYS[3], 'renewed_at', now, 'sessions', sessions)
    redis.call('PEXPIRE', KEYS[3], ttl)
    redis.call('PEXPIRE', KEYS[2], ttl)
    return {now, redis.call('SCARD', KEYS[4])}
    """)
}

/// Gives up a node's lease on a graceful shutdown: the node stays in the registry, lapsed now,
/// so that a reaper takes any device it still held.
struct ReleaseLease: ScriptCall {
    var node: String

    func keys(_ context: ScriptContext) -> [String] { [context.keys.lease(node), context.keys.nodes] }
    func arguments(_ context: ScriptContext) -> [RedisArgument] { [context.now, RedisArgument(node)] }
    func decode(_ reply: RESPValue) throws(PresenceError) {}

    static let script = RedisScript(ScriptLua.clock + """
    redis.call('DEL', KEYS[1])
    redis.call('ZADD', KEYS[2], clock(ARGV[1]), ARGV[2])
    return 1
    """)
}

/// Whether a node's lease key still exists: that, and nothing a clock says, is whether the node
/// is alive. A live node claimed by a reaper (its score passed a moment before its key expired,
/// or it was renewed meanwhile) is put back in the registry at its lease's real end.
struct LeaseLive: ScriptCall {
    var node: String

    func keys(_ context: ScriptContext) -> [String] { [context.keys.lease(node), context.keys.nodes] }
    func arguments(_ context: ScriptContext) -> [RedisArgument] { [context.now, RedisArgument(node)] }
    func decode(_ reply: RESPValue) throws(PresenceError) -> Bool { reply.int == 1 }

    static let script = RedisScript(ScriptLua.clock + """
    local left = leaseLeft(KEYS[1], ARGV[1])
    if not left then return 0 end
    if left > 0 then redis.call('ZADD', KEYS[2], clock(ARGV[1]) + left, ARGV[2]) end
    return 1
    """)
}

/// Deletes a reaped node's device index and info, unless its lease is held again (a new process
/// under the same id took it). Returns whether it deleted them.
struct DropNode: ScriptCall {
    var node: String

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.lease(node), context.keys.nodeDevices(node), context.keys.nodeInfo(node)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] { [context.now] }
    func decode(_ reply: RESPValue) throws(PresenceError) -> Bool { reply.int == 1 }

    static let script = RedisScript(ScriptLua.clock + """
    if leaseLeft(KEYS[1], ARGV[1]) then return 0 end
    redis.call('DEL', KEYS[2], KEYS[3])
    return 1
    """)
}

/// Claims up to `limit` due entries of a deadline sorted set: entries scored at or before now
/// are scored again to now plus `claimFor` (a retry time, should the claimer die), so that
/// exactly one reaper works on each.
struct ClaimDue: ScriptCall {
    /// What a claim took: the retry score it gave the entries, and the entries with their scores
    /// before it.
    struct Claim {
        var retry: RedisArgument
        var entries: [(member: String, score: Double)]
    }

    var key: String
    var claimFor: Duration
    var limit: Int

    func keys(_ context: ScriptContext) -> [String] { [key] }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, ScriptContext.milliseconds(claimFor), RedisArgument(limit)]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Claim {
        let values = reply.array ?? []
        guard values.count >= 2, let retry = values[1].int else { throw PresenceError(.internal, "unexpected reply from the claim script") }
        var entries: [(member: String, score: Double)] = []
        for index in stride(from: 2, to: values.count - 1, by: 2) {
            if let member = values[index].string, let score = values[index + 1].double { entries.append((member, score)) }
        }
        return Claim(retry: RedisArgument(retry), entries: entries)
    }

    /// Returns {now, retry, member, old score, ...}.
    static let script = RedisScript(ScriptLua.clock + """
    local now = clock(ARGV[1])
    local retry = now + tonumber(ARGV[2])
    local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[3]))
    for i = 1, #due, 2 do
      redis.call('ZADD', KEYS[1], retry, due[i])
    end
    table.insert(due, 1, tostring(retry))
    table.insert(due, 1, tostring(now))
    return due
    """)
}

/// Removes a member of a sorted set only if its score is still the one given (the claim's).
/// Returns whether it removed it.
struct RemoveIfScore: ScriptCall {
    var key: String
    var member: String
    var score: RedisArgument

    func keys(_ context: ScriptContext) -> [String] { [key] }
    func arguments(_ context: ScriptContext) -> [RedisArgument] { [context.now, RedisArgument(member), score] }
    func decode(_ reply: RESPValue) throws(PresenceError) -> Bool { reply.int == 1 }

    static let script = RedisScript("""
    local score = redis.call('ZSCORE', KEYS[1], ARGV[2])
    if score and tonumber(score) == tonumber(ARGV[3]) then
      return redis.call('ZREM', KEYS[1], ARGV[2])
    end
    return 0
    """)
}

/// Gives claimed entries back at their scores before the claim, each only if it still holds the
/// claim's retry score (nobody scored it again since). Returns how many were given back.
struct Unclaim: ScriptCall {
    var key: String
    var retry: RedisArgument
    var entries: [(member: String, score: Double)]

    func keys(_ context: ScriptContext) -> [String] { [key] }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, retry] + entries.flatMap { [RedisArgument($0.member), RedisArgument(Int($0.score))] }
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Int { reply.int ?? 0 }

    static let script = RedisScript("""
    local retry, given = tonumber(ARGV[2]), 0
    for i = 3, #ARGV - 1, 2 do
      local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
      if score and tonumber(score) == retry then
        redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
        given = given + 1
      end
    end
    return given
    """)
}
