import ClientTestSupport
import Foundation
import PresenceClient
import RedisTestSupport
import Testing

/// Redis stopped for a long while (30 s; `PRESENCE_OUTAGE_SECONDS` changes it) under two nodes
/// holding 40 sessions that keep changing their status throughout, with REST reads going on.
///
/// Run with the heavy tests (`make test` runs it alone): 40 clients and two nodes load 2 cores.
@Suite("Redis outages under load", .serialized)
struct OutageTests {
    static let outage = Int(ProcessInfo.processInfo.environment["PRESENCE_OUTAGE_SECONDS"] ?? "") ?? 30
    static let users = 40

    @Test("Redis down 30 s: sessions stay, REST and /readyz are 503, status changes made meanwhile are applied, and every watcher converges on the truth",
          arguments: [true, false])
    func outage(dataKept: Bool) async throws {
        let directory = NSTemporaryDirectory() + "presence-outage-" + UUID().uuidString.prefix(8).lowercased()
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let startedAt = ContinuousClock.now
        // With data kept: an append-only file synced on every write, loaded again at restart.
        let persistence = dataKept ? ["--appendonly", "yes", "--appendfsync", "always", "--dir", directory] : []
        let redis = try RedisServerProcess(arguments: persistence)
        let prefix = TestRedis.uniquePrefix("outage")
        let environment = nodeEnvironment(prefix: prefix, redisURL: redis.url(), extra: ["PRESENCE_VISIBILITY": "open"])
        let nodes = [
            try await GatewayProcess(nodeID: "a", environment: environment),
            try await GatewayProcess(nodeID: "b", environment: environment),
        ]
        let names = (0..<Self.users).map { "user\($0)" }
        var clients: [LiveClient] = []
        for (index, name) in names.enumerated() {
            clients.append(try await LiveClient(name, device: "phone", nodes: [nodes[index % 2]]))
        }
        for client in clients { try await client.client.watch(names.filter { $0 != client.user }) }
        for client in clients { #expect(await client.connected(), "\(client.user) connected") }
        let allOnline = await eventually(timeout: .seconds(20), poll: .milliseconds(50)) {
            for client in clients {
                for name in names where name != client.user {
                    if await client.client.presence(of: name)?.status != .online { return false }
                }
            }
            return true
        }
        try #require(allOnline, "every client sees the other 39 online before the outage")
        let reader = try await mint("reader")
        // `connections` counts the events the client's consumer has read: wait for it to count
        // the session each client already reports connected (two were still at 0 in a CI run).
        for client in clients { #expect(await client.waitUntil(.seconds(2)) { _ in client.connections >= 1 }, "\(client.user)'s session counted") }
        let connectionsBefore = clients.map(\.connections)

        // Redis goes away. Clients keep changing status all through the outage; the last change
        // of each is the truth the watchers must reach afterwards.
        redis.stop()
        let stoppedAt = ContinuousClock.now
        var truth: [String: PresenceStatus] = [:]
        var restStatuses: [Int: Int] = [:]
        var restCodes: Set<String> = []
        var readyz: [Int: Int] = [:]
        var round = 0
        while ContinuousClock.now < stoppedAt + .seconds(Self.outage) {
            for (index, client) in clients.enumerated() where (index + round) % 4 == 0 {
                let status: PresenceStatus = (index + round) % 8 == 0 ? .away : .online
                await client.client.setStatus(status)
                truth[client.user] = status
            }
            if ContinuousClock.now > stoppedAt + .seconds(1) {
                let node = nodes[round % 2]
                if let read = GatewayProcess.httpGet(port: node.port, path: "/api/presence/users/\(names[round % Self.users])", headers: ["Authorization": "Bearer \(reader)"]) {
                    restStatuses[read.status, default: 0] += 1
                    let body = try? JSONSerialization.jsonObject(with: Data(read.body.utf8)) as? [String: Any]
                    restCodes.insert((body?["error"] as? [String: Any])?["code"] as? String ?? read.body)
                }
                if let ready = GatewayProcess.httpStatus(port: node.port, path: "/readyz") { readyz[ready, default: 0] += 1 }
            }
            round += 1
            try await Task.sleep(for: .milliseconds(500))
        }
        let finalAway = Set(clients.indices.filter { $0 % 3 == 0 }.map { names[$0] })
        for client in clients {
            let status: PresenceStatus = finalAway.contains(client.user) ? .away : .online
            await client.client.setStatus(status)
            truth[client.user] = status
        }
        let stillConnected = await eventually(timeout: .seconds(1)) {
            for client in clients where await client.client.connectionState != .connected { return false }
            return true
        }
        let refusals = clients.reduce(0) { sum, client in
            sum + client.events.filter { if case .error(let code, _) = $0 { code == .unavailable } else { false } }.count
        }
        print("outage (\(dataKept ? "data kept" : "restarted empty")): \(Self.outage) s; REST \(restStatuses) codes \(restCodes); /readyz \(readyz); status refusals \(refusals)")
        #expect(stillConnected && clients.map(\.connections) == connectionsBefore,
                "every session stayed open through the outage: \(Self.reconnected(clients, since: connectionsBefore, at: stoppedAt))")
        #expect(!restStatuses.isEmpty && restStatuses.keys.allSatisfy { $0 == 503 } && restCodes == ["unavailable"], "REST: \(restStatuses) \(restCodes)")
        #expect(!readyz.isEmpty && readyz.keys.allSatisfy { $0 == 503 }, "/readyz: \(readyz)")
        #expect(refusals > 0, "status changes made during the outage were answered with error unavailable")

        // Redis returns: within seconds every session is present with its last status, and every
        // watcher holds that truth.
        try redis.start()
        let returnedAt = ContinuousClock.now
        func converged() async -> Bool {
            for client in clients {
                for name in names where name != client.user {
                    if await client.client.presence(of: name)?.status != truth[name] { return false }
                }
            }
            for (index, name) in names.enumerated() {
                guard let read = GatewayProcess.httpGet(port: nodes[index % 2].port, path: "/api/presence/users/\(name)", headers: ["Authorization": "Bearer \(reader)"]),
                      read.status == 200, read.body.contains(#""status":"\#(truth[name]!.rawValue)""#) else { return false }
            }
            return true
        }
        let recovered = await eventually(timeout: .seconds(20), poll: .milliseconds(100)) { await converged() }
        let recovery = ContinuousClock.now - returnedAt
        print("outage (\(dataKept ? "data kept" : "restarted empty")): every watcher and REST read agree with the truth \(recovery) after Redis returned")
        if !recovered {
            for client in clients.prefix(3) {
                let seen = await names.asyncMap { ($0, await client.client.presence(of: $0)?.status) }
                let wrong = seen.filter { $0.1 != truth[$0.0] && $0.0 != client.user }
                print("outage: \(client.user) holds \(wrong)")
                for (name, _) in wrong.prefix(2) {
                    let read = GatewayProcess.httpGet(port: nodes[0].port, path: "/api/presence/users/\(name)", headers: ["Authorization": "Bearer \(reader)"])
                    print("outage: \(name) truth \(truth[name]!), REST \(String(describing: read)); heard since the return:\n  " + client.timeline(since: returnedAt, peer: name).joined(separator: "\n  "))
                }
            }
        }
        #expect(recovered, "converged within 20 s of Redis returning")
        // Watchers may have the truth before a node's subscriber is back: a node that finds its
        // lease gone re-reads them over the command connection. The subscriber comes back
        // after its own backoff (at most 5 s), and the node is ready again with it.
        for node in nodes {
            let ready = await eventually(timeout: .seconds(10), poll: .milliseconds(100)) {
                GatewayProcess.httpStatus(port: node.port, path: "/readyz") == 200
            }
            #expect(ready, "node \(node.nodeID) not ready within 10 s; it printed:\n\(node.output.suffix(3000))")
        }
        print("outage (\(dataKept ? "data kept" : "restarted empty")): both nodes ready \(ContinuousClock.now - returnedAt) after Redis returned")
        #expect(clients.map(\.connections) == connectionsBefore,
                "no session was dropped on the way back: \(Self.reconnected(clients, since: connectionsBefore, at: stoppedAt))")
        // Nobody disconnected, so no watcher may have been shown anyone offline.
        let offline = clients.flatMap { watcher in names.filter { watcher.statusesSinceOnline(of: $0).contains(.offline) }.map { "\(watcher.user) saw \($0)" } }
        #expect(offline.isEmpty, "offline shown for live users: \(offline.prefix(5)); \(Self.offlineTimelines(clients, since: startedAt))")
    }

    /// The clients whose session count changed since `before`, with their connection states
    /// since `start`: for explaining a failure.
    static func reconnected(_ clients: [LiveClient], since before: [Int], at start: ContinuousClock.Instant) -> [String] {
        zip(clients, before).filter { $0.connections != $1 }.prefix(3).map { client, count in
            "\(client.user) (\(count) → \(client.connections)): " + client.timeline(since: start).joined(separator: ", ")
        }
    }

    /// For the first two watchers shown a live user offline: what each heard of that user since
    /// `start`.
    static func offlineTimelines(_ clients: [LiveClient], since start: ContinuousClock.Instant) -> [String] {
        let names = clients.map(\.user)
        return clients.compactMap { watcher in
            names.first { watcher.statusesSinceOnline(of: $0).contains(.offline) }.map { name in
                "\(watcher.user) on \(name): " + watcher.timeline(since: start, peer: name).joined(separator: ", ")
            }
        }.prefix(2).map { $0 }
    }
}

extension Sequence {
    func asyncMap<T>(_ transform: (Element) async -> T) async -> [T] {
        var results: [T] = []
        for element in self { results.append(await transform(element)) }
        return results
    }
}
