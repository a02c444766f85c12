import PresenceProtocol
import RedisClient

/// Moves a member's cursor forward (never back; a seq above the last is the last; `read` moves
/// `delivered` too) and, when it moved, publishes a receipt on the message channel, unless the
/// conversation has more than `PRESENCE_LARGE_GROUP` members: there members read cursors with
/// `GET …/receipts`, and one member's move is not a frame to every other member.
struct MoveCursor: ScriptCall {
    struct Outcome {
        var cursors: Cursors
        /// The conversation has more members than `PRESENCE_LARGE_GROUP`.
        var large: Bool
    }

    var conversation: String
    var user: String
    var kind: CursorKind
    var seq: Int64

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.members(conversation), context.keys.historyMeta(conversation), context.keys.cursors(conversation)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, RedisArgument(conversation), RedisArgument(user), RedisArgument(kind.rawValue), RedisArgument(Int(seq)),
         RedisArgument(context.keys.messageChannel(conversation)), ScriptContext.milliseconds(context.configuration.messageTTL),
         RedisArgument(context.configuration.largeGroup)]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        let parts = reply.array ?? []
        if let refusal = MessageLua.refusal(parts) { throw refusal }
        switch parts.first?.string {
        case "cursors":
            guard parts.count == 4, let delivered = parts[1].int, let read = parts[2].int else { break }
            return Outcome(cursors: Cursors(deliveredSeq: Int64(delivered), readSeq: Int64(read)), large: parts[3].int == 1)
        default: break
        }
        throw PresenceError(.internal, "unexpected reply from the cursor script: \(reply)")
    }

    /// Returns {'cursors', delivered, read, 1 when the conversation is large}, or a refusal.
    static let script = RedisScript(ScriptLua.clock + MessageLua.common + """
    local conversation, user, kind, seq, channel, ttl = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
    local no = refused(KEYS[1], user)
    if no then return {no} end
    local large = 0
    if redis.call('SCARD', KEYS[1]) > tonumber(ARGV[8]) then large = 1 end
    local epoch, last, forks = current(KEYS[2])
    if not epoch then return {'cursors', 0, 0, large} end
    local delivered, read = cursorOf(redis.call('HGET', KEYS[3], user), epoch, forks)
    local target = math.min(seq, last)
    local newRead = read
    if kind == 'read' then newRead = math.max(read, target) end
    local newDelivered = math.max(delivered, target, newRead)
    if newDelivered ~= delivered or newRead ~= read then
      redis.call('HSET', KEYS[3], user, cursorText(epoch, newDelivered, newRead))
      redis.call('PEXPIRE', KEYS[3], ttl)
      if large == 0 then
        redis.call(publishCommand, channel, encodeWhole({type = 'receipt', conversation_id = conversation, epoch = epoch,
          user_id = user, delivered_seq = newDelivered, read_seq = newRead}, {'delivered_seq', 'read_seq'}))
      end
    end
    return {'cursors', newDelivered, newRead, large}
    """)
}

/// Moves several members' `delivered` cursors in one large conversation at once: what one node's
/// sessions said in the last second (``PresenceEngine/flushDelivered()``). Each moves forward only
/// (a seq above the last is the last), a user no longer a member is skipped, and no receipt is
/// published. Returns how many cursors moved.
struct MoveDeliveredTogether: ScriptCall {
    var conversation: String
    /// Each user's highest `delivered` seq since the last write.
    var moves: [(user: String, seq: Int64)]

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.members(conversation), context.keys.historyMeta(conversation), context.keys.cursors(conversation)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, ScriptContext.milliseconds(context.configuration.messageTTL)]
            + moves.flatMap { [RedisArgument($0.user), RedisArgument(Int($0.seq))] }
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Int { reply.int ?? 0 }

    static let script = RedisScript(ScriptLua.clock + MessageLua.common + """
    local ttl = tonumber(ARGV[2])
    local epoch, last, forks = current(KEYS[2])
    if not epoch then return 0 end
    local fields = {}
    -- A thousand users a step, each step one SMISMEMBER and one HMGET, whatever the number of
    -- members: Lua's unpack takes a few thousand values at most.
    for start = 3, #ARGV - 1, 2000 do
      local users, seqs = {}, {}
      for i = start, math.min(start + 1998, #ARGV - 1), 2 do
        users[#users + 1] = ARGV[i]
        seqs[#seqs + 1] = tonumber(ARGV[i + 1])
      end
      local member = redis.call('SMISMEMBER', KEYS[1], unpack(users))
      local cursors = redis.call('HMGET', KEYS[3], unpack(users))
      for j = 1, #users do
        if member[j] == 1 then
          local delivered, read = cursorOf(cursors[j], epoch, forks)
          local target = math.min(seqs[j], last)
          if target > delivered then
            fields[#fields + 1] = users[j]
            fields[#fields + 1] = cursorText(epoch, target, read)
          end
        end
      end
    end
    -- One HSET per thousand cursors: Lua's unpack takes a few thousand values at most.
    for start = 1, #fields, 2000 do
      redis.call('HSET', KEYS[3], unpack(fields, start, math.min(start + 1999, #fields)))
    end
    if #fields > 0 then redis.call('PEXPIRE', KEYS[3], ttl) end
    return #fields / 2
    """)
}
