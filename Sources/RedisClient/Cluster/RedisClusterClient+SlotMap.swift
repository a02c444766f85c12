import Logging
import NIOConcurrencyHelpers
import NIOCore

/// The slot map: reading it from the cluster, keeping it current, and installing it.
extension RedisClusterClient {
    /// Asks for a full refresh of the slot map; requests made while one runs share the next.
    func requestRefresh() {
        refreshContinuation.yield()
    }

    func refreshPeriodically() async {
        while !Task.isCancelled {
            do {
                try await Task.sleep(for: refreshInterval)
            } catch {
                return
            }
            requestRefresh()
        }
    }

    /// Runs one refresh per request, one at a time. A map that did not change slows the next
    /// refresh down (100 ms doubling to 400 ms), so a storm of redirections or a node that stays
    /// dead does not turn into a storm of `CLUSTER SHARDS`.
    func refreshWhenAsked() async {
        var unchanged = 0
        var failures = 0
        for await _ in refreshRequests {
            let pause: Duration
            switch await discover() {
            case .success(let map):
                failures = 0
                unchanged = install(map) ? 0 : unchanged + 1
                pause = .milliseconds(100) * (1 << min(unchanged, 2))
            case .failure(let error):
                let known = state.withLockedValue { state in
                    state.lastDiscoveryError = error
                    return state.map != nil
                }
                logger.log(
                    level: failures == 0 ? .warning : .debug,
                    "cannot read the Redis cluster's slot map",
                    metadata: ["error": "\(error)"]
                )
                pause = Backoff(minimum: configuration.minimumBackoff, maximum: configuration.maximumBackoff).delay(attempt: failures)
                failures += 1
                // Until a map is known, keep trying on our own; afterwards commands and the
                // periodic refresh ask when needed.
                if !known { requestRefresh() }
            }
            do {
                try await Task.sleep(for: pause)
            } catch {
                return
            }
        }
    }

    /// Reads the slot map from up to ``discoveryFanOut`` nodes at once (known primaries first,
    /// then the seeds) and keeps an answer where every slot has a healthy primary, else the most
    /// complete one. Asks the next nodes only when none answered.
    func discover() async -> Result<ClusterSlotMap, RedisError> {
        let known = state.withLockedValue { $0.map?.primaries ?? [] }.shuffled()
        var candidates: [ClusterNodeAddress] = []
        for address in known + seeds where !candidates.contains(address) { candidates.append(address) }
        var lastError = RedisError(.unavailable, "no Redis cluster node to ask for the slot map")
        var start = 0
        while start < candidates.count {
            let batch = candidates[start..<min(start + Self.discoveryFanOut, candidates.count)]
            start = batch.endIndex
            var best: ClusterSlotMap?
            await withTaskGroup(of: Result<ClusterSlotMap, RedisError>.self) { group in
                for address in batch {
                    group.addTask { await self.askSlotMap(address) }
                }
                for await answer in group {
                    switch answer {
                    case .success(let map):
                        if best.map({ ($0.healthySlots, $0.coveredSlots) < (map.healthySlots, map.coveredSlots) }) ?? true {
                            best = map
                        }
                    case .failure(let error):
                        lastError = error
                    }
                }
            }
            if let best { return .success(best) }
        }
        return .failure(lastError)
    }

    /// `CLUSTER SHARDS` from one node, on its open connection or a short-lived one.
    func askSlotMap(_ address: ClusterNodeAddress) async -> Result<ClusterSlotMap, RedisError> {
        let open = state.withLockedValue { state in
            state.nodes[address]?.connection.flatMap { $0.isActive ? $0 : nil }
        }
        do {
            let reply: RESPValue
            if let open {
                reply = try await open.send(["CLUSTER", "SHARDS"])
            } else {
                let connection = try await RedisConnection.connect(configuration: nodeConfiguration(address), eventLoopGroup: eventLoopGroup, logger: logger)
                defer { connection.channel.close(promise: nil) }
                reply = try await connection.send(["CLUSTER", "SHARDS"])
            }
            let map = try ClusterSlotMap.parse(shards: reply, tls: configuration.tls != nil, fallbackHost: address.host)
            guard map.coveredSlots > 0 else {
                return .failure(RedisError(.unavailable, "Redis cluster node \(address) knows no slot owners yet"))
            }
            return .success(map)
        } catch {
            return .failure(RedisError(error.code, "cannot read the slot map from Redis cluster node \(address): \(error.message)", underlying: error.underlying))
        }
    }

    /// Makes `map` current: wakes the commands waiting for one, closes connections to nodes that
    /// are no longer primaries and opens those to new ones. Returns whether any slot changed.
    @discardableResult
    func install(_ map: ClusterSlotMap) -> Bool {
        let primaries = Set(map.primaries)
        let (changed, waiters, retired, missing) = state.withLockedValue { state in
            let changed = state.map.map { !$0.sameAssignment(as: map) } ?? true
            state.map = map
            state.lastDiscoveryError = nil
            let waiters = Array(state.mapWaiters.values)
            state.mapWaiters = [:]
            var retired: [RedisConnection] = []
            for (address, node) in state.nodes where !primaries.contains(address) {
                if let connection = node.connection { retired.append(connection) }
                state.nodes[address]?.connection = nil
                if node.waiters.isEmpty, !node.connecting { state.nodes[address] = nil }
            }
            let missing = primaries.filter { address in
                let node = state.nodes[address]
                return !(node?.connecting ?? false) && !(node?.connection?.isActive ?? false)
            }
            return (changed, waiters, retired, missing)
        }
        if changed {
            logger.info("Redis cluster slot map", metadata: [
                "redis.primaries": "\(map.primaries.map(\.description).joined(separator: ","))",
                "redis.slots_covered": "\(map.coveredSlots)",
            ])
        }
        for waiter in waiters { waiter.resume() }
        for connection in retired { workContinuation.yield(.retire(connection)) }
        for address in missing { requestConnection(to: address) }
        return changed
    }
}
