import Logging
import NIOConcurrencyHelpers
import PresenceProtocol
import RedisClient

/// What a node's upkeep found, for the gateway to act on.
public enum UpkeepEvent: Sendable, Equatable {
    /// Redis had lost what this node wrote (its lease, or devices its sessions hold), and the
    /// node is writing it again. What watchers were told may be stale: read it again.
    case dataLost
    /// While Redis had lost a device, another session took it over; this node's session that
    /// held it must close, as after any takeover.
    case deviceTakenOver(session: String)
}

extension PresenceEngine {
    /// Devices written per pipelined batch when writing them again.
    static let restoreBatch = 200
    /// Devices checked per audit script.
    static let auditBatch = 500

    /// Registers the node and every device its live sessions hold again, with their statuses,
    /// after the lease was found gone (a reaper took the node, or Redis lost its data).
    /// Watchers get events for every aggregate this brings back. Resumable: what a failure
    /// leaves unwritten is written by the next ``restorePending()``.
    @discardableResult
    public func reregister() async throws(PresenceError) -> Int {
        // Owed before the lease is taken again: until they are written, reads of this node's
        // users are not current (``holdsCurrentState``).
        unrestored.withLockedValue { $0.owed = Set(local.withLockedValue { $0.keys }) }
        try await registerNode()
        reportLoss()
        // Redis restarted, perhaps from an older snapshot: a device it has under an older session
        // of this node's is this node's again before the write-back, which would take it for
        // another session's and close the live one.
        if takeNewLife() {
            do {
                try await settleNewLife()
            } catch {
                noteNewLife()
                throw error
            }
        }
        return try await restorePending()
    }

    /// Redis was found to have lost what this node wrote: the gateway reads again what its
    /// watchers were told (``UpkeepEvent/dataLost``), and an audit follows a renewal period later.
    /// On a cluster a loss reaches the shards one by one: one that lands just after this node
    /// wrote its devices back is found by that audit, within the grace other nodes give before
    /// they read again (an audit at once finds nothing: everything was just written).
    func reportLoss() {
        upkeep.yield(.dataLost)
        requestAudit(after: configuration.leaseTTL / 3)
    }

    /// Devices owed a write since Redis was found to have lost them, and which of them a run of
    /// ``restorePending()`` is writing: runs at once (the lease service's, an audit's, a status
    /// write's) each take batches of their own.
    struct RestoreQueue: Sendable {
        /// Owed, claimed or not: until it is empty, reads of this node's users are not current.
        var owed: Set<String> = []
        /// Owed devices a run is writing now.
        var claimed: Set<String> = []

        /// Up to `limit` owed devices no run has claimed, claimed now.
        mutating func claim(_ limit: Int) -> [String] {
            var batch: [String] = []
            for member in owed where !claimed.contains(member) {
                batch.append(member)
                if batch.count == limit { break }
            }
            claimed.formUnion(batch)
            return batch
        }

        /// A claimed batch was written (or its sessions closed since): owed no more.
        mutating func written(_ batch: [String]) {
            owed.subtract(batch)
            claimed.subtract(batch)
        }

        /// A claimed batch a failure left unwritten: owed still, for the next run.
        mutating func unclaim(_ batch: [String]) {
            claimed.subtract(batch)
        }
    }

    /// Whether devices found lost are still to be written.
    public var restoreOwed: Bool { !unrestored.withLockedValue { $0.owed.isEmpty } }

    /// Writes the devices found lost, in pipelined batches, each only if no other session has
    /// taken it meanwhile (such a session of this node is reported, ``UpkeepEvent/deviceTakenOver(session:)``).
    /// The lease is renewed between batches, so that a long run does not let it lapse and have
    /// reapers remove what it wrote. Returns how many devices were written.
    @discardableResult
    public func restorePending() async throws(PresenceError) -> Int {
        var written = 0
        var renewed = ContinuousClock.now
        while true {
            let members = unrestored.withLockedValue { $0.claim(Self.restoreBatch) }
            if members.isEmpty { break }
            let batch = local.withLockedValue { devices in members.compactMap { member in devices[member].map { (member: member, device: $0) } } }
            do {
                if !batch.isEmpty { written += try await restore(batch) }
            } catch {
                unrestored.withLockedValue { $0.unclaim(members) }
                throw error
            }
            // Written now, or closed since and nothing to write.
            unrestored.withLockedValue { $0.written(members) }
            if ContinuousClock.now - renewed >= configuration.leaseTTL / 3 {
                if try await !renewLease() { try await registerNode() }
                renewed = .now
            }
        }
        if written > 0 {
            logger.info("wrote this node's sessions again", metadata: ["presence.node_id": "\(configuration.nodeID)", "presence.devices": "\(written)"])
        }
        return written
    }

    /// Writes one batch of devices again: the node's registry entry and index first (a stale
    /// entry costs a reaper a no-op), then each device, pipelined.
    ///
    /// Redis may have lost the registry with the devices (a restart without its data): a node
    /// that wrote its devices again and died before its next renewal found its lease gone would
    /// then be listed nowhere, and no reaper would ever take its users offline. So the node is
    /// listed here unless it is already (at the end a lease taken now would have; a listed node
    /// keeps the end its lease set).
    private func restore(_ batch: [(member: String, device: LocalDevice)]) async throws(PresenceError) -> Int {
        let node = configuration.nodeID
        try await list(node, until: indexScore(after: configuration.leaseTTL), unlessListed: true)
        try await run { try await self.redis.execute(SADD(key: self.keys.nodeDevices(node), members: batch.map(\.member))) }
        let calls = batch.map { entry in
            UpsertDevice(user: entry.device.user, device: entry.device.device, status: entry.device.status, node: node, session: entry.device.session,
                         mode: .restore, opened: entry.device.opened)
        }
        var written = 0
        var overtaken: [(member: String, device: LocalDevice)] = []
        for (entry, result) in zip(batch, try await evaluate(calls)) {
            switch result {
            case .success(.heldByAnother):
                await takenOver(entry.member, session: entry.device.session)
                continue
            case .success(.unheld):
                // The answer of a status write only; a restore writes whatever it finds.
                continue
            case .success(.written(let change, _, _, _)):
                written += 1
                await settle(change)
            case .failure(let error):
                // An error Redis answered with (the device limit, say) is this device's alone;
                // an unreachable Redis stops the run, and the batch is written again on the next
                // tick.
                guard error.code != .unavailable else { throw error }
                logger.warning("cannot write a device again", metadata: ["presence.user_id": "\(entry.device.user)", "error": "\(error)"])
                continue
            }
            let now = local.withLockedValue { $0[entry.member] }
            if now?.session != entry.device.session || now?.status != entry.device.status { overtaken.append(entry) }
        }
        // What changed while the batch was in flight: a status frame whose own write reached Redis
        // before this one must not lose, and a close must win.
        for (member, device) in overtaken {
            if local.withLockedValue({ $0[member]?.session == device.session }) {
                try await writeCurrentStatus(member, session: device.session) { user, device, session, status throws(PresenceError) in
                    _ = try await self.writeStatus(user: user, device: device, session: session, status: status)
                }
            } else {
                _ = try? await disconnect(user: device.user, device: device.device, session: device.session, clean: false)
            }
        }
        return written
    }

    /// Another session holds the device of `session` now: this node lets it go, and takes it out
    /// of its index unless a session here holds it again (should that race a new session, the
    /// next audit puts the entry back).
    private func takenOver(_ member: String, session: String) async {
        let dropped = local.withLockedValue { devices in
            guard devices[member]?.session == session else { return false }
            devices[member] = nil
            return true
        }
        guard dropped else { return }
        upkeep.yield(.deviceTakenOver(session: session))
        if local.withLockedValue({ $0[member] == nil }) {
            _ = try? await run { try await self.redis.execute(SREM(key: self.keys.nodeDevices(self.configuration.nodeID), members: [member])) }
        }
    }

    /// Asks for an audit of every device on the upkeep's next tick once `delay` has passed: after
    /// a connection to Redis was made again (a failover may have lost the last writes), or a loss
    /// was found. A request due within a quarter of a renewal period before this one's time, and
    /// not taken yet, stands for it.
    public func requestAudit(after delay: Duration = .zero) {
        let due = ContinuousClock.now + delay
        let slack = configuration.leaseTTL / 12
        auditsRequested.withLockedValue { pending in
            guard !pending.contains(where: { $0 <= due && $0 >= due - slack }) else { return }
            pending.append(due)
        }
    }

    /// Whether an audit asked for is due, taking every request that is.
    func takeAuditRequest() -> Bool {
        let now = ContinuousClock.now
        return auditsRequested.withLockedValue { pending in
            let before = pending.count
            pending.removeAll { $0 <= now }
            return pending.count < before
        }
    }

    /// What an audit found.
    public struct AuditReport: Sendable, Equatable {
        /// Devices checked.
        public var checked = 0
        /// Devices Redis had lost, or had out of this node's index; written again.
        public var restored = 0
        /// Devices another session holds now; their sessions here are let go.
        public var takenOver = 0
        /// Devices whose status Redis had lost (an older one stood there); written again.
        public var restatused = 0
        /// Users whose stored aggregate Redis had lost (their `state` key); worked out again from
        /// their devices, stored and published.
        public var restated = 0
    }

    /// Compares what Redis holds with the devices this node's sessions hold: a device lost
    /// (partial data loss while the lease survived, or a write Redis acknowledged and then lost
    /// in a failover) is written again, and a device another session took is let go. One script
    /// per ``auditBatch`` devices, reading only unless something is wrong.
    ///
    /// `all` checks every device (after a reconnect, or an index found short). Otherwise, as the
    /// lease service does on its schedule, it checks the next ``auditBatch`` devices after the
    /// last one checked, round the node's devices in turn: the idle cost stays one script per
    /// ``PresenceConfiguration/auditInterval`` however many devices the node holds, and every
    /// device is checked once per interval per 500 devices.
    /// What Redis holds of each device, read in two steps each on one slot: the node's index
    /// (one `SMISMEMBER`), then one script per user over that user's devices (one pipeline).
    /// `nil` for a device whose user's script Redis refused (checked on the next audit).
    /// `repaired` counts the users whose stored aggregate was wrong and was written again.
    private func auditFindings(_ devices: [(key: String, value: LocalDevice)], repaired: inout Int) async throws(PresenceError) -> [AuditDevices.Finding?] {
        guard !devices.isEmpty else { return [] }
        let index = try await indexed(devices.map(\.key))
        var positions: [String: [Int]] = [:]
        var users: [String] = []
        for (position, (_, device)) in devices.enumerated() {
            if positions[device.user] == nil { users.append(device.user) }
            positions[device.user, default: []].append(position)
        }
        let calls = users.map { user in
            AuditDevices(user: user, node: configuration.nodeID, devices: (positions[user] ?? []).map { position in
                let device = devices[position].value
                return AuditDevices.Device(device: device.device, session: device.session, status: device.status, indexed: index[position],
                                           opened: device.opened)
            })
        }
        var findings = [AuditDevices.Finding?](repeating: nil, count: devices.count)
        for (user, result) in zip(users, try await evaluate(calls)) {
            switch result {
            case .success(let found):
                for (position, finding) in zip(positions[user] ?? [], found.findings) { findings[position] = finding }
                if found.stateRepaired {
                    repaired += 1
                    logger.warning("Redis had lost a user's aggregate; worked out again from the devices", metadata: ["presence.user_id": "\(user)"])
                }
            case .failure(let error) where error.code == .unavailable:
                throw error
            case .failure(let error):
                logger.warning("cannot audit a user's devices", metadata: ["presence.user_id": "\(user)", "error": "\(error)"])
            }
        }
        // A session opening meanwhile writes the index, then the device: one found held but not
        // indexed may have been indexed just after the index was read. Read again, those alone.
        let unindexed = findings.indices.filter { findings[$0] == .unindexed }
        if !unindexed.isEmpty {
            let again = try await indexed(unindexed.map { devices[$0].key })
            for (position, held) in zip(unindexed, again) where held { findings[position] = .held }
        }
        return findings
    }

    /// Which of `members` the node's device index holds (one `SMISMEMBER`), in order.
    private func indexed(_ members: [String]) async throws(PresenceError) -> [Bool] {
        try await run { try await self.redis.execute(SMISMEMBER(key: self.keys.nodeDevices(self.configuration.nodeID), members: members)) }
    }

    @discardableResult
    public func audit(all: Bool = true) async throws(PresenceError) -> AuditReport {
        if let probe = beforeAudit.withLockedValue({ $0 }) { await probe() }
        let devices: [(key: String, value: LocalDevice)] = local.withLockedValue { local in
            guard !all else { return Array(local) }
            let members = local.keys.sorted()
            let after = auditCursor.withLockedValue { $0 }
            let start = members.firstIndex { $0 > after } ?? 0
            let chosen = members[start...].prefix(Self.auditBatch) + members.prefix(max(0, Self.auditBatch - (members.count - start)))
            let picked = Array(Set(chosen))
            auditCursor.withLockedValue { $0 = chosen.last ?? "" }
            return picked.compactMap { member in local[member].map { (member, $0) } }
        }
        var report = AuditReport()
        var lost: [String] = []
        var stale: [(member: String, session: String)] = []
        let node = configuration.nodeID
        for start in stride(from: 0, to: devices.count, by: Self.auditBatch) {
            let slice = Array(devices[start..<min(start + Self.auditBatch, devices.count)])
            let findings = try await auditFindings(slice, repaired: &report.restated)
            report.checked += findings.count
            for ((member, device), finding) in zip(slice, findings) {
                guard let finding else { continue }
                switch finding {
                case .lost, .unindexed:
                    // A session that closed since the audit listed it is not lost.
                    if local.withLockedValue({ $0[member]?.session == device.session }) { lost.append(member) }
                case .heldByAnother:
                    report.takenOver += 1
                    await takenOver(member, session: device.session)
                case .heldByOlderSession:
                    // Not another's: Redis went back to before this session opened.
                    _ = try? await evaluate(SettleNewLife(user: device.user, node: node, devices: [(device.device, (device.session, device.status, device.opened))]))
                case .staleStatus:
                    stale.append((member, device.session))
                case .held: break
                }
            }
        }
        if !stale.isEmpty {
            logger.warning("Redis had lost status changes of this node's sessions; writing them again", metadata: ["presence.node_id": "\(node)", "presence.devices": "\(stale.count)"])
            local.withLockedValue { local in
                for (member, session) in stale where local[member]?.session == session { local[member]?.statusOwed = true }
            }
            report.restatused = stale.count
            await retryOwedStatuses()
        }
        if !lost.isEmpty {
            logger.warning("Redis had lost devices this node's sessions hold; writing them again", metadata: ["presence.node_id": "\(node)", "presence.devices": "\(lost.count)"])
            unrestored.withLockedValue { $0.owed.formUnion(lost) }
            reportLoss()
            report.restored = try await restorePending()
        }
        return report
    }
}
