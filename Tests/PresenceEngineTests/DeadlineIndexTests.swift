import Foundation
import NIOConcurrencyHelpers
@testable import PresenceEngine
import RedisClient
import RedisTestSupport
import Testing

/// A device gets a deadline (a linger, a REST heartbeat) in two steps: its entry in the deadline
/// sets, which the reaper goes by, then the script that writes the deadline. A reaper that looks
/// at the entry between the two finds no deadline yet and drops the entry; the device must still
/// be reaped at its deadline, not stay live with an entry nobody looks at.
@Suite("A deadline written after the reaper looked at its entry")
struct DeadlineIndexTests {
    /// Makes each script of `node` that gives a deadline come `delay` after its entry, with
    /// `reaper` passing over the deadline sets meanwhile; the passes' reports are kept.
    static func delayScripts(of node: PresenceEngine, by delay: Duration, reaper: PresenceEngine, cluster: EngineCluster) -> NIOLockedValueBox<[ReapReport]> {
        let passes = NIOLockedValueBox<[ReapReport]>([])
        node.afterDeadlineIndexed.withLockedValue { probe in
            probe = {
                cluster.clock.advance(delay)
                if let report = try? await reaper.reapOnce() { passes.withLockedValue { $0.append(report) } }
            }
        }
        return passes
    }

    /// Ends ``delayScripts(of:by:reaper:cluster:)``; the reports of the reaper's passes.
    static func stopDelaying(_ node: PresenceEngine, _ passes: NIOLockedValueBox<[ReapReport]>) -> [ReapReport] {
        node.afterDeadlineIndexed.withLockedValue { $0 = nil }
        return passes.withLockedValue { $0 }
    }

    @Test("a drop whose linger is written after a reaper dropped its entry still goes offline at the linger's end")
    func lingerAfterReaperLooked() async throws {
        try await EngineCluster.with { cluster in
            let node = cluster.engine(node: "a")
            let reaper = cluster.engine(node: "b")
            _ = try await node.connect(user: "bob", device: "phone", session: "s1")
            let linger = node.configuration.linger
            // The linger's script waits past its entry's score (a stalled connection, a starved
            // process); a reaper finds the device held by its session meanwhile.
            let passes = Self.delayScripts(of: node, by: linger + .milliseconds(100), reaper: reaper, cluster: cluster)
            let droppedAt = cluster.clock.nowMilliseconds() + (linger + .milliseconds(100)).milliseconds
            #expect(try await node.disconnect(user: "bob", device: "phone", session: "s1", clean: false) == nil, "lingering")
            #expect(Self.stopDelaying(node, passes).map(\.expiredDevices) == [0], "held by its session: nothing to reap yet")
            #expect(try await node.devices(of: "bob").map(\.deadline) == [droppedAt + linger.milliseconds])
            cluster.clock.advance(linger + .milliseconds(100))
            #expect(try await reaper.reapOnce().expiredDevices == 1, "reaped at the linger's end")
            #expect(try await reaper.views(of: "bob").real == Presence(userID: "bob", status: .offline, lastSeen: droppedAt))
        }
    }

    @Test("a REST heartbeat written after a reaper dropped its entry still expires at the heartbeat TTL")
    func heartbeatAfterReaperLooked() async throws {
        try await EngineCluster.with { cluster in
            let node = cluster.engine(node: "a")
            let reaper = cluster.engine(node: "b")
            let ttl = node.configuration.heartbeatTTL
            let passes = Self.delayScripts(of: node, by: ttl + .milliseconds(100), reaper: reaper, cluster: cluster)
            let postedAt = cluster.clock.nowMilliseconds() + (ttl + .milliseconds(100)).milliseconds
            let posted = try await node.post(user: "carol", device: "web", status: .online)
            #expect(posted.views.real.status == .online)
            #expect(Self.stopDelaying(node, passes).count == 1, "a reaper looked before the post's script")
            cluster.clock.advance(ttl + .milliseconds(100))
            #expect(try await reaper.reapOnce().expiredDevices == 1, "reaped at the heartbeat's end")
            #expect(try await reaper.views(of: "carol").real == Presence(userID: "carol", status: .offline, lastSeen: postedAt))
        }
    }

    @Test("a restarted process's linger of its predecessor's devices, written after a reaper dropped their entries, still ends")
    func predecessorLingerAfterReaperLooked() async throws {
        try await EngineCluster.with { cluster in
            let killed = cluster.engine(node: "node-2")
            let reaper = cluster.engine(node: "other")
            try await killed.registerNode()
            _ = try await killed.connect(user: "jo", device: "phone", session: "old-1")
            cluster.clock.advance(.seconds(1))
            let restarted = cluster.engine(node: "node-2")
            let linger = restarted.configuration.linger
            let passes = Self.delayScripts(of: restarted, by: linger + .milliseconds(100), reaper: reaper, cluster: cluster)
            _ = try await restarted.reapPredecessor()
            #expect(Self.stopDelaying(restarted, passes).map(\.expiredDevices) == [0], "held by the old process's session: nothing to reap yet")
            #expect(try await reaper.views(of: "jo").real.status == .online, "lingering")
            cluster.clock.advance(linger + .milliseconds(100))
            #expect(try await reaper.reapOnce().expiredDevices == 1, "reaped at the linger's end")
            #expect(try await reaper.views(of: "jo").real.status == .offline)
        }
    }

    @Test("a typing start written after a reaper dropped its entry still ends, with its stop published, at its expiry")
    func typingAfterReaperLooked() async throws {
        try await EngineCluster.with { cluster in
            let node = cluster.engine(node: "a")
            let reaper = cluster.engine(node: "b")
            _ = try await node.setMembers(of: "room", to: ["ivy", "jon"])
            _ = try await node.connect(user: "ivy", device: "phone", session: "s1")
            let ttl = node.configuration.typingTTL
            let passes = Self.delayScripts(of: node, by: ttl + .milliseconds(100), reaper: reaper, cluster: cluster)
            let started = try await node.setTyping(user: "ivy", conversation: "room", isTyping: true)
            #expect(started, "the start is published")
            #expect(Self.stopDelaying(node, passes).map(\.typingEnded) == [0], "no typing state yet")
            cluster.clock.advance(ttl + .milliseconds(100))
            #expect(try await reaper.reapOnce().typingEnded == 1, "ended by the reaper at its expiry, and its stop published")
            #expect(try await reaper.reapOnce().typingEnded == 0)
        }
    }

    @Test("entries Redis did not take are written on the next upkeep tick, only where none is there by then")
    func pendingEntriesRetried() async throws {
        try await EngineCluster.with { cluster in
            let node = cluster.engine(node: "a")
            let lost = node.deviceDeadline(of: "amy", device: "phone", at: 5_000)
            let newer = node.deviceDeadline(of: "ben", device: "phone", at: 6_000)
            _ = try await cluster.redis.execute(ZADD(key: newer.set, entries: [(7_000, newer.member)]))
            node.keepPending(PresenceEngine.deadlineCommands([lost, newer]))
            await node.retryPendingIndexEntries()
            #expect(try await cluster.redis.execute(ZSCORE(key: lost.set, member: lost.member)) == 5_000, "written")
            #expect(try await cluster.redis.execute(ZSCORE(key: newer.set, member: newer.member)) == 7_000, "the entry there by then kept")
            #expect(node.pendingIndexEntries.withLockedValue { $0.isEmpty })
        }
    }
}
