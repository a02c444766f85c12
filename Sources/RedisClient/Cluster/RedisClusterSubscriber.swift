import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import ServiceLifecycle

/// Sharded pub/sub (SSUBSCRIBE) over a Redis Cluster, with one subscriber connection per primary
/// that serves a wanted channel's slot.
///
/// It is built on a running ``RedisClusterClient``, the router, which it asks where a slot is
/// served: a probe (`EXISTS channel`, read only) sent through the router reaches the slot's
/// primary after following its redirections and waiting out a failover, and refreshes the
/// router's slot map on the way. Channels are grouped by slot and each slot is subscribed with
/// its own SSUBSCRIBE, so a command never names two slots (`CROSSSLOT`).
///
/// The wanted channels live here, counted (``retain(_:)``, ``release(_:)``) or not
/// (``subscribe(_:)``, ``unsubscribe(_:)``). When Redis drops channels by itself (an unasked
/// `sunsubscribe` after their slot moved) or a connection is lost, their slots are subscribed
/// again at their current primaries, with backoff until that works, and ``events`` announces
/// them with ``RedisSubscriberEvent/resubscribed(channels:)``. Each connection is probed
/// with PING every ``RedisConfiguration/subscriberPingInterval`` of the router's configuration
/// and closed when neither the answer nor any message came within
/// ``RedisConfiguration/commandTimeout``.
///
/// Run it as a `Service` (or inside ``withSubscriber(router:eventLoopGroup:logger:_:)``) beside
/// the router's own `run()`.
public final class RedisClusterSubscriber: RedisChannelSubscriber {
    /// The router that says which primary serves a slot.
    public let router: RedisClusterClient
    /// Messages and connection changes, in order; finishes when `run()` returns.
    public let events: AsyncStream<RedisSubscriberEvent>
    let continuation: AsyncStream<RedisSubscriberEvent>.Continuation
    let outlet: MessageOutlet
    let eventLoopGroup: any EventLoopGroup
    let logger: Logger
    let state = NIOLockedValueBox(State())
    /// New connections, for `run()` to watch.
    let work: AsyncStream<Link>
    let workContinuation: AsyncStream<Link>.Continuation
    /// Repair requests; holding at most one coalesces those made while a repair runs.
    let repairs: AsyncStream<Void>
    let repairContinuation: AsyncStream<Void>.Continuation
    /// Most `MOVED` answers to one SSUBSCRIBE followed before the slot is left to the repair.
    static let maximumRedirections = 3

    /// One subscriber connection to one primary.
    struct Link: Sendable {
        let id: Int
        let address: ClusterNodeAddress
        let connection: RedisConnection
        /// Messages received on it: what the keep-alive counts as life.
        let received: NIOLockedValueBox<Int>
    }

    struct Slot {
        /// The channels of this slot someone wants.
        var wanted: Set<String> = []
        /// The connection the channels in `sent` were subscribed on.
        var link: Int?
        /// Channels named in an SSUBSCRIBE on `link` and not unsubscribed since.
        var sent: Set<String> = []
    }

    struct State {
        var references: [String: Int] = [:]
        var slots: [HashSlot: Slot] = [:]
        var links: [ClusterNodeAddress: Link] = [:]
        var connecting: [ClusterNodeAddress: EventLoopFuture<Link>] = [:]
        /// SUNSUBSCRIBE answers still to come, by connection and channel: they are ours, not Redis
        /// dropping a channel.
        var unsubscribing: [Int: [String: Int]] = [:]
        /// SSUBSCRIBEs sent and not yet confirmed, by channel: a second user waits for them too.
        var confirming: [String: EventLoopFuture<RESPValue>] = [:]
        /// Slots to subscribe again at their current primary.
        var dirty: Set<HashSlot> = []
        /// Channels that may have missed messages, announced once they are subscribed again.
        var lost: Set<String> = []
        var nextLinkID = 0
        var running = false
        var shutdown = false

        func isActive(_ id: Int?) -> Link? {
            guard let id else { return nil }
            return links.values.first { $0.id == id && $0.connection.isActive }
        }
    }

    /// Makes a subscriber on `router`; it connects as channels are wanted, once `run()` starts.
    public init(router: RedisClusterClient, eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton, logger: Logger) {
        self.router = router
        self.eventLoopGroup = eventLoopGroup
        self.logger = logger
        (events, continuation) = AsyncStream.makeStream(of: RedisSubscriberEvent.self)
        outlet = MessageOutlet(continuation)
        (work, workContinuation) = AsyncStream.makeStream(of: Link.self)
        (repairs, repairContinuation) = AsyncStream.makeStream(of: Void.self, bufferingPolicy: .bufferingNewest(1))
    }

    /// Runs a subscriber on `router` for the duration of `body`.
    public static func withSubscriber<Result: Sendable>(
        router: RedisClusterClient,
        eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton,
        logger: Logger,
        _ body: (RedisClusterSubscriber) async throws -> Result
    ) async throws -> Result {
        let subscriber = RedisClusterSubscriber(router: router, eventLoopGroup: eventLoopGroup, logger: logger)
        return try await subscriber.whileRunning { try await body(subscriber) }
    }

    var configuration: RedisConfiguration { router.configuration }

    // MARK: - State seen from outside

    /// The channels this subscriber wants, whether or not they are subscribed right now.
    public var channels: Set<String> {
        state.withLockedValue { Set($0.references.keys) }
    }

    /// Returns at once: a connection to a primary opens when one of its slots' channels is first
    /// wanted, and ``subscribe(_:)`` waits for it.
    public func waitUntilConnected() async throws {}

    /// Whether the router can serve commands: the slots of a primary that is failing over are
    /// subscribed again on their own once its replica serves them.
    public var isAvailable: Bool { router.isAvailable }

    /// Whether every wanted channel is subscribed on an open connection.
    public var isConnected: Bool {
        state.withLockedValue { state in
            guard state.dirty.isEmpty else { return false }
            return state.slots.values.allSatisfy { slot in
                slot.wanted.isEmpty || (state.isActive(slot.link) != nil && slot.wanted.isSubset(of: slot.sent))
            }
        }
    }

    // MARK: - Changing the wanted channels

    /// Adds channels (not counted: one unsubscribe removes them) and waits until Redis confirms them.
    ///
    /// The channels are wanted from this call on: when their primary cannot be reached this
    /// throws, and they are subscribed as soon as it can, announced by
    /// ``RedisSubscriberEvent/resubscribed(channels:)``.
    public func subscribe(_ channels: [String]) async throws(RedisError) {
        try await change(channels, subscribing: true) { state in
            let added = Set(channels).filter { state.references[$0] == nil }
            for channel in added { state.references[channel] = 1 }
            return Array(added)
        }
    }

    /// Removes channels; no message of theirs is delivered once this returns.
    public func unsubscribe(_ channels: [String]) async throws(RedisError) {
        try await change(channels, subscribing: false) { state in
            let removed = Set(channels).filter { state.references[$0] != nil }
            for channel in removed { state.references[channel] = nil }
            return Array(removed)
        }
    }

    /// Counts one more user of each channel, subscribing those that had none; waits for Redis.
    ///
    /// Throws as ``subscribe(_:)`` does; the count stands either way.
    public func retain(_ channels: [String]) async throws(RedisError) {
        try await change(channels, subscribing: true) { state in
            var added: [String] = []
            for channel in channels {
                state.references[channel, default: 0] += 1
                if state.references[channel] == 1 { added.append(channel) }
            }
            return added
        }
    }

    /// Counts one user less of each channel, unsubscribing those that have none left.
    public func release(_ channels: [String]) async throws(RedisError) {
        try await change(channels, subscribing: false) { state in
            var removed: [String] = []
            for channel in channels {
                guard let count = state.references[channel] else { continue }
                if count <= 1 {
                    state.references[channel] = nil
                    removed.append(channel)
                } else {
                    state.references[channel] = count - 1
                }
            }
            return removed
        }
    }

    func change(_ channels: [String], subscribing: Bool, update: (inout State) -> [String]) async throws(RedisError) {
        guard !channels.isEmpty else { return }
        // The wanted sets and the order of commands on each connection change under one lock, so
        // that a retain and a release of one channel from two tasks cannot cross over.
        let plan: (waits: [EventLoopFuture<RESPValue>], sent: [(HashSlot, EventLoopFuture<RESPValue>)], unlinked: Set<HashSlot>)? = state.withLockedValue { state in
            guard !state.shutdown else { return nil }
            let effective = update(&state)
            var waits: [EventLoopFuture<RESPValue>] = []
            var sent: [(HashSlot, EventLoopFuture<RESPValue>)] = []
            var unlinked: Set<HashSlot> = []
            let bySlot = Dictionary(grouping: effective, by: { HashSlot(of: $0) })
            if subscribing {
                // Channels someone else wants already may still be on their way to Redis.
                waits = Set(channels).subtracting(effective).compactMap { state.confirming[$0] }
                for (slot, group) in bySlot {
                    state.slots[slot, default: Slot()].wanted.formUnion(group)
                    if let link = state.isActive(state.slots[slot]?.link) {
                        if let future = self.sendSubscribe(slot, group, on: link, state: &state) { sent.append((slot, future)) }
                    } else {
                        unlinked.insert(slot)
                    }
                }
            } else {
                state.lost.subtract(effective)
                for (slot, group) in bySlot {
                    state.slots[slot]?.wanted.subtract(group)
                    if let link = state.isActive(state.slots[slot]?.link) {
                        if let future = self.sendUnsubscribe(slot, group, on: link, state: &state) { waits.append(future) }
                    }
                    if let remaining = state.slots[slot], remaining.wanted.isEmpty, remaining.sent.isEmpty { state.slots[slot] = nil }
                }
            }
            return (waits, sent, unlinked)
        }
        guard let plan else {
            throw RedisError(.unavailable, "the Redis cluster subscriber is shut down")
        }
        var failure: RedisError?
        if !plan.unlinked.isEmpty {
            let failures = await attach(plan.unlinked)
            if !failures.isEmpty {
                state.withLockedValue { state in
                    for slot in failures.keys {
                        guard let wanted = state.slots[slot]?.wanted, !wanted.isEmpty else { continue }
                        state.dirty.insert(slot)
                        state.lost.formUnion(wanted)
                    }
                }
                requestRepair()
                failure = RedisError(
                    .unavailable,
                    "\(failures.count) of \(plan.unlinked.count) hash slots could not be subscribed yet; they are subscribed when their primary answers",
                    underlying: failures.values.first
                )
            }
        }
        // Refused at the slot's link (the slot moved away and nothing of it was left there to be
        // dropped): the slot is subscribed again where it is served now, as after a drop.
        var refused: Set<HashSlot> = []
        for (slot, future) in plan.sent {
            do {
                if case .error(let message) = try await future.get() {
                    refused.insert(slot)
                    if failure == nil { failure = RedisError(.server, message) }
                }
            } catch {
                refused.insert(slot)
                if failure == nil { failure = (error as? RedisError) ?? RedisError(.connectionClosed, "the subscriber connection failed", underlying: error) }
            }
        }
        if !refused.isEmpty {
            state.withLockedValue { state in
                for slot in refused {
                    guard let wanted = state.slots[slot]?.wanted, !wanted.isEmpty else { continue }
                    state.dirty.insert(slot)
                    state.lost.formUnion(wanted)
                }
            }
            requestRepair()
        }
        for future in plan.waits {
            do {
                let reply = try await future.get()
                if subscribing, case .error(let message) = reply, failure == nil { failure = RedisError(.server, message) }
            } catch {
                if subscribing, failure == nil {
                    failure = (error as? RedisError) ?? RedisError(.connectionClosed, "the subscriber connection failed", underlying: error)
                }
            }
        }
        if let failure { throw failure }
    }

    // MARK: - Running

    func requestRepair() {
        repairContinuation.yield()
    }

    /// Subscribes the dirty slots at their current primaries, one round per request, with
    /// backoff while some fail.
    func repairWhenAsked() async {
        let backoff = Backoff(minimum: configuration.minimumBackoff, maximum: configuration.maximumBackoff)
        var attempt = 0
        for await _ in repairs {
            let slots = state.withLockedValue { state in
                defer { state.dirty = [] }
                return state.dirty
            }
            guard !slots.isEmpty else { continue }
            let failures = await attach(slots)
            let stillWanted = state.withLockedValue { state in
                var count = 0
                for slot in failures.keys where !(state.slots[slot]?.wanted.isEmpty ?? true) {
                    state.dirty.insert(slot)
                    count += 1
                }
                return count
            }
            guard stillWanted > 0 else {
                attempt = 0
                continue
            }
            logger.log(level: attempt == 0 ? .warning : .debug, "cannot subscribe shard channels again yet; retrying", metadata: [
                "redis.slots": "\(stillWanted)", "error": "\(failures.values.first.map { "\($0)" } ?? "")",
            ])
            guard (try? await Task.sleep(for: backoff.delay(attempt: attempt))) != nil else { return }
            attempt += 1
            requestRepair()
        }
    }

    /// Watches connections and repairs subscriptions until cancelled or shut down gracefully.
    public func run() async throws {
        let alreadyRunning = state.withLockedValue { state in
            defer { state.running = true }
            return state.running
        }
        guard !alreadyRunning else {
            throw RedisError(.unavailable, "this Redis cluster subscriber is already running")
        }
        await withGracefulShutdownHandler {
            // Discarding, so that each connection's finished watch is given back at once (see
            // ``RedisClusterClient/run()``).
            await withDiscardingTaskGroup { group in
                group.addTask { await self.repairWhenAsked() }
                // Ends at shutdown, or when this task is cancelled.
                for await link in self.work {
                    group.addTask { await self.watch(link) }
                }
                self.shutdown()
                group.cancelAll()
            }
        } onGracefulShutdown: {
            self.shutdown()
        }
        shutdown()
        continuation.finish()
    }

    public func handleMessages(_ handler: (@Sendable (_ channel: String, _ payload: [UInt8]) -> Bool)?) {
        outlet.set(handler)
    }

    /// Stops the subscriber and closes its connections; later changes throw.
    public func shutdown() {
        let links = state.withLockedValue { state in
            state.shutdown = true
            defer { state.links = [:] }
            return Array(state.links.values)
        }
        workContinuation.finish()
        repairContinuation.finish()
        for link in links { link.connection.channel.close(promise: nil) }
    }
}
