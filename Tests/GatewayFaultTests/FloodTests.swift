import ClientTestSupport
import Foundation
import NIOConcurrencyHelpers
import PresenceClient
import RedisTestSupport
import Testing

/// Floods of connections and frames meet the limits of docs/configuration.md, and the node
/// keeps serving everyone else. Heavy (`make test` runs it alone).
@Suite("Connection and frame floods", .serialized)
struct FloodTests {
    /// A node, and bob on it watching alice: the sessions a flood must not disturb.
    static func nodeWithWatcher(_ name: String) async throws -> (GatewayProcess, alice: LiveClient, bob: LiveClient) {
        let node = try await GatewayProcess(nodeID: name, environment: nodeEnvironment(prefix: TestRedis.uniquePrefix(name), extra: ["PRESENCE_VISIBILITY": "open"]))
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        try await bob.client.watch(["alice"])
        #expect(await bob.sees("alice", .online))
        return (node, alice, bob)
    }

    @Test("a frame flood gets pongs up to the frame rate, then rate_limited errors, then close 4029; another session is unaffected")
    func frameFlood() async throws {
        let (node, alice, bob) = try await Self.nodeWithWatcher("flood")

        let flooder = try RawWebSocketClient(port: node.port, token: try await mint("mallory"), device: "d", watching: [], receiveBuffer: nil)
        let frames = NIOLockedValueBox<[(opcode: UInt8, payload: [UInt8])]>([])
        let reader = Thread { frames.withLockedValue { $0 = flooder.readFrames(within: .seconds(20)) } }
        reader.start()
        var sent = 0
        while sent < 5_000 {
            do { try flooder.sendText(#"{"type":"ping","data":{}}"#) } catch { break }
            sent += 1
        }
        await alice.client.setStatus(.away)
        #expect(await bob.sees("alice", .away, within: .seconds(3)), "another session's changes flow during the flood")
        #expect(await eventually(timeout: .seconds(20)) { frames.withLockedValue { $0.last?.opcode == 8 } }, "the flooder was closed")

        let received = frames.withLockedValue { $0 }
        let texts = received.filter { $0.opcode == 1 }.map { String(decoding: $0.payload, as: UTF8.self) }
        let pongs = texts.filter { $0.contains(#""type":"pong""#) }.count
        let limited = texts.filter { $0.contains(#""code":"rate_limited""#) }.count
        // A frame the refilling bucket lets through resets the count; the close follows 51 in a row.
        let lastAnswers = texts.suffix(51)
        let close = received.last.flatMap { $0.opcode == 8 && $0.payload.count >= 2 ? Int($0.payload[0]) << 8 | Int($0.payload[1]) : nil }
        print("frame flood: \(sent) pings written before the close; \(pongs) pongs, \(limited) rate_limited, close \(close.map(String.init) ?? "none")")
        #expect(close == 4029, "closed with 4029")
        #expect(pongs >= 100 && pongs < 200, "the burst (100) and what the rate (50/s) refills are answered: \(pongs)")
        #expect(limited >= 51 && lastAnswers.count == 51 && lastAnswers.allSatisfy { $0.contains(#""code":"rate_limited""#) },
                "51 rate_limited answers in a row, then the close (\(limited) in all)")
        #expect(GatewayProcess.httpStatus(port: node.port, path: "/healthz") == 200)
    }

    @Test("a connection flood with bad tokens is closed with 4001 while the node keeps serving its sessions; one user's 33rd device is refused with 4029")
    func connectionFlood() async throws {
        let (node, alice, bob) = try await Self.nodeWithWatcher("connflood")
        let memoryBefore = node.residentBytes ?? 0

        // 16 threads, 2,000 sessions with a garbage token: each is upgraded and closed with 4001.
        let codes = NIOLockedValueBox<[Int: Int]>([:])
        let started = ContinuousClock.now
        let threads = (0..<16).map { _ in
            Thread {
                for _ in 0..<125 {
                    let client = try? RawWebSocketClient(port: node.port, token: "garbage", device: "d", watching: [], receiveBuffer: nil)
                    let close = client?.readFrames(within: .seconds(5)).last.flatMap { $0.opcode == 8 && $0.payload.count >= 2 ? Int($0.payload[0]) << 8 | Int($0.payload[1]) : nil }
                    codes.withLockedValue { $0[close ?? 0, default: 0] += 1 }
                }
            }
        }
        for thread in threads { thread.start() }
        await alice.client.setStatus(.away)
        let seenDuring = await bob.sees("alice", .away, within: .seconds(5))
        #expect(await eventually(timeout: .seconds(60)) { codes.withLockedValue { $0.values.reduce(0, +) } == 2_000 })
        let elapsed = ContinuousClock.now - started
        let memoryAfter = node.residentBytes ?? 0
        print("connection flood: 2,000 sessions with a bad token in \(elapsed): close codes \(codes.withLockedValue { $0 }); node RSS \(memoryBefore / 1_048_576) → \(memoryAfter / 1_048_576) MiB")
        #expect(codes.withLockedValue { $0 } == [4001: 2_000], "every one closed with 4001")
        #expect(seenDuring, "a change during the flood reached its watcher")
        #expect(memoryAfter - memoryBefore < 32 * 1_048_576)

        // One user opening devices: 32 live, the 33rd is told why and closed with 4029.
        let token = try await mint("carol")
        var devices: [RawWebSocketClient] = []
        // Each one live (its `initial_state` read) before the next opens: openings run
        // concurrently on the node, so a 33rd sent at once could be counted before the 32nd.
        var live = 0
        for index in 0..<32 {
            let device = try RawWebSocketClient(port: node.port, token: token, device: "device-\(index)", watching: [], receiveBuffer: nil)
            let first = device.readFrames(within: .seconds(5), limit: 1).first { $0.opcode == 1 }
            if let first, String(decoding: first.payload, as: UTF8.self).contains("initial_state") { live += 1 }
            devices.append(device)
        }
        #expect(live == 32, "every one of the 32 devices opened")
        let extra = try RawWebSocketClient(port: node.port, token: token, device: "device-32", watching: [], receiveBuffer: nil)
        let frames = extra.readFrames(within: .seconds(5))
        let error = frames.first { $0.opcode == 1 }.map { String(decoding: $0.payload, as: UTF8.self) } ?? ""
        let close = frames.last.flatMap { $0.opcode == 8 && $0.payload.count >= 2 ? Int($0.payload[0]) << 8 | Int($0.payload[1]) : nil }
        #expect(error.contains(#""code":"rate_limited""#) && error.contains("32 devices"), "\(error)")
        #expect(close == 4029)
        #expect(devices.count == 32)
    }
    @Test("a flood of connections with good tokens meets PRESENCE_MAX_SESSIONS: the node holds that many, closes each one more with 1013, and keeps serving")
    func sessionLimitFlood() async throws {
        let limit = 300
        let flood = 1_000
        let node = try await GatewayProcess(nodeID: "full", environment: nodeEnvironment(
            prefix: TestRedis.uniquePrefix("full"), extra: ["PRESENCE_VISIBILITY": "open", "PRESENCE_MAX_SESSIONS": "\(limit)"]
        ))
        let alice = try await LiveClient("alice", device: "phone", nodes: [node])
        let bob = try await LiveClient("bob", device: "laptop", nodes: [node])
        try await bob.client.watch(["alice"])
        #expect(await bob.sees("alice", .online))
        let memoryBefore = node.residentBytes ?? 0
        var minted: [String] = []
        for index in 0..<flood { minted.append(try await mint("flood\(index)")) }
        let tokens = minted

        // 16 threads open 1,000 sessions of 1,000 users and hold the ones that open.
        let outcomes = NIOLockedValueBox<[String: Int]>([:])
        let held = NIOLockedValueBox<[RawWebSocketClient]>([])
        let started = ContinuousClock.now
        let threads = (0..<16).map { thread in
            Thread {
                for index in stride(from: thread, to: flood, by: 16) {
                    guard let client = try? RawWebSocketClient(port: node.port, token: tokens[index], device: "d", watching: [], receiveBuffer: nil) else {
                        outcomes.withLockedValue { $0["no upgrade", default: 0] += 1 }
                        continue
                    }
                    // The first frame says it: `initial_state`, or the close.
                    let frames = client.readFrames(within: .seconds(10), limit: 1)
                    let outcome: String
                    if let close = frames.last(where: { $0.opcode == 8 }) {
                        outcome = close.payload.count >= 2 ? "\(Int(close.payload[0]) << 8 | Int(close.payload[1]))" : "close without a code"
                    } else if frames.contains(where: { $0.opcode == 1 && String(decoding: $0.payload, as: UTF8.self).contains("initial_state") }) {
                        outcome = "open"
                        held.withLockedValue { $0.append(client) }
                    } else {
                        outcome = "nothing"
                    }
                    outcomes.withLockedValue { $0[outcome, default: 0] += 1 }
                }
            }
        }
        for thread in threads { thread.start() }
        #expect(await eventually(timeout: .seconds(120)) { outcomes.withLockedValue { $0.values.reduce(0, +) } == flood })
        let elapsed = ContinuousClock.now - started
        let sessions = node.openSessions
        let memoryAfter = node.residentBytes ?? 0
        print("session limit: \(flood) connections in \(elapsed) against a limit of \(limit) with 2 held already: \(outcomes.withLockedValue { $0 }); node sessions \(String(describing: sessions)), RSS \(memoryBefore / 1_048_576) → \(memoryAfter / 1_048_576) MiB")
        #expect(outcomes.withLockedValue { $0 } == ["open": limit - 2, "1013": flood - limit + 2], "the limit, then 1013 for each one more")
        #expect(sessions == limit)
        await alice.client.setStatus(.away)
        #expect(await bob.sees("alice", .away, within: .seconds(5)), "the node keeps serving its sessions while full")
        #expect(memoryAfter - memoryBefore < 64 * 1_048_576)

        // Once the flood lets go, the node takes sessions again.
        held.withLockedValue { $0.removeAll() }
        let released = ContinuousClock.now
        let drained = await eventually(timeout: .seconds(10)) { node.openSessions == 2 }
        // What the node counts, if it did not drain: sessions against connections and session
        // work tell a stale count from sessions that never ended.
        let counts = GatewayProcess.httpGet(port: node.port, path: "/metrics")?.body.split(separator: "\n")
            .filter { $0.hasPrefix("presence_sessions ") || $0.hasPrefix("presence_connections ") || $0.hasPrefix("presence_session_work") }
        #expect(drained, "the node is back to its 2 sessions 10 s after the flood let go; it holds \(String(describing: node.openSessions)); \(counts ?? []); its last lines: \(node.output.split(separator: "\n").suffix(20).joined(separator: "\n"))")
        if drained { print("session limit: the node was back to its 2 sessions \(ContinuousClock.now - released) after the flood let go") }
        let carol = try await LiveClient("carol", device: "phone", nodes: [node])
        #expect(await carol.connected())
    }
}
