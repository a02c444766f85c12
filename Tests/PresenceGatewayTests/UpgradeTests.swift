import Foundation
import RedisTestSupport
import Testing

@testable import PresenceGateway

#if canImport(Glibc)
import Glibc
#endif

/// How the node's one port tells sessions from HTTP: only a connection's first request can be
/// the session upgrade; anything else at the session path is HTTP, answered with the reason.
@Suite("The session upgrade on the node's one port")
struct UpgradeTests {
    /// A blocking loopback connection that writes requests and reads what comes back.
    final class Connection: Sendable {
        let fd: Int32

        init(port: Int) throws {
            guard let fd = connectLoopback(port: port) else { throw GatewayProcessError("cannot connect to \(port)") }
            self.fd = fd
            var timeout = timeval(tv_sec: 0, tv_usec: 200_000)
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        }

        deinit { close(fd) }

        func send(_ text: String) { send(Array(text.utf8)) }

        func send(_ bytes: [UInt8]) {
            var sent = 0
            while sent < bytes.count {
                let count = bytes[sent...].withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
                guard count > 0 else { return }
                sent += count
            }
        }

        /// What arrives until `done` says it is enough or `seconds` pass, and whether the server
        /// ended the connection by then. The blocking reads run on a thread of their own, not on
        /// the tests' shared concurrency threads (2 on this machine), which every test needs.
        func read(for seconds: Double, until done: @escaping @Sendable (String) -> Bool) async -> (text: String, closed: Bool) {
            let fd = self.fd
            return await withCheckedContinuation { continuation in
                Thread.detachNewThread {
                    var received: [UInt8] = []
                    var buffer = [UInt8](repeating: 0, count: 4096)
                    let deadline = Date().addingTimeInterval(seconds)
                    var closed = false
                    while Date() < deadline, !done(String(decoding: received, as: UTF8.self)) {
                        let count = Glibc.read(fd, &buffer, buffer.count)
                        if count > 0 { received += buffer[..<count] } else if count == 0 { closed = true; break }
                    }
                    continuation.resume(returning: (String(decoding: received, as: UTF8.self), closed))
                }
            }
        }
    }

    static func upgrade(_ token: String) -> String {
        "GET /api/presence/subscribe?token=\(token)&device_id=web HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            + "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    }

    @Test("an upgrade as a connection's first request opens a session; as a later one (a balancer reusing its connection) it is 503 with Connection: close, and the connection ends")
    func upgradeOnlyFirst() async throws {
        try await withNodes(1) { ports in
            let alice = try await token("alice")
            let first = try Connection(port: ports[0])
            first.send(Self.upgrade(alice))
            let opened = await first.read(for: 5) { $0.contains("initial_state") }
            #expect(opened.text.hasPrefix("HTTP/1.1 101"), "\(opened.text.prefix(80))")
            #expect(opened.text.contains("initial_state"), "the session's first frame follows the 101")

            let reused = try Connection(port: ports[0])
            reused.send("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            #expect(await reused.read(for: 5) { $0.contains("\r\n\r\n") }.text.hasPrefix("HTTP/1.1 200"))
            reused.send(Self.upgrade(alice))
            let refused = await reused.read(for: 5) { _ in false }
            #expect(refused.text.hasPrefix("HTTP/1.1 503"), "\(refused.text.prefix(80))")
            #expect(refused.text.lowercased().contains("connection: close"))
            #expect(refused.closed, "the connection ends after the 503")
        }
    }

    /// A client's text frame as a client sends it: masked, its length in the form its size needs.
    static func maskedText(_ text: String) -> [UInt8] {
        let payload = Array(text.utf8)
        var frame: [UInt8] = [0x81]
        switch payload.count {
        case ..<126: frame.append(0x80 | UInt8(payload.count))
        case ..<65_536: frame += [0x80 | 126, UInt8(payload.count >> 8), UInt8(payload.count & 0xFF)]
        default: frame += [0x80 | 127] + (0..<8).reversed().map { UInt8((payload.count >> ($0 * 8)) & 0xFF) }
        }
        let mask: [UInt8] = [0x37, 0xFA, 0x21, 0x3D]
        frame += mask
        frame += payload.enumerated().map { $0.element ^ mask[$0.offset % 4] }
        return frame
    }

    /// A connection's reads start at 512 bytes (``GatewayServerChannel/receiveBuffers``) and
    /// double each time one fills its buffer; the upgrade's request is handed to the opening
    /// alone. Both must still carry what is large: a head of several reads with the token in a
    /// header, and a frame larger than the largest read (64 KiB).
    @Test("an upgrade whose head is 12 KB (the token in its Authorization header) opens a session, and a 100 KB frame is answered: a connection's reads start small and grow")
    func largeReads() async throws {
        try await withNodes(1) { ports in
            let connection = try Connection(port: ports[0])
            let cookie = String(repeating: "c", count: 12_000)
            connection.send(
                "GET /api/presence/subscribe?device_id=web HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    + "Authorization: Bearer \(try await token("alice"))\r\nCookie: session=\(cookie)\r\n"
                    + "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    + "Sec-WebSocket-Version: 13\r\n\r\n"
            )
            let opened = await connection.read(for: 5) { $0.contains("initial_state") }
            #expect(opened.text.hasPrefix("HTTP/1.1 101"), "\(opened.text.prefix(80))")
            #expect(opened.text.contains("initial_state"), "the session opened with the token of the header")

            let padding = String(repeating: " ", count: 100_000)
            connection.send(Self.maskedText("{\"type\":\"ping\",\"id\":\"large\"\(padding)}"))
            connection.send(Self.maskedText("{\"type\":\"ping\",\"id\":\"small\"}"))
            let answered = await connection.read(for: 5) { $0.contains("\"small\"") }
            #expect(answered.text.contains("\"id\":\"large\""), "the large frame was answered: \(answered.text.prefix(200))")
            #expect(answered.text.contains("\"id\":\"small\""), "and the small one after it")
            #expect(!answered.closed)
        }
    }

    @Test("a plain GET of the session path is 422 with the reason; a POST is 405 with Allow: GET")
    func plainRequests() async throws {
        try await withNodes(1) { ports in
            let plain = try await call(ports[0], "GET", "/api/presence/subscribe")
            #expect(plain.status == 422)
            let message = ((plain.json as? [String: Any])?["error"] as? [String: Any])?["message"] as? String
            #expect(message?.contains("WebSocket upgrade") == true, "\(message ?? "nil")")
            let post = try await call(ports[0], "POST", "/api/presence/subscribe")
            #expect(post.status == 405)
        }
    }

    /// The answer to `request` sent as a connection's first, and whether the connection ended.
    static func firstAnswer(_ port: Int, _ request: String, seconds: Double = 3) async throws -> (text: String, closed: Bool) {
        let connection = try Connection(port: port)
        connection.send(request)
        return await connection.read(for: seconds) { text in
            // A whole answer: its head, and the body its Content-Length announces.
            guard let end = text.range(of: "\r\n\r\n") else { return false }
            let head = text[..<end.lowerBound].lowercased()
            guard let line = head.split(separator: "\r\n").first(where: { $0.hasPrefix("content-length:") }),
                  let length = Int(line.dropFirst(15).trimmingCharacters(in: .whitespaces)) else { return true }
            return text.utf8.count - text[..<end.upperBound].utf8.count >= length
        }
    }

    /// Each of these was closed with no answer at all: NIO's upgrader dropped the head of a
    /// request asking for an upgrade it would not make.
    @Test("an upgrade the node will not make is an ordinary request: 404 for another path, 422 at the session path without a key or with another version, the route's answer elsewhere")
    func upgradesNotMade() async throws {
        try await withNodes(1) { ports in
            let key = "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            let headers = "Upgrade: websocket\r\nConnection: Upgrade\r\n\(key)Sec-WebSocket-Version: 13\r\n"
            // (what, request line, further headers, the answer's status)
            let cases = [
                ("another path", "GET /api/presence/ws", headers, 404),
                ("no key", "GET /api/presence/subscribe", "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n", 422),
                ("version 8", "GET /api/presence/subscribe", "Upgrade: websocket\r\nConnection: Upgrade\r\n\(key)Sec-WebSocket-Version: 8\r\n", 422),
                ("a POST asking for the upgrade is a POST", "POST /api/presence/subscribe", headers + "Content-Length: 0\r\n", 405),
                ("the node's own refusal marker from a client means nothing", "GET /healthz", "presence-upgrade-refused: draining\r\n", 200),
                ("h2c", "GET /healthz", "Upgrade: h2c\r\nConnection: Upgrade\r\n", 200),
            ]
            for (what, line, extra, status) in cases {
                let answer = try await Self.firstAnswer(ports[0], "\(line) HTTP/1.1\r\nHost: 127.0.0.1\r\n\(extra)\r\n")
                #expect(answer.text.hasPrefix("HTTP/1.1 \(status)"), "\(what): \(answer.text.prefix(120))")
            }
            // The session upgrade itself still opens a session.
            let alice = try await token("alice")
            let session = try await Self.firstAnswer(ports[0], Self.upgrade(alice))
            #expect(session.text.hasPrefix("HTTP/1.1 101"), "\(session.text.prefix(120))")
        }
    }

    /// A head over NIO's decoder's limit (80 KiB) was neither answered nor closed: the decoder
    /// stopped reading, and the connection was held for as long as the client kept it.
    @Test("a request whose headers pass 80 KiB is answered 431 and closed within a second; a request that is not HTTP is answered 400 and closed")
    func oversizedHeaders() async throws {
        try await withNodes(1) { ports in
            let big = String(repeating: "a", count: 100_000)
            let started = ContinuousClock.now
            let oversized = try await Self.firstAnswer(ports[0], "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: \(big)\r\n\r\n")
            #expect(oversized.text.hasPrefix("HTTP/1.1 431"), "\(oversized.text.prefix(120))")
            #expect(oversized.text.contains("\"code\":\"invalid_request\""))
            let connection = try Connection(port: ports[0])
            connection.send("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: \(big)\r\n\r\n")
            let ended = await connection.read(for: 3) { _ in false }
            #expect(ended.closed, "the connection ends after the 431")
            #expect(ContinuousClock.now - started < .seconds(4))
            let garbage = try await Self.firstAnswer(ports[0], "NOT HTTP AT ALL\r\n\r\n")
            #expect(garbage.text.hasPrefix("HTTP/1.1 400"), "\(garbage.text.prefix(120))")
            // Just under the limit is served.
            let fits = try await Self.firstAnswer(ports[0], "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: \(String(repeating: "a", count: 80_000))\r\n\r\n")
            #expect(fits.text.hasPrefix("HTTP/1.1 200"), "\(fits.text.prefix(120))")
        }
    }

    /// The whole path of a client gone silent (its socket open, nothing answered): pinged, not
    /// answered, dropped, and offline for its watcher after the linger. The timing itself is
    /// the handler's test (`SessionChannelHandlerTests.pingTimeout`); the bound here is loose.
    @Test("a client that answers nothing (no pong, no FIN) is dropped after the ping and pong timeout and shown offline after the linger")
    func silentClient() async throws {
        try await withNodes(1, configure: { $0.pingInterval = .seconds(1); $0.pongTimeout = .seconds(1) }) { ports in
            _ = try await call(ports[0], "PUT", "/api/admin/conversations/pair", token: adminToken, body: #"{"member_ids":["alice","bob"]}"#)
            let bob = TestSocket(port: ports[0], token: try await token("bob"), device: "phone")
            _ = try await bob.next("initial_state")
            let silent = try Connection(port: ports[0])
            silent.send(Self.upgrade(try await token("alice")))
            #expect(try await bob.next("presence_update").status == "online")
            let opened = ContinuousClock.now
            let offline = try await bob.next("presence_update", timeout: .seconds(10))
            let after = ContinuousClock.now - opened
            print("silent client: offline \(after) after opening")
            #expect(offline.status == "offline")
            // Ping at 1 s, no pong by 2 s, then the 1 s linger: some 3 s.
            #expect(after > .milliseconds(1500) && after < .seconds(7), "offline \(after) after opening")
            _ = silent
        }
    }

    /// Each of these connections was held for good before: nothing limited how long a request
    /// head may take.
    @Test("a request head must arrive whole within the head timeout: silent connections, slow heads, half an upgrade and idle keep-alive connections are closed; a long response is not")
    func slowHeads() async throws {
        try await withNodes(1, configure: { $0.requestHeadTimeout = .seconds(1) }) { ports in
            let port = ports[0]
            let started = ContinuousClock.now
            let silent = try Connection(port: port)
            let slow = try Connection(port: port)
            slow.send("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            let feeding = Task {
                for index in 0..<10 {
                    try await Task.sleep(for: .milliseconds(300))
                    slow.send("X-Slow-\(index): a\r\n")
                }
            }
            defer { feeding.cancel() }
            let halfUpgrade = try Connection(port: port)
            halfUpgrade.send(String(Self.upgrade(try await token("alice")).dropLast(2)))
            let keptAlive = try Connection(port: port)
            keptAlive.send("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            let served = await keptAlive.read(for: 2) { $0.contains("\r\n\r\n") }
            #expect(served.text.hasPrefix("HTTP/1.1 200"), "a whole head in time is served: \(served.text.prefix(80))")
            for (name, connection) in [("silent", silent), ("slow head", slow), ("half an upgrade", halfUpgrade), ("idle keep-alive", keptAlive)] {
                let ended = await connection.read(for: 4) { _ in false }
                #expect(ended.closed, "\(name): still open \(ContinuousClock.now - started) after the start")
            }
            #expect(ContinuousClock.now - started < .seconds(8))
            // A response that lasts (the admin feed) is not cut by the head timeout.
            let feed = try await offThePool {
                try DashboardTests.readEvents(port: port, token: adminToken, timeout: .milliseconds(2600)) { _ in false }
            }
            #expect(feed.components(separatedBy: "event: overview\n").count - 1 >= 2, "the feed goes on past the head timeout: \(feed.suffix(200))")
        }
    }
}
