import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix

/// Subscribing and unsubscribing a slot's channels at the primary that serves it.
extension RedisClusterSubscriber {
    // MARK: - Commands on subscriber connections

    /// Writes `requests` in order on `link`. All writes to a subscriber connection go through
    /// here, in the order of the state changes that made them (the lock is held), and always
    /// through the event loop's queue so that a failing write cannot call back into the lock.
    static func write(_ requests: [RedisRequest], on link: Link) {
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

    static func request(_ arguments: [RedisArgument], on link: Link, replies: Int, counting: RedisRequest.Counting) -> RedisRequest {
        let channel = link.connection.channel
        var buffer = channel.allocator.buffer(capacity: 64)
        RESPEncoder.encode(arguments, into: &buffer)
        return RedisRequest(encoded: buffer, expectedReplies: replies, promise: channel.eventLoop.makePromise(of: RESPValue.self), counting: counting)
    }

    /// SSUBSCRIBE for those of `channels` not yet sent on `link`; nil when there are none.
    func sendSubscribe(_ slot: HashSlot, _ channels: some Sequence<String>, on link: Link, state: inout State) -> EventLoopFuture<RESPValue>? {
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
                // Not subscribed after all (MOVED): whoever sent it decides what comes next. A
                // link left with nothing of the slot is not the slot's link any more: kept, every
                // later subscribe of the slot would go to the node that refused it, for good.
                if refused, state.slots[slot]?.link == link.id {
                    state.slots[slot]?.sent.subtract(missing)
                    if state.slots[slot]?.sent.isEmpty == true { state.slots[slot]?.link = nil }
                }
            }
        }
        Self.write([request], on: link)
        return future
    }

    /// SUNSUBSCRIBE for those of `channels` sent on `link`, followed by a PING whose answer
    /// tells that Redis is done with it; nil when none was sent.
    func sendUnsubscribe(_ slot: HashSlot, _ channels: some Sequence<String>, on link: Link, state: inout State) -> EventLoopFuture<RESPValue>? {
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
    func attach(_ slots: Set<HashSlot>) async -> [HashSlot: RedisError] {
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
    static func redirection(_ error: RedisError) -> ClusterNodeAddress? {
        let parts = error.message.split(separator: " ")
        guard parts.count >= 3 else { return nil }
        return ClusterNodeAddress(redirection: parts[2], defaultHost: "127.0.0.1")
    }

    /// One SSUBSCRIBE per slot at the node given; each slot's outcome: the lost channels it
    /// brought back, or its error.
    func subscribe(slots targets: [HashSlot: ClusterNodeAddress]) async -> [HashSlot: Result<Set<String>, RedisError>] {
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
}
