import PresenceProtocol
import RedisClient

// The scripts of typing states. A conversation's typing hash holds user → `expiry|forwarded`;
// the scripts touch the conversation's keys only (`{c:ID}`). The engine indexes the expiry in the
// conversation's bucket of the typing deadline sets before a start (as the device scripts' callers
// do), and checks the user's own state, in the user's slot, before and after it.

/// Sets or clears a user's typing state in a conversation. A start, or a refresh at least a
/// coalescing window after the last one forwarded, is published; other refreshes only extend
/// the expiry. A stop is published only if the user was typing. A checked request (a client's)
/// from a non-member is refused in the same step as the write, so that one racing a removal
/// cannot outlive it; a start the engine found the user may not make (offline or hidden) is not
/// sent at all.
struct SetTyping: ScriptCall {
    enum Outcome {
        /// Watchers were told.
        case published
        /// Nothing to tell: a refresh within the window, or a stop with nothing typing.
        case quiet
        /// A checked request from a user who is not a member.
        case notMember
    }

    var conversation: String
    var user: String
    var isTyping: Bool
    /// A client's request, checked against membership and status; the server's own stops are not.
    var checked: Bool

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.typing(conversation), context.keys.members(conversation)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, RedisArgument(conversation), RedisArgument(user), isTyping ? "1" : "0",
         ScriptContext.milliseconds(context.configuration.typingTTL), RedisArgument(Int(PresenceEngine.typingCoalescingMilliseconds)),
         RedisArgument(context.keys.conversationChannel(conversation)), checked ? "check" : ""]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        switch reply.int {
        case -1: .notMember
        case 1: .published
        default: .quiet
        }
    }

    static let script = RedisScript(ScriptLua.clock + """
    local now, conversation, user, typing = clock(ARGV[1]), ARGV[2], ARGV[3], ARGV[4] == '1'
    local ttl, window, channel, checked = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], ARGV[8] == 'check'
    if checked and redis.call('SISMEMBER', KEYS[2], user) == 0 then return -1 end
    local raw = redis.call('HGET', KEYS[1], user)
    local expiry, forwarded = 0, 0
    if raw then
      local e, f = string.match(raw, '^([^|]*)|([^|]*)$')
      expiry, forwarded = tonumber(e), tonumber(f)
    end
    if typing then
      local active = expiry > now
      local publish = (not active) or (now - forwarded >= window)
      if publish then forwarded = now end
      redis.call('HSET', KEYS[1], user, (now + ttl) .. '|' .. forwarded)
      redis.call('PEXPIRE', KEYS[1], ttl * 10)
      if publish then
        publishTyping(channel, conversation, user, true, now)
        return 1
      end
      return 0
    end
    -- An entry still here has not had its stop published (the reaper publishes when it removes
    -- one), even if its expiry has just passed: publish it now.
    if raw then
      redis.call('HDEL', KEYS[1], user)
      publishTyping(channel, conversation, user, false, now)
      return 1
    end
    return 0
    """)
}

/// Ends a typing state whose expiry passed, publishing `is_typing: false`.
struct ExpireTyping: ScriptCall {
    enum Outcome: Equatable {
        case ended
        /// Refreshed since it was indexed: it runs until then.
        case running(until: Int64)
        /// There is none.
        case none
    }

    var conversation: String
    var user: String

    func keys(_ context: ScriptContext) -> [String] { [context.keys.typing(conversation)] }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, RedisArgument(conversation), RedisArgument(user), RedisArgument(context.keys.conversationChannel(conversation))]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        switch reply.int {
        case 1: .ended
        case let expiry? where expiry > 1: .running(until: Int64(expiry))
        default: .none
        }
    }

    /// Returns 1 when it ended, the expiry when it is still running, 0 when there is none.
    static let script = RedisScript(ScriptLua.clock + """
    local now, conversation, user, channel = clock(ARGV[1]), ARGV[2], ARGV[3], ARGV[4]
    local raw = redis.call('HGET', KEYS[1], user)
    if not raw then return 0 end
    local expiry = tonumber(string.match(raw, '^([^|]*)|'))
    if expiry > now then return expiry end
    redis.call('HDEL', KEYS[1], user)
    publishTyping(channel, conversation, user, false, now)
    return 1
    """)
}
