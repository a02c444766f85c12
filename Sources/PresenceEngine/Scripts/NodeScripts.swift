import PresenceProtocol
import RedisClient

// The scripts of node leases and of the reapers' deadline sets. A node's keys share the tag
// `{n:ID}`; the registry (`prefix:nodes`) is a key of its own, which the engine writes beside
// these scripts: a registry score is when a reaper looks at the node, and it is never later than
// the node's lease end (written before a lease is taken, moved on after each renewal), so a
// registry write that fails costs a reaper an early look, never a node left unreaped.

/// Renews a node's lease, or with `register` takes it whether or not it exists. The lease's
/// value becomes the new lease end, and the node's info records the renewal (the last moment the
/// node was known alive) and the node's pub/sub (which nodes starting later must share).
struct RenewLease: ScriptCall {
    enum Outcome {
        /// Renewed at this moment, until `ends`; the node's device index holds this many devices.
        /// An index smaller than the node's sessions says Redis lost some of it: the caller audits.
        /// `newLife`: the server is not the one the node last renewed on (it restarted, perhaps
        /// from an older snapshot, or a replica took over): what it holds may be older than what
        /// the node knows, and the caller settles it (``PresenceEngine/settleNewLife()``).
        case renewed(at: Int64, ends: Int64, indexed: Int, newLife: Bool)
        /// A renewal found the lease gone (reaped, or Redis lost its data): the caller registers again.
        case gone
    }

    var node: String
    var register: Bool
    /// Live sessions on the node, for its info.
    var sessions: Int
    /// Messages stored through the node since it started, for its info (the dashboard's rate).
    var messages: Int = 0

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.lease(node), context.keys.nodeInfo(node), context.keys.nodeDevices(node)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, ScriptContext.milliseconds(context.configuration.leaseTTL), RedisArgument(node), RedisArgument(sessions),
         context.deviceTTL, register ? "register" : "renew", RedisArgument(context.pubSub.rawValue), RedisArgument(messages)]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        let values = reply.array ?? []
        guard let at = values.first?.int else { throw PresenceError(.internal, "unexpected reply from the lease script") }
        guard at > 0 else { return .gone }
        guard values.count == 4, let ends = values[1].int, let indexed = values[2].int else {
            throw PresenceError(.internal, "unexpected reply from the lease script")
        }
        return .renewed(at: Int64(at), ends: Int64(ends), indexed: indexed, newLife: values[3].int == 1)
    }

    /// Returns {the renewal's moment, the lease's end, how many devices the index holds, 1 if
    /// the server's run id is not the one of the node's last renewal}, or {0} when gone. The run
    /// id changes on every restart and on a failover to another server. A registration compares
    /// too: a node that found its lease gone may find Redis restarted from an older snapshot (one
    /// where the lease had run out).
    static let script = RedisScript(ScriptLua.clock + """
    local now = clock(ARGV[1])
    local lease, node, sessions, ttl, mode, pubsub = tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
    local ends = now + lease
    if mode ~= 'register' and not leaseLeft(KEYS[1], ARGV[1]) then return {0} end
    local life = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or ''
    local before = redis.call('HGET', KEYS[2], 'life')
    local newLife = 0
    if before and before ~= life then newLife = 1 end
    redis.call('SET', KEYS[1], ends, 'PX', lease)
    redis.call('HSET', KEYS[2], 'renewed_at', now, 'sessions', sessions, 'pubsub', pubsub, 'messages', ARGV[8], 'life', life)
    redis.call('PEXPIRE', KEYS[2], ttl)
    return {now, ends, redis.call('SCARD', KEYS[3]), newLife}
    """)
}

/// Gives up a node's lease on a graceful shutdown; returns the moment, which the engine makes
/// the node's registry score, so that a reaper takes any device it still held.
struct ReleaseLease: ScriptCall {
    var node: String

    func keys(_ context: ScriptContext) -> [String] { [context.keys.lease(node)] }
    func arguments(_ context: ScriptContext) -> [RedisArgument] { [context.now] }
    func decode(_ reply: RESPValue) throws(PresenceError) -> Int64 { Int64(reply.int ?? 0) }

    static let script = RedisScript(ScriptLua.clock + """
    redis.call('DEL', KEYS[1])
    return clock(ARGV[1])
    """)
}

/// Whether a node's lease key still exists: that, and nothing a clock says, is whether the node
/// is alive. For a live node, also when its lease ends, for the engine to put it back in the
/// registry at that moment (a reaper claimed it a moment before its key expired, or it was
/// renewed meanwhile).
struct LeaseLive: ScriptCall {
    struct Outcome: Equatable {
        /// The lease's end, or `nil` when it lapsed.
        var until: Int64?
        /// The time by the clock of the lease's server: on a cluster each primary has its own,
        /// so a reaper measures how long ago the lease ended on this one.
        var now: Int64
    }

    var node: String

    func keys(_ context: ScriptContext) -> [String] { [context.keys.lease(node), context.keys.nodeInfo(node)] }
    func arguments(_ context: ScriptContext) -> [RedisArgument] { [context.now, ScriptContext.milliseconds(context.configuration.leaseTTL)] }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        let values = reply.array ?? []
        guard values.count == 2, let until = values[0].int, let now = values[1].int else {
            throw PresenceError(.internal, "unexpected reply to the lease check: \(reply)")
        }
        return Outcome(until: until > 0 ? Int64(until) : nil, now: Int64(now))
    }

    /// Returns the lease's end (0 when it has none) and the server's time.
    ///
    /// A node whose last renewal was in an earlier life of the server (its info's `life` is not
    /// today's run id) counts as holding a lease that ends a lease after a reaper first found it
    /// so. Redis restarted, perhaps from a snapshot older than a lease, where every node's lease
    /// had run out, or failed over to a replica that lagged: a live node renews in the new life
    /// within a third of a lease, and until then its sessions are not a dead node's. One that
    /// does not is reaped a lease later than it would have been.
    static let script = RedisScript(ScriptLua.clock + """
    local now = clock(ARGV[1])
    local left = leaseLeft(KEYS[1], ARGV[1])
    if left then return {now + math.max(left, 0), now} end
    local last = redis.call('HGET', KEYS[2], 'life')
    if not last then return {0, now} end
    local life = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or ''
    if last == life then return {0, now} end
    local found = redis.call('HMGET', KEYS[2], 'grace_life', 'grace_from')
    local from = tonumber(found[2])
    if found[1] ~= life or not from then
      from = now
      redis.call('HSET', KEYS[2], 'grace_life', life, 'grace_from', now)
    end
    local ends = from + tonumber(ARGV[2])
    if now < ends then return {ends, now} end
    return {0, now}
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

/// Settles a claimed entry of a sorted set, only if its score is still the claim's (nobody wrote
/// it again since): removes it, or with `next` scores it for the next look. Returns whether it
/// changed it.
struct ResolveClaim: ScriptCall {
    var key: String
    var member: String
    var score: RedisArgument
    var next: Int64?

    func keys(_ context: ScriptContext) -> [String] { [key] }
    func arguments(_ context: ScriptContext) -> [RedisArgument] { [context.now, RedisArgument(member), score, RedisArgument(Int(next ?? 0))] }
    func decode(_ reply: RESPValue) throws(PresenceError) -> Bool { reply.int == 1 }

    static let script = RedisScript(ScriptLua.header + """
    local score = redis.call('ZSCORE', KEYS[1], ARGV[2])
    if not score or tonumber(score) ~= tonumber(ARGV[3]) then return 0 end
    if tonumber(ARGV[4]) > 0 then
      redis.call('ZADD', KEYS[1], ARGV[4], ARGV[2])
      return 1
    end
    return redis.call('ZREM', KEYS[1], ARGV[2])
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

    static let script = RedisScript(ScriptLua.header + """
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
