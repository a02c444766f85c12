import Foundation
import NIOConcurrencyHelpers
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
#if canImport(Glibc)
import Glibc
#endif
import RedisTestSupport
import Testing

@testable import PresenceGateway

/// The browser client and dashboard the node serves, and the admin reads behind the dashboard:
/// a user's devices, the overview, and the live feed (Server-Sent Events), on a live node.
@Suite("Browser client, dashboard and admin feed")
struct DashboardTests {
    /// The repository's `Sources/`.
    static let sources = URL(fileURLWithPath: #filePath)
        .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        .appendingPathComponent("Sources")

    static func fetch(_ port: Int, _ path: String, token: String? = nil) async throws -> (status: Int, body: Data, headers: [String: String]) {
        var request = URLRequest(url: URL(string: "http://127.0.0.1:\(port)\(path)")!)
        if let token { request.setValue("Bearer \(token)", forHTTPHeaderField: "Authorization") }
        let (data, response) = try await URLSession.shared.data(for: request)
        let http = response as! HTTPURLResponse
        var headers: [String: String] = [:]
        for (name, value) in http.allHeaderFields { headers[String(describing: name).lowercased()] = String(describing: value) }
        return (http.statusCode, data, headers)
    }

    @Test("the client module, its types and the dashboard are served as the repository holds them, the page under a strict CSP")
    func assets() async throws {
        try await withNodes(1) { ports in
            for (path, file, type) in [
                ("/client/presence.js", "PresenceWebClient/presence.js", "text/javascript"),
                ("/client/presence.d.ts", "PresenceWebClient/presence.d.ts", "text/plain"),
                ("/dashboard", "PresenceGateway/Web/dashboard.html", "text/html"),
                ("/dashboard/dashboard.js", "PresenceGateway/Web/dashboard.js", "text/javascript"),
                ("/dashboard/dashboard.css", "PresenceGateway/Web/dashboard.css", "text/css"),
            ] {
                let answer = try await Self.fetch(ports[0], path)
                #expect(answer.status == 200, "\(path)")
                #expect(answer.headers["content-type"]?.hasPrefix(type) == true, "\(path): \(answer.headers["content-type"] ?? "none")")
                let repository = try Data(contentsOf: Self.sources.appendingPathComponent(file))
                #expect(answer.body == repository, "\(path) is \(file)")
                #expect(answer.headers["x-content-type-options"] == "nosniff")
            }
            let client = try await Self.fetch(ports[0], "/client/presence.js")
            #expect(client.headers["access-control-allow-origin"] == "*", "any origin may import the module")
            let page = try await Self.fetch(ports[0], "/dashboard")
            let policy = try #require(page.headers["content-security-policy"])
            #expect(policy.contains("default-src 'none'") && policy.contains("script-src 'self'") && policy.contains("connect-src 'self'"))
            #expect(!policy.contains("unsafe"), "no inline scripts or styles, no eval")
            #expect(page.headers["x-frame-options"] == "DENY")
        }
    }

    @Test("admin user lookup and overview: 401 with a wrong token, 404 for an unknown user, the real state otherwise")
    func adminReads() async throws {
        try await withNodes(1) { ports in
            let port = ports[0]
            #expect(try await Self.fetch(port, "/api/admin/users/alice", token: "wrong").status == 401)
            #expect(try await Self.fetch(port, "/api/admin/overview", token: try await token("alice")).status == 401)
            #expect(try await Self.fetch(port, "/api/admin/users/nobody", token: adminToken).status == 404)
            #expect(try await Self.fetch(port, "/api/admin/users/bad%20id", token: adminToken).status == 422)

            #expect(try await call(port, "POST", "/api/presence/status", token: try await token("alice"), body: #"{"status":"away","device_id":"web"}"#).status == 200)
            #expect(try await call(port, "PUT", "/api/admin/conversations/team", token: adminToken, body: #"{"member_ids":["alice","bob","carol"]}"#).status == 200)
            _ = try await call(port, "PUT", "/api/presence/privacy", token: try await token("alice"), body: #"{"show_online_status":false}"#)

            let user = try await Self.fetch(port, "/api/admin/users/alice", token: adminToken)
            #expect(user.status == 200)
            let detail = try #require(try JSONSerialization.jsonObject(with: user.body) as? [String: Any])
            #expect(detail["status"] as? String == "away", "the operator sees the real status")
            #expect(detail["show_online_status"] as? Bool == false)
            #expect((detail["shown_to_others"] as? [String: Any])?["status"] as? String == "offline")
            let device = try #require((detail["devices"] as? [[String: Any]])?.first)
            #expect(device["device_id"] as? String == "web")
            #expect(device["node"] is NSNull, "a REST device has no node, written as null")
            #expect(device["deadline"] is String, "a REST device lives until its heartbeat runs out")
            #expect((detail["conversations"] as? [[String: Any]])?.first?["conversation_id"] as? String == "team")

            // Messages: the lookup shows the user's cursors, the overview the nodes' running count.
            for number in 1...3 {
                let body = MessageRESTTests.body(["client_message_id": "m\(number)", "text": "hi"])
                #expect(try await call(port, "POST", "/api/conversations/team/messages", token: try await token("bob"), body: body).status == 201)
            }
            _ = try await call(port, "POST", "/api/conversations/team/read", token: try await token("alice"), body: #"{"seq":2}"#)
            let withCursors = try JSONSerialization.jsonObject(with: try await Self.fetch(port, "/api/admin/users/alice", token: adminToken).body) as? [String: Any]
            let team = try #require((withCursors?["conversations"] as? [[String: Any]])?.first)
            #expect(team["last_seq"] as? Int == 3 && team["read_seq"] as? Int == 2 && team["delivered_seq"] as? Int == 2 && team["unread"] as? Int == 1)
            #expect((team["epoch"] as? String)?.isEmpty == false)

            let ready = try await eventually {
                let answer = try await Self.fetch(port, "/api/admin/overview", token: adminToken)
                let overview = try JSONSerialization.jsonObject(with: answer.body) as? [String: Any]
                return (overview?["nodes"] as? [[String: Any]])?.first?["node_id"] as? String == "node-0"
            }
            #expect(ready, "the node is in the overview once it holds its lease")
            try await Task.sleep(for: .seconds(1))  // past the overview cache's second
            let answer = try await Self.fetch(port, "/api/admin/overview", token: adminToken)
            let overview = try #require(try JSONSerialization.jsonObject(with: answer.body) as? [String: Any])
            #expect(overview["users_online"] as? Int == 0 && overview["users_away"] as? Int == 1)
            #expect((overview["users"] as? [[String: Any]])?.map { $0["user_id"] as? String } == ["alice"])
            let counts = try #require((overview["conversations"] as? [[String: Any]])?.first)
            #expect(counts["conversation_id"] as? String == "team" && counts["total"] as? Int == 3 && counts["away"] as? Int == 1 && counts["online"] as? Int == 0)
            // The node records its count at each lease renewal (a third of the 3 s lease).
            let counted = try await eventually(timeout: .seconds(5)) {
                try await Task.sleep(for: .milliseconds(500))
                let answer = try await Self.fetch(port, "/api/admin/overview", token: adminToken)
                let overview = try JSONSerialization.jsonObject(with: answer.body) as? [String: Any]
                return overview?["messages_stored"] as? Int == 3 && (overview?["nodes"] as? [[String: Any]])?.first?["messages_stored"] as? Int == 3
            }
            #expect(counted, "the overview counts the 3 messages stored through the node")
        }
        try await withNodes(1, configure: { $0.adminToken = nil }) { ports in
            let overview = try await Self.fetch(ports[0], "/api/admin/overview", token: adminToken)
            let feed = try await Self.fetch(ports[0], "/api/admin/events", token: adminToken)
            let page = try await Self.fetch(ports[0], "/dashboard")
            #expect(overview.status == 404 && feed.status == 404)
            #expect(page.status == 200, "the page itself says the admin routes are off")
        }
    }

    /// Reads a Server-Sent Events stream over a plain socket (`URLSession` on Linux has no
    /// streaming body) until `until` holds for what has arrived, or `timeout` passes.
    static func readEvents(port: Int, token: String, timeout: Duration, until: (String) -> Bool) throws -> String {
        let socket = Glibc.socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        guard socket >= 0 else { throw POSIXError(.EIO) }
        defer { close(socket) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = in_port_t(UInt16(port).bigEndian)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        let connected = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(socket, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard connected == 0 else { throw POSIXError(.ECONNREFUSED) }
        var wait = timeval(tv_sec: 0, tv_usec: 200_000)
        setsockopt(socket, SOL_SOCKET, SO_RCVTIMEO, &wait, socklen_t(MemoryLayout<timeval>.size))
        let request = "GET /api/admin/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \(token)\r\n\r\n"
        _ = request.withCString { send(socket, $0, strlen($0), 0) }
        var received: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 65_536)
        let deadline = ContinuousClock.now + timeout
        while ContinuousClock.now < deadline {
            let count = recv(socket, &buffer, buffer.count, 0)
            if count == 0 { break }
            if count > 0 { received += buffer[0..<count] }
            if until(String(decoding: received, as: UTF8.self)) { break }
        }
        return String(decoding: received, as: UTF8.self)
    }

    @Test("the admin feed: an overview at once and every 2 s, and each change of any user as a presence event (with sharded pub/sub: of each user the last overview listed)")
    func feed() async throws {
        try await withNodes(1) { ports in
            let port = ports[0]
            let alice = try await token("alice")
            // Changes made while the feed is being read, after its first overview (from which on it
            // carries every change). With sharded pub/sub the feed follows the users an overview
            // listed: alice's first change is not an event, and the next one is made once an
            // overview lists her.
            let listening = NIOLockedValueBox(false)
            let aliceListed = NIOLockedValueBox(false)
            let sharded = TestRedis.isSharded
            let changes = Task {
                for _ in 0..<500 where !listening.withLockedValue({ $0 }) { try await Task.sleep(for: .milliseconds(10)) }
                _ = try await call(port, "POST", "/api/presence/status", token: alice, body: #"{"status":"online","device_id":"web"}"#)
                if sharded {
                    for _ in 0..<500 where !aliceListed.withLockedValue({ $0 }) { try await Task.sleep(for: .milliseconds(10)) }
                }
                try await Task.sleep(for: .milliseconds(300))
                _ = try await call(port, "POST", "/api/presence/status", token: alice, body: #"{"status":"away","device_id":"web"}"#)
            }
            defer { changes.cancel() }
            let text = try await offThePool {
                try Self.readEvents(port: port, token: adminToken, timeout: .seconds(10)) { text in
                    if text.contains("event: overview") { listening.withLockedValue { $0 = true } }
                    if text.contains("\"user_id\":\"alice\"") { aliceListed.withLockedValue { $0 = true } }
                    // Both changes as presence events (an overview read after the second change
                    // shows it too, and may come before its event under load); with sharded
                    // pub/sub the second.
                    let overviews = text.components(separatedBy: "event: overview\n").count - 1
                    return overviews > 1 && text.components(separatedBy: "event: presence\n").count > (sharded ? 1 : 2)
                }
            }
            #expect(text.hasPrefix("HTTP/1.1 200"), "\(text.prefix(200))")
            #expect(text.lowercased().contains("content-type: text/event-stream"))
            // The body is chunked, one event a chunk: the chunks' size lines fall between events.
            let events = text.replacingOccurrences(of: "\r\n", with: "\n").components(separatedBy: "\n\n").compactMap { block -> (String, [String: Any])? in
                let lines = block.split(separator: "\n")
                guard let name = lines.first(where: { $0.hasPrefix("event: ") })?.dropFirst(7),
                      let data = lines.first(where: { $0.hasPrefix("data: ") })?.dropFirst(6),
                      let json = try? JSONSerialization.jsonObject(with: Data(data.utf8)) as? [String: Any] else { return nil }
                return (String(name), json)
            }
            #expect(events.first?.0 == "overview", "an overview first: \(events.map(\.0))")
            #expect(events.count { $0.0 == "overview" } >= 2, "overviews keep coming: \(events.map(\.0))")
            let presences = events.filter { $0.0 == "presence" }.map(\.1)
            let expected = sharded ? ["away"] : ["online", "away"]
            #expect(presences.map { $0["user_id"] as? String } == expected.map { _ in "alice" }, "\(presences)")
            #expect(presences.map { $0["status"] as? String } == expected)
            #expect(presences.allSatisfy { $0["shown_status"] as? String == $0["status"] as? String && $0["at"] is String })
            #expect(try await Self.fetch(port, "/api/admin/events", token: "wrong").status == 401)
        }
    }

    /// A feed opened while Redis is down says so (`unavailable` events) and, once Redis is back,
    /// carries overviews again. Before, its subscriber's failed start was never reported: a 200 and
    /// then nothing, for as long as the client waited.
    @Test("the admin feed opened while Redis is down says it is unavailable, then carries overviews once Redis is back")
    func feedWhileRedisIsDown() async throws {
        let redis = try RedisServerProcess()
        try await withNodes(1, configure: { $0.redisURL = redis.url() }) { ports in
            redis.stop()
            // Redis comes back once the feed has said it is unavailable (at most 15 s): a fixed
            // delay raced the subscriber's first try, which waits up to 2.5 s and then connected.
            let said = NIOLockedValueBox(false)
            let restarted = NIOLockedValueBox<ContinuousClock.Instant?>(nil)
            let restart = Task {
                for _ in 0..<1500 where !said.withLockedValue({ $0 }) { try await Task.sleep(for: .milliseconds(10)) }
                try redis.start()
                restarted.withLockedValue { $0 = .now }
            }
            defer { restart.cancel() }
            let text = try await offThePool {
                try Self.readEvents(port: ports[0], token: adminToken, timeout: .seconds(25)) { text in
                    if text.contains("event: unavailable\n") { said.withLockedValue { $0 = true } }
                    return text.contains("event: overview\n")
                }
            }
            let seenAt = ContinuousClock.now
            #expect(text.hasPrefix("HTTP/1.1 200"), "\(text.prefix(200))")
            let unavailable = text.range(of: "event: unavailable\n"), overview = text.range(of: "event: overview\n")
            #expect(unavailable != nil, "the feed says Redis is unreachable: \(text)")
            #expect(overview != nil, "an overview once Redis is back: \(text)")
            if let unavailable, let overview { #expect(unavailable.lowerBound < overview.lowerBound) }
            #expect(text.contains("\"error\":\"unavailable\""), "\(text)")
            if let back = restarted.withLockedValue({ $0 }) {
                print("admin feed: the first overview \(seenAt - back) after Redis was back")
                #expect(seenAt - back < .seconds(6), "the first overview came \(seenAt - back) after Redis was back")
            }
        }
    }
}
