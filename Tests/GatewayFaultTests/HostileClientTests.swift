import ClientTestSupport
import Foundation
import NIOConcurrencyHelpers
import PresenceClient
import RedisTestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// Clients that hold connections without finishing anything, against one node process: whatever
/// they took is given back (connections and sessions counted through `/metrics`), the node's
/// memory stays bounded, and a watcher's changes keep flowing. Heavy (`make test` runs it alone):
/// it waits out the node's 15 s request-head timeout.
@Suite("Hostile clients", .serialized)
struct HostileClientTests {
    /// The value of an unlabelled gauge or counter in `/metrics`.
    static func metric(_ port: Int, _ name: String) -> Double? {
        guard let text = GatewayProcess.httpGet(port: port, path: "/metrics")?.body else { return nil }
        return text.split(separator: "\n").first { $0.hasPrefix(name + " ") }.flatMap { Double($0.split(separator: " ").last ?? "") }
    }

    static func send(_ fd: Int32, _ text: String) {
        let bytes = Array(text.utf8)
        _ = bytes.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
    }

    @Test("silent connections, slow heads, half upgrades, oversized heads, wrong-path upgrades, silent and vanished sessions: all given back, memory bounded, others served")
    func everythingGivenBack() async throws {
        let (node, alice, bob) = try await FloodTests.nodeWithWatcher("hostile")
        let port = node.port
        // The watcher's two sessions, and the /metrics request's own connection.
        let baseline = Self.metric(port, "presence_connections") ?? -1
        let memoryBefore = node.residentBytes ?? 0
        var held: [Int32] = []
        defer { for fd in held { close(fd) } }
        func open() -> Int32? {
            guard let fd = connectLoopback(port: port) else { return nil }
            held.append(fd)
            return fd
        }
        let token = try await mint("mallory")
        let upgrade = "GET /api/presence/subscribe?token=\(token)&device_id=d HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            + "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        var opened = 0
        for _ in 0..<200 where open() != nil { opened += 1 }  // silent
        for _ in 0..<200 { if let fd = open() { Self.send(fd, "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: a"); opened += 1 } }
        for _ in 0..<100 { if let fd = open() { Self.send(fd, upgrade); opened += 1 } }  // half an upgrade: no final CRLF
        let big = String(repeating: "a", count: 90_000)
        for _ in 0..<50 { if let fd = open() { Self.send(fd, "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: \(big)\r\n\r\n"); opened += 1 } }
        for _ in 0..<50 { if let fd = open() { Self.send(fd, upgrade.replacingOccurrences(of: "/api/presence/subscribe", with: "/api/presence/ws") + "\r\n"); opened += 1 } }
        // Sessions that open and never read nor answer a ping, and sessions that vanish.
        for index in 0..<50 {
            if let fd = open() { Self.send(fd, upgrade.replacingOccurrences(of: "device_id=d", with: "device_id=s\(index)") + "\r\n"); opened += 1 }
        }
        var vanished = 0
        for index in 0..<50 {
            if let client = try? RawWebSocketClient(port: port, token: token, device: "v\(index)", watching: ["alice"]) {
                client.shutDown()
                vanished += 1
            }
        }
        let during = Self.metric(port, "presence_connections") ?? -1
        let memoryDuring = node.residentBytes ?? 0
        print("hostile: \(opened) connections held and \(vanished) sessions vanished; connections \(Int(baseline)) -> \(Int(during)), memory \(memoryBefore >> 20) -> \(memoryDuring >> 20) MiB")
        #expect(during >= baseline + 400, "the held connections are counted: \(during)")
        await alice.client.setStatus(.away)
        #expect(await bob.sees("alice", .away, within: .seconds(3)), "another session's change flows meanwhile")
        // Head timeout 15 s; silent sessions: ping after 10 s, dropped 5 s later; then the linger.
        let attacked = ContinuousClock.now
        let settled = await eventually(timeout: .seconds(30), poll: .milliseconds(500)) {
            Self.metric(port, "presence_connections") == baseline && Self.metric(port, "presence_sessions") == 2
        }
        let memoryAfter = node.residentBytes ?? 0
        print("hostile: \(ContinuousClock.now - attacked) after the attack, connections \(Self.metric(port, "presence_connections").map { Int($0) } ?? -1), sessions \(Self.metric(port, "presence_sessions").map { Int($0) } ?? -1), memory \(memoryAfter >> 20) MiB")
        #expect(settled, "every connection and session given back: connections \(Self.metric(port, "presence_connections") ?? -1) (baseline \(baseline)), sessions \(Self.metric(port, "presence_sessions") ?? -1)")
        #expect(memoryAfter < memoryBefore + 64 << 20, "memory bounded: \(memoryBefore >> 20) -> \(memoryAfter >> 20) MiB")
        await alice.client.setStatus(.online)
        #expect(await bob.sees("alice", .online, within: .seconds(3)))
        node.kill()
    }
}
