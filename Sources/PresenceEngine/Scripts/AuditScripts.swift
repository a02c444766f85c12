import PresenceProtocol
import RedisClient

// The audit's script: what a node's sessions hold, checked against what Redis has.

/// Checks devices of one user that this node's sessions hold against what Redis has, and the
/// user's stored aggregate against their devices. Reads only, unless the aggregate is wrong: a
/// lost `state` key (or one Redis lost a write of) is worked out again from the devices, stored
/// and published, so that REST and watchers agree again.
struct AuditDevices: ScriptCall {
    struct Device {
        var device: String
        /// The session holding it here.
        var session: String
        /// The status this node's session set.
        var status: PresenceStatus
        /// Whether the node's device index has it (read just before, in the index's own slot).
        var indexed: Bool
        /// When the session opened (ms, Redis's clock as the node estimates it).
        var opened: Int64 = 0
    }

    enum Finding: Equatable {
        /// As it should be.
        case held
        /// Gone, or held by no session: lost.
        case lost
        /// Missing from the node's index.
        case unindexed
        /// Another session holds it now.
        case heldByAnother
        /// Held by an older session of this same node, which the node no longer has, or by another
        /// node's session in a record last written before this session opened: Redis went back in
        /// time (a restart from an older snapshot), and the device is this session's again.
        case heldByOlderSession
        /// Held, with a status other than the session's: a status write Redis acknowledged and
        /// then lost in a failover.
        case staleStatus
    }

    struct Outcome {
        /// One finding per device, in order.
        var findings: [Finding]
        /// Whether the stored aggregate differed from the devices' and was written again.
        var stateRepaired: Bool
    }

    var user: String
    /// This node: a device held by one of its own sessions other than the one it has is not
    /// another's.
    var node: String
    var devices: [Device]

    func keys(_ context: ScriptContext) -> [String] { [context.keys.devices(user), context.keys.state(user)] }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, RedisArgument(user), RedisArgument(context.keys.userChannel(user)), context.deviceTTL, RedisArgument(node)]
            + devices.flatMap { [RedisArgument($0.device), RedisArgument($0.session), RedisArgument($0.status.rawValue), $0.indexed ? "1" : "0",
                                 RedisArgument("\($0.opened)")] }
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        let codes = reply.array ?? []
        guard codes.count == devices.count + 1 else { throw PresenceError(.internal, "unexpected reply from the audit script") }
        let findings: [Finding] = codes.dropLast().map { code in
            switch code.int {
            case 1: .lost
            case 2: .unindexed
            case 3: .heldByAnother
            case 4: .staleStatus
            case 5: .heldByOlderSession
            default: .held
            }
        }
        return Outcome(findings: findings, stateRepaired: codes.last?.int == 1)
    }

    /// Returns a code per device, then 1 if the aggregate was written again, else 0.
    static let script = RedisScript(ScriptLua.devices + """
    local user, channel, ttl, node = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
    local codes = {}
    for base = 5, #ARGV - 5, 5 do
      local device, session, status, indexed, opened = ARGV[base + 1], ARGV[base + 2], ARGV[base + 3], ARGV[base + 4], tonumber(ARGV[base + 5])
      local raw = redis.call('HGET', KEYS[1], device)
      local code = 0
      if not raw then
        code = 1
      else
        local held = parse(raw)
        if held.session == '' then
          code = 1
        elseif held.session ~= session and predates(held, node, opened) then
          code = 5
        elseif held.session ~= session then
          code = 3
        elseif indexed ~= '1' then
          code = 2
        elseif held.status ~= status then
          code = 4
        end
      end
      codes[#codes + 1] = code
    end
    -- Every script that changes a device stores the aggregate with it, so a difference is data
    -- Redis lost (the state key deleted or evicted): stored and published again. Not while one of
    -- these devices is lost: the node writes it again next, which sets the aggregate right, and
    -- the devices left now would publish an offline that is not true.
    local lostAny = false
    for _, code in ipairs(codes) do
      if code == 1 then lostAny = true end
    end
    local stored = redis.call('HGET', KEYS[2], 'status') or 'offline'
    if not lostAny and stored ~= aggregate(KEYS[1]) then
      finish(KEYS[2], KEYS[1], channel, clock(ARGV[1]), 0, user, ttl)
      codes[#codes + 1] = 1
    else
      codes[#codes + 1] = 0
    end
    return codes
    """)
}

/// After Redis began a new life (a restart, perhaps from an older snapshot, or a failover to a
/// replica that lagged), checks the devices of one user that name this node, or that a session
/// here holds, against this node's sessions. A device no session here holds, which Redis still
/// has as held by one of this node's sessions, is a device that went away after the snapshot: it
/// lingers as after a drop (the engine indexed its deadline first), so that a device that moved
/// to another node meanwhile, which that node writes again, shows no offline. A device a session
/// here holds, which Redis has as held by an older session of this node, is its session's again;
/// so is one Redis has as held by another node's session in a record last written before this
/// session opened (the device moved here after the snapshot; that node lets its record go).
struct SettleNewLife: ScriptCall {
    /// The session that holds a device here, its status, and when it opened (ms, Redis's clock
    /// as the node estimates it).
    typealias Held = (session: String, status: PresenceStatus, opened: Int64)

    enum Finding: Equatable {
        /// As it should be, or not this node's (another node's session, a REST device).
        case kept
        /// Held here, and Redis has no live record of it: the node writes it again.
        case lost
        /// Held here under an older session of this node's in Redis, or another node's session
        /// recorded before this one opened: written with this session.
        case retaken
        /// No session here holds it; lingers until this deadline (ms).
        case lingering(until: Int64)
    }

    struct Outcome {
        var findings: [Finding]
        /// The aggregate worked out again, when a record changed.
        var change: PresenceChange?
    }

    var user: String
    var node: String
    /// Each device to check, with the session and status that hold it here (`nil`: none).
    var devices: [(device: String, held: Held?)]

    func keys(_ context: ScriptContext) -> [String] { [context.keys.devices(user), context.keys.state(user)] }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, RedisArgument(user), RedisArgument(node), ScriptContext.milliseconds(context.configuration.linger),
         RedisArgument(context.keys.userChannel(user)), context.deviceTTL]
            + devices.flatMap { [RedisArgument($0.device), RedisArgument($0.held?.session ?? ""), RedisArgument($0.held?.status.rawValue ?? ""),
                                 RedisArgument("\($0.held?.opened ?? 0)")] }
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        let values = reply.array ?? []
        guard values.count == devices.count + 1, let codes = values.first?.array, codes.count == devices.count else {
            throw PresenceError(.internal, "unexpected reply from the new-life script")
        }
        let findings: [Finding] = codes.map { code in
            switch code.string {
            case "lost": .lost
            case "retaken": .retaken
            case let text? where text.hasPrefix("linger:"): .lingering(until: Int64(text.dropFirst(7)) ?? 0)
            default: .kept
            }
        }
        let change = values[1].array.flatMap { $0.isEmpty ? nil : try? ScriptLua.change($0, user: user) }
        return Outcome(findings: findings, change: change)
    }

    /// Returns {a code per device, the aggregate's change as `finish()` gives it, or {}}.
    static let script = RedisScript(ScriptLua.devices + """
    local now = clock(ARGV[1])
    local user, node, linger, channel, ttl = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
    local codes = {}
    local changed = false
    for base = 6, #ARGV - 4, 4 do
      local device, session, status, opened = ARGV[base + 1], ARGV[base + 2], ARGV[base + 3], tonumber(ARGV[base + 4])
      local raw = redis.call('HGET', KEYS[1], device)
      local code = 'kept'
      if raw then
        local d = parse(raw)
        local older = predates(d, node, opened)
        if session ~= '' and d.session ~= session and d.session ~= '' and older then
          d.node, d.session, d.status, d.deadline, d.alive = node, session, status, 0, now
          redis.call('HSET', KEYS[1], device, encode(d))
          code, changed = 'retaken', true
        elseif session ~= '' and d.session == '' then
          code = 'lost'
        elseif session == '' and d.node == node and d.session ~= '' then
          d.node, d.session, d.deadline, d.alive = '', '', now + linger, now
          redis.call('HSET', KEYS[1], device, encode(d))
          code, changed = 'linger:' .. tostring(d.deadline), true
        end
      elseif session ~= '' then
        code = 'lost'
      end
      codes[#codes + 1] = code
    end
    local change = {}
    if changed then change = finish(KEYS[2], KEYS[1], channel, now, 0, user, ttl) end
    return {codes, change}
    """)
}
