import NIOConcurrencyHelpers
import NIOCore

extension RedisClusterClient {
    /// Waits at most `timeout` for a continuation registered by `register` (which returns false
    /// when it resumed it at once); `expire` takes it back on timeout, with the error to throw.
    func wait<Value: Sendable>(
        timeout: Duration,
        register: (inout State, Int, CheckedContinuation<Value, any Error>) -> Bool,
        expire: @escaping @Sendable (inout State, Int) -> (CheckedContinuation<Value, any Error>?, RedisError)
    ) async throws(RedisError) -> Value {
        do {
            return try await withCheckedThrowingContinuation { continuation in
                let id: Int? = state.withLockedValue { state in
                    state.nextWaiterID += 1
                    return register(&state, state.nextWaiterID, continuation) ? state.nextWaiterID : nil
                }
                guard let id else { return }
                eventLoopGroup.any().scheduleTask(in: TimeAmount(timeout)) {
                    let (waiter, error) = self.state.withLockedValue { expire(&$0, id) }
                    waiter?.resume(throwing: error)
                }
            }
        } catch let error as RedisError {
            throw error
        } catch {
            throw RedisError(.unavailable, "waiting for the Redis cluster failed", underlying: error)
        }
    }

    /// Waits `delay` before a command is sent again, or less when `address` is given and a
    /// connection to it opens sooner: a command whose node was out of reach goes out the moment
    /// the node is back, not at the end of its backoff (a lease renewal asleep in a 400 ms
    /// backoff when the network came back could land after its lease ran out). A failed attempt
    /// to connect does not end the pause: where connects fail at once (a node refusing them),
    /// commands woken by each other's failures would retry in a busy loop. Never starts a
    /// connection itself.
    func pause(_ delay: Duration, orUntilConnected address: ClusterNodeAddress?) async {
        let end = ContinuousClock.now + delay
        if let address {
            do {
                _ = try await wait(timeout: delay) { (state, id, continuation: CheckedContinuation<RedisConnection, any Error>) in
                    if let connection = state.nodes[address]?.connection, connection.isActive {
                        continuation.resume(returning: connection)
                        return false
                    }
                    if state.shutdown {
                        continuation.resume(throwing: RedisError(.unavailable, "the Redis cluster client is shut down"))
                        return false
                    }
                    var node = state.nodes[address] ?? Node()
                    node.waiters[id] = continuation
                    state.nodes[address] = node
                    return true
                } expire: { state, id in
                    (state.nodes[address]?.waiters.removeValue(forKey: id), RedisError(.unavailable, "the pause before sending again ended"))
                }
                return
            } catch {
                // The pause ran out, or an attempt to connect failed: sleep out the rest.
            }
        }
        try? await Task.sleep(until: end)
    }

    /// Returns once a slot map is known, waiting at most until `deadline` or
    /// ``RedisConfiguration/waitForConnection``, whichever comes first.
    func waitForMap(until deadline: ContinuousClock.Instant) async throws(RedisError) {
        let timeout = min(configuration.waitForConnection, deadline - .now)
        try await wait(timeout: timeout) { (state, id, continuation: CheckedContinuation<Void, any Error>) in
            if state.map != nil {
                continuation.resume()
                return false
            }
            if state.shutdown {
                continuation.resume(throwing: RedisError(.unavailable, "the Redis cluster client is shut down"))
                return false
            }
            state.mapWaiters[id] = continuation
            return true
        } expire: { state, id in
            (
                state.mapWaiters.removeValue(forKey: id),
                RedisError(.unavailable, "the Redis cluster's slot map is not known yet: no node answered CLUSTER SHARDS", underlying: state.lastDiscoveryError)
            )
        }
    }

    /// The open connection to `address`, or one that opens in time.
    func connection(to address: ClusterNodeAddress, until deadline: ContinuousClock.Instant) async throws(RedisError) -> RedisConnection {
        let ready: RedisConnection? = state.withLockedValue { state in
            state.nodes[address]?.connection.flatMap { $0.isActive ? $0 : nil }
        }
        if let ready { return ready }
        let timeout = min(configuration.waitForConnection, deadline - .now)
        return try await wait(timeout: timeout) { (state, id, continuation: CheckedContinuation<RedisConnection, any Error>) in
            if state.shutdown {
                continuation.resume(throwing: RedisError(.unavailable, "the Redis cluster client is shut down"))
                return false
            }
            var node = state.nodes[address] ?? Node()
            defer { state.nodes[address] = node }
            if let connection = node.connection, connection.isActive {
                continuation.resume(returning: connection)
                return false
            }
            node.waiters[id] = continuation
            if !node.connecting {
                node.connecting = true
                workContinuation.yield(.connect(address))
            }
            return true
        } expire: { state, id in
            (
                state.nodes[address]?.waiters.removeValue(forKey: id),
                RedisError(.unavailable, "Redis cluster node \(address) is unreachable", underlying: state.nodes[address]?.lastError)
            )
        }
    }
}
