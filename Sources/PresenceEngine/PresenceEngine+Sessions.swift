import Foundation
import Logging
import NIOConcurrencyHelpers
import PresenceProtocol
import RedisClient

/// A live session's device: opening, status changes, closing, and what is owed to Redis when a
/// write could not be made (statuses to write again, devices to let go).
extension PresenceEngine {
    /// Registers a live session's device; the device is live once this returns.
    public func connect(user: String, device: String, session: String, status: PresenceStatus = .online) async throws(PresenceError) -> SessionOpened {
        let member = keys.deviceMember(user: user, device: device)
        let opened = estimatedStoreNow()
        local.withLockedValue { $0[member] = LocalDevice(user: user, device: device, session: session, status: status, opened: opened) }
        do {
            return try await register(user: user, device: device, session: session, status: status)
        } catch {
            local.withLockedValue { devices in
                if devices[member]?.session == session { devices[member] = nil }
            }
            // Unreachable in time, Redis may still have run the write (its reply lost in a cut):
            // then the device would be held for good by a session that never opened. It is let go
            // as after a drop, on the upkeep ticks until Redis takes it; a no-op if the write never
            // ran or another session holds the device by then.
            if error.code == .unavailable {
                let release = PendingRelease(user: user, device: device, session: session, clean: false)
                pendingReleases.withLockedValue { $0[release.key] = release }
            }
            throw error
        }
    }

    /// Writes a device held by a session of this node: the node's index, then the device.
    func register(user: String, device: String, session: String, status: PresenceStatus) async throws(PresenceError) -> SessionOpened {
        let member = keys.deviceMember(user: user, device: device)
        // The node's device index is written first: if the script then fails, a stale entry
        // costs the reaper one no-op; the other order could leave a device nobody reaps. With it
        // a registered node is listed in the registry unless it is already: Redis may have lost
        // the registry a moment ago, before this node's renewal finds out, and a node killed then
        // must still be found by a reaper. (A gateway writes no session before it registers.)
        let node = configuration.nodeID
        let index = SADD(key: keys.nodeDevices(node), members: [member])
        if isRegistered {
            let (indexed, listed, _) = try await run {
                try await self.redis.pipeline(
                    index,
                    ZADD(key: self.keys.nodes, entries: [(self.indexScore(after: self.configuration.leaseTTL), node)], onlyNew: true),
                    PEXPIRE(key: self.keys.nodes, milliseconds: self.configuration.deviceKeyTTL.milliseconds)
                )
            }
            if case .failure(let error) = indexed { throw Self.presenceError(error) }
            if case .failure(let error) = listed { throw Self.presenceError(error) }
        } else {
            try await run { try await self.redis.execute(index) }
        }
        let outcome = try await evaluate(UpsertDevice(user: user, device: device, status: status, node: configuration.nodeID, session: session, mode: .session))
        guard case .written(let change, let previous, _, let at) = outcome else { throw PresenceError(.internal, "unexpected reply from the device script") }
        // Two sessions of this device opening here at once: `local` names the one that recorded
        // itself last, not the one Redis took last. This session holds the device now, unless
        // one whose script is still on its way takes it next: recorded here where `local` names
        // the session this one replaced, or none (the other closed). Left to the other, a live
        // session holding the device went unaudited and, once the other closed, unindexed.
        // The session's opening moment is the write's own now, no longer the node's estimate.
        local.withLockedValue { devices in
            let recorded = devices[member]?.session
            if recorded == session {
                if let at { devices[member]?.opened = at }
                return
            }
            guard recorded == nil || recorded == previous?.session else { return }
            devices[member] = LocalDevice(user: user, device: device, session: session, status: status, opened: at ?? estimatedStoreNow())
        }
        return SessionOpened(change: change, replaced: previous)
    }

    /// Changes the status of a device held by a live session of this node.
    public func setStatus(user: String, device: String, session: String, status: PresenceStatus) async throws(PresenceError) -> PresenceChange {
        let member = keys.deviceMember(user: user, device: device)
        local.withLockedValue { devices in
            guard devices[member]?.session == session else { return }
            devices[member]?.status = status
            devices[member]?.statusOwed = true
        }
        let change = try await writeStatus(user: user, device: device, session: session, status: status)
        written(member, session: session, status: status)
        if let change { return change }
        // Another session took the device over (this one is about to be closed), or the device was
        // written again whole.
        return PresenceChange(changed: false, shownChanged: false, views: try await views(of: user))
    }

    /// Writes the status of a device held by `session` of this node and settles the change;
    /// `nil` when another session has taken the device over, or when Redis no longer has the
    /// session holding it: then, if the session is still live here, the device is written again
    /// whole (as after a loss), with the status it has by now.
    func writeStatus(user: String, device: String, session: String, status: PresenceStatus) async throws(PresenceError) -> PresenceChange? {
        let outcome = try await evaluate(UpsertDevice(user: user, device: device, status: status, node: configuration.nodeID, session: session, mode: .status))
        switch outcome {
        case .written(let change, _, _, _):
            await settle(change)
            return change
        case .heldByAnother:
            return nil
        case .unheld:
            let member = keys.deviceMember(user: user, device: device)
            guard local.withLockedValue({ $0[member]?.session == session }) else { return nil }
            logger.warning("Redis had lost a device a session here holds; writing it again", metadata: ["presence.user_id": "\(user)", "presence.device_id": "\(device)"])
            unrestored.withLockedValue { _ = $0.owed.insert(member) }
            reportLoss()
            try await restorePending()
            return nil
        }
    }

    /// Ends a session: `clean` (close code 1000, or an explicit sign-out) takes the device offline
    /// at once; otherwise it stays live for the linger window. Returns `nil` when another session
    /// has taken the device over meanwhile, which this changes nothing for.
    @discardableResult
    public func disconnect(user: String, device: String, session: String, clean: Bool) async throws(PresenceError) -> PresenceChange? {
        let member = keys.deviceMember(user: user, device: device)
        local.withLockedValue { devices in
            if devices[member]?.session == session { devices[member] = nil }
        }
        newLife.withLockedValue { $0.releases.note(member, at: .now) }
        do {
            let change = try await release(user: user, device: device, session: session, clean: clean)
            return change
        } catch {
            // Redis did not take it: retried on every upkeep tick, or the device would stay held
            // by this live node for good.
            let release = PendingRelease(user: user, device: device, session: session, clean: clean)
            pendingReleases.withLockedValue { $0[release.key] = release }
            throw error
        }
    }

    /// Redis holds `status` for the device as `session` has it: nothing is owed, unless the
    /// session changed it again meanwhile.
    func written(_ member: String, session: String, status: PresenceStatus) {
        local.withLockedValue { devices in
            if devices[member]?.session == session, devices[member]?.status == status { devices[member]?.statusOwed = false }
        }
    }

    /// Writes the status Redis has not taken for each device of this node (a change made while
    /// Redis was unreachable); called on every upkeep tick (``PresenceLeaseService``).
    public func retryOwedStatuses() async {
        let owed = local.withLockedValue { $0.filter(\.value.statusOwed) }
        for (member, device) in owed {
            do {
                try await writeCurrentStatus(member, session: device.session) { user, device, session, status throws(PresenceError) in
                    _ = try await self.writeStatus(user: user, device: device, session: session, status: status)
                }
            } catch {
                return
            }
        }
    }

    /// Writes the device's status as this node holds it, again until it no longer changes
    /// meanwhile: a status read here and then overtaken by a newer one (a `status` frame whose
    /// write reached Redis first) must not be the last word. Stops when `session` no longer
    /// holds the device.
    func writeCurrentStatus(
        _ member: String,
        session: String,
        write: (_ user: String, _ device: String, _ session: String, _ status: PresenceStatus) async throws(PresenceError) -> Void
    ) async throws(PresenceError) {
        var last: PresenceStatus?
        while let current = local.withLockedValue({ $0[member] }), current.session == session, current.status != last || current.statusOwed {
            try await write(current.user, current.device, session, current.status)
            written(member, session: session, status: current.status)
            last = current.status
        }
    }

    /// Retries the disconnects Redis could not take; called on every upkeep tick (``PresenceLeaseService``).
    public func retryPendingReleases() async {
        let pending = pendingReleases.withLockedValue { Array($0.values) }
        for release in pending {
            do {
                _ = try await self.release(user: release.user, device: release.device, session: release.session, clean: release.clean)
                pendingReleases.withLockedValue { $0[release.key] = nil }
            } catch {
                return
            }
        }
    }

    private func release(user: String, device: String, session: String, clean: Bool) async throws(PresenceError) -> PresenceChange? {
        let member = keys.deviceMember(user: user, device: device)
        if !clean {
            try await indexDeadline(of: user, devices: [device], after: configuration.linger)
            if let probe = afterDeadlineIndexed.withLockedValue({ $0 }) { await probe() }
        }
        let outcome = try await evaluate(RemoveDevice(user: user, device: device, session: session, mode: clean ? .clean : .linger))
        if case .live(let deadline?) = outcome { await reindex([deviceDeadline(of: user, device: device, at: deadline)]) }
        // This session no longer holds the device: out of the node's index, unless a session of
        // this node holds it again (a new one, or the one that took it over). A device taken
        // over by another node's session is indexed there; left here, it would stay for good.
        _ = try? await redis.execute(SREM(key: keys.nodeDevices(configuration.nodeID), members: [member]))
        if local.withLockedValue({ $0[member] != nil }) {
            _ = try? await redis.execute(SADD(key: keys.nodeDevices(configuration.nodeID), members: [member]))
        }
        guard case .removed(let change) = outcome else { return nil }
        await settle(change)
        return change
    }
}
