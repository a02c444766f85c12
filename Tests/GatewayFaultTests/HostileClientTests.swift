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
        for _ in 0..<1_000 { if let fd = open() { Self.send(fd, upgrade); opened += 1 } }  // half an upgrade: no final CRLF
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
        #expect(during >= baseline + 1_300, "the held connections are counted: \(during)")
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
    /// One kind of attack by frames on open sessions: how many attackers, what each sends, and
    /// the close codes that may end it (none: the connection's end is what is checked).
    struct FrameAttack {
        var name: String
        var attackers: Int
        var receiveBuffer: Int32? = nil
        var codes: Set<UInt16>
        var send: @Sendable (RawWebSocketClient) -> Void
    }

    static func frameAttacks() -> [FrameAttack] {
        let padding = String(repeating: "a", count: 16 * 1024 - 64)
        let maxSize = #"{"type":"ping","data":{},"id":"\#(padding)"}"#
        return [
            FrameAttack(name: "max-size frames (16 KiB each, as fast as they go)", attackers: 10, codes: [4029, 1008]) { client in
                for _ in 0..<2_000 { if (try? client.sendText(maxSize)) == nil { return } }
            },
            FrameAttack(name: "invalid UTF-8 in a text frame", attackers: 50, codes: [1007]) { client in
                try? client.sendFrame(opcode: 0x1, payload: [0x7B, 0xC3, 0x28, 0x7D])
            },
            FrameAttack(name: "fragment storm (empty continuations, never final)", attackers: 20, codes: [1008]) { client in
                guard (try? client.sendFrame(opcode: 0x1, payload: [], fin: false)) != nil else { return }
                for _ in 0..<20_000 { if (try? client.sendFrame(opcode: 0x0, payload: [], fin: false)) == nil { return } }
            },
            FrameAttack(name: "ping flood, pongs never read", attackers: 10, receiveBuffer: 4096, codes: []) { client in
                let payload = [UInt8](repeating: 0x70, count: 125)
                for _ in 0..<100_000 { if (try? client.sendFrame(opcode: 0x9, payload: payload)) == nil { return } }
            },
            FrameAttack(name: "close sent, nothing read", attackers: 50, receiveBuffer: 4096, codes: []) { client in
                try? client.sendFrame(opcode: 0x8, payload: [0x03, 0xE8])
            },
        ]
    }

    /// How long alice's changes take to reach bob, `count` of them, polled every millisecond,
    /// 200 ms apart (a user's status changes are limited to 5 a second).
    static func probe(_ alice: LiveClient, _ bob: LiveClient, count: Int) async -> [Duration] {
        var latencies: [Duration] = []
        for index in 0..<count {
            let status: PresenceStatus = index % 2 == 0 ? .away : .online
            let start = ContinuousClock.now
            await alice.client.setStatus(status)
            if await eventually(timeout: .seconds(5), poll: .milliseconds(1), { await bob.client.presence(of: "alice")?.status == status }) {
                latencies.append(ContinuousClock.now - start)
            }
            try? await Task.sleep(until: start + .milliseconds(200))
        }
        return latencies.sorted()
    }

    static func describe(_ latencies: [Duration]) -> String {
        guard !latencies.isEmpty else { return "none arrived" }
        func ms(_ value: Duration) -> String { String(format: "%.1f ms", Double(value.components.attoseconds) / 1e15 + Double(value.components.seconds) * 1000) }
        return "p50 \(ms(latencies[latencies.count / 2])), p99 \(ms(latencies[min(latencies.count - 1, latencies.count * 99 / 100)]))"
    }

    @Test("frame attacks on open sessions (max-size floods, invalid UTF-8, fragment storms, unread pings, unread closes): each ends with its code, memory stays bounded, nothing leaks, others served")
    func frameAttacks() async throws {
        let (node, alice, bob) = try await FloodTests.nodeWithWatcher("hostile-frames")
        let port = node.port
        let idle = (
            connections: Self.metric(port, "presence_connections") ?? -1,
            channels: Self.metric(port, "presence_subscribed_channels") ?? -1
        )
        let quiet = await Self.probe(alice, bob, count: 20)
        print("frame attacks: without an attack, alice -> bob \(Self.describe(quiet)); node \((node.residentBytes ?? 0) >> 20) MiB, \(Int(idle.channels)) channels")
        var users = 0
        for attack in Self.frameAttacks() {
            let memoryBefore = node.residentBytes ?? 0
            var clients: [RawWebSocketClient] = []
            for _ in 0..<attack.attackers {
                users += 1
                clients.append(try RawWebSocketClient(port: port, token: try await mint("mallory-\(users)"), device: "d", watching: ["alice"], receiveBuffer: attack.receiveBuffer))
            }
            // Each attacker sends from a thread of its own; those that read, read on another. At
            // the lowest priority: on two cores, ten spinning senders would otherwise take the CPU
            // from the node under test and the figures would measure the load generator.
            let closes = NIOLockedValueBox<[UInt16?]>([])
            let done = NIOLockedValueBox(0)
            for client in clients {
                Thread.detachNewThread {
                    _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), 0, 19)  // 0: this thread, on Linux
                    attack.send(client)
                    done.withLockedValue { $0 += 1 }
                }
                if !attack.codes.isEmpty {
                    Thread.detachNewThread {
                        let last = client.readFrames(within: .seconds(20)).last
                        let code = last.flatMap { $0.opcode == 8 && $0.payload.count >= 2 ? UInt16($0.payload[0]) << 8 | UInt16($0.payload[1]) : nil }
                        closes.withLockedValue { $0.append(code) }
                    }
                }
            }
            let during = await Self.probe(alice, bob, count: 20)
            var peak = node.residentBytes ?? 0
            let sent = await eventually(timeout: .seconds(30), poll: .milliseconds(100)) {
                peak = max(peak, node.residentBytes ?? 0)
                return done.withLockedValue { $0 } == clients.count
            }
            #expect(sent, "\(attack.name): every attacker is done sending")
            if attack.codes.isEmpty {
                // Nothing read: the node must end these connections on its own.
                let ended = clients.map { $0.drainUntilClosed(within: .seconds(10)).closed }
                #expect(ended.allSatisfy { $0 }, "\(attack.name): the node ended every connection (\(ended.filter { $0 }.count) of \(ended.count))")
            } else {
                #expect(await eventually(timeout: .seconds(25)) { closes.withLockedValue { $0.count } == clients.count })
                let codes = closes.withLockedValue { $0 }
                #expect(codes.allSatisfy { $0.map(attack.codes.contains) ?? false }, "\(attack.name): closed with \(attack.codes.sorted()): \(codes)")
            }
            // Given back: sessions (bob's and alice's remain), connections, channels, work.
            let settled = await eventually(timeout: .seconds(15), poll: .milliseconds(200)) {
                Self.metric(port, "presence_sessions") == 2 && Self.metric(port, "presence_connections") == idle.connections
                    && Self.metric(port, "presence_subscribed_channels") == idle.channels
                    && GatewayProcess.httpGet(port: port, path: "/metrics")?.body.contains(#"presence_session_work{state="waiting"} 0"#) == true
            }
            let memoryAfter = node.residentBytes ?? 0
            print("""
                frame attack "\(attack.name)": \(clients.count) attackers; alice -> bob \(Self.describe(during)); \
                node \(memoryBefore >> 20) -> peak \(peak >> 20) -> \(memoryAfter >> 20) MiB; \
                after: sessions \(Self.metric(port, "presence_sessions").map { Int($0) } ?? -1), connections \(Self.metric(port, "presence_connections").map { Int($0) } ?? -1), \
                channels \(Self.metric(port, "presence_subscribed_channels").map { Int($0) } ?? -1)
                """)
            #expect(settled, "\(attack.name): everything given back")
            #expect(during.count == 20, "\(attack.name): every change reached the watcher during the attack")
            #expect(peak < memoryBefore + 128 << 20, "\(attack.name): memory bounded (\(memoryBefore >> 20) -> \(peak >> 20) MiB)")
            clients.removeAll()
        }
        node.kill()
    }
}
