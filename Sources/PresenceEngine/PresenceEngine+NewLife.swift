import Logging
import NIOConcurrencyHelpers
import RedisClient

/// The devices a node let go of lately, for a Redis that went back in time to bring back: a
/// snapshot taken before a release still has the device as held by this node's session. On one
/// server the node's index comes back from the same snapshot and names them; on a cluster the
/// index may live on a primary that did not go back, so the node remembers them itself.
///
/// Kept for ``window`` (an hour: Redis's default snapshot schedule saves at least hourly while
/// anything changes) and at most ``capacity`` of them (100,000), the oldest dropped first. A
/// snapshot older than that may bring back a device let go before it, which its key's safety
/// TTL then ends.
struct RecentReleases: Sendable {
    let window: Duration
    let capacity: Int

    private var entries: [(member: String, at: ContinuousClock.Instant)] = []
    /// Where the live entries begin: the ones before it are dropped, and compacted away once
    /// they are half of the array.
    private var start = 0

    init(window: Duration = .seconds(3600), capacity: Int = 100_000) {
        self.window = window
        self.capacity = capacity
    }

    var count: Int { entries.count - start }

    /// Notes that `member` was let go of `at`.
    mutating func note(_ member: String, at: ContinuousClock.Instant) {
        entries.append((member, at))
        drop(before: at - window)
    }

    /// The members let go of within the window before `now`.
    mutating func members(now: ContinuousClock.Instant) -> Set<String> {
        drop(before: now - window)
        return Set(entries[start...].map(\.member))
    }

    private mutating func drop(before oldest: ContinuousClock.Instant) {
        while start < entries.count, count > capacity || entries[start].at < oldest { start += 1 }
        if start >= 1_024, start * 2 >= entries.count {
            entries.removeFirst(start)
            start = 0
        }
    }
}

/// What a node knows of Redis's lives, in one place: whether a new life is found and not settled
/// yet, each cluster primary's run id as last seen, and the devices it let go of lately.
struct NewLifeWatch: Sendable {
    /// A renewal (or a cluster primary's run id) found Redis in a new life, and
    /// ``PresenceEngine/settleNewLife()`` has not run since.
    var found = false
    /// On a cluster, the run id of each primary by address (``PresenceEngine/checkPrimaryLives()``).
    var primaryLives: [String: String] = [:]
    var releases = RecentReleases()
}

extension PresenceEngine {
    /// On a Redis Cluster: asks every primary for its run id (`INFO server`), and takes one this
    /// node has not seen before as a new life (``takeNewLife()``): that primary restarted,
    /// perhaps from an older snapshot, or a replica that may have lagged took over its slots.
    /// The lease script sees this only for the primary of the node's own lease. The first answer
    /// of each primary is taken as it is; a primary that does not answer is asked again at the
    /// next renewal. One server (or Sentinel's primary) is checked by the lease script itself.
    func checkPrimaryLives() async {
        guard let cluster = redis as? RedisClusterClient else { return }
        let info = INFO(section: "server")
        guard let answers = try? await cluster.sendToEachPrimary(info.arguments) else { return }
        var lives: [String: String] = [:]
        for (primary, result) in answers {
            guard let text = try? info.decode(result.get()), let life = Self.runID(in: text) else { continue }
            lives[primary.description] = life
        }
        let changed = newLife.withLockedValue { watch in
            let first = watch.primaryLives.isEmpty
            var changed: [String] = []
            for (primary, life) in lives where watch.primaryLives[primary] != life {
                if !first { changed.append(primary) }
                watch.primaryLives[primary] = life
            }
            return changed
        }
        guard !changed.isEmpty else { return }
        logger.warning("a Redis primary began a new life; settling this node's devices", metadata: [
            "presence.node_id": "\(configuration.nodeID)", "presence.primaries": "\(changed.sorted().joined(separator: ","))",
        ])
        noteNewLife()
    }

    /// Marks Redis as in a new life that ``settleNewLife()`` has still to settle.
    func noteNewLife() {
        newLife.withLockedValue { $0.found = true }
    }

    /// The `run_id` line of an `INFO server` answer.
    static func runID(in info: String) -> String? {
        for line in info.split(whereSeparator: \.isNewline) where line.hasPrefix("run_id:") {
            return String(line.dropFirst("run_id:".count).filter { !$0.isWhitespace })
        }
        return nil
    }

    /// Whether a renewal found Redis in a new life since the last ``settleNewLife()``; taking it.
    public func takeNewLife() -> Bool {
        newLife.withLockedValue { watch in
            defer { watch.found = false }
            return watch.found
        }
    }

    /// Redis began a new life since this node last renewed (a restart, perhaps from an older
    /// snapshot, or a failover to a replica that lagged), or one primary of a cluster did: it
    /// may hold what this node's sessions were long ago. Every device the node's index names,
    /// every device its sessions hold, and every device it let go of lately (``RecentReleases``:
    /// on a cluster the index may live on a primary that did not go back) is checked against
    /// them (``SettleNewLife``): one no session here holds lingers and then goes offline; one
    /// held under an older session of this node is this session's again; one lost is written
    /// again. Watchers read everything again (``UpkeepEvent/dataLost``), and an audit follows.
    /// Returns how many devices it changed.
    @discardableResult
    public func settleNewLife() async throws(PresenceError) -> Int {
        let node = configuration.nodeID
        var members = Set<String>()
        var cursor = "0"
        repeat {
            let page = try await run { try await self.redis.execute(SSCAN(key: self.keys.nodeDevices(node), cursor: cursor, count: 1000)) }
            cursor = page.cursor
            members.formUnion(page.members)
        } while cursor != "0"
        let held = local.withLockedValue { $0 }
        members.formUnion(held.keys)
        members.formUnion(newLife.withLockedValue { $0.releases.members(now: .now) })
        var byUser: [String: [(device: String, held: SettleNewLife.Held?)]] = [:]
        for member in members.sorted() {
            guard let (user, device) = keys.splitDeviceMember(member) else { continue }
            byUser[user, default: []].append((device, held[member].map { ($0.session, $0.status, $0.opened) }))
        }
        reportLoss()
        let users = byUser.keys.sorted()
        var changedDevices = 0
        var lost: [String] = []
        for start in stride(from: 0, to: users.count, by: Self.restoreBatch) {
            let batch = Array(users[start..<min(start + Self.restoreBatch, users.count)])
            // A device that may linger is indexed at its deadline before it is given one.
            let unheld = batch.map { user in (user: user, devices: byUser[user, default: []].filter { $0.held == nil }.map(\.device)) }
            try await indexDeadlines(unheld.filter { !$0.devices.isEmpty }, after: configuration.linger)
            let calls = batch.map { SettleNewLife(user: $0, node: node, devices: byUser[$0] ?? []) }
            var lingering: [DeadlineEntry] = []
            var released: [String] = []
            for (call, result) in zip(calls, try await evaluate(calls)) {
                guard case .success(let outcome) = result else { continue }
                for (entry, finding) in zip(call.devices, outcome.findings) {
                    let member = keys.deviceMember(user: call.user, device: entry.device)
                    switch finding {
                    case .kept: break
                    case .lost: lost.append(member)
                    case .retaken: changedDevices += 1
                    case .lingering(let until):
                        changedDevices += 1
                        lingering.append(deviceDeadline(of: call.user, device: entry.device, at: until))
                    }
                    if entry.held == nil { released.append(member) }
                }
                if let change = outcome.change { await settle(change) }
            }
            await reindex(lingering)
            if !released.isEmpty {
                _ = try? await run { try await self.redis.execute(SREM(key: self.keys.nodeDevices(node), members: released)) }
                // A session that opened meanwhile holds its device again: indexed again.
                let back = released.filter { member in local.withLockedValue { $0[member] != nil } }
                if !back.isEmpty { _ = try? await run { try await self.redis.execute(SADD(key: self.keys.nodeDevices(node), members: back)) } }
            }
        }
        if !lost.isEmpty {
            unrestored.withLockedValue { $0.owed.formUnion(lost) }
            changedDevices += try await restorePending()
        }
        logger.info("Redis began a new life; this node's devices settled against its sessions", metadata: [
            "presence.node_id": "\(node)", "presence.devices": "\(changedDevices)",
        ])
        return changedDevices
    }
}
