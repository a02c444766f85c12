import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix

/// The subscriber connections: one per primary, their pushes and their keep-alive.
extension RedisClusterSubscriber {
    // MARK: - Connections

    /// The open subscriber connection to `address`, opening it if needed; one per node.
    func link(to address: ClusterNodeAddress) async throws(RedisError) -> Link {
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

    func connect(to address: ClusterNodeAddress, id: Int) async throws(RedisError) -> Link {
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
    func handle(_ push: RedisPush, link: Int, node: ClusterNodeAddress) {
        switch push.kind {
        case .message:
            // A released channel's messages can still arrive until Redis has its SUNSUBSCRIBE.
            guard state.withLockedValue({ $0.references[push.channel] != nil }) else { return }
            outlet.deliver(channel: push.channel, payload: push.payload)
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
    func watch(_ link: Link) async {
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
    func keepAlive(_ link: Link) async {
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
}
