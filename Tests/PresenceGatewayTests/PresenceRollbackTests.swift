import Foundation
import PresenceEngine
import RedisClient
import RedisTestSupport
import Testing

@testable import PresenceGateway

/// Presence across a Redis that went back in time (DESIGN.md invariants 1, 2, 3 and 5; the
/// failure table of docs/operations.md): a restart from a snapshot taken before devices came
/// and went.
@Suite("Presence across a Redis rollback")
struct PresenceRollbackTests {
    /// `user`'s status over REST, as `viewer` sees it.
    static func status(_ port: Int, _ user: String, viewer: String = "bob") async -> String? {
        guard let read = try? await call(port, "GET", "/api/presence/users/\(user)", token: try await token(viewer)), read.status == 200 else { return nil }
        return (read.json as? [String: Any])?["status"] as? String
    }

    /// Reads `user` over REST every 200 ms for 8 s: never offline, online at the end; and
    /// `watcher` was told no offline of them.
    static func expectNeverOffline(_ user: String, readOn port: Int, watcher: TestSocket) async throws {
        var statuses: [String] = []
        let deadline = ContinuousClock.now + .seconds(8)
        while ContinuousClock.now < deadline {
            statuses.append(await status(port, user) ?? "no answer")
            try await Task.sleep(for: .milliseconds(200))
        }
        #expect(!statuses.contains("offline"), "\(user) read offline \(statuses.count { $0 == "offline" }) times of \(statuses.count)")
        #expect(statuses.last == "online")
        let seen = await watcher.drain(for: .milliseconds(500))
        let flickers = seen.filter { $0.type == "presence_update" && $0.userID == user && $0.status == "offline" }
        #expect(flickers.isEmpty, "\(flickers.map(\.data))")
    }

    @Test("a restart from an older snapshot: a device gone since goes offline, one that reconnected since keeps its session, and watchers see no flicker")
    func restartFromSnapshot() async throws {
        let server = try RedisServerProcess()
        let prefix = TestRedis.uniquePrefix("rollback")
        try await withNodes(1, prefix: prefix, configure: { $0.redisURL = server.url() }) { ports in
            let port = ports[0]
            try await ConversationTests.setUp(port, ["alice", "bob", "carol", "erin"])
            let bob = try await MessageSessionTests.open(port, "bob", device: "phone")
            bob.send("subscribe", ["user_ids": ["alice", "carol", "erin"]], id: "w")
            _ = try await bob.next("initial_state")
            let carol = try await MessageSessionTests.open(port, "carol", device: "laptop")
            let alice = try await MessageSessionTests.open(port, "alice", device: "phone")
            let erin = try await MessageSessionTests.open(port, "erin", device: "desk")
            #expect(await eventually {
                let alice = await Self.status(port, "alice"), erin = await Self.status(port, "erin")
                return alice == "online" && erin == "online"
            })
            try server.cli("SAVE")

            // After the snapshot: alice signs off; erin's device drops and comes back at once on
            // a new session.
            alice.closeNormally()
            #expect(await eventually { await Self.status(port, "alice") == "offline" })
            erin.closeAbruptly()
            let erinAgain = try await MessageSessionTests.open(port, "erin", device: "desk")
            _ = await bob.drain(for: .milliseconds(300))

            server.stop()
            try server.start()
            // The snapshot has alice live on this node, and erin's device under its first session.
            #expect(try server.cli("HLEN", "\(prefix):{u:alice}:devices").contains("1"))

            // Offline within a lease (3 s) plus a second, counted from Redis coming back.
            let settled = await eventually(timeout: .seconds(8)) { await Self.status(port, "alice") == "offline" }
            #expect(settled, "alice, gone before the rollback, is offline again")
            let erinNow = await Self.status(port, "erin"), carolNow = await Self.status(port, "carol")
            #expect(erinNow == "online" && carolNow == "online")
            let seen = await bob.drain(for: .seconds(2))
            let flickers = seen.filter { $0.type == "presence_update" && ($0.userID == "carol" || $0.userID == "erin") && $0.status == "offline" }
            #expect(flickers.isEmpty, "\(flickers.map(\.data))")
            #expect(await erinAgain.closed(timeout: .milliseconds(100)) == nil, "erin's session is not taken for another's")
            #expect(await carol.closed(timeout: .milliseconds(100)) == nil)
        }
    }

    @Test("a restart from an older snapshot: a device that moved to another node since stays online there, and is never shown offline")
    func movedSinceTheSnapshot() async throws {
        let server = try RedisServerProcess()
        try await withNodes(2, configure: { $0.redisURL = server.url() }) { ports in
            try await ConversationTests.setUp(ports[0], ["bob", "frank"])
            let bob = try await MessageSessionTests.open(ports[0], "bob", device: "phone")
            bob.send("subscribe", ["user_ids": ["frank"]], id: "w")
            _ = try await bob.next("initial_state")
            let before = try await MessageSessionTests.open(ports[0], "frank", device: "phone")
            #expect(await eventually { await Self.status(ports[0], "frank") == "online" })
            try server.cli("SAVE")

            // After the snapshot: frank's phone drops here and is back at once on the other node.
            before.closeAbruptly()
            let moved = try await MessageSessionTests.open(ports[1], "frank", device: "phone")
            _ = await bob.drain(for: .milliseconds(300))

            // The snapshot has frank's phone on the first node, whose session has gone.
            server.stop()
            try server.start()
            try await Self.expectNeverOffline("frank", readOn: ports[0], watcher: bob)
            #expect(await moved.closed(timeout: .milliseconds(100)) == nil, "frank's session on the other node is not taken for another's")
        }
    }

    @Test("a restart from a snapshot older than a lease, where every node's lease had run out: no node is reaped as dead while it renews, and a watcher sees no offline")
    func snapshotOlderThanALease() async throws {
        let server = try RedisServerProcess()
        // The first node reaches Redis through a proxy, cut for 2 s after the restart: the other
        // node's reaper looks at it well before it can renew.
        let proxy = try RedisProxy(upstreamPort: server.port)
        var made = 0
        try await withNodes(2, configure: { configuration in
            configuration.redisURL = made == 0 ? proxy.url : server.url()
            made += 1
        }) { ports in
            try await ConversationTests.setUp(ports[1], ["bob", "frank"])
            let frank = try await MessageSessionTests.open(ports[0], "frank", device: "phone")
            let bob = try await MessageSessionTests.open(ports[1], "bob", device: "phone")
            bob.send("subscribe", ["user_ids": ["frank"]], id: "w")
            _ = try await bob.next("initial_state")
            #expect(await eventually { await Self.status(ports[1], "frank") == "online" })
            try server.cli("SAVE")
            // Every lease in the snapshot (3 s) has run out by the time Redis loads it.
            try await Task.sleep(for: .seconds(4))
            _ = await bob.drain(for: .milliseconds(100))

            server.stop()
            proxy.cut(for: .seconds(2))
            try server.start()
            try await Self.expectNeverOffline("frank", readOn: ports[1], watcher: bob)
            #expect(await frank.closed(timeout: .milliseconds(100)) == nil)
        }
    }

    @Test("a restart from an older snapshot of one primary of a Redis Cluster, not the one of the node's lease: a device gone since goes offline, and a watcher sees no flicker of one still there")
    func clusterPrimaryRollback() async throws {
        let cluster = try await LocalRedisCluster()
        let prefix = TestRedis.uniquePrefix("rollback")
        let keys = PresenceKeys(prefix: prefix)
        // Two users whose devices live on one primary; the node's lease and index on another, so
        // neither the lease script nor the index sees that primary go back.
        let leasePort = try cluster.server(holding: keys.lease("node-0")).port
        var byServer: [Int: [String]] = [:]
        for index in 0..<100 {
            let port = try cluster.server(holding: keys.devices("user\(index)")).port
            if port != leasePort { byServer[port, default: []].append("user\(index)") }
        }
        let (rolledPort, users) = try #require(byServer.sorted { $0.key < $1.key }.first { $0.value.count >= 2 })
        let server = try #require(cluster.servers.first { $0.port == rolledPort })
        let gone = users[0], stays = users[1]
        try await withNodes(1, prefix: prefix, configure: { $0.redisURL = cluster.url }) { ports in
            let port = ports[0]
            try await ConversationTests.setUp(port, ["bob", gone, stays])
            let bob = try await MessageSessionTests.open(port, "bob", device: "phone")
            bob.send("subscribe", ["user_ids": [gone, stays]], id: "w")
            _ = try await bob.next("initial_state")
            let leaving = try await MessageSessionTests.open(port, gone, device: "phone")
            let staying = try await MessageSessionTests.open(port, stays, device: "phone")
            #expect(await eventually {
                let one = await Self.status(port, gone), other = await Self.status(port, stays)
                return one == "online" && other == "online"
            })
            try server.cli("SAVE")

            // After the snapshot: the first user signs off.
            leaving.closeNormally()
            #expect(await eventually { await Self.status(port, gone) == "offline" })
            _ = await bob.drain(for: .milliseconds(300))

            server.stop()
            try server.start()
            // Until the node hears from the others again, it answers CLUSTERDOWN.
            let back = await eventually(timeout: .seconds(5), poll: .milliseconds(50)) { ((try? server.cli("CLUSTER", "INFO")) ?? "").contains("cluster_state:ok") }
            let restored = try server.cli("HLEN", keys.devices(gone))
            #expect(back && restored.contains("1"), "the snapshot has the device that left: \(restored)")

            // Offline within a lease (3 s) plus a second, counted from the primary coming back.
            let settled = await eventually(timeout: .seconds(8)) { await Self.status(port, gone) == "offline" }
            #expect(settled, "\(gone), gone before the rollback, is offline again")
            #expect(await Self.status(port, stays) == "online")
            let seen = await bob.drain(for: .seconds(1))
            let flickers = seen.filter { $0.type == "presence_update" && $0.userID == stays && $0.status == "offline" }
            #expect(flickers.isEmpty, "\(flickers.map(\.data))")
            #expect(await staying.closed(timeout: .milliseconds(100)) == nil)
        }
    }
}
