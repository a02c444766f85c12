import Logging
import NIOCore
import NIOPosix
import ServiceLifecycle

/// What a user of Redis needs, whether one server (a `redis://` or `redis+sentinel://` URL, a
/// ``RedisClient``) or a cluster (`redis+cluster://`, a ``RedisClusterClient``) answers: commands,
/// pipelines and scripts routed to the server that holds their keys, connection events, and a
/// walk of the whole key space.
///
/// A pipeline or a batch of script calls may name keys of several hash slots: a cluster client
/// sends each command to its slot's primary, and each result still comes back in order. A single
/// command or script must keep its keys in one slot.
public protocol RedisCommands: AnyObject, Sendable, Service {
    /// Where the client connects (for a cluster: the template of every node connection).
    var configuration: RedisConfiguration { get }
    /// Whether the client can reach every server it needs right now.
    var isConnected: Bool { get }
    /// Whether commands can be served now: the one server is connected; on a cluster, the slot
    /// map is known and a primary is connected (commands to the slots of a primary that is
    /// missing fail on their own, until its replica takes over). What a node's readiness asks.
    var isAvailable: Bool { get }
    /// Sends one command and returns its reply; an error reply throws ``RedisError/Code/server``.
    @discardableResult
    func send(_ arguments: [RedisArgument]) async throws(RedisError) -> RESPValue
    /// Sends several commands; each result is that command's reply or error, in order.
    func pipeline(_ commands: [[RedisArgument]]) async throws(RedisError) -> [Result<RESPValue, RedisError>]
    /// Runs `script` by SHA, loading it where the server does not know it.
    @discardableResult
    func evaluate(_ script: RedisScript, keys: [String], arguments: [RedisArgument]) async throws(RedisError) -> RESPValue
    /// Runs `script` once per call; each result in order.
    func evaluate(_ script: RedisScript, calls: [(keys: [String], arguments: [RedisArgument])]) async throws(RedisError) -> [Result<RESPValue, RedisError>]
    /// One page of the keys matching `pattern` on every server that holds keys, by `SCAN` with
    /// `count` as its hint: the one server, or each primary of a cluster in turn. Start with the
    /// cursor "0" and pass each returned cursor back until it is "0" again. A key may come twice,
    /// as SCAN may return it twice; on a cluster whose primaries change meanwhile, keys of a
    /// moved slot may be missed or repeated.
    func scanPage(cursor: String, matching pattern: String, count: Int) async throws(RedisError) -> (cursor: String, keys: [String])
    /// `WAIT replicas timeout` on the connections that may have written `key` (on one server
    /// each event loop's, the fewest count of them; on a cluster the connection to the primary of
    /// the key's slot): how many replicas have every write sent on them so far, waiting up to
    /// `timeoutMilliseconds` for `replicas`.
    func waitForReplicas(_ replicas: Int, timeoutMilliseconds: Int, afterWriting key: String) async throws(RedisError) -> Int
    /// How messages reach subscribers: classic pub/sub on one server, sharded on a cluster.
    var pubSub: RedisPubSub { get }
    /// Registers `observer` for connection events; keep the token to remove it.
    @discardableResult
    func addConnectionObserver(_ observer: @escaping @Sendable (RedisConnectionEvent) -> Void) -> Int
    /// Removes an observer added with ``addConnectionObserver(_:)``.
    func removeConnectionObserver(_ token: Int)
}

/// How a client's messages reach subscribers.
public enum RedisPubSub: String, Sendable, CaseIterable, Codable {
    /// `PUBLISH` and `SUBSCRIBE`: one server hears every channel; patterns work.
    case classic
    /// `SPUBLISH` and `SSUBSCRIBE`: a channel lives on the shard of its hash slot, so a cluster
    /// passes a message to that shard alone, not to every node. No patterns.
    case sharded

    /// The command that publishes a message.
    public var publishCommand: RedisArgument {
        switch self {
        case .classic: "PUBLISH"
        case .sharded: "SPUBLISH"
        }
    }

    /// The pub/sub a setting names (`classic` or `sharded`, as `PRESENCE_REDIS_PUBSUB` gives
    /// it) for a client of `topology`. A cluster takes `sharded` only: a classic message goes
    /// to every node of the cluster, and one subscriber connection could not hear them all.
    public init(setting: String, topology: RedisConfiguration.Topology) throws(RedisError) {
        guard let value = RedisPubSub(rawValue: setting) else {
            throw RedisError(.unsupported, "'\(setting)' is not a pub/sub mode: use 'classic' or 'sharded'")
        }
        if case .cluster = topology, value == .classic {
            throw RedisError(.unsupported, "a Redis Cluster takes sharded pub/sub only (a classic PUBLISH would go to every node of the cluster)")
        }
        self = value
    }

    /// The command that subscribes channels.
    var subscribeCommand: RedisArgument {
        switch self {
        case .classic: "SUBSCRIBE"
        case .sharded: "SSUBSCRIBE"
        }
    }
}

extension RedisCommands {
    /// Publishes `payload` on `channel` with ``pubSub``'s command; returns how many subscribers
    /// received it. On a cluster that is the count of the node that took it: the primary of the
    /// channel's slot, or just after a failover the demoted primary, which as a replica of the
    /// same shard passes the message on and counts none.
    @discardableResult
    public func publish(_ payload: [UInt8], on channel: String) async throws(RedisError) -> Int {
        try await execute(Publish(payload, on: channel, mode: pubSub))
    }

    /// Sends one command given as words.
    @discardableResult
    public func send(_ arguments: RedisArgument...) async throws(RedisError) -> RESPValue {
        try await send(arguments)
    }
}

/// Makes the client a URL names: a ``RedisClusterClient`` for `redis+cluster://` and
/// `rediss+cluster://`, else a ``RedisClient``. It connects once `run()` starts.
public func makeRedisCommands(
    configuration: RedisConfiguration,
    eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton,
    logger: Logger
) throws(RedisError) -> any RedisCommands {
    if case .cluster(let seeds) = configuration.topology {
        return try RedisClusterClient(seeds: seeds.map { ($0.host, $0.port) }, configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
    }
    return RedisClient(configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
}

extension RedisCommands {
    /// Every key matching `pattern` (see ``scanPage(cursor:matching:count:)``), each once: for
    /// admin walks and tests, whose key sets fit in memory.
    public func allKeys(matching pattern: String, count: Int = 1000) async throws(RedisError) -> Set<String> {
        var keys = Set<String>()
        var cursor = "0"
        repeat {
            let page = try await scanPage(cursor: cursor, matching: pattern, count: count)
            cursor = page.cursor
            keys.formUnion(page.keys)
        } while cursor != "0"
        return keys
    }
}

/// Reads a SCAN reply: the next cursor and the keys.
private func scanReply(_ reply: RESPValue, pattern: String) throws(RedisError) -> (cursor: String, keys: [String]) {
    guard let parts = reply.array, parts.count == 2, let next = parts[0].string else {
        throw RedisError(.protocolViolation, "unexpected reply to SCAN MATCH \(pattern)")
    }
    return (next, parts[1].strings)
}

extension RedisClient: RedisCommands {
    public var isAvailable: Bool { isConnected }

    public func waitForReplicas(_ replicas: Int, timeoutMilliseconds: Int, afterWriting key: String) async throws(RedisError) -> Int {
        try await waitForReplicasOnEveryConnection(replicas, timeoutMilliseconds: timeoutMilliseconds)
    }

    public var pubSub: RedisPubSub { configuration.pubSub }

    public func scanPage(cursor: String, matching pattern: String, count: Int) async throws(RedisError) -> (cursor: String, keys: [String]) {
        try scanReply(try await send("SCAN", RedisArgument(cursor), "MATCH", RedisArgument(pattern), "COUNT", RedisArgument(count)), pattern: pattern)
    }
}

extension RedisClusterClient: RedisCommands {
    public func waitForReplicas(_ replicas: Int, timeoutMilliseconds: Int, afterWriting key: String) async throws(RedisError) -> Int {
        let command: [RedisArgument] = ["WAIT", RedisArgument(replicas), RedisArgument(timeoutMilliseconds)]
        return try await execute(command, slot: HashSlot(of: key), deadline: commandDeadline()).result.get().int ?? 0
    }

    /// The cursor is `primary:cursor`: the index of a primary in ``primaries`` and SCAN's cursor there.
    public func scanPage(cursor: String, matching pattern: String, count: Int) async throws(RedisError) -> (cursor: String, keys: [String]) {
        try await waitForMap(until: commandDeadline())
        let nodes = primaries
        var index = 0
        var nodeCursor = "0"
        if cursor != "0" {
            let parts = cursor.split(separator: ":", maxSplits: 1)
            guard parts.count == 2, let number = Int(parts[0]), number >= 0 else {
                throw RedisError(.server, "ERR invalid cursor '\(cursor)': a cluster's cursors read primary:cursor")
            }
            index = number
            nodeCursor = String(parts[1])
        }
        guard index < nodes.count else { return ("0", []) }
        let reply = try await execute(["SCAN", RedisArgument(nodeCursor), "MATCH", RedisArgument(pattern), "COUNT", RedisArgument(count)], slot: nil, deadline: commandDeadline(), target: .pinned(nodes[index])).result.get()
        let page = try scanReply(reply, pattern: pattern)
        if page.cursor != "0" { return ("\(index):\(page.cursor)", page.keys) }
        return (index + 1 < nodes.count ? "\(index + 1):0" : "0", page.keys)
    }

    public var pubSub: RedisPubSub { .sharded }
}

/// Runs the client a URL names (see ``makeRedisCommands(configuration:eventLoopGroup:logger:)``)
/// for the duration of `body`, connected before `body` starts; throws if it cannot connect, so
/// that a command line tool can report it and exit.
public func withRedisCommands<Result: Sendable>(
    configuration: RedisConfiguration,
    eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton,
    logger: Logger,
    _ body: (any RedisCommands) async throws -> Result
) async throws -> Result {
    if case .cluster(let seeds) = configuration.topology {
        return try await RedisClusterClient.withClient(seeds: seeds.map { ($0.host, $0.port) }, configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger) { client in
            try await body(client)
        }
    }
    return try await RedisClient.withClient(configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger) { client in
        try await body(client)
    }
}

/// A deadline for the commands a task sends, sooner than the client's own retry budget.
///
/// A Redis Cluster client retries a command whose node cannot be reached (a failover) for
/// ``RedisConfiguration/waitForConnection`` plus ``RedisConfiguration/commandTimeout``; a caller
/// that must answer sooner (an HTTP read that owes a 503 within a second) binds a deadline for
/// its work, and commands sent within it fail with ``RedisError/Code/unavailable`` once it passed:
///
///     try await RedisCommandDeadline.$current.withValue(.now + .milliseconds(900)) { ... }
public enum RedisCommandDeadline {
    @TaskLocal public static var current: ContinuousClock.Instant?
}
