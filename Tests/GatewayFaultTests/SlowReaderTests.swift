import Foundation
import Logging
import PresenceEngine
import RedisClient
import RedisTestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

@testable import PresenceClient

/// A client that stops reading while events pour in. Heavy (`make test` runs it alone): it
/// publishes thousands of changes a second.
@Suite("Slow clients", .serialized)
struct SlowReaderTests {
    static let floodUsers = (0..<200).map { "flood\($0)" }

    @Test("clients that never read are closed when their queue fills; the node's memory stays bounded and another session's latency holds")
    func neverReads() async throws {
        let prefix = TestRedis.uniquePrefix("slow")
        let node = try await GatewayProcess(nodeID: "slow", environment: nodeEnvironment(prefix: prefix, extra: ["PRESENCE_VISIBILITY": "open"]))
        let fast = try await LiveClient("fast", device: "phone", nodes: [node])
        try await fast.client.watch(["pinger"])
        #expect(await fast.connected())
        try await RedisClient.withClient(configuration: TestRedis.configuration(), logger: TestRedis.logger()) { redis in
            let engine = PresenceEngine(redis: redis, configuration: PresenceConfiguration(keyPrefix: prefix, nodeID: "flood", visibility: .open), logger: TestRedis.logger())
            // The fast client's latency: pinger changes every 100 ms; each change is one update.
            var posted: [ContinuousClock.Instant] = []
            func ping() async throws {
                posted.append(.now)
                _ = try await engine.post(user: "pinger", device: "web", status: posted.count % 2 == 0 ? .online : .away)
            }
            for _ in 0..<20 {
                try await ping()
                try await Task.sleep(for: .milliseconds(100))
            }
            let baselineCount = posted.count

            // The flood: every flood user flips between online and away, as fast as Redis takes it.
            let floodStarted = ContinuousClock.now
            let flood = Task {
                await withTaskGroup(of: Int.self) { group in
                    for worker in 0..<16 {
                        group.addTask {
                            var count = 0
                            var round = 0
                            while !Task.isCancelled {
                                for user in Self.floodUsers[(worker * 200 / 16)..<((worker + 1) * 200 / 16)] {
                                    _ = try? await engine.post(user: user, device: "web", status: round % 2 == 0 ? .away : .online)
                                    count += 1
                                }
                                round += 1
                            }
                            return count
                        }
                    }
                    return await group.reduce(0, +)
                }
            }
            // For comparison, 5 s of the flood watched by 3 clients that read everything; then
            // they leave and 3 clients that watch the same and never read take their place.
            var readers: [RawWebSocketClient] = []
            for index in 0..<3 {
                readers.append(try RawWebSocketClient(port: node.port, token: try await mint("reader\(index)"), device: "d\(index)", watching: Self.floodUsers))
                readers[index].startReading()
            }
            while ContinuousClock.now < floodStarted + .seconds(5) {
                try await ping()
                try await Task.sleep(for: .milliseconds(100))
            }
            let floodOnlyCount = posted.count
            for reader in readers { reader.shutDown() }
            // Each leaving session's disconnect waits its turn on Redis behind the flood (its
            // round trips take 1-2 s here): whether they leave is checked, not how fast.
            let leaving = ContinuousClock.now
            #expect(await eventually(timeout: .seconds(15)) { Self.sessions(node) == 1 }, "the readers left")
            print("slow readers: the 3 readers' sessions ended \(ContinuousClock.now - leaving) after they shut down, under the flood")
            let memoryBefore = node.residentBytes ?? 0
            var stalled: [RawWebSocketClient] = []
            for index in 0..<3 {
                stalled.append(try RawWebSocketClient(port: node.port, token: try await mint("stalled\(index)"), device: "d\(index)", watching: Self.floodUsers))
            }
            let stalledAt = ContinuousClock.now
            var peak = memoryBefore
            var sessionsSeen = 0
            var closedAfter: Duration?
            while ContinuousClock.now < stalledAt + .seconds(40) {
                try await ping()
                peak = max(peak, node.residentBytes ?? 0)
                let sessions = Self.sessions(node) ?? 0
                sessionsSeen = max(sessionsSeen, sessions)
                if closedAfter == nil, sessionsSeen == 4, sessions == 1 { closedAfter = ContinuousClock.now - stalledAt }
                if let closedAfter, ContinuousClock.now - stalledAt > closedAfter + .seconds(3) { break }
                try await Task.sleep(for: .milliseconds(100))
            }
            flood.cancel()
            let changes = await flood.value
            try await Task.sleep(for: .milliseconds(500))

            // The first update is the answer to the subscribe, before any change.
            let arrivals = fast.arrivals(of: "pinger").map(\.at).filter { $0 > posted[0] }
            let latencies = zip(posted, arrivals).map { $1 - $0 }
            let baseline = latencies.prefix(baselineCount).sorted()
            let floodOnly = latencies[baselineCount..<min(floodOnlyCount, latencies.count)].sorted()
            let during = latencies.dropFirst(floodOnlyCount).sorted()
            func percentile(_ values: [Duration], _ p: Double) -> Duration {
                values.isEmpty ? .zero : values[min(values.count - 1, Int(Double(values.count) * p))]
            }
            let drained = stalled.map { $0.drainUntilClosed(within: .seconds(10)) }
            let rate = Double(changes) / Double(max(1, (ContinuousClock.now - floodStarted).components.seconds))
            print("""
                slow readers: \(changes) changes (\(Int(rate))/s) to 200 users watched by 3 clients that never read; \
                closed \(closedAfter.map { "\($0)" } ?? "never") after they stalled; they then read \(drained.map(\.bytes)) bytes before the end
                slow readers: node memory \(memoryBefore / 1_048_576) MiB before, peak \(peak / 1_048_576) MiB
                slow readers: the fast client's latency, quiet: p50 \(percentile(baseline, 0.5)) max \(baseline.last ?? .zero); \
                flood to 3 readers: p50 \(percentile(floodOnly, 0.5)) p90 \(percentile(floodOnly, 0.9)) max \(floodOnly.last ?? .zero); \
                flood to 3 stalled clients: p50 \(percentile(during, 0.5)) p90 \(percentile(during, 0.9)) max \(during.last ?? .zero) (\(during.count) updates)
                """)
            #expect(sessionsSeen == 4, "1 fast and 3 stalled sessions were open")
            #expect(closedAfter != nil, "the node closed the stalled sessions")
            #expect(drained.allSatisfy { $0.closed }, "each stalled client finds its connection ended: \(drained)")
            #expect(arrivals.count == posted.count, "the fast client got every one of pinger's \(posted.count) changes, got \(arrivals.count)")
            #expect(peak - memoryBefore < 64 * 1_048_576, "memory bounded: grew \((peak - memoryBefore) / 1_048_576) MiB")
            // On 2 cores the flood itself (5,000 changes a second from this process, fanned out
            // to 3 sessions) slows everyone; stalled clients must not add to it. Only a coarse
            // bound here: the numbers printed above are the measurement.
            #expect(percentile(during, 0.5) < percentile(floodOnly, 0.5) * 2 + .milliseconds(100), "stalled clients do not slow the others")
            #expect(GatewayProcess.httpStatus(port: node.port, path: "/healthz") == 200)
        }
    }

    /// `presence_sessions` from the node's /metrics.
    static func sessions(_ node: GatewayProcess) -> Int? {
        guard let metrics = GatewayProcess.httpGet(port: node.port, path: "/metrics")?.body else { return nil }
        let line = metrics.split(separator: "\n").first { $0.hasPrefix("presence_sessions ") }
        return line.flatMap { Double($0.split(separator: " ").last ?? "") }.map { Int($0) }
    }
}

/// A WebSocket client on a blocking socket with a small receive buffer: it opens a session,
/// subscribes, and then reads nothing until told to (a stalled client), or reads and discards
/// everything on a thread of its own (``startReading()``).
final class RawWebSocketClient: @unchecked Sendable {
    // Safe: used by one test, one call at a time.
    private let fd: Int32

    init(port: Int, token: String, device: String, watching users: [String], receiveBuffer: Int32? = 4096) throws {
        guard let fd = connectLoopback(port: port, receiveBuffer: receiveBuffer) else { throw GatewayProcessError("cannot connect to \(port)") }
        self.fd = fd
        let key = Data((0..<16).map { _ in UInt8.random(in: 0...255) }).base64EncodedString()
        try send(Array("""
            GET /api/presence/subscribe?token=\(token)&device_id=\(device) HTTP/1.1\r
            Host: 127.0.0.1:\(port)\r
            Upgrade: websocket\r
            Connection: Upgrade\r
            Sec-WebSocket-Key: \(key)\r
            Sec-WebSocket-Version: 13\r
            \r

            """.utf8))
        var response: [UInt8] = []
        var byte: UInt8 = 0
        while !response.ends(with: Array("\r\n\r\n".utf8)), read(fd, &byte, 1) == 1 { response.append(byte) }
        guard String(decoding: response, as: UTF8.self).hasPrefix("HTTP/1.1 101") else {
            close(fd)
            throw GatewayProcessError("the upgrade was refused: \(String(decoding: response, as: UTF8.self))")
        }
        guard !users.isEmpty else { return }
        let ids = users.map { "\"\($0)\"" }.joined(separator: ",")
        try sendText(#"{"type":"subscribe","data":{"user_ids":[\#(ids)]},"id":"s"}"#)
    }

    deinit { close(fd) }

    /// One masked text frame, as a client must send it.
    func sendText(_ text: String) throws {
        let payload = Array(text.utf8)
        var frame: [UInt8] = [0x81]
        if payload.count < 126 {
            frame.append(0x80 | UInt8(payload.count))
        } else {
            frame += [0x80 | 126, UInt8(payload.count >> 8), UInt8(payload.count & 0xFF)]
        }
        let mask = (0..<4).map { _ in UInt8.random(in: 0...255) }
        frame += mask
        frame += payload.enumerated().map { $1 ^ mask[$0 % 4] }
        try send(frame)
    }

    private func send(_ bytes: [UInt8]) throws {
        var offset = 0
        while offset < bytes.count {
            let written = bytes[offset...].withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
            guard written > 0 else { throw GatewayProcessError("write failed: \(errno)") }
            offset += written
        }
    }

    /// Reads frames until the server's close frame, the end of the connection or `limit`
    /// frames, for at most `timeout`: each frame's opcode and payload (a close frame's payload
    /// starts with its code).
    func readFrames(within timeout: Duration, limit: Int = .max) -> [(opcode: UInt8, payload: [UInt8])] {
        var wait = timeval(tv_sec: 1, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, socklen_t(MemoryLayout<timeval>.size))
        let deadline = ContinuousClock.now + timeout
        var stream: [UInt8] = []
        var frames: [(opcode: UInt8, payload: [UInt8])] = []
        var buffer = [UInt8](repeating: 0, count: 65_536)
        while ContinuousClock.now < deadline {
            let count = read(fd, &buffer, buffer.count)
            if count == 0 || (count < 0 && errno != EAGAIN && errno != EWOULDBLOCK) { break }
            if count > 0 { stream += buffer[..<count] }
            // Server frames are unmasked: opcode, a 7-bit, 16-bit or 64-bit length, the payload.
            while stream.count >= 2 {
                var length = Int(stream[1] & 0x7F)
                var header = 2
                if length == 126 {
                    guard stream.count >= 4 else { break }
                    length = Int(stream[2]) << 8 | Int(stream[3])
                    header = 4
                } else if length == 127 {
                    guard stream.count >= 10 else { break }
                    length = stream[2..<10].reduce(0) { $0 << 8 | Int($1) }
                    header = 10
                }
                guard stream.count >= header + length else { break }
                frames.append((stream[0] & 0x0F, Array(stream[header..<(header + length)])))
                stream.removeFirst(header + length)
                if frames.last?.opcode == 8 || frames.count >= limit { return frames }
            }
        }
        return frames
    }

    /// Reads and discards everything on a thread of its own, until ``shutDown()``.
    func startReading() {
        Thread.detachNewThread { _ = self.drainUntilClosed(within: .seconds(600)) }
    }

    /// Ends the connection (a reading thread sees its end).
    func shutDown() { shutdown(fd, Int32(SHUT_RDWR)) }

    /// Reads everything the server left in the socket until it ends (EOF or reset), for at most
    /// `timeout`; returns the bytes read and whether the end came.
    func drainUntilClosed(within timeout: Duration) -> (bytes: Int, closed: Bool) {
        var wait = timeval(tv_sec: 1, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, socklen_t(MemoryLayout<timeval>.size))
        let deadline = ContinuousClock.now + timeout
        var total = 0
        var buffer = [UInt8](repeating: 0, count: 65_536)
        while ContinuousClock.now < deadline {
            let count = read(fd, &buffer, buffer.count)
            if count > 0 { total += count; continue }
            if count == 0 || errno == ECONNRESET { return (total, true) }
        }
        return (total, false)
    }
}

extension Array where Element: Equatable {
    func ends(with suffix: [Element]) -> Bool { count >= suffix.count && Array(self[(count - suffix.count)...]) == suffix }
}
