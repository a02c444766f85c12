import Logging
import NIOCore
import NIOPosix
import ServiceLifecycle

/// What a ``RedisSubscriber`` delivers.
public enum RedisSubscriberEvent: Sendable, Equatable {
    /// A message published on a subscribed channel.
    case message(channel: String, payload: [UInt8])
    /// Every wanted channel is subscribed on a fresh connection. After a reconnect (`true`)
    /// messages published meanwhile were missed: the owner should re-read the state it mirrors.
    case subscribed(reconnect: Bool)
    /// These channels are subscribed again, at the primary serving them now, after Redis dropped
    /// them (on a cluster their slot moved: a migration or a failover) or their connection was
    /// lost. Messages published on them meanwhile may have been missed: the owner should re-read
    /// the state they mirror. Sent by ``RedisClusterSubscriber``.
    case resubscribed(channels: [String])
    /// A subscriber connection was lost; it is being re-established.
    case disconnected
}

/// Channels subscribed on connections that follow their servers: ``RedisSubscriber`` (classic
/// pub/sub on one server) or ``RedisClusterSubscriber`` (sharded pub/sub over a cluster); see
/// ``makeRedisSubscriber(for:eventLoopGroup:logger:)``.
public protocol RedisChannelSubscriber: AnyObject, Sendable, Service {
    /// Messages and connection changes, in order; finishes when `run()` returns.
    var events: AsyncStream<RedisSubscriberEvent> { get }
    /// The channels wanted, whether or not they are subscribed right now.
    var channels: Set<String> { get }
    /// Whether every wanted channel is subscribed on an open connection.
    var isConnected: Bool { get }
    /// Whether messages can flow now: the one connection is open; on a cluster, its router can
    /// serve commands (channels of a primary that is failing over come back on their own).
    var isAvailable: Bool { get }
    /// Adds channels (not counted) and waits until Redis confirms them.
    func subscribe(_ channels: [String]) async throws(RedisError)
    /// Removes channels added with ``subscribe(_:)``.
    func unsubscribe(_ channels: [String]) async throws(RedisError)
    /// Counts one more user of each channel, subscribing those that had none.
    func retain(_ channels: [String]) async throws(RedisError)
    /// Counts one user less of each channel, unsubscribing those that have none left.
    func release(_ channels: [String]) async throws(RedisError)
    /// Waits until channels can be subscribed: the connection is up (classic); on a cluster
    /// at once, as connections open per primary when a slot's channels are first wanted.
    func waitUntilConnected() async throws
    /// Stops the subscriber; later changes throw.
    func shutdown()
    /// Offers each message to `handler` first, on the event loop of the connection it came on,
    /// in that connection's order: a message it takes (returns true) does not reach ``events``.
    /// The handler must not wait on anything: the connection reads nothing until it returns.
    /// `nil` takes it away.
    func handleMessages(_ handler: (@Sendable (_ channel: String, _ payload: [UInt8]) -> Bool)?)
}

/// The subscriber that hears what `redis` publishes (see ``RedisCommands/pubSub``): sharded
/// channels through a ``RedisClusterSubscriber`` on a cluster client, else a
/// ``RedisSubscriber`` on a connection of its own to the same server, named `clientName` if
/// given. Run it beside `redis`.
public func makeRedisSubscriber(
    for redis: any RedisCommands,
    clientName: String? = nil,
    eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton,
    logger: Logger
) -> any RedisChannelSubscriber {
    if let router = redis as? RedisClusterClient {
        return RedisClusterSubscriber(router: router, eventLoopGroup: eventLoopGroup, logger: logger)
    }
    var configuration = redis.configuration
    if let clientName { configuration.clientName = clientName }
    return RedisSubscriber(configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
}

/// Runs the subscriber of `redis` (see ``makeRedisSubscriber(for:clientName:eventLoopGroup:logger:)``)
/// for the duration of `body`, which starts once channels can be subscribed.
public func withRedisSubscriber<Result: Sendable>(
    for redis: any RedisCommands,
    clientName: String? = nil,
    eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton,
    logger: Logger,
    _ body: (any RedisChannelSubscriber) async throws -> Result
) async throws -> Result {
    let subscriber = makeRedisSubscriber(for: redis, clientName: clientName, eventLoopGroup: eventLoopGroup, logger: logger)
    return try await subscriber.whileRunning { try await body(subscriber) }
}

extension RedisChannelSubscriber {
    /// Runs this subscriber for the duration of `body`, which starts once channels can be
    /// subscribed (``waitUntilConnected()``); shuts it down after.
    public func whileRunning<Result: Sendable>(_ body: () async throws -> Result) async throws -> Result {
        try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask { try await self.run() }
            defer {
                shutdown()
                group.cancelAll()
            }
            try await waitUntilConnected()
            return try await body()
        }
    }
}
