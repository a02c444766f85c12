import Logging
import NIOConcurrencyHelpers
import RedisClient
import ServiceLifecycle

/// Keeps this node's lease and its keys, in two loops that never wait for each other.
///
/// The lease loop, before taking the lease, refuses to run beside live nodes of another pub/sub
/// (``PubSubMismatch``); then renews it every third of the lease TTL, on a fixed schedule from
/// the moment the last renewal was sent (never a period after the work of a tick), tries a failed
/// renewal again 200 ms later, registers every session again when it finds the lease gone
/// (resuming on the next tick if that was cut short), and gives the lease up on graceful
/// shutdown.
///
/// The upkeep loop, on the same period once the lease is taken, sends the disconnects and
/// statuses Redis could not take yet, refreshes the safety TTL of the devices, and audits the
/// devices the node's sessions hold: some every ``PresenceConfiguration/auditInterval``, all of
/// them after a reconnect of either Redis connection and a renewal period after a loss was found
/// (``PresenceEngine/requestAudit(after:)``). However long an audit takes (a big node, a Redis
/// that stalls it), the next renewal is not held up: a renewal that waited behind one came late,
/// and a cut of the network then let the lease lapse within the bound a cut must stay under.
public struct PresenceLeaseService: Service {
    let engine: PresenceEngine

    /// A lease service for `engine`.
    public init(engine: PresenceEngine) { self.engine = engine }

    /// How soon a renewal that failed is tried again.
    static let retryAfterFailure = Duration.milliseconds(200)

    public func run() async throws {
        // A connection made again may lead to a new primary that missed the last writes.
        let observer = engine.redis.addConnectionObserver { [engine] event in
            if case .connected(reconnect: true) = event { engine.requestAudit() }
        }
        defer { engine.redis.removeConnectionObserver(observer) }
        try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask { await keepUp() }
            group.addTask { await writeDeliveredTogether() }
            do {
                try await keepLease()
            } catch {
                group.cancelAll()
                throw error
            }
            group.cancelAll()
        }
        // What the sessions said last, before the lease goes.
        await engine.flushDelivered()
        do {
            try await engine.deregisterNode()
        } catch {
            engine.logger.warning("cannot give up the lease", metadata: ["error": "\(error)"])
        }
    }

    private var period: Duration { engine.configuration.leaseTTL / 3 }

    /// Takes the lease, then renews it every period until graceful shutdown.
    private func keepLease() async throws {
        var registered = false
        var failures = 0
        while !Task.isShuttingDownGracefully, !Task.isCancelled {
            let started = ContinuousClock.now
            do {
                if !registered {
                    try await engine.checkPubSubAgreement()
                    try await engine.reapPredecessor()
                    try await engine.registerNode()
                    registered = true
                } else if try await !engine.renewLease() {
                    engine.logger.warning("this node's lease was gone; registering its sessions again", metadata: ["presence.node_id": "\(engine.configuration.nodeID)"])
                    try await engine.reregister()
                } else if engine.restoreOwed {
                    try await engine.restorePending()
                }
                // Redis restarted or failed over since the last renewal: it may have gone back in
                // time, and holds devices of sessions this node no longer has.
                if registered, engine.takeNewLife() {
                    do {
                        try await engine.settleNewLife()
                    } catch {
                        engine.noteNewLife()
                        throw error
                    }
                }
                failures = 0
            } catch let mismatch as PubSubMismatch {
                // Not a node that can serve: ends the node's services (and so the process).
                engine.logger.error("refusing to start", metadata: ["error": "\(mismatch)"])
                throw mismatch
            } catch {
                failures += 1
                // Said once per outage, then every 20th try.
                let level: Logger.Level = failures % 20 == 1 ? .warning : .debug
                engine.logger.log(level: level, "cannot renew the lease", metadata: ["error": "\(error)", "presence.attempts": "\(failures)"])
            }
            // After a failure, tried again soon (on a fresh connection once the stalled one is
            // dropped): a renewal that waits a whole period may come after the lease ran out.
            let next = failures > 0 ? ContinuousClock.now + min(period, Self.retryAfterFailure) : started + period
            try? await cancelWhenGracefulShutdown { try await Task.sleep(until: next) }
        }
    }

    /// Writes the `delivered` moves of large conversations once a second
    /// (``PresenceEngine/flushDelivered()``), until shutdown.
    private func writeDeliveredTogether() async {
        while !Task.isShuttingDownGracefully, !Task.isCancelled {
            try? await cancelWhenGracefulShutdown { try await Task.sleep(for: PresenceEngine.deliveredFlushInterval) }
            await engine.flushDelivered()
        }
    }

    /// Once the lease is taken: every period, what Redis could not take yet (disconnects, statuses,
    /// deadline entries) is sent again, the devices' safety TTL is refreshed every third of it,
    /// and devices are audited.
    private func keepUp() async {
        let refreshEvery = max(1, Int(engine.configuration.deviceKeyTTL / 3 / period))
        let auditEvery = max(1, Int(engine.configuration.auditInterval / period))
        var tick = 0
        while !Task.isShuttingDownGracefully, !Task.isCancelled {
            let started = ContinuousClock.now
            if engine.isRegistered {
                tick += 1
                await engine.retryPendingReleases()
                await engine.retryPendingIndexEntries()
                await engine.retryOwedStatuses()
                do {
                    if tick % refreshEvery == 0 { try await engine.refreshDeviceKeys() }
                    if engine.takeAuditRequest() {
                        try await engine.audit()
                    } else if tick % auditEvery == 0 {
                        try await engine.audit(all: false)
                    }
                } catch {
                    engine.logger.warning("cannot keep the node's keys (audit, refresh)", metadata: ["error": "\(error)"])
                }
            }
            try? await cancelWhenGracefulShutdown { try await Task.sleep(until: started + period) }
        }
    }
}

/// Runs the reaper on a fixed interval (at most a second), on every node.
public struct PresenceReaperService: Service {
    let engine: PresenceEngine

    /// A reaper for `engine`.
    public init(engine: PresenceEngine) { self.engine = engine }

    public func run() async throws {
        while !Task.isShuttingDownGracefully, !Task.isCancelled {
            do {
                var report = try await engine.reapOnce()
                // A full page means more is due: keep going without waiting.
                while report.expiredDevices >= 500 { report = try await engine.reapOnce() }
            } catch {
                engine.logger.debug("reaper pass failed", metadata: ["error": "\(error)"])
            }
            try? await cancelWhenGracefulShutdown { try await Task.sleep(for: engine.configuration.reaperInterval) }
        }
    }
}
