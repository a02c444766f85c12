import Foundation
import PresenceProtocol
import RedisClient

/// One call of a Lua script: its inputs by name, its `KEYS` and `ARGV` built from them in one
/// place, and its reply read into an outcome, so that no caller counts positions or compares
/// sentinels. Each conforming type keeps its script's source beside it.
///
/// The scripts share three conventions: `ARGV[1]` is now (see ``ScriptContext/now``); the last
/// `ARGV`, which ``PresenceEngine/evaluate(_:on:)`` appends to every call, is the command that
/// publishes (`PUBLISH`, or `SPUBLISH` where pub/sub is sharded), and ``ScriptLua/header`` takes
/// it off before the script reads its own; and the device scripts name their safety TTL and pass
/// it on to `finish()` themselves.
protocol ScriptCall {
    associatedtype Outcome
    /// The script this calls.
    static var script: RedisScript { get }
    /// `KEYS`, in the order the script reads them.
    func keys(_ context: ScriptContext) -> [String]
    /// `ARGV`, in the order the script reads them.
    func arguments(_ context: ScriptContext) -> [RedisArgument]
    /// Reads the script's reply.
    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome
}

/// What a script call takes from the node rather than from its caller.
struct ScriptContext: Sendable {
    let keys: PresenceKeys
    let configuration: PresenceConfiguration
    /// Every script's `ARGV[1]`: empty, so that it reads Redis's clock, or a test clock's time.
    let now: RedisArgument
    /// How the engine's client publishes (recorded in the node's info by the lease script).
    let pubSub: RedisPubSub

    /// The safety TTL of devices hashes and node keys.
    var deviceTTL: RedisArgument { Self.milliseconds(configuration.deviceKeyTTL) }

    static func milliseconds(_ duration: Duration) -> RedisArgument { RedisArgument(Int(duration.milliseconds)) }

    /// `call`'s `ARGV`, and the publish command after them.
    func arguments<Call: ScriptCall>(of call: Call) -> [RedisArgument] { call.arguments(self) + [pubSub.publishCommand] }
}

extension PresenceEngine {
    var scriptContext: ScriptContext { ScriptContext(keys: keys, configuration: configuration, now: nowArgument, pubSub: redis.pubSub) }

    /// Runs one script call, on `client` when given (else the engine's).
    func evaluate<Call: ScriptCall>(_ call: Call, on client: (any RedisCommands)? = nil) async throws(PresenceError) -> Call.Outcome {
        let context = scriptContext
        let redis = client ?? self.redis
        let reply = try await run { try await redis.evaluate(Call.script, keys: call.keys(context), arguments: context.arguments(of: call)) }
        return try call.decode(reply)
    }

    /// Runs calls of one script in one pipeline; each has its outcome, or its own error (a
    /// server error is that call's alone). Throws when Redis could not be reached.
    func evaluate<Call: ScriptCall>(_ calls: [Call]) async throws(PresenceError) -> [Result<Call.Outcome, PresenceError>] {
        guard !calls.isEmpty else { return [] }
        let context = scriptContext
        let results = try await run {
            try await self.redis.evaluate(Call.script, calls: calls.map { (keys: $0.keys(context), arguments: context.arguments(of: $0)) })
        }
        return zip(calls, results).map { call, result in
            switch result {
            case .success(let reply):
                do throws(PresenceError) { return .success(try call.decode(reply)) } catch { return .failure(error) }
            case .failure(let error):
                return .failure(Self.presenceError(error))
            }
        }
    }
}

/// Lua shared by the scripts, and how their common replies read.
enum ScriptLua {
    /// Begins every script: takes the publish command off the end of `ARGV` (see ``ScriptCall``),
    /// so that `#ARGV` counts the script's own arguments.
    static let header = """
    local publishCommand = table.remove(ARGV)

    """

    /// Now in ms: ARGV[1] when a test drives the time, else Redis's clock. Whether a node's
    /// lease is held: its key exists. Under a test's clock, whose time Redis's key expiry does
    /// not follow, a lease whose end (its value) that clock has passed counts as expired too.
    /// And the two events the scripts publish, each written in one place (read by
    /// ``PublishedPresence`` and ``TypingEvent``).
    static let clock = header + """
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
    local function publishPresence(channel, user, status, lastSeen, publicStatus, publicSeen, changed, publicChanged, now)
      redis.call(publishCommand, channel, cjson.encode({type = 'presence', user_id = user, status = status,
        last_seen = lastSeen, public_status = publicStatus, public_last_seen = publicSeen,
        changed = changed, public_changed = publicChanged, at = now}))
    end
    local function publishTyping(channel, conversation, user, isTyping, now)
      redis.call(publishCommand, channel, cjson.encode({type = 'typing', conversation_id = conversation, user_id = user,
        is_typing = isTyping, at = now}))
    end

    """

    /// Shared by the device scripts: a device record, the aggregate, and the finishing step.
    ///
    /// A device is stored as one field of the user's devices hash:
    /// `status|node|session|since|deadline|alive`: `node` and `session` are empty for a REST
    /// device or a lingering one, `deadline` is 0 while a live session on a leased node holds
    /// the device, and `alive` is the last moment the device was known to be alive (all times
    /// in ms). ``DeviceRecord/init(id:stored:)`` reads the same record on the Swift side.
    static let devices = clock + """
    local function parse(raw)
      local s, n, ses, since, dl, alive = string.match(raw, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
      return {status = s, node = n, session = ses, since = tonumber(since), deadline = tonumber(dl), alive = tonumber(alive)}
    end
    local function encode(d)
      return d.status .. '|' .. d.node .. '|' .. d.session .. '|' .. d.since .. '|' .. d.deadline .. '|' .. d.alive
    end
    -- Whether record d, of another session than one this node holds that opened at `opened`
    -- (ms), is older than that session, so Redis went back to before it: a record of this
    -- node's own is (the node holds one session per device, its latest), and another node's is
    -- when it was last written before the session opened. A restore after a loss asks the
    -- second half alone: there a record of this node's may be of a session opening just now.
    local function predates(d, node, opened)
      return d.node == node or opened > d.alive
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
    -- Stores the new aggregate, publishes if anything visible changed, keeps the devices hash
    -- for `ttl` ms more, and returns
    -- {changed, status, last_seen, public_changed, public_status, public_last_seen}.
    -- `devicesWereGone`: the script found no devices hash (lost, or its TTL ran out). Readers saw
    -- the user offline then, whatever the state key says, and so may watchers they told: the
    -- aggregate counts as changed from offline.
    local function finish(stateKey, devicesKey, channel, now, removedAlive, user, ttl, devicesWereGone)
      local old = redis.call('HMGET', stateKey, 'status', 'last_seen', 'hidden', 'hidden_last_seen')
      local oldStatus = old[1] or 'offline'
      if devicesWereGone then oldStatus = 'offline' end
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
        redis.call('PEXPIRE', devicesKey, ttl)
      end
      if changed or publicChanged then
        publishPresence(channel, user, newStatus, lastSeen, publicStatus, publicSeen, changed, publicChanged, now)
      end
      return {changed and 1 or 0, newStatus, tostring(lastSeen), publicChanged and 1 or 0, publicStatus, tostring(publicSeen)}
    end

    """

    /// Reads `finish()`'s array (changed, status, last_seen, shown changed, shown status, shown
    /// last_seen), or the same shape from another script.
    static func change(_ values: [RESPValue], user: String) throws(PresenceError) -> PresenceChange {
        guard values.count >= 6,
              let status = values[1].string.flatMap(PresenceStatus.init(rawValue:)),
              let shownStatus = values[4].string.flatMap(PresenceStatus.init(rawValue:))
        else { throw PresenceError(.internal, "unexpected reply from a presence script") }
        let real = Presence(userID: user, status: status, lastSeen: timestamp(values[2]))
        let shown = Presence(userID: user, status: shownStatus, lastSeen: timestamp(values[5]))
        return PresenceChange(
            changed: values[0].int == 1,
            shownChanged: values[3].int == 1,
            views: PresenceViews(real: real, shown: shown, hidden: shown != real)
        )
    }

    /// A moment in ms; `nil` for 0 (never).
    static func timestamp(_ value: RESPValue) -> Int64? {
        timestamp(value.string)
    }

    /// The same, from a field's text (`HMGET`'s answer).
    static func timestamp(_ text: String?) -> Int64? {
        guard let number = text.flatMap({ Int64($0) }), number > 0 else { return nil }
        return number
    }
}
