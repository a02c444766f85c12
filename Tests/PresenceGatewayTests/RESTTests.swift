import Crypto
import Foundation
import RedisTestSupport
import Testing

@testable import PresenceGateway

@Suite("REST routes of a live node")
struct RESTTests {
    static func errorCode(_ json: Any?) -> String? {
        ((json as? [String: Any])?["error"] as? [String: Any])?["code"] as? String
    }

    static func base64URL(_ data: Data) -> String {
        data.base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_").replacingOccurrences(of: "=", with: "")
    }

    @Test("bad tokens are 401 with the error body, never 500")
    func badTokens() async throws {
        try await withNodes(1) { ports in
            let port = ports[0]
            let valid = try await token("alice")
            let parts = valid.split(separator: ".")
            let header = Data(#"{"alg":"none","typ":"JWT"}"#.utf8).base64EncodedString().replacingOccurrences(of: "=", with: "")
            // Signed with the right secret, but the header names another algorithm.
            func resigned(alg: String) -> String {
                let header = Self.base64URL(Data(#"{"alg":"\#(alg)","typ":"JWT"}"#.utf8))
                let mac = HMAC<SHA256>.authenticationCode(for: Data("\(header).\(parts[1])".utf8), using: SymmetricKey(data: Data(testSecret.utf8)))
                return "\(header).\(parts[1]).\(Self.base64URL(Data(mac)))"
            }
            #expect(try await call(port, "GET", "/api/presence/users/alice", token: resigned(alg: "HS256")).status == 200, "the re-signing itself is right")
            let bad: [String?] = [
                nil, "", "garbage", "a.b.c",
                try await token("alice", expiresIn: -60),
                try await token("alice", secret: "another-secret-that-is-long-enough-000"),
                "\(header).\(parts[1]).",
                resigned(alg: "RS256"), resigned(alg: "none"), resigned(alg: "HS512"),
                String(repeating: "x", count: 20_000),
                try await token("bad id with spaces"),
            ]
            for candidate in bad {
                let answer = try await call(port, "GET", "/api/presence/users/alice", token: candidate)
                #expect(answer.status == 401, "token \(candidate?.prefix(20) ?? "nil")")
                #expect(Self.errorCode(answer.json) == "unauthorized")
            }
            #expect(try await call(port, "GET", "/api/presence/users/alice", token: valid).status == 200)
        }
    }

    @Test("status posts: the aggregate back, 422 for bad input, 429 with Retry-After past the rate")
    func statusPosts() async throws {
        try await withNodes(1) { ports in
            let port = ports[0]
            let alice = try await token("alice")
            let posted = try await call(port, "POST", "/api/presence/status", token: alice, body: #"{"status":"away","device_id":"web-1"}"#)
            #expect(posted.status == 200)
            let body = posted.json as? [String: Any]
            #expect(body?["user_id"] as? String == "alice" && body?["status"] as? String == "away")
            #expect((body?["last_seen"] as? String)?.hasSuffix("Z") == true)
            for bad in [#"{"status":"busy"}"#, #"{"status":1}"#, "not json", #"{"status":"online","device_id":"a b"}"#, "{}"] {
                let answer = try await call(port, "POST", "/api/presence/status", token: alice, body: bad)
                #expect(answer.status == 422, "body \(bad)")
                #expect(Self.errorCode(answer.json) == "invalid_request")
            }
            // Sent together, so that they come faster than the bucket refills (5/s) however
            // slowly a loaded machine answers each.
            let answers = try await withThrowingTaskGroup(of: (status: Int, code: String?, retryAfter: Bool).self) { group in
                for _ in 0..<30 {
                    group.addTask {
                        let answer = try await call(port, "POST", "/api/presence/status", token: alice, body: #"{"status":"online","device_id":"web-1"}"#)
                        return (answer.status, Self.errorCode(answer.json), answer.headers["Retry-After"] != nil)
                    }
                }
                return try await group.reduce(into: []) { $0.append($1) }
            }
            let limited = answers.first { $0.status == 429 }
            #expect(limited != nil, "30 posts at once must hit the rate limit: \(answers.map(\.status))")
            #expect(limited?.code == "rate_limited")
            #expect(limited?.retryAfter == true)
        }
    }

    @Test("a bad body's 422 names the field as the client wrote it; bodies are taken up to 128 KiB, past it 413")
    func bodyErrors() async throws {
        try await withNodes(1) { ports in
            let port = ports[0]
            let alice = try await token("alice")
            func message(_ path: String, _ body: String, method: String = "POST", status: Int = 422) async throws -> String? {
                let answer = try await call(port, method, path, token: alice, body: body)
                #expect(answer.status == status, "\(path) \(body.prefix(40)): \(answer.status)")
                return ((answer.json as? [String: Any])?["error"] as? [String: Any])?["message"] as? String
            }
            let wrongType = try await message("/api/presence/status", #"{"status":"online","device_id":7}"#)
            #expect(wrongType?.contains("'device_id'") == true, "\(wrongType ?? "nil")")
            let missing = try await message("/api/presence/privacy", "{}", method: "PUT")
            #expect(missing?.contains("'show_online_status'") == true, "\(missing ?? "nil")")
            let null = try await message("/api/conversations/room/typing", #"{"is_typing":null}"#)
            #expect(null?.contains("'is_typing'") == true, "\(null ?? "nil")")
            // Whitespace pads a valid body to just under and just over the limit.
            let padded = { (size: Int) in #"{"status":"online","# + String(repeating: " ", count: size - 20) + "}" }
            #expect(padded(128 * 1024).utf8.count == 128 * 1024)
            #expect(try await call(port, "POST", "/api/presence/status", token: alice, body: padded(128 * 1024)).status == 200)
            let tooLarge = try await message("/api/presence/status", padded(128 * 1024 + 1), status: 413)
            #expect(tooLarge?.contains("128 KiB") == true, "\(tooLarge ?? "nil")")
        }
    }

    @Test("reads honour visibility and privacy; unknown and invisible users look the same")
    func reads() async throws {
        try await withNodes(1) { ports in
            let port = ports[0]
            #expect(try await call(port, "PUT", "/api/admin/conversations/c1", token: adminToken, body: #"{"member_ids":["alice","bob"]}"#).status == 200)
            let alice = try await token("alice"), bob = try await token("bob"), carol = try await token("carol")
            _ = try await call(port, "POST", "/api/presence/status", token: bob, body: #"{"status":"online"}"#)
            let seen = try await call(port, "GET", "/api/presence/users/bob", token: alice)
            #expect(seen.status == 200 && (seen.json as? [String: Any])?["status"] as? String == "online")
            #expect((seen.json as? [String: Any])?["is_typing"] as? Bool == false)
            #expect(try await call(port, "GET", "/api/presence/users/bob", token: carol).status == 404)
            #expect(try await call(port, "GET", "/api/presence/users/nobody", token: carol).status == 404)
            #expect(try await call(port, "GET", "/api/presence/users/bad%20id", token: carol).status == 422)
            let encoded = try await call(port, "GET", "/api/presence/users/b%6Fb", token: alice)
            #expect(encoded.status == 200 && (encoded.json as? [String: Any])?["user_id"] as? String == "bob", "a percent-encoded id is the id")
            #expect(try await call(port, "GET", "/api/conversations/c%31/presence", token: alice).status == 200)
            #expect(try await call(port, "GET", "/api/presence/users/a%40b", token: carol).status == 404, "a@b is a valid id, unknown")
            #expect(try await call(port, "GET", "/api/presence/users/a%2Fb", token: carol).status == 422, "a/b is not")
            let list = try await call(port, "GET", "/api/presence/users?user_ids=bob,carol,nobody", token: alice)
            #expect((list.json as? [[String: Any]])?.compactMap { $0["user_id"] as? String } == ["bob"])
            let contacts = try await call(port, "GET", "/api/presence/users", token: alice)
            #expect((contacts.json as? [[String: Any]])?.compactMap { $0["user_id"] as? String } == ["bob"])

            let hidden = try await call(port, "PUT", "/api/presence/privacy", token: bob, body: #"{"show_online_status":false}"#)
            #expect(hidden.status == 200 && (hidden.json as? [String: Any])?["show_online_status"] as? Bool == false)
            #expect((try await call(port, "GET", "/api/presence/users/bob", token: alice).json as? [String: Any])?["status"] as? String == "offline")
            #expect((try await call(port, "GET", "/api/presence/users/bob", token: bob).json as? [String: Any])?["status"] as? String == "online")
            #expect(try await call(port, "PUT", "/api/presence/privacy", token: bob, body: #"{"show_online_status":"no"}"#).status == 422)

            let group = try await call(port, "GET", "/api/conversations/c1/presence", token: alice)
            #expect((group.json as? [String: Any])?["total"] as? Int == 2)
            #expect((group.json as? [String: Any])?["online"] as? Int == 0, "hidden bob counts as offline")
            #expect(try await call(port, "GET", "/api/conversations/c1/presence", token: carol).status == 403)
            #expect(try await call(port, "GET", "/api/conversations/none/presence", token: carol).status == 404)
        }
    }

    @Test("callers act only as themselves; ids carrying CR/LF, globs, hash tags or separators are 422 everywhere")
    func actingAsOthersAndInjection() async throws {
        try await withNodes(1) { ports in
            let port = ports[0]
            #expect(try await call(port, "PUT", "/api/admin/conversations/c1", token: adminToken, body: #"{"member_ids":["alice","bob"]}"#).status == 200)
            let alice = try await token("alice"), bob = try await token("bob"), mallory = try await token("mallory")
            // A body naming another user changes the caller, never that user.
            let posted = try await call(port, "POST", "/api/presence/status", token: alice, body: #"{"status":"away","user_id":"bob","device_id":"web"}"#)
            #expect(posted.status == 200 && (posted.json as? [String: Any])?["user_id"] as? String == "alice")
            let bobSelf = try await call(port, "GET", "/api/presence/users/bob", token: bob)
            #expect((bobSelf.json as? [String: Any])?["status"] as? String == "offline", "bob was not made away by alice")
            _ = try await call(port, "PUT", "/api/presence/privacy", token: alice, body: #"{"show_online_status":false,"user_id":"bob"}"#)
            _ = try await call(port, "POST", "/api/presence/status", token: bob, body: #"{"status":"online"}"#)
            let bobSeen = try await call(port, "GET", "/api/presence/users/bob", token: alice)
            #expect((bobSeen.json as? [String: Any])?["status"] as? String == "online", "bob's privacy is his own")
            // Outsiders: no reads, no typing, no counts, no admin.
            #expect(try await call(port, "GET", "/api/presence/users/bob", token: mallory).status == 404)
            #expect(try await call(port, "POST", "/api/conversations/c1/typing", token: mallory, body: #"{"is_typing":true}"#).status == 403)
            #expect(try await call(port, "GET", "/api/conversations/c1/presence", token: mallory).status == 403)
            #expect(try await call(port, "PUT", "/api/admin/conversations/c1", token: mallory, body: #"{"member_ids":["mallory"]}"#).status == 401)

            let hostile = ["a%0D%0AX-Injected:%201", "a%0Ab", "a*", "a%7Bb%7D", "a%7Cb", "a%20b", "a%00b", String(repeating: "x", count: 129), "%C3%A9"]
            for id in hostile {
                for path in ["/api/presence/users/\(id)", "/api/conversations/\(id)/presence", "/api/presence/users?user_ids=bob,\(id)"] {
                    let answer = try await call(port, "GET", path, token: alice)
                    #expect(answer.status == 422 && Self.errorCode(answer.json) == "invalid_request", "\(path): \(answer.status)")
                }
                let typing = try await call(port, "POST", "/api/conversations/\(id)/typing", token: alice, body: #"{"is_typing":true}"#)
                #expect(typing.status == 422, "typing in \(id): \(typing.status)")
                let device = try await call(port, "POST", "/api/presence/status", token: alice, body: #"{"status":"online","device_id":"\#(id.removingPercentEncoding ?? id)"}"#)
                #expect(device.status == 422, "device_id \(id): \(device.status)")
                let upgrade = GatewayProcess.http(port: port, method: "GET", path: "/api/presence/subscribe?token=\(alice)&device_id=\(id)", headers: [
                    "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                ])
                // Upgraded, then told why and closed with 1008 (the frames follow the 101 in the body).
                #expect(upgrade?.status == 101 && upgrade?.body.contains(#""code":"invalid_request""#) == true, "upgrade with device_id \(id): \(String(describing: upgrade))")
                let admin = try await call(port, "PUT", "/api/admin/conversations/\(id)", token: adminToken, body: #"{"member_ids":["alice"]}"#)
                #expect(admin.status == 422, "admin conversation \(id): \(admin.status)")
            }
        }
    }

    /// Every route openapi.yaml lists, with its method: `/api/admin/...` ones take the admin
    /// token, other `/api/...` ones a client token, the rest none.
    static func documentedRoutes(filePath: String = #filePath) throws -> [(method: String, path: String)] {
        let root = URL(fileURLWithPath: filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        let lines = try String(contentsOf: root.appendingPathComponent("openapi.yaml"), encoding: .utf8).split(separator: "\n")
        var routes: [(method: String, path: String)] = []
        var path: String?
        for line in lines {
            if line.hasPrefix("  /"), line.hasSuffix(":") { path = String(line.dropFirst(2).dropLast()) }
            else if !line.hasPrefix(" ") { path = nil }
            else if let path, let method = ["get", "post", "put", "delete", "patch"].first(where: { line == "    \($0):" }) {
                routes.append((method.uppercased(), path))
            }
        }
        return routes
    }

    @Test("every route asks for its token before anything else: a client's on /api, the admin's on /api/admin (401 without it, 401 with the other kind), none elsewhere")
    func everyRouteAsksForItsToken() async throws {
        let routes = try Self.documentedRoutes()
        #expect(routes.count > 25, "openapi.yaml read: \(routes.count) routes")
        try await withNodes(1) { ports in
            let port = ports[0]
            let alice = try await token("alice")
            for (method, template) in routes {
                let path = template.replacingOccurrences(of: "{conversation_id}", with: "room").replacingOccurrences(of: "{user_id}", with: "bob")
                // A body that is no body: a route that read it before the token would answer 400 or 422.
                let body = method == "GET" || method == "DELETE" ? nil : "not json"
                if path.hasPrefix("/api/admin/") {
                    for (label, candidate) in [("none", nil), ("a client's", alice)] as [(String, String?)] {
                        let answer = try await call(port, method, path, token: candidate, body: body)
                        #expect(answer.status == 401 && Self.errorCode(answer.json) == "unauthorized", "\(method) \(path) with \(label): \(answer.status)")
                    }
                } else if path.hasPrefix("/api/") {
                    for (label, candidate) in [("none", nil), ("the admin's", adminToken)] as [(String, String?)] {
                        let answer = try await call(port, method, path, token: candidate, body: body)
                        #expect(answer.status == 401 && Self.errorCode(answer.json) == "unauthorized", "\(method) \(path) with \(label): \(answer.status)")
                    }
                } else if path != "/readyz" {
                    #expect(try await call(port, method, path).status == 200, "\(method) \(path) needs no token")
                }
            }
        }
    }

    @Test("admin routes: 401 with a wrong token, 404 when turned off; nodes are listed")
    func admin() async throws {
        try await withNodes(1) { ports in
            let port = ports[0]
            #expect(try await call(port, "GET", "/api/admin/nodes", token: "wrong").status == 401)
            #expect(try await call(port, "GET", "/api/admin/nodes", token: try await token("alice")).status == 401)
            // The node takes its lease as it starts, beside the server: under load, a moment after
            // the server answers.
            let listed = try await eventually {
                let nodes = try await call(port, "GET", "/api/admin/nodes", token: adminToken)
                return (nodes.json as? [[String: Any]])?.first?["node_id"] as? String == "node-0"
            }
            #expect(listed, "node-0 is listed in /api/admin/nodes")
            #expect(try await call(port, "PUT", "/api/admin/conversations/c1", token: adminToken, body: #"{"member_ids":["ok","not ok"]}"#).status == 422)
            #expect(try await call(port, "POST", "/api/admin/conversations/c1/members", token: adminToken, body: #"{"user_ids":["a","b"]}"#).status == 200)
            #expect(try await call(port, "DELETE", "/api/admin/conversations/c1/members/a", token: adminToken).status == 200)
            #expect(try await call(port, "DELETE", "/api/admin/conversations/c1", token: adminToken).status == 200)
            #expect(try await call(port, "DELETE", "/api/admin/conversations/c1", token: adminToken).status == 404)
            #expect(try await call(port, "GET", "/healthz").status == 200)
            let ready = await eventually { (try? await call(port, "GET", "/readyz").status) == 200 }
            #expect(ready)
            let metrics = try await call(port, "GET", "/metrics")
            #expect(metrics.status == 200)
        }
        try await withNodes(1, configure: { $0.adminToken = nil }) { ports in
            let answer = try await call(ports[0], "GET", "/api/admin/nodes", token: adminToken)
            #expect(answer.status == 404)
            let otherMethod = try await call(ports[0], "POST", "/api/admin/nodes", token: adminToken)
            #expect(otherMethod.status == 404, "admin paths do not show through a 405 while turned off")
        }
    }

    @Test("a path asked with a method it does not take is 405 with Allow; an unknown path is 404")
    func methodNotAllowed() async throws {
        try await withNodes(1) { ports in
            let port = ports[0]
            let user = try await token("alice")
            func errorCode(_ answer: (status: Int, json: Any?, headers: [AnyHashable: Any])) -> String? {
                ((answer.json as? [String: Any])?["error"] as? [String: Any])?["code"] as? String
            }
            let cases: [(method: String, path: String, allow: String)] = [
                ("POST", "/api/presence/users/bob", "GET"),
                ("DELETE", "/api/presence/status", "POST"),
                ("GET", "/api/presence/privacy", "PUT"),
                ("PATCH", "/api/conversations/c1/typing", "POST"),
                ("POST", "/api/admin/conversations/c1", "DELETE, GET, PUT"),
                ("PUT", "/api/presence/subscribe", "GET"),
            ]
            for (method, path, allow) in cases {
                let answer = try await call(port, method, path, token: user, body: method == "GET" ? nil : "{}")
                #expect(answer.status == 405, "\(method) \(path)")
                #expect(answer.headers["Allow"] as? String == allow, "\(method) \(path): \(answer.headers)")
                #expect(errorCode(answer) == "method_not_allowed")
            }
            let unknown = try await call(port, "GET", "/api/presence/nowhere", token: user)
            #expect(unknown.status == 404 && errorCode(unknown) == "not_found")
            let tooDeep = try await call(port, "POST", "/api/presence/users/bob/extra", token: user)
            #expect(tooDeep.status == 404, "a route's path with a segment more is not that route")
        }
    }

    @Test("/readyz is 503 and REST answers 503 within a second while Redis is down")
    func redisDown() async throws {
        let server = try RedisServerProcess()
        try await withNodes(1, configure: { $0.redisURL = server.url() }) { ports in
            let port = ports[0]
            let alice = try await token("alice")
            let ready = await eventually { (try? await call(port, "GET", "/readyz").status) == 200 }
            #expect(ready)
            server.stop()
            let down = await eventually { (try? await call(port, "GET", "/readyz").status) == 503 }
            #expect(down)
            // Three tries, each a 503 well before a hang would end it; the fastest within the
            // second. Timed from this test process, one try among the parallel suites' load has
            // taken 1.04-1.35 s (the node's own wait for Redis is 300 ms).
            var fastest = Duration.seconds(60)
            for _ in 0..<3 {
                let started = ContinuousClock.now
                let answer = try await call(port, "POST", "/api/presence/status", token: alice, body: #"{"status":"online"}"#)
                let took = ContinuousClock.now - started
                #expect(answer.status == 503 && Self.errorCode(answer.json) == "unavailable")
                #expect(took < .seconds(3), "a 503 took \(took)")
                fastest = min(fastest, took)
            }
            #expect(fastest < .seconds(1), "the fastest 503 took \(fastest)")
            #expect(try await call(port, "GET", "/healthz").status == 200)
            try server.start()
            let back = await eventually(timeout: .seconds(10)) { (try? await call(port, "GET", "/readyz").status) == 200 }
            #expect(back)
        }
    }
}
