import ClientTestSupport
import Foundation
import JWTKit
import Logging
import NIOConcurrencyHelpers
import PresenceProtocol
import RedisClient
import RedisTestSupport
import Testing

@testable import PresenceClient

@Suite("PresenceClient against live gateway processes", .serialized)
struct ClientLiveTests {
    /// Nodes "doomed" and "survivor" with a 5 s lease (a reconnect must be registered on the
    /// survivor before the dead node is reaped, and beside the parallel suites on 2 cores that
    /// took more than the usual 3 s), alice and bob in one conversation.
    private func doomedAndSurvivor(_ name: String) async throws -> (doomed: GatewayProcess, survivor: GatewayProcess) {
        let environment = nodeEnvironment(prefix: TestRedis.uniquePrefix(name), extra: ["PRESENCE_LEASE_TTL": "5"])
        let doomed = try await GatewayProcess(nodeID: "doomed", environment: environment)
        let survivor = try await GatewayProcess(nodeID: "survivor", environment: environment)
        #expect(admin(survivor, "PUT", "/api/admin/conversations/room", #"{"member_ids":["alice","bob"]}"#)?.status == 200)
        return (doomed, survivor)
    }

    @Test("survives the kill of its node: reconnects to the other, and its watcher never sees it offline")
    func nodeKilled() async throws {
        let (doomed, survivor) = try await doomedAndSurvivor("sdk-kill")
        let alice = try await LiveClient("alice", device: "phone", nodes: [doomed, survivor])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [survivor])
        #expect(await alice.connected())
        #expect(await bob.connected())
        #expect(await bob.sees("alice", .online))
        // Session counts are published with each lease renewal (every lease/3 s).
        let onDoomed = await eventually(timeout: .seconds(5)) {
            admin(doomed, "GET", "/api/admin/nodes")?.body.contains(#""node_id":"doomed","sessions":1"#) == true
        }
        #expect(onDoomed, "alice is on the doomed node")

        let killedAt = ContinuousClock.now
        doomed.kill()
        #expect(await alice.waitUntil { _ in alice.connections >= 2 }, "alice reconnected")
        let reconnect = ContinuousClock.now - killedAt
        print("reconnect after SIGKILL of the node: \(reconnect)")
        // One attempt, after the first backoff step (1 s ± 20 %): counted rather than timed, as
        // a connect beside the parallel suites can take a second of its own.
        let attempts = alice.timeline(since: killedAt).filter { $0.hasSuffix(" connecting") }.count
        #expect(attempts == 1, "reconnected on the first attempt: \(alice.timeline(since: killedAt))")
        #expect(reconnect < .seconds(5), "within the first backoff step plus a connect")
        // Past the dead node's lease (5 s) and a reaper period: the reaper has run for it.
        try await Task.sleep(until: killedAt + .seconds(7))
        #expect(!bob.statusesSinceOnline(of: "alice").contains(.offline), "no offline flicker: \(bob.statuses(of: "alice"))")
        #expect(await bob.client.presence(of: "alice")?.status == .online)
        let nodes = admin(survivor, "GET", "/api/admin/nodes")?.body ?? ""
        #expect(!nodes.contains("doomed") && nodes.contains(#""sessions":2"#), "the dead node is gone, both sessions on the survivor: \(nodes)")
        await alice.client.setStatus(.away)
        #expect(await bob.sees("alice", .away), "the new session carries changes")
    }

    /// Its node killed and the next URL down too: the SDK waits the first backoff, finds nobody
    /// at the next URL, and tries the one after at once. (Before, the refused attempt waited the
    /// second backoff, 2 s, which outlasted the device's linger: `ChaosTests` seed 3.)
    @Test("its node killed and the next URL down too: the one after is tried at once, and its watcher never sees it offline")
    func nextNodeDown() async throws {
        let (doomed, survivor) = try await doomedAndSurvivor("sdk-next-down")
        let down = try RefusingPort()
        let alice = try await LiveClient("alice", device: "phone", ports: [doomed.port, down.port, survivor.port])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [survivor])
        #expect(await alice.connected())
        #expect(await bob.sees("alice", .online))

        let killedAt = ContinuousClock.now
        doomed.kill()
        #expect(await alice.waitUntil { _ in alice.connections >= 2 }, "alice reconnected")
        let timeline = alice.timeline(since: killedAt)
        print("reconnect after SIGKILL with the next URL down: \(ContinuousClock.now - killedAt), \(timeline)")
        // Counted rather than timed: one wait, the drop's backoff; then nobody at the second URL
        // and the survivor at the third, one after the other while the client stays
        // "connecting" (before: a second wait between them).
        #expect(timeline.filter { $0.contains(" waiting") }.count == 1, "one wait, the drop's: \(timeline)")
        // Past the dead node's lease (5 s) and a reaper period.
        try await Task.sleep(until: killedAt + .seconds(7))
        #expect(!bob.statusesSinceOnline(of: "alice").contains(.offline), "no offline flicker: \(bob.statuses(of: "alice"))")
        #expect(await bob.client.presence(of: "alice")?.status == .online)
        withExtendedLifetime(down) {}
    }

    @Test("watching a contact under conversations visibility keeps it, through a reconnect: no 'no longer visible'")
    func contactsKept() async throws {
        let started = ContinuousClock.now
        let prefix = TestRedis.uniquePrefix("sdk-contact")
        let node = try await GatewayProcess(nodeID: "n1", environment: nodeEnvironment(prefix: prefix))
        #expect(admin(node, "PUT", "/api/admin/conversations/room", #"{"member_ids":["alice","bob"]}"#)?.status == 200)
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        // bob watches alice from before he connects, as `presence-client --watch alice` does.
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node]) { _ in }
        try await bob.client.watch(["alice"])
        #expect(await alice.connected())
        #expect(await bob.sees("alice", .online))
        // Connected, not only told of alice: an initial_state comes before the session counts
        // as open, and a drop in between would be no reconnect.
        #expect(await bob.connected())
        // A reconnect subscribes again to users the server already knows bob watches... it is a
        // new session, but the answer must hold alice either way.
        let dropped = ContinuousClock.now
        await bob.client.networkChanged(available: false)
        #expect(await bob.waitUntil { await $0.connectionState == .idle })
        await bob.client.networkChanged(available: true)
        let reconnected = await bob.waitUntil { _ in bob.connectedAt.contains { $0 > dropped } }
        let state = await bob.client.connectionState
        #expect(reconnected, "bob connected again: \(bob.timeline(since: started)) (dropped at +\(dropped - started)); now \(state)")
        try await Task.sleep(for: .milliseconds(500))
        #expect(!bob.events.contains(.removed(userID: "alice")), "alice was never dropped as invisible: \(bob.events)")
        #expect(await bob.client.presence(of: "alice")?.status == .online)
    }

    @Test("a token that expires: 4001, a refreshed token, a reconnect, and no offline for watchers")
    func tokenExpiry() async throws {
        let prefix = TestRedis.uniquePrefix("sdk-token")
        let node = try await GatewayProcess(nodeID: "node", environment: nodeEnvironment(prefix: prefix))
        #expect(admin(node, "PUT", "/api/admin/conversations/room", #"{"member_ids":["alice","bob"]}"#)?.status == 200)
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        #expect(await bob.connected())
        let alice = try await LiveClient("alice", device: "phone", nodes: [node], tokenLifetime: 2)
        #expect(await alice.connected())
        #expect(await bob.sees("alice", .online))
        #expect(await alice.waitUntil(.seconds(8)) { _ in alice.connections >= 2 }, "reconnected after the token expired")
        #expect(alice.calls.withLockedValue { $0.dropFirst().contains(true) }, "asked for a fresh token: \(alice.calls.withLockedValue { $0 })")
        #expect(await alice.connected())
        try await Task.sleep(for: .milliseconds(500))
        #expect(!bob.statusesSinceOnline(of: "alice").contains(.offline), "\(bob.statuses(of: "alice"))")
    }

    @Test("Redis restarts empty: the session stays, the device comes back, and changes flow again")
    func redisRestart() async throws {
        let redis = try RedisServerProcess()
        let prefix = TestRedis.uniquePrefix("sdk-redis")
        let node = try await GatewayProcess(nodeID: "node", environment: nodeEnvironment(prefix: prefix, redisURL: redis.url(), extra: ["PRESENCE_VISIBILITY": "open"]))
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        try await bob.client.watch(["alice"])
        #expect(await alice.connected())
        #expect(await bob.sees("alice", .online))

        redis.stop()
        try await Task.sleep(for: .milliseconds(500))
        try redis.start()
        // The node re-registers its sessions; the user reads online again without a reconnect.
        let reader = try await mint("carol")
        let back = await eventually(timeout: .seconds(10), poll: .milliseconds(100)) {
            GatewayProcess.httpGet(port: node.port, path: "/api/presence/users/alice", headers: ["Authorization": "Bearer \(reader)"])?.body.contains(#""status":"online""#) == true
        }
        #expect(back, "alice is present again after Redis lost everything")
        #expect(await alice.client.connectionState == .connected)
        await alice.client.setStatus(.away)
        #expect(await bob.sees("alice", .away, within: .seconds(10)), "bob hears changes after the restart: \(bob.statuses(of: "alice"))")
    }

    @Test("a node on rediss:// (TLS, client certificate): sessions register, fan-out and REST work")
    func overTLS() async throws {
        let certificates = try TestCertificates()
        let tlsPort = try RedisServerProcess.freePort()
        let redis = try RedisServerProcess(arguments: certificates.redisArguments(tlsPort: tlsPort, clientCertificates: true))
        let url = "rediss://localhost:\(tlsPort)/0?ca=\(certificates.caFile)&cert=\(certificates.clientCertificateFile)&key=\(certificates.clientKeyFile)"
        let prefix = TestRedis.uniquePrefix("sdk-tls")
        let node = try await GatewayProcess(nodeID: "tls", environment: nodeEnvironment(prefix: prefix, redisURL: url, extra: ["PRESENCE_VISIBILITY": "open"]))
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        try await bob.client.watch(["alice"])
        #expect(await alice.connected())
        #expect(await bob.sees("alice", .online))
        await alice.client.setStatus(.away)
        #expect(await bob.sees("alice", .away, within: .seconds(5)), "a change published over TLS reaches the watcher: \(bob.statuses(of: "alice"))")
        let reader = try await mint("carol")
        let read = GatewayProcess.httpGet(port: node.port, path: "/api/presence/users/alice", headers: ["Authorization": "Bearer \(reader)"])
        #expect(read?.status == 200 && read?.body.contains(#""status":"away""#) == true, "\(String(describing: read))")
        // The keys are in the TLS server's data (read back over its plain port).
        try await RedisClient.withClient(configuration: RedisConfiguration(url: redis.url()), logger: TestRedis.logger()) { client in
            let keys = try await client.send("KEYS", RedisArgument("\(prefix):*")).array ?? []
            #expect(keys.count >= 3, "presence keys written over TLS: \(keys)")
        }
    }

    @Test("two nodes on rediss+cluster:// (a cluster that speaks TLS, client certificate): presence, typing and messages cross between them, every connection on a TLS port")
    func overTLSCluster() async throws {
        let cluster = try await LocalTLSCluster(clientCertificates: true)
        let environment = nodeEnvironment(prefix: TestRedis.uniquePrefix("sdk-tls-cluster"), redisURL: cluster.url(seeds: [0, 1]), extra: ["PRESENCE_VISIBILITY": "open"])
        let first = try await GatewayProcess(nodeID: "tls-a", environment: environment)
        let second = try await GatewayProcess(nodeID: "tls-b", environment: environment)
        #expect(admin(first, "PUT", "/api/admin/conversations/room", #"{"member_ids":["alice","bob"]}"#)?.status == 200)
        let alice = try await LiveClient("alice", device: "phone", nodes: [first]) { $0.typingIdleTimeout = 0.5 }
        let bob = try await LiveClient("bob", device: "laptop", nodes: [second])
        try await alice.client.join(conversation: "room")
        try await bob.client.join(conversation: "room")
        try await bob.client.watch(["alice"])
        #expect(await alice.connected())
        #expect(await bob.sees("alice", .online, within: .seconds(10)))
        await alice.client.setStatus(.away)
        #expect(await bob.sees("alice", .away, within: .seconds(5)), "a change on one node reaches a watcher on the other: \(bob.statuses(of: "alice"))")
        try await alice.client.userTyped(in: "room")
        #expect(await bob.waitUntil(.seconds(5)) { await $0.typingUsers(in: "room") == ["alice"] }, "typing crosses the nodes")
        for text in ["one", "two", "three"] { try await alice.client.send(text, to: "room") }
        #expect(await bob.waitUntil(.seconds(5)) { await $0.messages(in: "room").map(\.text) == ["one", "two", "three"] }, "messages cross the nodes in order")
        #expect(await bob.client.messages(in: "room").compactMap(\.seq) == [1, 2, 3])
        // Both nodes talked to the cluster (its keys are in it) and never through a plain port.
        let keys = try cluster.servers.reduce(0) { $0 + (Int(try $1.cli("DBSIZE").trimmingCharacters(in: .whitespacesAndNewlines)) ?? 0) }
        #expect(keys > 0)
        let tls = try cluster.clients(onTLSPort: true)
        #expect(tls.count >= 6, "each node has command and subscriber connections to the primaries: \(tls.count)")
        // presencectl takes the same URL.
        var root = URL(fileURLWithPath: #filePath)
        for _ in 0..<3 { root.deleteLastPathComponent() }
        let read = try runProcess(root.appendingPathComponent(".build/debug/presencectl").path,
                                  ["user", "alice", "--redis-url", cluster.url(), "--key-prefix", environment["PRESENCE_KEY_PREFIX"]!, "--json"])
        #expect(read.status == 0 && read.output.contains("away"), "presencectl reads alice over TLS: \(read.output.suffix(600))")
        let plain = try cluster.clients(onTLSPort: false)
        #expect(plain.isEmpty, "no connection on a plain port: \(plain)")
    }

    @Test("a node on rediss+sentinel:// (Sentinels and servers that speak TLS): sessions register and fan-out works, every connection of the node at a TLS port")
    func overTLSSentinel() async throws {
        let set = try await LocalSentinels(tls: TestCertificates())
        let node = try await GatewayProcess(nodeID: "tls-sentinel", environment: nodeEnvironment(prefix: TestRedis.uniquePrefix("sdk-tls-sentinel"), redisURL: set.url(), extra: ["PRESENCE_VISIBILITY": "open"]))
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        try await bob.client.watch(["alice"])
        #expect(await alice.connected())
        #expect(await bob.sees("alice", .online, within: .seconds(10)))
        await alice.client.setStatus(.away)
        #expect(await bob.sees("alice", .away, within: .seconds(5)), "a change published over TLS reaches the watcher: \(bob.statuses(of: "alice"))")
        // Nothing but the test's redis-cli at a plain port of a server or a Sentinel.
        let plain = try set.clients(onTLSPort: false)
        #expect(plain.isEmpty, "\(plain)")
    }

    @Test("a node given rediss+cluster:// with the wrong CA is not ready, and its log says the certificate was refused")
    func tlsClusterWrongCA() async throws {
        let cluster = try await LocalTLSCluster(clientCertificates: false)
        let environment = nodeEnvironment(prefix: TestRedis.uniquePrefix("sdk-tls-ca"), redisURL: cluster.url(ca: cluster.certificates.otherCAFile, clientCertificate: false))
        let node = try await GatewayProcess(nodeID: "tls-wrong-ca", environment: environment)
        let said = await eventually(timeout: .seconds(10), poll: .milliseconds(100)) { node.output.contains("CERTIFICATE_VERIFY_FAILED") }
        #expect(said, "the log names the refused certificate: \(node.output.suffix(1500))")
        #expect(GatewayProcess.httpStatus(port: node.port, path: "/readyz") == 503)
    }

    @Test("app lifecycle: background is away, typing starts and stops, appearing offline hides typing, network loss does not flicker, sign-out is offline at once")
    func lifecycle() async throws {
        let prefix = TestRedis.uniquePrefix("sdk-life")
        let node = try await GatewayProcess(nodeID: "node", environment: nodeEnvironment(prefix: prefix))
        #expect(admin(node, "PUT", "/api/admin/conversations/room", #"{"member_ids":["alice","bob"]}"#)?.status == 200)
        let alice = try await LiveClient("alice", device: "phone", nodes: [node]) { $0.typingIdleTimeout = 0.5 }
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        try await alice.client.join(conversation: "room")
        try await bob.client.join(conversation: "room")
        #expect(await alice.connected())
        #expect(await bob.connected())
        #expect(await bob.sees("alice", .online))
        #expect(await bob.waitUntil { await $0.group("room")?.online == 2 }, "2 of 2 online")

        await alice.client.didEnterBackground()
        #expect(await bob.sees("alice", .away))
        await alice.client.didBecomeActive()
        #expect(await bob.sees("alice", .online))

        try await alice.client.userTyped(in: "room")
        #expect(await bob.waitUntil { await $0.typingUsers(in: "room") == ["alice"] })
        #expect(await bob.waitUntil(.seconds(3)) { await $0.typingUsers(in: "room").isEmpty }, "stopped after idling")

        await alice.client.setStatus(.offline)
        #expect(await bob.sees("alice", .offline))
        let typingStart = PresenceClientEvent.typing(conversationID: "room", userID: "alice", isTyping: true)
        let startsBefore = bob.events.filter { $0 == typingStart }.count
        try await alice.client.userTyped(in: "room")
        try await Task.sleep(for: .milliseconds(700))
        #expect(bob.events.filter { $0 == typingStart }.count == startsBefore, "no typing from a device appearing offline")
        await alice.client.setStatus(.online)
        #expect(await bob.sees("alice", .online))

        let before = bob.statuses(of: "alice").count
        await alice.client.networkChanged(available: false)
        #expect(await alice.waitUntil { await $0.connectionState == .idle })
        await alice.client.networkChanged(available: true)
        #expect(await alice.waitUntil { _ in alice.connections >= 2 })
        try await Task.sleep(for: .milliseconds(300))
        #expect(!bob.statuses(of: "alice").dropFirst(before).contains(.offline), "a short network loss shows no offline")

        let signedOut = ContinuousClock.now
        await alice.client.signOut()
        #expect(await bob.sees("alice", .offline, within: .seconds(1.5)), "offline at once, not after the linger")
        print("sign-out to watcher offline: \(ContinuousClock.now - signedOut)")
        #expect(await alice.finished(within: .seconds(3)), "run() returns after sign-out")
        #expect(await alice.client.connectionState == .stopped(.signedOut))
    }

    @Test("SIGTERM: /readyz answers 503 from the start of the drain to the exit, new upgrades are refused, and a held session gets 1001")
    func drain() async throws {
        let prefix = TestRedis.uniquePrefix("sdk-drain")
        let node = try await GatewayProcess(nodeID: "node", environment: nodeEnvironment(prefix: prefix))
        // Ready once its lease is taken and its subscriber connected, which may trail /healthz.
        #expect(await eventually(timeout: .seconds(5)) { GatewayProcess.httpStatus(port: node.port, path: "/readyz") == 200 })
        // A client that never answers the close keeps the drain going until the node's close
        // watchdog shuts its connection (2 s): long enough to watch /readyz.
        let held = try RawWebSocketClient(port: node.port, token: try await mint("alice"), device: "phone", watching: [], receiveBuffer: nil)
        #expect(await eventually(timeout: .seconds(5)) { node.openSessions == 1 })
        node.terminate()
        let terminatedAt = ContinuousClock.now
        let draining = await eventually(timeout: .seconds(2), poll: .milliseconds(5)) {
            GatewayProcess.httpStatus(port: node.port, path: "/readyz") == 503
        }
        try #require(draining, "/readyz turned 503 once SIGTERM arrived")
        do {
            _ = try RawWebSocketClient(port: node.port, token: "irrelevant", device: "tablet", watching: [], receiveBuffer: nil)
            Issue.record("a new upgrade is refused while draining")
        } catch {
            // 503, so that a balancer retries it elsewhere (an empty reply before).
            #expect("\(error)".contains("HTTP/1.1 503"), "refused with 503: \(error)")
        }
        var statuses: [Int: Int] = [:]
        while let status = GatewayProcess.httpStatus(port: node.port, path: "/readyz"), ContinuousClock.now < terminatedAt + .seconds(10) {
            statuses[status, default: 0] += 1
            try await Task.sleep(for: .milliseconds(20))
        }
        print("drain: /readyz answered \(statuses) after turning 503, until the node stopped listening \(ContinuousClock.now - terminatedAt) after SIGTERM")
        #expect(statuses[503, default: 0] > 10, "503 throughout the drain (about 2 s at 20 ms a poll): \(statuses)")
        #expect(statuses.keys.allSatisfy { $0 == 503 }, "never ready again: \(statuses)")
        let close = held.readFrames(within: .seconds(3)).last { $0.opcode == 8 }
        let code = close.flatMap { $0.payload.count >= 2 ? Int($0.payload[0]) << 8 | Int($0.payload[1]) : nil }
        #expect(code == 1001, "the held session was closed with 1001")
        #expect(await node.exited(within: .seconds(10)), "the node exits once its sessions are gone")
    }

    @Test("a gateway that takes the connection and never answers: the attempt is given up after openTimeout and the next URL is tried")
    func silentGateway() async throws {
        let silent = try SilentListener()
        let prefix = TestRedis.uniquePrefix("sdk-silent")
        let node = try await GatewayProcess(nodeID: "node", environment: nodeEnvironment(prefix: prefix))
        let started = ContinuousClock.now
        let alice = try await LiveClient("alice", device: "phone", ports: [silent.port, node.port]) { $0.openTimeout = 1 }
        #expect(await alice.connected(), "connected to the second URL")
        let took = ContinuousClock.now - started
        print("silent gateway: given up and connected to the next URL \(took) after the start")
        // 1 s of silence, then the next URL at once: a node that never answered cannot serve
        // (before, the first backoff came between, 1 s ± 20 %: 1.8 s at the least).
        #expect(took >= .seconds(1) && took < .milliseconds(1_800), "took \(took)")
        // Counted by the client's event consumer, a moment after the state says connected.
        let counted = await eventually(timeout: .seconds(2)) { alice.connections == 1 }
        #expect(counted && alice.connections == 1, "one session, on the second URL: \(alice.connections)")
    }

    @Test("a transport's session outlives the cancellation of an earlier attempt that still waits for its upgrade")
    func overlappingAttempts() async throws {
        // A device that drops a session and opens the next at once can leave the first attempt
        // waiting for its upgrade while the second opens; cancelling the first must end it alone.
        let silent = try SilentListener()
        let node = try await GatewayProcess(nodeID: "node", environment: nodeEnvironment(prefix: TestRedis.uniquePrefix("sdk-overlap")))
        let transport = WebSocketTransport(logger: TestRedis.logger("transport"))
        let (quiet, _) = AsyncStream.makeStream(of: OutgoingFrame.self)
        let waitingEnded = NIOLockedValueBox(false)
        let waiting = Task {
            _ = try? await transport.session(url: URL(string: "ws://127.0.0.1:\(silent.port)/api/presence/subscribe")!, outgoing: quiet) { _ in }
            waitingEnded.withLockedValue { $0 = true }
        }
        #expect(await eventually(timeout: .seconds(5)) { silent.accept(within: .zero) }, "the first attempt connected and waits for its upgrade")

        let token = try await mint("alice")
        let url = URL(string: "ws://127.0.0.1:\(node.port)/api/presence/subscribe?token=\(token)&device_id=phone")!
        let received = NIOLockedValueBox<[String]>([])
        let sessionEnded = NIOLockedValueBox<(ended: Bool, code: UInt16?)>((false, nil))
        let (outgoing, frames) = AsyncStream.makeStream(of: OutgoingFrame.self)
        let session = Task {
            let code = try? await transport.session(url: url, outgoing: outgoing) { text in received.withLockedValue { $0.append(text) } }
            sessionEnded.withLockedValue { $0 = (true, code) }
        }
        defer { session.cancel() }
        #expect(await eventually(timeout: .seconds(5)) { received.withLockedValue { $0.contains { $0.contains("initial_state") } } }, "the second session opened")

        waiting.cancel()
        #expect(await eventually(timeout: .seconds(5)) { waitingEnded.withLockedValue { $0 } }, "the cancelled attempt ended")
        try await Task.sleep(for: .milliseconds(300))
        #expect(!sessionEnded.withLockedValue { $0.ended }, "the open session goes on")
        frames.yield(.text(FrameCoder().text(ClientMessage(.ping, id: "still-there"))))
        #expect(await eventually(timeout: .seconds(3)) { received.withLockedValue { $0.contains { $0.contains("pong") } } }, "and answers: \(received.withLockedValue { $0 })")
        frames.yield(.close(.normal))
        #expect(await eventually(timeout: .seconds(5)) { sessionEnded.withLockedValue { $0.ended } })
        #expect(sessionEnded.withLockedValue { $0.code } == 1000, "closed the ordinary way")
    }

    @Test("an admin disconnect (4003) stops the client for good")
    func adminDisconnect() async throws {
        let prefix = TestRedis.uniquePrefix("sdk-admin")
        let node = try await GatewayProcess(nodeID: "node", environment: nodeEnvironment(prefix: prefix))
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        #expect(await alice.connected())
        #expect(admin(node, "POST", "/api/admin/users/alice/disconnect")?.status == 200)
        #expect(await alice.waitUntil { await $0.connectionState == .stopped(.disconnectedByAdmin) })
        #expect(await alice.finished(within: .seconds(3)))
        try await Task.sleep(for: .milliseconds(300))
        #expect(alice.connections == 1, "no reconnect after 4003")
    }

    @Test("presence-client, the terminal client: prints changes, takes commands, signs out on quit")
    func terminalClient() async throws {
        let prefix = TestRedis.uniquePrefix("sdk-cli")
        let node = try await GatewayProcess(nodeID: "node", environment: nodeEnvironment(prefix: prefix, extra: ["PRESENCE_VISIBILITY": "open"]))
        let terminal = try await TerminalClient(node, user: "bob", ["--watch", "alice"])
        defer { terminal.stop() }
        #expect(await terminal.printed("[connected]"))
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        #expect(await alice.connected())
        try await alice.client.watch(["bob"])
        #expect(await alice.sees("bob", .online))
        #expect(await terminal.printed("alice: Online"))
        await alice.client.setStatus(.away)
        #expect(await terminal.printed("alice: Away"))
        terminal.type("list")
        #expect(await terminal.printed("alice  Away"))
        terminal.type("quit")
        #expect(await alice.sees("bob", .offline, within: .seconds(1.5)), "a clean close: offline before the 2 s linger")
        #expect(await eventually(timeout: .seconds(5)) { !terminal.process.isRunning }, "quit ends the client")
        #expect(terminal.process.terminationStatus == 0)
        #expect(await terminal.printed("[signed out]"))
    }

    @Test("presence-client --chat: typed lines are messages; written while /offline they wait as sending and go out on /online")
    func terminalChat() async throws {
        let prefix = TestRedis.uniquePrefix("sdk-chat")
        let node = try await GatewayProcess(nodeID: "node", environment: nodeEnvironment(prefix: prefix))
        #expect(admin(node, "PUT", "/api/admin/conversations/room", #"{"member_ids":["alice","bob"]}"#)?.status == 200)
        let terminal = try await TerminalClient(node, user: "bob", ["--chat", "room"])
        defer { terminal.stop() }
        #expect(await terminal.printed("[connected]"))
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        #expect(await alice.connected())
        #expect(await terminal.printed("room: 2 of 2 online"))
        // Members away are counted beside the SDK's "2 of 2 online" (they were not printed).
        await alice.client.setStatus(.away)
        #expect(await terminal.printed("room: 1 of 2 online, 1 away"))
        await alice.client.setStatus(.online)
        // One's own status is echoed (nothing was printed for it).
        terminal.type("/away")
        #expect(await terminal.printed("you: away on this device"))
        terminal.type("/offline")
        #expect(await terminal.printed("[idle]"))
        terminal.type("written offline")
        #expect(await terminal.printed("me: written offline  [sending]"))
        try await Task.sleep(for: .milliseconds(300))
        #expect(await alice.client.messages(in: "room").isEmpty)
        terminal.type("/online")
        #expect(await alice.waitUntil { await $0.messages(in: "room").map(\.text) == ["written offline"] })
        // Its line is printed from the ack (sender "me") or from the gateway's copy (bob),
        // whichever comes first.
        #expect(await terminal.printedLine("room #1 ", ": written offline  [sent]"))
        try await alice.client.send("hi bob", to: "room")
        #expect(await terminal.printed("room #2 alice: hi bob  [delivered]"))
        terminal.type("/quit")
        #expect(await eventually(timeout: .seconds(5)) { !terminal.process.isRunning }, "quit ends the client")
        #expect(terminal.process.terminationStatus == 0)
    }
}

extension ClientLiveTests {
    /// Fails before the change: in a pipe whose reader had gone the client ran on (and trapped
    /// with SIGILL on its next line), and a refused fixed token was retried for ever.
    @Test("presence-client ends quietly (status 0) when the reader of its pipe goes away, and stops with 77 on a refused token")
    func terminalClientEdges() async throws {
        let prefix = TestRedis.uniquePrefix("sdk-cli-edges")
        let node = try await GatewayProcess(nodeID: "node", environment: nodeEnvironment(prefix: prefix))
        let binary = GatewayProcess.binary.deletingLastPathComponent().appendingPathComponent("presence-client")
        let outbox = FileManager.default.temporaryDirectory.appendingPathComponent("presence-client-\(UUID().uuidString).json")
        defer { try? FileManager.default.removeItem(at: outbox) }
        func client(token: String) -> Process {
            let process = Process()
            process.executableURL = binary
            process.arguments = ["--url", "ws://127.0.0.1:\(node.port)", "--token", token, "--device", "terminal", "--outbox", outbox.path]
            process.standardInput = Pipe()
            return process
        }

        // `presence-client | head -1`: both ends close-on-exec (see PresencectlTests.watchInAPipe).
        var ends: [Int32] = [0, 0]
        #expect(pipe(&ends) == 0)
        for end in ends { _ = fcntl(end, F_SETFD, FD_CLOEXEC) }
        let piped = client(token: try await mint("bob"))
        piped.standardOutput = FileHandle(fileDescriptor: ends[1], closeOnDealloc: false)
        try piped.run()
        close(ends[1])
        defer { if piped.isRunning { kill(piped.processIdentifier, SIGKILL) } }
        let readEnd = ends[0]
        let first = try await offThePool { () -> String in
            var pending = pollfd(fd: readEnd, events: Int16(POLLIN), revents: 0)
            guard poll(&pending, 1, 10_000) > 0 else { return "" }
            var bytes = [UInt8](repeating: 0, count: 256)
            let count = read(readEnd, &bytes, bytes.count)
            return String(decoding: bytes.prefix(max(0, count)), as: UTF8.self)
        }
        #expect(first.hasPrefix("connecting to "), "\(first)")
        close(readEnd)
        #expect(await eventually(timeout: .seconds(5)) { !piped.isRunning }, "the reader gone, the client ends")
        #expect(!piped.isRunning && piped.terminationReason == .exit && piped.terminationStatus == 0)

        // A token signed with another secret: refused at once, and no use trying it again.
        let errors = FileManager.default.temporaryDirectory.appendingPathComponent("presence-client-\(UUID().uuidString).err")
        _ = FileManager.default.createFile(atPath: errors.path, contents: nil)
        defer { try? FileManager.default.removeItem(at: errors) }
        let refused = client(token: "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJib2IifQ.c2lnbmVkIHdpdGggYW5vdGhlciBzZWNyZXQ")
        refused.standardOutput = FileHandle.nullDevice
        refused.standardError = try FileHandle(forWritingTo: errors)
        try refused.run()
        defer { if refused.isRunning { kill(refused.processIdentifier, SIGKILL) } }
        #expect(await eventually(timeout: .seconds(10)) { !refused.isRunning }, "a refused token ends the client")
        #expect(!refused.isRunning && refused.terminationStatus == 77)
        #expect(((try? String(contentsOf: errors, encoding: .utf8)) ?? "").contains("the token was refused"))
    }
}

extension ClientLiveTests {
    /// Fails before the change: the chat's banner said to type `help` (sent as a message in chat
    /// mode), nothing it printed was marked read, and a `--token-command` whose token the gateway
    /// refused was run again for ever.
    @Test("presence-client --chat names /help, marks what it prints read (and /read); says why a session ended; a --token-command token refused twice in a row stops it with 77")
    func terminalChatRead() async throws {
        let prefix = TestRedis.uniquePrefix("sdk-chat-read")
        let node = try await GatewayProcess(nodeID: "node", environment: nodeEnvironment(prefix: prefix))
        #expect(admin(node, "PUT", "/api/admin/conversations/room", #"{"member_ids":["alice","bob"]}"#)?.status == 200)
        let terminal = try await TerminalClient(node, user: "bob", ["--chat", "room"])
        defer { terminal.stop() }
        #expect(await terminal.printedLine("connecting to ", "type /help for commands"))
        #expect(await terminal.printed("[connected]"))
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        #expect(await alice.connected())
        try await alice.client.send("read me", to: "room")
        #expect(await terminal.printed("alice: read me  [delivered]"))
        // Bob's read cursor reaches alice as a receipt.
        #expect(await alice.waitUntil { client in await client.receipts(in: "room").first { $0.userID == "bob" }?.readSeq == 1 },
                "what it printed is read")
        terminal.type("/read")
        #expect(await terminal.printed("room: marked read"))
        terminal.type("/quit")
        #expect(await eventually(timeout: .seconds(5)) { !terminal.process.isRunning })

        // A token command that prints a token signed with another secret: refused twice, then 77.
        let binary = GatewayProcess.binary.deletingLastPathComponent().appendingPathComponent("presence-client")
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("presence-client-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let output = directory.appendingPathComponent("out")
        let errors = directory.appendingPathComponent("err")
        for file in [output, errors] { _ = FileManager.default.createFile(atPath: file.path, contents: nil) }
        let refused = Process()
        refused.executableURL = binary
        refused.arguments = ["--url", "ws://127.0.0.1:\(node.port)", "--device", "terminal", "--outbox", directory.appendingPathComponent("outbox.json").path,
                             "--token-command", "echo eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJib2IifQ.c2lnbmVkIHdpdGggYW5vdGhlciBzZWNyZXQ"]
        refused.standardInput = Pipe()
        refused.standardOutput = try FileHandle(forWritingTo: output)
        refused.standardError = try FileHandle(forWritingTo: errors)
        try refused.run()
        defer { if refused.isRunning { kill(refused.processIdentifier, SIGKILL) } }
        #expect(await eventually(timeout: .seconds(10)) { !refused.isRunning }, "two refusals in a row end the client")
        #expect(!refused.isRunning && refused.terminationStatus == 77)
        #expect(((try? String(contentsOf: errors, encoding: .utf8)) ?? "").contains("refused twice in a row"))
        let printed = (try? String(contentsOf: output, encoding: .utf8)) ?? ""
        #expect(printed.contains("[session ended: the gateway refused the token (4001); reconnecting now with a new token]"), "\(printed)")
    }
}

/// `presence-client` run against a node as `user`, with `arguments` besides the URL, token, device
/// and an outbox of its own; what it prints goes to a file the checks read.
final class TerminalClient {
    let process: Process
    private let input: Pipe
    private let directory: URL
    private var output: URL { directory.appendingPathComponent("out") }

    init(_ node: GatewayProcess, user: String, _ arguments: [String]) async throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("presence-client-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        let output = directory.appendingPathComponent("out")
        _ = FileManager.default.createFile(atPath: output.path, contents: nil)
        process = Process()
        process.executableURL = GatewayProcess.binary.deletingLastPathComponent().appendingPathComponent("presence-client")
        process.arguments = ["--url", "ws://127.0.0.1:\(node.port)", "--token", try await mint(user), "--device", "terminal",
                             "--outbox", directory.appendingPathComponent("outbox.json").path] + arguments
        input = Pipe()
        process.standardInput = input
        process.standardOutput = try FileHandle(forWritingTo: output)
        process.standardError = try FileHandle(forWritingTo: output)
        try process.run()
    }

    /// Types a line on its standard input.
    func type(_ line: String) {
        input.fileHandleForWriting.write(Data((line + "\n").utf8))
    }

    /// Whether it printed `text` within 10 s.
    func printed(_ text: String) async -> Bool {
        await printedLine(text)
    }

    /// Whether it printed, within 10 s, a line with every one of `parts`.
    func printedLine(_ parts: String...) async -> Bool {
        let output = self.output
        return await eventually(timeout: .seconds(10), poll: .milliseconds(20)) {
            ((try? String(contentsOf: output, encoding: .utf8)) ?? "").split(separator: "\n").contains { line in
                parts.allSatisfy { line.contains($0) }
            }
        }
    }

    /// Kills it if it still runs, and removes its files.
    func stop() {
        if process.isRunning { kill(process.processIdentifier, SIGKILL) }
        try? FileManager.default.removeItem(at: directory)
    }
}
