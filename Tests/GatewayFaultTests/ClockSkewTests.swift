import ClientTestSupport
import Foundation
import PresenceClient
import RedisTestSupport
import Testing

/// Three gateway processes whose wall clocks disagree: one behind the machine's, one true, one
/// ahead (libfaketime, `SkewedClock`). Presence must not care: every moment one node writes and
/// another compares is Redis's.
///
/// Run with the heavy tests: three nodes and a minute of waiting.
@Suite("Nodes with skewed clocks", .serialized)
struct ClockSkewTests {
    struct Case: CustomTestStringConvertible, Sendable {
        let skew: Int
        let lease: Int
        let linger: Int
        var testDescription: String { "±\(skew) s, lease \(lease) s, linger \(linger) s" }
    }

    @Test("a node behind and a node ahead: nobody connected goes offline or flickers, and a drop goes offline after the linger by the true clock",
          arguments: [Case(skew: 2, lease: 3, linger: 2), Case(skew: 30, lease: 10, linger: 3)])
    func skewedNodes(_ setting: Case) async throws {
        let environment = nodeEnvironment(prefix: TestRedis.uniquePrefix("skew"), extra: [
            "PRESENCE_VISIBILITY": "open", "PRESENCE_LEASE_TTL": "\(setting.lease)", "PRESENCE_LINGER": "\(setting.linger)",
        ])
        let behind = try await GatewayProcess(nodeID: "behind", environment: environment.merging(try SkewedClock.environment(offset: -setting.skew)) { _, new in new })
        let truthful = try await GatewayProcess(nodeID: "true", environment: environment)
        let ahead = try await GatewayProcess(nodeID: "ahead", environment: environment.merging(try SkewedClock.environment(offset: setting.skew)) { _, new in new })
        // The skew is real: each node's Date header is off by what it was given (to the second).
        for (node, offset) in [(behind, -setting.skew), (truthful, 0), (ahead, setting.skew)] {
            let clock = try #require(GatewayProcess.wallClock(port: node.port), "\(node.nodeID) sends a Date header")
            #expect(abs(clock.timeIntervalSinceNow - Double(offset)) <= 1.5, "\(node.nodeID)'s clock is \(clock.timeIntervalSinceNow) s off, not \(offset) s")
        }

        // alice and dan on the node behind, carol on the node ahead; bob watches them from the true node.
        let peers = ["alice", "carol", "dan"]
        var alice = try await LiveClient("alice", device: "phone", nodes: [behind])
        let carol = try await LiveClient("carol", device: "phone", nodes: [ahead])
        let dan = try await LiveClient("dan", device: "phone", nodes: [behind])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [truthful])
        try await bob.client.watch(peers)
        // erin watches from the node ahead: the delivery latency it records must not hold its skew.
        let erin = try await LiveClient("erin", device: "tablet", nodes: [ahead])
        try await erin.client.watch(peers)
        for peer in peers { #expect(await bob.sees(peer, .online, within: .seconds(10)), "bob sees \(peer) online") }
        let reader = try await mint("reader")
        func rest(_ user: String, on node: GatewayProcess) -> String? {
            guard let read = GatewayProcess.httpGet(port: node.port, path: "/api/presence/users/\(user)", headers: ["Authorization": "Bearer \(reader)"]),
                  read.status == 200,
                  let body = try? JSONSerialization.jsonObject(with: Data(read.body.utf8)) as? [String: Any] else { return nil }
            return body["status"] as? String
        }

        // Two leases and more: the node ahead would have reaped the node behind by its own clock.
        let start = ContinuousClock.now
        var restAnswers: [String: Int] = [:]
        while ContinuousClock.now < start + .seconds(2 * setting.lease + 2) {
            for peer in peers {
                for node in [behind, truthful, ahead] { restAnswers["\(peer) \(rest(peer, on: node) ?? "no answer")", default: 0] += 1 }
            }
            try await Task.sleep(for: .milliseconds(500))
        }
        print("skew ±\(setting.skew) s: REST answers while everyone was connected: \(restAnswers.sorted { $0.key < $1.key })")
        #expect(restAnswers.keys.allSatisfy { $0.hasSuffix(" online") }, "REST says online on every node: \(restAnswers)")
        for peer in peers {
            #expect(bob.statusesSinceOnline(of: peer).allSatisfy { $0 == .online }, "bob never heard \(peer) go offline: \(bob.timeline(since: start, peer: peer))")
        }

        // A handoff off the node behind: a drop there, the same device back 0.3 s later on the true node.
        let handoff = ContinuousClock.now
        await alice.client.networkChanged(available: false)
        #expect(await alice.waitUntil { await $0.connectionState == .idle })
        try await Task.sleep(for: .milliseconds(300))
        alice = try await LiveClient("alice", device: "phone", nodes: [truthful])
        #expect(await alice.connected())
        try await Task.sleep(for: .seconds(setting.linger + 2))
        #expect(bob.statusesSinceOnline(of: "alice").allSatisfy { $0 == .online }, "no flicker on the handoff: \(bob.timeline(since: handoff, peer: "alice"))")
        #expect(rest("alice", on: truthful) == "online")

        // Drops on the node behind and on the node ahead at once: each offline after the linger,
        // by the true clock, give or take a second.
        let dropped = ContinuousClock.now
        await dan.client.networkChanged(available: false)
        await carol.client.networkChanged(available: false)
        for peer in ["dan", "carol"] {
            #expect(await bob.sees(peer, .offline, within: .seconds(setting.linger + 3)), "\(peer) goes offline")
            // The client's cache changes before its event reaches the test's log: wait for the event.
            func heard() -> ContinuousClock.Instant? { bob.arrivals(of: peer).first { $0.at >= dropped && $0.status == .offline }?.at }
            #expect(await eventually(timeout: .seconds(2)) { heard() != nil }, "bob's log has \(peer)'s offline: \(bob.timeline(since: dropped, peer: peer))")
            let offlineAt = try #require(heard())
            let after = offlineAt - dropped
            print("skew ±\(setting.skew) s: \(peer) dropped, bob heard offline after \(after) (linger \(setting.linger) s)")
            #expect(after >= .seconds(setting.linger - 1) && after <= .seconds(setting.linger + 1), "\(peer) offline after \(after), linger \(setting.linger) s")
            #expect(rest(peer, on: truthful) == "offline")
        }
        #expect(await erin.sees("dan", .offline), "erin, on the node ahead, heard the drop")
        // The node ahead timed its deliveries against Redis's clock, not its own.
        let metrics = GatewayProcess.httpGet(port: ahead.port, path: "/metrics")?.body ?? ""
        func value(_ name: String) -> Double? {
            metrics.split(separator: "\n").first { $0.hasPrefix(name + " ") }.flatMap { Double($0.split(separator: " ").last ?? "") }
        }
        let sum = try #require(value("presence_delivery_latency_seconds_sum"), "the node ahead reports delivery latency")
        let count = try #require(value("presence_delivery_latency_seconds_count"))
        print("skew ±\(setting.skew) s: the node ahead timed \(Int(count)) deliveries at \(sum / max(count, 1)) s on average")
        #expect(count > 0 && sum / count < 1, "mean delivery latency on the node \(setting.skew) s ahead: \(sum / max(count, 1)) s")
        #expect(bob.statusesSinceOnline(of: "alice").allSatisfy { $0 == .online }, "alice, connected all along, stays online")
    }
}
