import RedisClient

/// The Lua scripts that change presence atomically. Each touches the keys of one user (one hash
/// slot, `{u:ID}`), recomputes the aggregate and publishes on the user's channel only when the
/// aggregate (or the view others have of it) changed.
///
/// A device is stored as one field of the user's devices hash:
/// `status|node|session|since|deadline|alive` — `node` and `session` are empty for a REST
/// device or a lingering one, `deadline` is 0 while a live session on a leased node holds the
/// device, and `alive` is the last moment the device was known to be alive (all times in ms).
///
/// Every script takes ARGV[1] as now: empty, it reads Redis's clock (`TIME`), the one clock all
/// nodes share; a number is a test's manual clock. Deadlines are passed as durations and turned
/// into moments here, never by a node's own clock.
enum PresenceScripts {
    /// Now in ms: ARGV[1] when a test drives the time, else Redis's clock. And whether a node's
    /// lease is held: its key exists. Under a test's clock, whose time Redis's key expiry does
    /// not follow, a lease whose end (its value) that clock has passed counts as expired too.
    private static let clock = """
    local function clock(given)
      if given ~= '' then return tonumber(given) end
      local t = redis.call('TIME')
      return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    local function leaseLeft(key, given)
      local left = redis.call('PTTL', key)
      if left == -2 then return nil end
      if given ~= '' then
        left = (tonumber(redis.call('GET', key)) or 0) - tonumber(given)
        if left <= 0 then return nil end
      end
      return left
    end

    """

    /// Shared by the device scripts: parsing a device, the aggregate, and the finishing step.
    private static let prelude = clock + """
    local function parse(raw)
      local s, n, ses, since, dl, alive = string.match(raw, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
      return {status = s, node = n, session = ses, since = tonumber(since), deadline = tonumber(dl), alive = tonumber(alive)}
    end
    local function encode(d)
      return d.status .. '|' .. d.node .. '|' .. d.session .. '|' .. d.since .. '|' .. d.deadline .. '|' .. d.alive
    end
    local function aggregate(devicesKey)
      local all = redis.call('HGETALL', devicesKey)
      local best = 'offline'
      for i = 2, #all, 2 do
        local s = string.match(all[i], '^([^|]*)')
        if s == 'online' then return 'online' end
        if s == 'away' then best = 'away' end
      end
      return best
    end
    local function view(status, lastSeen, hidden, hiddenLastSeen)
      if hidden == '1' then return 'offline', hiddenLastSeen end
      return status, lastSeen
    end
    -- Stores the new aggregate, publishes if anything visible changed, and returns
    -- {changed, status, last_seen, public_changed, public_status, public_last_seen}.
    local function finish(stateKey, devicesKey, channel, now, removedAlive, user)
      local old = redis.call('HMGET', stateKey, 'status', 'last_seen', 'hidden', 'hidden_last_seen')
      local oldStatus = old[1] or 'offline'
      local lastSeen = tonumber(old[2] or '0')
      local newStatus = aggregate(devicesKey)
      -- last_seen never moves backwards, even if Redis's clock does (a failover to a replica
      -- whose clock is behind).
      if removedAlive > lastSeen then lastSeen = removedAlive end
      if newStatus ~= 'offline' and now > lastSeen then lastSeen = now end
      local hidden = old[3] or '0'
      local hiddenLastSeen = tonumber(old[4] or '0')
      local oldPublicStatus, oldPublicSeen = view(oldStatus, tonumber(old[2] or '0'), hidden, hiddenLastSeen)
      local publicStatus, publicSeen = view(newStatus, lastSeen, hidden, hiddenLastSeen)
      local changed = newStatus ~= oldStatus
      local publicChanged = publicStatus ~= oldPublicStatus or (publicStatus == 'offline' and publicSeen ~= oldPublicSeen)
      redis.call('HSET', stateKey, 'status', newStatus, 'last_seen', lastSeen)
      if redis.call('EXISTS', devicesKey) == 1 then
        redis.call('PEXPIRE', devicesKey, ARGV[#ARGV])
      end
      if changed or publicChanged then
        redis.call('PUBLISH', channel, cjson.encode({type = 'presence', user_id = user, status = newStatus,
          last_seen = lastSeen, public_status = publicStatus, public_last_seen = publicSeen,
          changed = changed, public_changed = publicChanged, at = now}))
      end
      return {changed and 1 or 0, newStatus, tostring(lastSeen), publicChanged and 1 or 0, publicStatus, tostring(publicSeen)}
    end
    """

    /// Adds or updates a device. KEYS: devices, state, deadlines. ARGV: now, user, device,
    /// status, node, session, heartbeat ms (a REST device's time to live), max devices, channel,
    /// mode (`session` to open a session, `restore` to write a session's device again after
    /// Redis lost it, `status` for a change from a session, `rest`), device TTL. A REST device's
    /// deadline is indexed in `deadlines` in the same step, and a device a session holds is taken
    /// out of it, so no device is left with a deadline nobody reaps. Returns finish()'s array
    /// plus the previous session and its node; {-3} when a `status` or a `restore` comes from a
    /// session that lost the device to another; or an error reply `TOO_MANY_DEVICES`.
    static let upsertDevice = RedisScript(prelude + """

    local now = clock(ARGV[1])
    local user, device, status, node, session = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
    local heartbeat, maxDevices, channel, mode = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9], ARGV[10]
    local deadline = 0
    if mode == 'rest' then deadline = now + heartbeat end
    local raw = redis.call('HGET', KEYS[1], device)
    local prevSession, prevNode = '', ''
    local since = now
    local wentOffline = 0
    if raw then
      local d = parse(raw)
      -- A status change from a session that no longer holds the device changes nothing.
      if mode == 'status' and d.session ~= '' and d.session ~= session then return {-3} end
      -- Written again after a loss, a device that another session took meanwhile stays its.
      if mode == 'restore' and d.session ~= '' and d.session ~= session then return {-3} end
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
    if deadline > 0 then
      redis.call('ZADD', KEYS[3], deadline, user .. '|' .. device)
    else
      redis.call('ZREM', KEYS[3], user .. '|' .. device)
    end
    -- A device that says offline was alive until now: that is the user's last_seen if it was the last.
    local result = finish(KEYS[2], KEYS[1], channel, now, wentOffline, user)
    table.insert(result, prevSession)
    table.insert(result, prevNode)
    return result
    """)

    /// Checks devices this node's sessions hold against what Redis has, reading only. KEYS: the
    /// node's device index, then each device's devices hash. ARGV: for each device, its index
    /// member, its id and the session holding it here. Returns one code per device: 0 as it
    /// should be; 1 gone, or held by no session (lost); 2 missing from the index; 3 held by
    /// another session now.
    static let auditDevices = RedisScript(prelude + """

    local codes = {}
    for i = 2, #KEYS do
      local base = (i - 2) * 3
      local member, device, session = ARGV[base + 1], ARGV[base + 2], ARGV[base + 3]
      local raw = redis.call('HGET', KEYS[i], device)
      local code = 0
      if not raw then
        code = 1
      else
        local held = parse(raw).session
        if held == '' then
          code = 1
        elseif held ~= session then
          code = 3
        elseif redis.call('SISMEMBER', KEYS[1], member) == 0 then
          code = 2
        end
      end
      codes[#codes + 1] = code
    end
    return codes
    """)

    /// Takes a device away. KEYS: devices, state, deadlines. ARGV: now, user, device, session
    /// ('' for any), mode, linger ms, channel, device TTL. Modes: `clean` removes at once;
    /// `linger` keeps the device live for the linger without its session; `expire` (the reaper)
    /// removes it only if its deadline has passed. The device's entry in `deadlines` follows in
    /// the same step: set to its deadline while it has one, removed otherwise. Returns
    /// finish()'s array, also when there is no such device (the aggregate is worked out again);
    /// {-1, deadline} when the device stays live (lingering, or not due yet); {-3} when another
    /// session holds it now.
    static let removeDevice = RedisScript(prelude + """

    local now = clock(ARGV[1])
    local user, device, session, mode, linger, channel = ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7]
    local member = user .. '|' .. device
    local raw = redis.call('HGET', KEYS[1], device)
    if not raw then
      -- Gone already, or lost with Redis data: the user's state is worked out again from the
      -- devices that are left, so a state the lost devices made stale is set right, and watchers
      -- are told.
      redis.call('ZREM', KEYS[3], member)
      return finish(KEYS[2], KEYS[1], channel, now, 0, user)
    end
    local d = parse(raw)
    if session ~= '' and d.session ~= session then return {-3} end
    if mode == 'linger' then
      d.node, d.session, d.deadline, d.alive = '', '', now + linger, now
      redis.call('HSET', KEYS[1], device, encode(d))
      redis.call('ZADD', KEYS[3], d.deadline, member)
      return {-1, tostring(d.deadline)}
    end
    -- A device that already said offline was last alive when it said so.
    local alive = now
    if d.status == 'offline' then alive = d.alive end
    if mode == 'expire' then
      if d.deadline == 0 then
        redis.call('ZREM', KEYS[3], member)
        return {-1, '0'}
      end
      if d.deadline > now then
        redis.call('ZADD', KEYS[3], d.deadline, member)
        return {-1, tostring(d.deadline)}
      end
      alive = d.alive
    end
    redis.call('HDEL', KEYS[1], device)
    redis.call('ZREM', KEYS[3], member)
    return finish(KEYS[2], KEYS[1], channel, now, alive, user)
    """)

    /// Removes every device a dead node's sessions held. KEYS: devices, state, deadlines. ARGV:
    /// now, user, node, the node's last renewal, channel, the moment its lease ended, linger ms,
    /// device TTL (last, as finish() reads it). A device written after that moment belongs to a new process under the same node
    /// id and stays. With a linger (a process restarted under the node id reaping what the killed
    /// one left, at once), each device lingers as after a drop instead, so that a client
    /// reconnecting meanwhile shows no offline. Returns finish()'s array, or {-2} when the node
    /// held none of this user's devices. A removed device that had said `offline` was last alive
    /// when it said so, not at the renewal.
    static let reapNode = RedisScript(prelude + """

    local now = clock(ARGV[1])
    local user, node, renewed, channel = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
    local ended, linger = tonumber(ARGV[6]), tonumber(ARGV[7])
    local all = redis.call('HGETALL', KEYS[1])
    local removed = 0
    local alive = 0
    for i = 1, #all, 2 do
      local d = parse(all[i + 1])
      if d.node == node and d.deadline == 0 and d.alive <= ended then
        removed = removed + 1
        local last = renewed
        if d.status == 'offline' then last = d.alive end
        if linger > 0 then
          d.node, d.session, d.deadline, d.alive = '', '', now + linger, last
          redis.call('HSET', KEYS[1], all[i], encode(d))
          redis.call('ZADD', KEYS[3], d.deadline, user .. '|' .. all[i])
        else
          redis.call('HDEL', KEYS[1], all[i])
          if last > alive then alive = last end
        end
      end
    end
    if removed == 0 then return {-2} end
    return finish(KEYS[2], KEYS[1], channel, now, alive, user)
    """)

    /// Turns `show_online_status` on or off. KEYS: devices, state. ARGV: now, user, show (1/0),
    /// channel, device TTL. Returns finish()'s array.
    static let setPrivacy = RedisScript(prelude + """

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
      if publicChanged then
        redis.call('PUBLISH', channel, cjson.encode({type = 'presence', user_id = user, status = status,
          last_seen = seen, public_status = 'offline', public_last_seen = seen,
          changed = false, public_changed = true, at = now}))
      end
      return {0, status, tostring(seen), publicChanged and 1 or 0, 'offline', tostring(seen)}
    elseif show == '1' and wasHidden then
      redis.call('HSET', KEYS[2], 'hidden', '0')
      local status = state[1] or 'offline'
      local seen = tonumber(state[2] or '0')
      if status ~= 'offline' then seen = now end
      redis.call('PUBLISH', channel, cjson.encode({type = 'presence', user_id = user, status = status,
        last_seen = seen, public_status = status, public_last_seen = seen,
        changed = false, public_changed = true, at = now}))
      return {0, status, tostring(seen), 1, status, tostring(seen)}
    end
    local status, seen = view(state[1] or 'offline', tonumber(state[2] or '0'), state[3] or '0', 0)
    return {0, state[1] or 'offline', state[2] or '0', 0, status, tostring(seen)}
    """)

    /// Reads a user. KEYS: devices, state. ARGV: now. Returns {status, last_seen, hidden,
    /// hidden_last_seen, seen_ever, now}; a stored aggregate whose devices are all gone (their
    /// safety TTL ran out with every node dead) reads as offline. `now` is the `last_seen` of a
    /// user who is online or away.
    static let read = RedisScript(clock + """
    local s = redis.call('HMGET', KEYS[2], 'status', 'last_seen', 'hidden', 'hidden_last_seen')
    local status = s[1] or 'offline'
    if status ~= 'offline' and redis.call('EXISTS', KEYS[1]) == 0 then status = 'offline' end
    return {status, s[2] or '0', s[3] or '0', s[4] or '0', s[2] and 1 or 0, tostring(clock(ARGV[1]))}
    """)

    /// Claims up to ARGV[3] due entries of a deadline sorted set (KEYS[1]): entries scored at or
    /// before now (ARGV[1]) are re-scored to now + ARGV[2] ms (a retry time, should the claimer
    /// die), so exactly one reaper works on each. Returns {now, retry, member, old score, ...}.
    static let claimDue = RedisScript(clock + """
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

    /// Whether a node's lease key still exists: that, and nothing a clock says, is whether the
    /// node is alive. A live node claimed by a reaper (its score passed a moment before its key
    /// expired, or it was renewed meanwhile) is put back in the registry at its lease's real end.
    /// KEYS: lease, nodes registry. ARGV: now, node id. Returns 1 when the lease is live.
    static let leaseLive = RedisScript(clock + """
    local left = leaseLeft(KEYS[1], ARGV[1])
    if not left then return 0 end
    if left > 0 then redis.call('ZADD', KEYS[2], clock(ARGV[1]) + left, ARGV[2]) end
    return 1
    """)

    /// Deletes a reaped node's device index and info, unless its lease is held again (a new
    /// process under the same id took it). KEYS: lease, node devices, node info. ARGV: now.
    /// Returns 1 if deleted.
    static let dropNode = RedisScript(clock + """
    if leaseLeft(KEYS[1], ARGV[1]) then return 0 end
    redis.call('DEL', KEYS[2], KEYS[3])
    return 1
    """)

    /// Removes member ARGV[1] from sorted set KEYS[1] only if its score is still ARGV[2].
    static let removeIfScore = RedisScript("""
    local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
    if score and tonumber(score) == tonumber(ARGV[2]) then
      return redis.call('ZREM', KEYS[1], ARGV[1])
    end
    return 0
    """)

    /// Gives claimed entries back at their scores before the claim, each only if it still holds
    /// the claim's retry score (nobody re-scored it since). KEYS: the sorted set. ARGV: the
    /// claim's retry score, then pairs of member and old score. Returns how many were given back.
    static let unclaim = RedisScript("""
    local retry, given = tonumber(ARGV[1]), 0
    for i = 2, #ARGV - 1, 2 do
      local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
      if score and tonumber(score) == retry then
        redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
        given = given + 1
      end
    end
    return given
    """)

    /// Renews a node's lease, or with ARGV[6] = `register` takes it whether or not it exists.
    /// KEYS: lease, nodes registry, node info, the node's device index. ARGV: now, lease ms, node
    /// id, sessions, safety TTL ms, mode. The lease's value and the node's score become the new
    /// lease end, and the info records the renewal (the last moment the node was known alive).
    /// Returns {the renewal's moment, how many devices the index holds}, or {0} when a renewal
    /// found the lease gone (reaped, or Redis lost its data): the caller registers again. An
    /// index smaller than the node's sessions says Redis lost some of it: the caller audits.
    static let renewLease = RedisScript(clock + """
    local now = clock(ARGV[1])
    local ends = now + tonumber(ARGV[2])
    if ARGV[6] ~= 'register' and not leaseLeft(KEYS[1], ARGV[1]) then return {0} end
    redis.call('SET', KEYS[1], ends, 'PX', ARGV[2])
    redis.call('ZADD', KEYS[2], ends, ARGV[3])
    redis.call('HSET', KEYS[3], 'renewed_at', now, 'sessions', ARGV[4])
    redis.call('PEXPIRE', KEYS[3], ARGV[5])
    redis.call('PEXPIRE', KEYS[2], ARGV[5])
    return {now, redis.call('SCARD', KEYS[4])}
    """)

    /// Gives up a node's lease on a graceful shutdown: the node stays in the registry, lapsed
    /// now, so that a reaper takes any device it still held. KEYS: lease, nodes registry. ARGV:
    /// now, node id.
    static let releaseLease = RedisScript(clock + """
    redis.call('DEL', KEYS[1])
    redis.call('ZADD', KEYS[2], clock(ARGV[1]), ARGV[2])
    return 1
    """)

    /// Sets or clears a user's typing state in a conversation. KEYS: the conversation's typing
    /// hash (user → `expiry|forwarded`), the typing deadlines, the conversation's members, the
    /// user's state. ARGV: now, conversation, user, is_typing (1/0), TTL ms, coalescing window
    /// ms, channel, `check` for a client's request ('' for the server's own stops). A start, or a
    /// refresh at least a window after the last forwarded one, is published; other refreshes
    /// only extend the expiry. A stop is published only if the user was typing. The expiry is
    /// indexed for the reaper in the same step. A checked request from a non-member returns -1;
    /// a start from a user who is offline or hidden is ignored, checked in the same step as the
    /// write, so that one racing a removal, an offline or a privacy change cannot outlive it.
    /// Returns 1 when something was published.
    static let setTyping = RedisScript(clock + """
    local now, conversation, user = clock(ARGV[1]), ARGV[2], ARGV[3]
    local ttl, window, channel = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
    if ARGV[8] == 'check' then
      if redis.call('SISMEMBER', KEYS[3], user) == 0 then return -1 end
      if ARGV[4] == '1' then
        local state = redis.call('HMGET', KEYS[4], 'status', 'hidden')
        if not state[1] or state[1] == 'offline' or state[2] == '1' then return 0 end
      end
    end
    local raw = redis.call('HGET', KEYS[1], user)
    local expiry, forwarded = 0, 0
    if raw then
      local e, f = string.match(raw, '^([^|]*)|([^|]*)$')
      expiry, forwarded = tonumber(e), tonumber(f)
    end
    if ARGV[4] == '1' then
      local active = expiry > now
      local publish = (not active) or (now - forwarded >= window)
      if publish then forwarded = now end
      redis.call('HSET', KEYS[1], user, (now + ttl) .. '|' .. forwarded)
      redis.call('PEXPIRE', KEYS[1], ttl * 10)
      redis.call('ZADD', KEYS[2], now + ttl, conversation .. '|' .. user)
      if publish then
        redis.call('PUBLISH', channel, cjson.encode({type = 'typing', conversation_id = conversation, user_id = user, is_typing = true, at = now}))
        return 1
      end
      return 0
    end
    -- An entry still here has not had its stop published (the reaper publishes when it removes
    -- one), even if its expiry has just passed: publish it now.
    if raw then
      redis.call('HDEL', KEYS[1], user)
      redis.call('ZREM', KEYS[2], conversation .. '|' .. user)
      redis.call('PUBLISH', channel, cjson.encode({type = 'typing', conversation_id = conversation, user_id = user, is_typing = false, at = now}))
      return 1
    end
    return 0
    """)

    /// Ends a typing state whose expiry passed. KEYS: the typing hash. ARGV: now, conversation,
    /// user, channel. Returns 1 when it ended (and `is_typing: false` was published), the
    /// expiry when it is still running, 0 when there is none.
    static let expireTyping = RedisScript(clock + """
    local now, conversation, user, channel = clock(ARGV[1]), ARGV[2], ARGV[3], ARGV[4]
    local raw = redis.call('HGET', KEYS[1], user)
    if not raw then return 0 end
    local expiry = tonumber(string.match(raw, '^([^|]*)|'))
    if expiry > now then return expiry end
    redis.call('HDEL', KEYS[1], user)
    redis.call('PUBLISH', channel, cjson.encode({type = 'typing', conversation_id = conversation, user_id = user, is_typing = false, at = now}))
    return 1
    """)
}
