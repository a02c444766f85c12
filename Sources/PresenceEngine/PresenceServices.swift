import Logging
import RedisClient
import ServiceLifecycle

/// Keeps this node's lease: before taking it, refuses to run beside live nodes of another
/// pub/sub (``PubSubMismatch``); renews it every third of the lease TTL, registers every session
/// again when it finds the lease gone (resuming on the next tick if that was cut short), audits
/// the devices its sessions hold every ``PresenceConfiguration/auditInterval``, after every
/// reconnect of either Redis connection and on the tick after a loss was found, and gives the
/// lease up on graceful shutdown.
public struct PresenceLeaseService: Service {
    let engine: PresenceEngine

    /// A lease service for `engine`.
    public init(engine: PresenceEngine) { self.engine = engine }

    /// How soon a renewal that failed is tried again.
    static let retryAfterFailure = Duration.milliseconds(200)

    public func run() async throws {
        let interval = engine.configuration.leaseTTL / 3
        let refreshEvery = max(1, Int(engine.configuration.deviceKeyTTL.milliseconds / 3 / max(1, interval.milliseconds)))
        let auditEvery = max(1, Int(engine.configuration.auditInterval / interval))
        var registered = false
        var tick = 0
        var failures = 0
        // A connection made again may lead to a new primary that missed the last writes.
        let observer = engine.redis.addConnectionObserver { [engine] event in
            if case .connected(reconnect: true) = event { engine.requestAudit() }
        }
        defer { engine.redis.removeConnectionObserver(observer) }
        while !Task.isShuttingDownGracefully, !Task.isCancelled {
            var renewed = false
            var foundLoss = false
            do {
                if !registered {
                    try await engine.checkPubSubAgreement()
                    try await engine.reapPredecessor()
                    try await engine.registerNode()
                    registered = true
                } else if try await !engine.renewLease() {
                    engine.logger.warning("this node's lease was gone; registering its sessions again", metadata: ["presence.node_id": "\(engine.configuration.nodeID)"])
                    try await engine.reregister()
                    foundLoss = true
                } else if engine.restoreOwed {
                    try await engine.restorePending()
                }
                renewed = true
                failures = 0
                await engine.retryPendingReleases()
                await engine.retryOwedStatuses()
                tick += 1
                if tick % refreshEvery == 0 { try await engine.refreshDeviceKeys() }
                if foundLoss {
                    // On a cluster a loss reaches the shards one by one: one that lands just
                    // after the sessions were written again is found on the next tick, within
                    // the grace other nodes give before they re-read (an audit now finds
                    // nothing: everything was just written).
                    engine.requestAudit()
                } else if engine.takeAuditRequest() {
                    try await engine.audit()
                } else if tick % auditEvery == 0 {
                    try await engine.audit(all: false)
                }
            } catch let mismatch as PubSubMismatch {
                // Not a node that can serve: ends the node's services (and so the process).
                engine.logger.error("refusing to start", metadata: ["error": "\(mismatch)"])
                throw mismatch
            } catch {
                // An audit's failure waits a whole period: the lease is renewed.
                if !renewed { failures += 1 }
                // A renewal's failure is said once per outage, then every 20th try.
                let level: Logger.Level = renewed || failures % 20 == 1 ? .warning : .debug
                let what = renewed ? "cannot keep the node's keys (audit, refresh)" : "cannot renew the lease"
                engine.logger.log(level: level, "\(what)", metadata: ["error": "\(error)", "presence.attempts": "\(failures)"])
            }
            // After a failure, tried again soon (on a fresh connection once the stalled one is
            // dropped): a renewal that waits a whole period may come after the lease ran out.
            let pause = failures > 0 ? min(interval, Self.retryAfterFailure) : interval
            try? await cancelWhenGracefulShutdown { try await Task.sleep(for: pause) }
        }
        do {
            try await engine.deregisterNode()
        } catch {
            engine.logger.warning("cannot give up the lease", metadata: ["error": "\(error)"])
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
