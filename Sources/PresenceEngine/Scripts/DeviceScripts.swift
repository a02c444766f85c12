import PresenceProtocol
import RedisClient

// The scripts that change a user's devices. Each touches the keys of one user and nothing else
// (one hash slot, `{u:ID}`), works the aggregate out again and publishes on the user's channel
// only when the aggregate, or the view others have of it, changed.
//
// A device with a deadline (lingering, or kept by REST heartbeats) is found by the reaper through
// its bucket of the deadline sets, which lives in another slot. The engine indexes it there
// before the script gives it the deadline, at a moment no later than the deadline, and again
// after it at the deadline written (a reaper may have dropped the first entry meanwhile, finding
// no deadline yet), so that no device is ever left with a deadline nobody looks at; an entry for
// a device that has no deadline (any more) costs the reaper one look, after which it drops the
// entry.

/// Adds or updates a device.
struct UpsertDevice: ScriptCall {
    enum Mode: String {
        /// A session opens.
        case session
        /// A session's device is written again after Redis lost it.
        case restore
        /// A session changes its status.
        case status
        /// A REST post: a heartbeat with the heartbeat TTL.
        case rest
    }

    enum Outcome {
        /// Written; `previous` is the other session (and its node) that held the device before,
        /// `deadline` the one written with it (a REST heartbeat's; `nil` for none), `at` the
        /// moment of the write by Redis's clock (ms): the record's `alive`.
        case written(PresenceChange, previous: (node: String, session: String)?, deadline: Int64?, at: Int64?)
        /// A `status` or `restore` from a session that lost the device to another: nothing changed.
        case heldByAnother
        /// A `status` from a session that Redis no longer has holding the device (gone, or held by
        /// no session): nothing changed. A live session's device must be written again whole.
        case unheld
    }

    var user: String
    var device: String
    var status: PresenceStatus
    /// The node and session holding the device; empty for REST.
    var node = ""
    var session = ""
    var mode: Mode
    /// For `.restore`: when the session opened (ms, Redis's clock as the node estimates it). A
    /// record of another session last written before then is older than this session (Redis
    /// went back in time): it is taken, not left to the other.
    var opened: Int64 = 0

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.devices(user), context.keys.state(user)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, RedisArgument(user), RedisArgument(device), RedisArgument(status.rawValue), RedisArgument(node),
         RedisArgument(session), ScriptContext.milliseconds(context.configuration.heartbeatTTL),
         RedisArgument(context.configuration.maxDevicesPerUser), RedisArgument(context.keys.userChannel(user)),
         RedisArgument(mode.rawValue), context.deviceTTL, RedisArgument("\(opened)")]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        let values = reply.array ?? []
        if values.first?.int == -3 { return .heldByAnother }
        if values.first?.int == -4 { return .unheld }
        let change = try ScriptLua.change(values, user: user)
        let previousSession = values.count > 7 ? values[6].string ?? "" : ""
        let previousNode = values.count > 7 ? values[7].string ?? "" : ""
        let previous = previousSession.isEmpty || previousSession == session ? nil : (node: previousNode, session: previousSession)
        return .written(change, previous: previous, deadline: values.count > 8 ? ScriptLua.timestamp(values[8]) : nil,
                        at: values.count > 9 ? values[9].int.map(Int64.init) : nil)
    }

    static let script = RedisScript(ScriptLua.devices + """
    local now = clock(ARGV[1])
    local user, device, status, node, session = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
    local heartbeat, maxDevices, channel, mode, ttl = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9], ARGV[10], ARGV[11]
    local deadline = 0
    if mode == 'rest' then deadline = now + heartbeat end
    local raw = redis.call('HGET', KEYS[1], device)
    -- A status change only ever changes a device its session holds: written for a device that is
    -- gone or was let go (a late write, behind its session's close), it would hold it for good.
    if mode == 'status' and not raw then return {-4} end
    local devicesWereGone = not raw and redis.call('EXISTS', KEYS[1]) == 0
    local prevSession, prevNode = '', ''
    local since = now
    local wentOffline = 0
    if raw then
      local d = parse(raw)
      -- A status change from a session that no longer holds the device changes nothing.
      if mode == 'status' and d.session == '' then return {-4} end
      if mode == 'status' and d.session ~= session then return {-3} end
      -- Written again after a loss, a device that another session took meanwhile stays its; one
      -- whose record was last written before this session opened is from before a rollback.
      if mode == 'restore' and d.session ~= '' and d.session ~= session and tonumber(ARGV[12]) <= d.alive then return {-3} end
      prevSession, prevNode = d.session, d.node
      if d.status == status then since = d.since end
      if status == 'offline' and d.status ~= 'offline' then wentOffline = now end
      if mode == 'rest' and d.deadline == 0 and d.node ~= '' then
        -- A REST post for a device that a live session holds changes its status only.
        node, session, deadline = d.node, d.session, 0
      end
    elseif maxDevices > 0 and redis.call('HLEN', KEYS[1]) >= maxDevices then
      return redis.error_reply('TOO_MANY_DEVICES the user has ' .. maxDevices .. ' devices already')
    end
    redis.call('HSET', KEYS[1], device, encode({status = status, node = node, session = session, since = since, deadline = deadline, alive = now}))
    -- A device that says offline was alive until now: that is the user's last_seen if it was the last.
    local result = finish(KEYS[2], KEYS[1], channel, now, wentOffline, user, ttl, devicesWereGone)
    table.insert(result, prevSession)
    table.insert(result, prevNode)
    table.insert(result, tostring(deadline))
    table.insert(result, now)
    return result
    """)
}

/// Takes a device away, or lets it linger (the engine indexes the linger's deadline first).
struct RemoveDevice: ScriptCall {
    enum Mode: String {
        /// Removes at once.
        case clean
        /// Keeps the device live for the linger, without its session.
        case linger
        /// The reaper: removes it only if its deadline has passed.
        case expire
    }

    enum Outcome {
        /// Removed, or there was no such device; the aggregate was worked out again either way.
        case removed(PresenceChange)
        /// The device stays live: lingering, or not due yet (the deadline, if it has one), or held
        /// by a session (no deadline).
        case live(deadline: Int64?)
        /// Another session holds it now.
        case heldByAnother
        /// Held, with a status other than the session's: a status write Redis acknowledged and
        /// then lost in a failover.
        case staleStatus
    }

    var user: String
    var device: String
    /// Only if this session holds it; `nil` for whichever does.
    var session: String?
    var mode: Mode

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.devices(user), context.keys.state(user)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        let linger = mode == .linger ? ScriptContext.milliseconds(context.configuration.linger) : "0"
        return [context.now, RedisArgument(user), RedisArgument(device), RedisArgument(session ?? ""), RedisArgument(mode.rawValue),
                linger, RedisArgument(context.keys.userChannel(user)), context.deviceTTL]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        let values = reply.array ?? []
        switch values.first?.int {
        case -3: return .heldByAnother
        case -1: return .live(deadline: values.count > 1 ? ScriptLua.timestamp(values[1]) : nil)
        default: return .removed(try ScriptLua.change(values, user: user))
        }
    }

    static let script = RedisScript(ScriptLua.devices + """
    local now = clock(ARGV[1])
    local user, device, session, mode, linger, channel = ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7]
    local ttl = ARGV[8]
    local raw = redis.call('HGET', KEYS[1], device)
    if not raw then
      -- Gone already, or lost with Redis data: the user's state is worked out again from the
      -- devices that are left, so a state the lost devices made stale is set right, and watchers
      -- are told.
      return finish(KEYS[2], KEYS[1], channel, now, 0, user, ttl)
    end
    local d = parse(raw)
    if session ~= '' and d.session ~= session then return {-3} end
    if mode == 'linger' then
      d.node, d.session, d.deadline, d.alive = '', '', now + linger, now
      redis.call('HSET', KEYS[1], device, encode(d))
      return {-1, tostring(d.deadline)}
    end
    -- A device that already said offline was last alive when it said so.
    local alive = now
    if d.status == 'offline' then alive = d.alive end
    if mode == 'expire' then
      if d.deadline == 0 then return {-1, '0'} end
      if d.deadline > now then return {-1, tostring(d.deadline)} end
      alive = d.alive
    end
    redis.call('HDEL', KEYS[1], device)
    return finish(KEYS[2], KEYS[1], channel, now, alive, user, ttl)
    """)
}

/// Removes the devices of one user that a dead node's sessions held. A device written after the
/// node's lease ended belongs to a new process under the same node id and stays. With a linger
/// (a process restarted under the node id reaping what the killed one left, at once), each
/// device lingers as after a drop instead, so that a client reconnecting meanwhile shows no
/// offline. A removed device that had said `offline` was last alive when it said so, not at the
/// node's last renewal.
struct ReapNode: ScriptCall {
    enum Outcome {
        /// Taken offline, or lingering: then with the lingering devices and their deadline, which
        /// the engine indexes.
        case reaped(PresenceChange, lingering: [String], until: Int64)
        /// The node held none of this user's devices.
        case noDevices
    }

    var user: String
    var node: String
    /// How long ago (ms, by the lease's server) the node last renewed: the last moment its
    /// devices were known alive.
    var renewedAgo: Int64
    /// How long ago (ms, by the lease's server) its lease ended.
    var endedAgo: Int64
    /// Zero to remove the devices; else how long they linger.
    var linger: Duration = .zero

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.devices(user), context.keys.state(user)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, RedisArgument(user), RedisArgument(node), RedisArgument(Int(renewedAgo)), RedisArgument(context.keys.userChannel(user)),
         RedisArgument(Int(endedAgo)), ScriptContext.milliseconds(linger), context.deviceTTL]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        let values = reply.array ?? []
        if values.first?.int == -2 { return .noDevices }
        let until = values.count > 6 ? values[6].int.map(Int64.init) ?? 0 : 0
        let lingering = values.count > 7 ? values[7...].compactMap(\.string) : []
        return .reaped(try ScriptLua.change(values, user: user), lingering: lingering, until: until)
    }

    static let script = RedisScript(ScriptLua.devices + """
    local now = clock(ARGV[1])
    local user, node, channel = ARGV[2], ARGV[3], ARGV[5]
    -- The lease's moments, by this server's clock: another primary's may be seconds off.
    local renewed, ended = now - tonumber(ARGV[4]), now - tonumber(ARGV[6])
    local linger, ttl = tonumber(ARGV[7]), ARGV[8]
    local all = redis.call('HGETALL', KEYS[1])
    local removed = 0
    local alive = 0
    local lingering = {}
    for i = 1, #all, 2 do
      local d = parse(all[i + 1])
      if d.node == node and d.deadline == 0 and d.alive <= ended then
        removed = removed + 1
        local last = renewed
        if d.status == 'offline' then last = d.alive end
        if linger > 0 then
          d.node, d.session, d.deadline, d.alive = '', '', now + linger, last
          redis.call('HSET', KEYS[1], all[i], encode(d))
          lingering[#lingering + 1] = all[i]
        else
          redis.call('HDEL', KEYS[1], all[i])
          if last > alive then alive = last end
        end
      end
    end
    if removed == 0 then return {-2} end
    local result = finish(KEYS[2], KEYS[1], channel, now, alive, user, ttl)
    result[7] = now + linger
    for _, device in ipairs(lingering) do result[#result + 1] = device end
    return result
    """)
}

/// Turns `show_online_status` on or off.
struct SetPrivacy: ScriptCall {
    var user: String
    var showOnlineStatus: Bool

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.devices(user), context.keys.state(user)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, RedisArgument(user), showOnlineStatus ? "1" : "0", RedisArgument(context.keys.userChannel(user))]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> PresenceChange {
        try ScriptLua.change(reply.array ?? [], user: user)
    }

    static let script = RedisScript(ScriptLua.devices + """
    local now = clock(ARGV[1])
    local user, show, channel = ARGV[2], ARGV[3], ARGV[4]
    local state = redis.call('HMGET', KEYS[2], 'status', 'last_seen', 'hidden')
    local wasHidden = state[3] == '1'
    if show == '0' and not wasHidden then
      local status = state[1] or 'offline'
      local seen = tonumber(state[2] or '0')
      if status ~= 'offline' then seen = now end
      redis.call('HSET', KEYS[2], 'hidden', '1', 'hidden_last_seen', seen)
      -- Others saw online/away until now; an offline user keeps the last_seen they already show.
      local publicChanged = status ~= 'offline'
      if publicChanged then publishPresence(channel, user, status, seen, 'offline', seen, false, true, now) end
      return {0, status, tostring(seen), publicChanged and 1 or 0, 'offline', tostring(seen)}
    elseif show == '1' and wasHidden then
      redis.call('HSET', KEYS[2], 'hidden', '0')
      local status = state[1] or 'offline'
      local seen = tonumber(state[2] or '0')
      if status ~= 'offline' then seen = now end
      publishPresence(channel, user, status, seen, status, seen, false, true, now)
      return {0, status, tostring(seen), 1, status, tostring(seen)}
    end
    local status, seen = view(state[1] or 'offline', tonumber(state[2] or '0'), state[3] or '0', 0)
    return {0, state[1] or 'offline', state[2] or '0', 0, status, tostring(seen)}
    """)
}

/// Reads a user: their real and shown presence. A stored aggregate whose devices are all gone
/// (their safety TTL ran out with every node dead) reads as offline; an online or away user's
/// `last_seen` is now, by the scripts' clock.
struct ReadUser: ScriptCall {
    var user: String

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.devices(user), context.keys.state(user)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] { [context.now] }

    func decode(_ reply: RESPValue) throws(PresenceError) -> UserRead {
        let values = reply.array ?? []
        guard values.count == 6, let status = values[0].string.flatMap(PresenceStatus.init(rawValue:)) else {
            throw PresenceError(.internal, "unexpected reply from the read script")
        }
        let lastSeen = status == .offline ? ScriptLua.timestamp(values[1]) : ScriptLua.timestamp(values[5])
        let hidden = values[2].string == "1"
        let real = Presence(userID: user, status: status, lastSeen: lastSeen)
        let shown = hidden ? Presence(userID: user, status: .offline, lastSeen: ScriptLua.timestamp(values[3])) : real
        return UserRead(views: PresenceViews(real: real, shown: shown, hidden: hidden), recorded: values[4].int == 1)
    }

    /// Returns {status, last_seen, hidden, hidden_last_seen, seen_ever, now}.
    /// A state key Redis lost while devices are live reads as the devices' aggregate (the audit
    /// stores it again): never `offline` for a user whose devices are connected.
    static let script = RedisScript(ScriptLua.devices + """
    local s = redis.call('HMGET', KEYS[2], 'status', 'last_seen', 'hidden', 'hidden_last_seen')
    local status = s[1] or aggregate(KEYS[1])
    if status ~= 'offline' and redis.call('EXISTS', KEYS[1]) == 0 then status = 'offline' end
    return {status, s[2] or '0', s[3] or '0', s[4] or '0', s[2] and 1 or 0, tostring(clock(ARGV[1]))}
    """)
}

extension DeviceRecord {
    /// Reads a field of a devices hash: `status|node|session|since|deadline|alive` (see
    /// ``ScriptLua/devices``); `nil` for anything else.
    init?(id: String, stored: String) {
        let fields = stored.split(separator: "|", omittingEmptySubsequences: false)
        guard fields.count == 6, let status = PresenceStatus(rawValue: String(fields[0])) else { return nil }
        let deadline = Int64(fields[4]) ?? 0
        self.init(deviceID: id, status: status, node: String(fields[1]), since: Int64(fields[3]) ?? 0,
                  deadline: deadline == 0 ? nil : deadline, lastAlive: Int64(fields[5]) ?? 0)
    }
}
