import Foundation
import RedisTestSupport
import Testing

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

        func send(_ text: String) {
            let bytes = Array(text.utf8)
            _ = bytes.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
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
}
