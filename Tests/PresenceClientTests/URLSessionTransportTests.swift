import ClientTestSupport
import Foundation
import RedisTestSupport
import Testing

@testable import PresenceClient

/// The URLSession transport (the default on Apple platforms) against a live gateway process,
/// through Linux's FoundationNetworking here. That needs a libcurl built with WebSockets, which
/// Debian 12's is not: there the live tests do not run (and say why), and the transport must
/// say so itself rather than look like a dropped connection.
@Suite("URLSessionTransport against a live gateway process", .serialized)
struct URLSessionTransportTests {
    @Test("where this Foundation cannot open WebSockets, the transport says so: unsupported, with libcurl's reason")
    func saysUnsupported() async throws {
        let (outgoing, _) = AsyncStream.makeStream(of: OutgoingFrame.self)
        do {
            _ = try await URLSessionTransport().session(url: URL(string: "ws://127.0.0.1:9/")!, outgoing: outgoing) { _ in }
            Issue.record("a session to a port nothing listens on ended without an error")
        } catch PresenceTransportError.unsupported(let reason) {
            print("URLSessionTransport on this machine: \(reason)")
            #expect(reason.contains("ws://"))
            #expect(await URLSessionTransport.isSupported() == false)
        } catch {
            // Supported: nothing listens there, so the connection fails like any other.
            #expect(await URLSessionTransport.isSupported(), "\(error)")
        }
    }

    @Test("a client on URLSessionTransport connects, hears presence, sends and receives messages, and signs out with a clean close",
          .enabled("this Foundation's URLSession cannot open WebSockets (libcurl without them)") { await URLSessionTransport.isSupported() })
    func liveSession() async throws {
        let node = try await GatewayProcess(nodeID: "n1", environment: nodeEnvironment(prefix: TestRedis.uniquePrefix("urlsession")))
        #expect(admin(node, "PUT", "/api/admin/conversations/room", #"{"member_ids":["alice","bob"]}"#)?.status == 200)
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        #expect(await bob.connected())
        let configuration = try PresenceClientConfiguration(gatewayURL: URL(string: "ws://127.0.0.1:\(node.port)")!, deviceID: "phone")
        let alice = PresenceClient(configuration: configuration, tokenProvider: { _ in try await mint("alice") }, transport: URLSessionTransport(),
                                   outboxStore: MemoryMessageOutboxStore(), logger: TestRedis.logger("client-alice"))
        let running = Task { await alice.run() }
        defer { running.cancel() }
        #expect(await eventually(timeout: .seconds(10)) { await alice.connectionState == .connected }, "connected over URLSession")
        #expect(await bob.sees("alice", .online))
        #expect(await eventually { await alice.presence(of: "bob")?.status == .online }, "alice hears bob")
        try await alice.send("over URLSession", to: "room")
        #expect(await bob.waitUntil { await $0.messages(in: "room").map(\.text) == ["over URLSession"] })
        try await bob.client.send("back at you", to: "room")
        #expect(await eventually { await alice.messages(in: "room").map(\.text) == ["over URLSession", "back at you"] })
        await alice.signOut()
        #expect(await bob.sees("alice", .offline, within: .seconds(1.5)), "a clean close: offline before the linger")
        #expect(await alice.lastCloseCode == 1000)
    }

    @Test("an upgrade the gateway refuses (a bad token) is upgradeRefused",
          .enabled("this Foundation's URLSession cannot open WebSockets (libcurl without them)") { await URLSessionTransport.isSupported() })
    func refused() async throws {
        let node = try await GatewayProcess(nodeID: "n1", environment: nodeEnvironment(prefix: TestRedis.uniquePrefix("urlsession-refused")))
        let url = URL(string: "ws://127.0.0.1:\(node.port)/api/presence/subscribe?token=not-a-token&device_id=phone")!
        let (outgoing, _) = AsyncStream.makeStream(of: OutgoingFrame.self)
        await #expect(throws: PresenceTransportError.self) {
            _ = try await URLSessionTransport().session(url: url, outgoing: outgoing) { _ in }
        }
    }
}
