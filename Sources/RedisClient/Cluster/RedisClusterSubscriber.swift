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
    private let continuation: AsyncStream<RedisSubscriberEvent>.Continuation
    private let eventLoopGroup: any EventLoopGroup
    private let logger: Logger
    private let state = NIOLockedValueBox(State())
    /// New connections, for `run()` to watch.
    private let work: AsyncStream<Link>
    private let workContinuation: AsyncStream<Link>.Continuation
    /// Repair requests; holding at most one coalesces those made while a repair runs.
    private let repairs: AsyncStream<Void>
    private let repairContinuation: AsyncStream<Void>.Continuation
    /// Most `MOVED` answers to one SSUBSCRIBE followed before the slot is left to the repair.
    private static let maximumRedirections = 3

    /// One subscriber connection to one primary.
    private struct Link: Sendable {
        let id: Int
        let address: ClusterNodeAddress
        let connection: RedisConnection
        /// Messages received on it: what the keep-alive counts as life.
        let received: NIOLockedValueBox<Int>
    }

    private struct Slot {
        /// The channels of this slot someone wants.
        var wanted: Set<String> = []
        /// The connection the channels in `sent` were subscribed on.
        var link: Int?
        /// Channels named in an SSUBSCRIBE on `link` and not unsubscribed since.
        var sent: Set<String> = []
    }

    private struct State {
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

    private var configuration: RedisConfiguration { router.configuration }

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

    private func change(_ channels: [String], subscribing: Bool, update: (inout State) -> [String]) async throws(RedisError) {
        guard !channels.isEmpty else { return }
        // The wanted sets and the order of commands on each connection change under one lock, so
        // that a retain and a release of one channel from two tasks cannot cross over.
        let plan: (waits: [EventLoopFuture<RESPValue>], unlinked: Set<HashSlot>)? = state.withLockedValue { state in
            guard !state.shutdown else { return nil }
            let effective = update(&state)
            var waits: [EventLoopFuture<RESPValue>] = []
            var unlinked: Set<HashSlot> = []
            let bySlot = Dictionary(grouping: effective, by: { HashSlot(of: $0) })
            if subscribing {
                // Channels someone else wants already may still be on their way to Redis.
                waits = Set(channels).subtracting(effective).compactMap { state.confirming[$0] }
                for (slot, group) in bySlot {
                    state.slots[slot, default: Slot()].wanted.formUnion(group)
                    if let link = state.isActive(state.slots[slot]?.link) {
                        if let future = self.sendSubscribe(slot, group, on: link, state: &state) { waits.append(future) }
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
            return (waits, unlinked)
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

    // MARK: - Commands on subscriber connections

    /// Writes `requests` in order on `link`. All writes to a subscriber connection go through
    /// here, in the order of the state changes that made them (the lock is held), and always
    /// through the event loop's queue so that a failing write cannot call back into the lock.
    private static func write(_ requests: [RedisRequest], on link: Link) {
        let channel = link.connection.channel
        channel.eventLoop.execute {
            guard channel.isActive else {
                for request in requests { request.promise.fail(RedisError(.connectionClosed, "the subscriber connection to Redis is closed")) }
                return
            }
            for request in requests { channel.write(request, promise: nil) }
            channel.flush()
        }
    }

    private static func request(_ arguments: [RedisArgument], on link: Link, replies: Int, counting: RedisRequest.Counting) -> RedisRequest {
        let channel = link.connection.channel
        var buffer = channel.allocator.buffer(capacity: 64)
        RESPEncoder.encode(arguments, into: &buffer)
        return RedisRequest(encoded: buffer, expectedReplies: replies, promise: channel.eventLoop.makePromise(of: RESPValue.self), counting: counting)
    }

    /// SSUBSCRIBE for those of `channels` not yet sent on `link`; nil when there are none.
    private func sendSubscribe(_ slot: HashSlot, _ channels: some Sequence<String>, on link: Link, state: inout State) -> EventLoopFuture<RESPValue>? {
        let missing = Array(Set(channels).subtracting(state.slots[slot]?.sent ?? []))
        guard !missing.isEmpty else { return nil }
        let request = Self.request(["SSUBSCRIBE"] + missing.map { RedisArgument($0) }, on: link, replies: missing.count, counting: .confirmationsOrError)
        state.slots[slot, default: Slot()].link = link.id
        state.slots[slot, default: Slot()].sent.formUnion(missing)
        let future = request.promise.futureResult
        for channel in missing { state.confirming[channel] = future }
        future.whenComplete { [state = self.state] result in
            let refused = if case .success(.error) = result { true } else { false }
            state.withLockedValue { state in
                for channel in missing where state.confirming[channel] === future { state.confirming[channel] = nil }
                // Not subscribed after all (MOVED): whoever sent it decides what comes next.
                if refused, state.slots[slot]?.link == link.id {
                    state.slots[slot]?.sent.subtract(missing)
                }
            }
        }
        Self.write([request], on: link)
        return future
    }

    /// SUNSUBSCRIBE for those of `channels` sent on `link`, followed by a PING whose answer
    /// tells that Redis is done with it; nil when none was sent.
    private func sendUnsubscribe(_ slot: HashSlot, _ channels: some Sequence<String>, on link: Link, state: inout State) -> EventLoopFuture<RESPValue>? {
        let named = Array(Set(channels).intersection(state.slots[slot]?.sent ?? []))
        guard !named.isEmpty else { return nil }
        state.slots[slot]?.sent.subtract(named)
        for channel in named {
            state.unsubscribing[link.id, default: [:]][channel, default: 0] += 1
            state.confirming[channel] = nil
        }
        let unsubscribe = Self.request(["SUNSUBSCRIBE"] + named.map { RedisArgument($0) }, on: link, replies: 1, counting: .pushesOnly)
        let ping = Self.request(["PING"], on: link, replies: 1, counting: .replies)
        unsubscribe.promise.futureResult.whenComplete { [state = self.state] result in
            if case .success(.null) = result { return }
            // Refused or never answered: no sunsubscribe is coming for these channels.
            state.withLockedValue { state in
                for channel in named {
                    guard let expected = state.unsubscribing[link.id]?[channel] else { continue }
                    state.unsubscribing[link.id]?[channel] = expected > 1 ? expected - 1 : nil
                }
            }
        }
        Self.write([unsubscribe, ping], on: link)
        return unsubscribe.promise.futureResult
    }

    // MARK: - Finding primaries and subscribing slots

    /// Subscribes the wanted channels of `slots` at the primaries serving them now; returns the
    /// slots that failed, each with its error. Channels in ``State/lost`` that are subscribed
    /// again are announced.
    private func attach(_ slots: Set<HashSlot>) async -> [HashSlot: RedisError] {
        let probes: [(slot: HashSlot, channel: String)] = state.withLockedValue { state in
            slots.compactMap { slot in state.slots[slot]?.wanted.min().map { (slot, $0) } }
        }
        guard !probes.isEmpty else { return [:] }
        var failures: [HashSlot: RedisError] = [:]
        var targets: [HashSlot: ClusterNodeAddress] = [:]
        do {
            // The node that answers a read of the slot serves it: the router follows MOVED and
            // ASK, waits out a failover, and refreshes its slot map as it goes.
            let outcomes = try await router.pipelineWithNodes(probes.map { ["EXISTS", RedisArgument($0.channel)] })
            for (probe, outcome) in zip(probes, outcomes) {
                switch (outcome.result, outcome.node) {
                case (.success, .some(let node)):
                    targets[probe.slot] = node
                case (.failure(let error), _):
                    failures[probe.slot] = error
                case (.success, .none):
                    failures[probe.slot] = RedisError(.unavailable, "no primary serves hash slot \(probe.slot)")
                }
            }
        } catch {
            for probe in probes { failures[probe.slot] = error }
        }
        var announced: Set<String> = []
        for _ in 0...Self.maximumRedirections where !targets.isEmpty {
            let round = await subscribe(slots: targets)
            targets = [:]
            for (slot, outcome) in round {
                switch outcome {
                case .success(let channels):
                    announced.formUnion(channels)
                    failures[slot] = nil
                case .failure(let error):
                    failures[slot] = error
                    // Mid-migration the probe may have reached the importing node; the owner says where to go.
                    if error.serverErrorPrefix == "MOVED", let address = Self.redirection(error) { targets[slot] = address }
                }
            }
        }
        if !announced.isEmpty {
            continuation.yield(.resubscribed(channels: announced.sorted()))
        }
        return failures
    }

    /// The address of a `MOVED slot host:port` error.
    private static func redirection(_ error: RedisError) -> ClusterNodeAddress? {
        let parts = error.message.split(separator: " ")
        guard parts.count >= 3 else { return nil }
        return ClusterNodeAddress(redirection: parts[2], defaultHost: "127.0.0.1")
    }

    /// One SSUBSCRIBE per slot at the node given; each slot's outcome: the lost channels it
    /// brought back, or its error.
    private func subscribe(slots targets: [HashSlot: ClusterNodeAddress]) async -> [HashSlot: Result<Set<String>, RedisError>] {
        let byNode = Dictionary(grouping: targets.keys, by: { targets[$0]! })
        return await withTaskGroup(of: [HashSlot: Result<Set<String>, RedisError>].self) { group in
            for (node, slots) in byNode {
                group.addTask {
                    let link: Link
                    do throws(RedisError) {
                        link = try await self.link(to: node)
                    } catch {
                        return Dictionary(uniqueKeysWithValues: slots.map { ($0, .failure(error)) })
                    }
                    let futures: [(HashSlot, EventLoopFuture<RESPValue>?)] = self.state.withLockedValue { state in
                        slots.compactMap { slot in
                            guard let current = state.slots[slot], !current.wanted.isEmpty else { return nil }
                            if let other = state.isActive(current.link), other.id != link.id {
                                // Already subscribed elsewhere and not dropped: nothing to move.
                                return (slot, self.sendSubscribe(slot, current.wanted, on: other, state: &state))
                            }
                            if current.link != link.id {
                                state.slots[slot]?.link = link.id
                                state.slots[slot]?.sent = []
                            }
                            return (slot, self.sendSubscribe(slot, current.wanted, on: link, state: &state))
                        }
                    }
                    var outcomes: [HashSlot: Result<Set<String>, RedisError>] = [:]
                    for (slot, future) in futures {
                        var failure: RedisError?
                        if let future {
                            do {
                                if case .error(let message) = try await future.get() { failure = RedisError(.server, message) }
                            } catch {
                                failure = (error as? RedisError) ?? RedisError(.connectionClosed, "the subscriber connection failed", underlying: error)
                            }
                        }
                        if let failure {
                            outcomes[slot] = .failure(failure)
                            continue
                        }
                        outcomes[slot] = .success(self.state.withLockedValue { state in
                            let back = state.lost.intersection(state.slots[slot]?.sent ?? [])
                            state.lost.subtract(back)
                            return back
                        })
                    }
                    return outcomes
                }
            }
            var all: [HashSlot: Result<Set<String>, RedisError>] = [:]
            for await part in group { all.merge(part) { $1 } }
            return all
        }
    }

    // MARK: - Connections

    /// The open subscriber connection to `address`, opening it if needed; one per node.
    private func link(to address: ClusterNodeAddress) async throws(RedisError) -> Link {
        enum Step { case ready(Link), wait(EventLoopFuture<Link>), connect(EventLoopPromise<Link>, Int), stopped }
        let step: Step = state.withLockedValue { state in
            guard !state.shutdown else { return .stopped }
            if let link = state.links[address], link.connection.isActive { return .ready(link) }
            if let future = state.connecting[address] { return .wait(future) }
            let promise = eventLoopGroup.any().makePromise(of: Link.self)
            state.connecting[address] = promise.futureResult
            state.nextLinkID += 1
            return .connect(promise, state.nextLinkID)
        }
        switch step {
        case .stopped:
            throw RedisError(.unavailable, "the Redis cluster subscriber is shut down")
        case .ready(let link):
            return link
        case .wait(let future):
            do {
                return try await future.get()
            } catch {
                throw (error as? RedisError) ?? RedisError(.unavailable, "cannot connect to Redis cluster node \(address)", underlying: error)
            }
        case .connect(let promise, let id):
            do {
                let link = try await connect(to: address, id: id)
                promise.succeed(link)
                return link
            } catch {
                state.withLockedValue { $0.connecting[address] = nil }
                promise.fail(error)
                throw error
            }
        }
    }

    private func connect(to address: ClusterNodeAddress, id: Int) async throws(RedisError) -> Link {
        var nodeConfiguration = configuration
        nodeConfiguration.host = address.host
        nodeConfiguration.port = address.port
        let received = NIOLockedValueBox(0)
        let connection: RedisConnection
        do {
            connection = try await RedisConnection.connect(configuration: nodeConfiguration, eventLoopGroup: eventLoopGroup, logger: logger) { [weak self] push in
                received.withLockedValue { $0 &+= 1 }
                self?.handle(push, link: id, node: address)
            }
        } catch {
            throw RedisError(.unavailable, "cannot open a subscriber connection to Redis cluster node \(address)", underlying: error)
        }
        let link = Link(id: id, address: address, connection: connection, received: received)
        let installed = state.withLockedValue { state in
            state.connecting[address] = nil
            guard !state.shutdown else { return false }
            state.links[address] = link
            return true
        }
        guard installed else {
            await connection.close()
            throw RedisError(.unavailable, "the Redis cluster subscriber is shut down")
        }
        logger.debug("opened a subscriber connection to a Redis cluster node", metadata: ["redis.node": "\(address)"])
        workContinuation.yield(link)
        return link
    }

    /// A push from the connection `link`: a message, or a `sunsubscribe` that is either the
    /// answer to ours or Redis dropping the channel because its slot moved.
    private func handle(_ push: RedisPush, link: Int, node: ClusterNodeAddress) {
        switch push.kind {
        case .message:
            // A released channel's messages can still arrive until Redis has its SUNSUBSCRIBE.
            guard state.withLockedValue({ $0.references[push.channel] != nil }) else { return }
            continuation.yield(.message(channel: push.channel, payload: push.payload))
        case .shardUnsubscribed:
            let dropped: Int? = state.withLockedValue { state in
                if let expected = state.unsubscribing[link]?[push.channel] {
                    state.unsubscribing[link]?[push.channel] = expected > 1 ? expected - 1 : nil
                    return nil
                }
                let slot = HashSlot(of: push.channel)
                guard let current = state.slots[slot], current.link == link, current.sent.contains(push.channel) else { return nil }
                // Redis drops every channel of a slot it no longer serves, one push each; the
                // first one sends the whole slot to be subscribed again.
                state.slots[slot]?.link = nil
                state.slots[slot]?.sent = []
                guard !current.wanted.isEmpty else { return nil }
                state.lost.formUnion(current.wanted)
                state.dirty.insert(slot)
                return slot.value
            }
            guard let slot = dropped else { return }
            logger.info("Redis dropped shard channels after their slot moved; subscribing them at the new primary", metadata: [
                "redis.node": "\(node)", "redis.slot": "\(slot)",
            ])
            requestRepair()
        }
    }

    /// Keeps `link` alive until it closes, then sends its slots to be subscribed elsewhere.
    private func watch(_ link: Link) async {
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await self.keepAlive(link) }
            await link.connection.closed()
            group.cancelAll()
        }
        let (orphaned, shutdown): (Int, Bool) = state.withLockedValue { state in
            if state.links[link.address]?.id == link.id { state.links[link.address] = nil }
            state.unsubscribing[link.id] = nil
            var orphaned = 0
            for (slot, current) in state.slots where current.link == link.id {
                state.slots[slot]?.link = nil
                state.slots[slot]?.sent = []
                guard !current.wanted.isEmpty else { continue }
                state.lost.formUnion(current.wanted)
                state.dirty.insert(slot)
                orphaned += 1
            }
            return (orphaned, state.shutdown)
        }
        guard !shutdown, orphaned > 0 else { return }
        logger.warning("lost a subscriber connection to a Redis cluster primary; subscribing its channels again", metadata: [
            "redis.node": "\(link.address)", "redis.slots": "\(orphaned)",
        ])
        continuation.yield(.disconnected)
        requestRepair()
    }

    /// PINGs `link` every ``RedisConfiguration/subscriberPingInterval`` and closes it when, for
    /// ``RedisConfiguration/commandTimeout``, neither the answer nor any message came (as
    /// ``RedisSubscriber`` does): a connection that died without a FIN is noticed, and a busy
    /// one whose answer waits behind messages is not dropped.
    private func keepAlive(_ link: Link) async {
        let interval = configuration.subscriberPingInterval
        let silence = configuration.commandTimeout
        while link.connection.isActive {
            guard (try? await Task.sleep(for: interval)) != nil else { return }
            let ping = Self.request(["PING"], on: link, replies: 1, counting: .replies)
            Self.write([ping], on: link)
            let answered = await withTaskGroup(of: Bool.self) { group in
                group.addTask { (try? await ping.promise.futureResult.get()) != nil }
                group.addTask {
                    while true {
                        let before = link.received.withLockedValue { $0 }
                        guard (try? await Task.sleep(for: silence)) != nil else { return true }
                        if link.received.withLockedValue({ $0 }) == before { return false }
                    }
                }
                let first = await group.next() ?? false
                group.cancelAll()
                return first
            }
            guard answered else {
                if !Task.isCancelled {
                    logger.warning("a subscriber connection did not answer PING; making a new one", metadata: ["redis.node": "\(link.address)"])
                }
                await link.connection.close()
                return
            }
        }
    }

    // MARK: - Running

    private func requestRepair() {
        repairContinuation.yield()
    }

    /// Subscribes the dirty slots at their current primaries, one round per request, with
    /// backoff while some fail.
    private func repairWhenAsked() async {
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
            await withTaskGroup(of: Void.self) { group in
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
