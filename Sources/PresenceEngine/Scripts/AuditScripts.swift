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
    var devices: [Device]

    func keys(_ context: ScriptContext) -> [String] { [context.keys.devices(user), context.keys.state(user)] }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, RedisArgument(user), RedisArgument(context.keys.userChannel(user)), context.deviceTTL]
            + devices.flatMap { [RedisArgument($0.device), RedisArgument($0.session), RedisArgument($0.status.rawValue), $0.indexed ? "1" : "0"] }
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
            default: .held
            }
        }
        return Outcome(findings: findings, stateRepaired: codes.last?.int == 1)
    }

    /// Returns a code per device, then 1 if the aggregate was written again, else 0.
    static let script = RedisScript(ScriptLua.devices + """
    local user, channel, ttl = ARGV[2], ARGV[3], ARGV[4]
    local codes = {}
    for base = 4, #ARGV - 4, 4 do
      local device, session, status, indexed = ARGV[base + 1], ARGV[base + 2], ARGV[base + 3], ARGV[base + 4]
      local raw = redis.call('HGET', KEYS[1], device)
      local code = 0
      if not raw then
        code = 1
      else
        local held = parse(raw)
        if held.session == '' then
          code = 1
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
