import PresenceProtocol
import RedisClient

// A conversation's messages, each change one script on the conversation's slot: its members,
// the history (a stream whose entry ids are the seqs), the history's meta (epoch and last seq),
// the members' cursors and the senders' retry records share the `{c:ID}` hash tag, so that a
// send is checked, numbered, stored, published and remembered at once, on a Redis Cluster too.
//
// Stream entry fields: `i` id, `u` sender, `c` client message id, `t` type, `x` text, `g` image
// URL, `k` client's creation moment (ms), `a` stored moment (ms, Redis's clock).

/// Lua the message scripts share: the conversation's checks and its history's epoch.
enum MessageLua {
    /// `refused(members, user)`: 'missing' without the conversation, 'forbidden' for a
    /// non-member, else nil. `current(meta)`: the epoch, last seq and forks, forking the epoch
    /// when the server's life changed since the history was last written (docs/API.md, "Forks").
    /// `cursorOf(raw, epoch, forks)`: a stored cursor's delivered and read seqs: as stored in the
    /// current epoch, kept up to the fork point in an ancestor, 0 and 0 in an epoch lost.
    /// The refusal `refused()` answered a script with, as the caller's error; `nil` otherwise.
    static func refusal(_ reply: [RESPValue]) -> PresenceError? {
        switch reply.first?.string {
        case "missing": PresenceError(.notFound, "no such conversation")
        case "forbidden": PresenceError(.forbidden, "you are not a member of this conversation")
        default: nil
        }
    }

    static let common = """
    local function refused(members, user)
      if redis.call('EXISTS', members) == 0 then return 'missing' end
      if redis.call('SISMEMBER', members, user) == 0 then return 'forbidden' end
      return nil
    end
    -- A seq as text: Lua's own conversion keeps 14 digits (1.2345678901234e+14).
    local function whole(n) return string.format('%.0f', n) end
    -- JSON of an event whose `keys` are seqs: written as strings, then as numbers.
    local function encodeWhole(event, keys)
      for _, k in ipairs(keys) do event[k] = whole(event[k]) end
      local json = cjson.encode(event)
      for _, k in ipairs(keys) do json = string.gsub(json, '"' .. k .. '":"(%d+)"', '"' .. k .. '":%1', 1) end
      return json
    end
    -- The history's epoch, last seq and forks (its ancestors, newest first, as
    -- 'epoch:forkpoint' separated by spaces), nil, nil, '' for no history. A history last written
    -- in another life of this server (a restart, a failover, a slot moved here) may have lost its
    -- newest writes: it forks a new epoch at the last seq it still holds, named after the old
    -- epoch, the life and that seq, so that no epoch is made twice.
    local function current(meta)
      local m = redis.call('HMGET', meta, 'epoch', 'seq', 'life', 'forks')
      if not m[1] then return nil, nil, '' end
      local epoch, last, forks = m[1], tonumber(m[2]) or 0, m[4] or ''
      local life = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or ''
      if m[3] == life then return epoch, last, forks end
      if m[3] then
        local kept = {epoch .. ':' .. whole(last)}
        for entry in string.gmatch(forks, '%S+') do
          if #kept < 8 then table.insert(kept, entry) end
        end
        forks = table.concat(kept, ' ')
        epoch = string.sub(redis.sha1hex(epoch .. '|' .. life .. '|' .. whole(last)), 1, 16)
        redis.call('HSET', meta, 'epoch', epoch, 'forks', forks, 'life', life)
      else
        -- Written before lives were recorded: this one is taken as its own.
        redis.call('HSET', meta, 'life', life)
      end
      return epoch, last, forks
    end
    -- Where `epoch`, an ancestor named in `forks`, joins the current epoch: the lowest fork
    -- point on the way; false for an epoch not named (the current one, or one lost).
    local function forkPoint(forks, epoch)
      local point
      for e, p in string.gmatch(forks, '(%S+):(%d+)') do
        p = tonumber(p)
        if point == nil or p < point then point = p end
        if e == epoch then return point end
      end
      return false
    end
    -- A new history: its epoch, with no life of another server to fork from.
    local function begin(meta, epoch, ttl)
      local life = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or ''
      redis.call('HSET', meta, 'epoch', epoch, 'seq', 0, 'life', life)
      redis.call('HDEL', meta, 'forks')
      if ttl then redis.call('PEXPIRE', meta, ttl) end
    end
    local function cursorOf(raw, epoch, forks)
      if not raw then return 0, 0 end
      local e, d, r = string.match(raw, '^(.*)|(%d+)|(%d+)$')
      d, r = tonumber(d), tonumber(r)
      if e == epoch then return d, r end
      local point = forkPoint(forks or '', e)
      if not point then return 0, 0 end
      return math.min(d, point), math.min(r, point)
    end
    local function cursorText(epoch, delivered, read) return epoch .. '|' .. whole(delivered) .. '|' .. whole(read) end

    """
}

/// Sends one message: checks membership and the sender's earlier send of the same client id,
/// numbers it from the history's meta, stores it (trimming the oldest), remembers it for
/// retries, moves the sender's cursors to it, and publishes it on the conversation's message
/// channel (read by ``PublishedMessage``).
struct SendMessage: ScriptCall {
    enum Outcome {
        case stored(StoredMessage)
        case duplicate(StoredMessage)
    }

    var conversation: String
    var sender: String
    var message: OutgoingMessage
    /// The epoch to start if the history has none (a new one, never used before).
    var newEpoch: String
    /// Whether the script publishes the message; not when acknowledgements wait for replicas,
    /// where the engine publishes once they have it (a message published and then lost in a
    /// failover would have its seq given again to another).
    var publish = true

    func keys(_ context: ScriptContext) -> [String] {
        let keys = context.keys
        return [keys.members(conversation), keys.historyMeta(conversation), keys.history(conversation),
                keys.sent(conversation, sender: sender, clientMessageID: message.clientMessageID), keys.cursors(conversation)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        let configuration = context.configuration
        return [
            context.now, RedisArgument(conversation), RedisArgument(sender), RedisArgument(message.clientMessageID),
            RedisArgument(message.type.rawValue), RedisArgument(message.text), RedisArgument(message.imageURL ?? ""),
            RedisArgument(message.clientCreatedAt.map { String($0) } ?? ""), RedisArgument(configuration.messageHistory),
            ScriptContext.milliseconds(configuration.messageTTL), ScriptContext.milliseconds(configuration.messageDedupTTL),
            RedisArgument(context.keys.messageChannel(conversation)), RedisArgument(newEpoch), publish ? "1" : "0",
            RedisArgument(configuration.largeGroup),
        ]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> Outcome {
        let parts = reply.array ?? []
        if let refusal = MessageLua.refusal(parts) { throw refusal }
        switch parts.first?.string {
        case "stored", "duplicate":
            guard parts.count == 3, let epoch = parts[1].string,
                  let stored = StoredMessage(conversation: conversation, epoch: epoch, seq: nil, fields: parts[2].strings) else { break }
            return parts[0].string == "stored" ? .stored(stored) : .duplicate(stored)
        default: break
        }
        throw PresenceError(.internal, "unexpected reply from the send script: \(reply)")
    }

    static let script = RedisScript(ScriptLua.clock + MessageLua.common + """
    local now, conversation, sender, clientID = clock(ARGV[1]), ARGV[2], ARGV[3], ARGV[4]
    local kind, text, image, clientAt = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
    local keep, ttl, dedupTTL, channel, newEpoch, publish = ARGV[9], tonumber(ARGV[10]), tonumber(ARGV[11]), ARGV[12], ARGV[13], ARGV[14]
    local receiptsUpTo = tonumber(ARGV[15])
    local no = refused(KEYS[1], sender)
    if no then return {no} end
    local epoch, last, forks = current(KEYS[2])
    -- A retry of a send this epoch kept (at or below its fork point, for a record of an epoch it
    -- forked from): the stored message, whatever the retry carries. A record of an epoch since
    -- lost (the conversation deleted and made again), or of a seq Redis lost in a rollback, is
    -- no longer a send of this history: the retry is stored as new.
    local earlier = redis.call('HGETALL', KEYS[4])
    if #earlier > 0 and epoch then
      local record = redis.call('HMGET', KEYS[4], 'e', 's')
      if record[1] == epoch then return {'duplicate', epoch, earlier} end
      local point = forkPoint(forks, record[1])
      if point and tonumber(record[2]) <= point then
        for i = 1, #earlier - 1, 2 do
          if earlier[i] == 'e' then earlier[i + 1] = epoch end
        end
        return {'duplicate', epoch, earlier}
      end
    end
    if not epoch then
      -- No history: a new epoch, and nothing left over from an earlier one.
      epoch, last = newEpoch, 0
      redis.call('DEL', KEYS[3], KEYS[5])
      begin(KEYS[2], epoch, nil)
    end
    local seq = last + 1
    local id = epoch .. '-' .. whole(seq)
    redis.call('HSET', KEYS[2], 'epoch', epoch, 'seq', seq)
    local fields = {'i', id, 'u', sender, 'c', clientID, 't', kind, 'x', text, 'a', now}
    if image ~= '' then table.insert(fields, 'g'); table.insert(fields, image) end
    if clientAt ~= '' then table.insert(fields, 'k'); table.insert(fields, clientAt) end
    redis.call('XADD', KEYS[3], 'MAXLEN', keep, whole(seq) .. '-0', unpack(fields))
    redis.call('HSET', KEYS[5], sender, cursorText(epoch, seq, seq))
    for _, key in ipairs({KEYS[2], KEYS[3], KEYS[5]}) do redis.call('PEXPIRE', key, ttl) end
    local record = {'e', epoch, 's', seq}
    for _, value in ipairs(fields) do table.insert(record, value) end
    redis.call('DEL', KEYS[4])
    redis.call('HSET', KEYS[4], unpack(record))
    redis.call('PEXPIRE', KEYS[4], dedupTTL)
    if publish == '1' then
      redis.call(publishCommand, channel, encodeWhole({type = 'message', conversation_id = conversation, epoch = epoch,
        seq = seq, id = id, sender_id = sender, client_message_id = clientID, message_type = kind, text = text,
        image_url = image, created_at = now, client_created_at = clientAt}, {'seq'}))
      -- The sender's cursors moved to the message (not in a group too large for receipts).
      if redis.call('SCARD', KEYS[1]) <= receiptsUpTo then
        redis.call(publishCommand, channel, encodeWhole({type = 'receipt', conversation_id = conversation, epoch = epoch,
          user_id = sender, delivered_seq = seq, read_seq = seq}, {'delivered_seq', 'read_seq'}))
      end
    end
    return {'stored', epoch, record}
    """)
}

/// Reads a page of a conversation's history for a member: after a seq, before one, or the
/// latest; with the epoch (made if the history has none yet, so that a client has one to
/// sync from), the last seq and the oldest seq kept. With an empty reader it is the node's
/// read for delivery: no member check, and no epoch made (an empty one answers no history).
struct ReadHistory: ScriptCall {
    var conversation: String
    var reader: String
    var page: HistoryRange
    var limit: Int
    var newEpoch: String
    /// For an `after` read: the epoch the seq belongs to, when the reader names one. An epoch
    /// the current one forked from reads from the lower of the seq and its fork point.
    var epoch: String? = nil

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.members(conversation), context.keys.historyMeta(conversation), context.keys.history(conversation)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        let (mode, seq): (String, Int64) = switch page {
        case .after(let seq): ("after", seq)
        case .before(let seq): ("before", seq)
        case .latest: ("latest", 0)
        }
        return [context.now, RedisArgument(reader), RedisArgument(mode), RedisArgument(Int(seq)), RedisArgument(limit),
                RedisArgument(newEpoch), ScriptContext.milliseconds(context.configuration.messageTTL), RedisArgument(epoch ?? "")]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> HistoryPage {
        let parts = reply.array ?? []
        if let refusal = MessageLua.refusal(parts) { throw refusal }
        switch parts.first?.string {
        case "page":
            guard parts.count == 7, let epoch = parts[1].string, let last = parts[2].int, let first = parts[3].int, let entries = parts[4].array,
                  let point = parts[5].int, let forks = parts[6].string else { break }
            let messages = entries.compactMap { StoredMessage(conversation: conversation, epoch: epoch, entry: $0) }
            return HistoryPage(epoch: epoch, lastSeq: Int64(last), firstSeq: Int64(first), messages: messages,
                               forkPoint: point >= 0 ? Int64(point) : nil, forks: HistoryPage.Fork.list(forks))
        default: break
        }
        throw PresenceError(.internal, "unexpected reply from the history script: \(reply)")
    }

    static let script = RedisScript(ScriptLua.clock + MessageLua.common + """
    local reader, mode, seq, limit, newEpoch, ttl, from = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6], tonumber(ARGV[7]), ARGV[8]
    -- No reader: a node's own read for delivery, which neither checks nor starts anything.
    if reader ~= '' then
      local no = refused(KEYS[1], reader)
      if no then return {no} end
    end
    local epoch, last, forks = current(KEYS[2])
    if not epoch and reader == '' then return {'page', '', 0, 1, {}, -1, ''} end
    if not epoch then
      epoch, last = newEpoch, 0
      redis.call('DEL', KEYS[3])
      begin(KEYS[2], epoch, ttl)
    end
    -- A seq of an epoch this one forked from goes on from the fork point at most.
    local point = -1
    if from ~= '' and from ~= epoch then
      local p = forkPoint(forks, from)
      if p then
        point = p
        seq = math.min(seq, p)
      end
    end
    local oldest = redis.call('XRANGE', KEYS[3], '-', '+', 'COUNT', 1)
    local first = last + 1
    if #oldest > 0 then first = tonumber(string.match(oldest[1][1], '^(%d+)')) end
    local entries
    if mode == 'after' then
      entries = redis.call('XRANGE', KEYS[3], '(' .. whole(seq) .. '-0', '+', 'COUNT', limit)
    else
      local top = '+'
      if mode == 'before' then top = '(' .. whole(seq) .. '-0' end
      if mode == 'before' and seq <= 1 then
        entries = {}
      else
        local newest = redis.call('XREVRANGE', KEYS[3], top, '-', 'COUNT', limit)
        entries = {}
        for i = #newest, 1, -1 do table.insert(entries, newest[i]) end
      end
    end
    return {'page', epoch, last, first, entries, point, forks}
    """)
}

/// Every member's cursors in a conversation, for a member (or, with no reader, an administrator);
/// with `atMost` above 0, `nil` for a conversation of more members, which are not read.
struct ReadReceipts: ScriptCall {
    var conversation: String
    var reader: String
    var atMost = 0

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.members(conversation), context.keys.historyMeta(conversation), context.keys.cursors(conversation)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, RedisArgument(reader), RedisArgument(atMost)]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> [(user: String, cursors: Cursors)]? {
        let parts = reply.array ?? []
        if let refusal = MessageLua.refusal(parts) { throw refusal }
        switch parts.first?.string {
        case "toomany":
            return nil
        case "receipts":
            guard parts.count == 2, let rows = parts[1].array else { break }
            return rows.compactMap { row in
                guard let fields = row.array, fields.count == 3, let user = fields[0].string, let delivered = fields[1].int, let read = fields[2].int else { return nil }
                return (user, Cursors(deliveredSeq: Int64(delivered), readSeq: Int64(read)))
            }.sorted { $0.user < $1.user }
        default: break
        }
        throw PresenceError(.internal, "unexpected reply from the receipts script: \(reply)")
    }

    static let script = RedisScript(ScriptLua.clock + MessageLua.common + """
    if ARGV[2] ~= '' then
      local no = refused(KEYS[1], ARGV[2])
      if no then return {no} end
    elseif redis.call('EXISTS', KEYS[1]) == 0 then
      return {'missing'}
    end
    local atMost = tonumber(ARGV[3])
    if atMost > 0 and redis.call('SCARD', KEYS[1]) > atMost then return {'toomany'} end
    local epoch, _, forks = current(KEYS[2])
    local rows = {}
    for _, member in ipairs(redis.call('SMEMBERS', KEYS[1])) do
      local delivered, read = 0, 0
      if epoch then delivered, read = cursorOf(redis.call('HGET', KEYS[3], member), epoch, forks) end
      table.insert(rows, {member, delivered, read})
    end
    return {'receipts', rows}
    """)
}

/// Reads ``ConversationSummary`` for a member; `nil` when they are not one (any more).
struct SummarizeConversation: ScriptCall {
    var conversation: String
    var user: String

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.members(conversation), context.keys.historyMeta(conversation), context.keys.history(conversation), context.keys.cursors(conversation)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, RedisArgument(user)]
    }

    func decode(_ reply: RESPValue) throws(PresenceError) -> ConversationSummary? {
        let parts = reply.array ?? []
        guard parts.first?.string == "summary" else { return nil }
        guard parts.count == 6, let epoch = parts[1].string, let last = parts[2].int, let delivered = parts[3].int, let read = parts[4].int,
              let newest = parts[5].array else {
            throw PresenceError(.internal, "unexpected reply from the summary script: \(reply)")
        }
        return ConversationSummary(
            conversationID: conversation, epoch: epoch, lastSeq: Int64(last), cursors: Cursors(deliveredSeq: Int64(delivered), readSeq: Int64(read)),
            lastMessage: newest.first.flatMap { StoredMessage(conversation: conversation, epoch: epoch, entry: $0) }
        )
    }

    static let script = RedisScript(ScriptLua.clock + MessageLua.common + """
    if refused(KEYS[1], ARGV[2]) then return {'none'} end
    local epoch, last, forks = current(KEYS[2])
    if not epoch then return {'summary', '', 0, 0, 0, {}} end
    local delivered, read = cursorOf(redis.call('HGET', KEYS[4], ARGV[2]), epoch, forks)
    return {'summary', epoch, last, delivered, read, redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)}
    """)
}

/// Starts new members' cursors at the history's last seq, as of their joining.
struct StartCursors: ScriptCall {
    var conversation: String
    var users: [String]

    func keys(_ context: ScriptContext) -> [String] {
        [context.keys.historyMeta(conversation), context.keys.cursors(conversation)]
    }

    func arguments(_ context: ScriptContext) -> [RedisArgument] {
        [context.now, ScriptContext.milliseconds(context.configuration.messageTTL)] + users.map { RedisArgument($0) }
    }

    func decode(_ reply: RESPValue) throws(PresenceError) {}

    static let script = RedisScript(ScriptLua.clock + MessageLua.common + """
    local epoch, last = current(KEYS[1])
    if not epoch or last == 0 then return 0 end
    for i = 3, #ARGV do redis.call('HSET', KEYS[2], ARGV[i], cursorText(epoch, last, last)) end
    redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]))
    return 1
    """)
}
