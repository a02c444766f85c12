import Foundation
import JWTKit
import PresenceEngine
import RedisClient
import RedisTestSupport
import Testing

@testable import PresenceGateway

/// Clients written against the original presence API (shared/reference/original-presence-api.md):
/// they connect with a token only, and in `PRESENCE_ID_FORMAT=numeric` they read and write
/// integer ids.
@Suite("Clients of the original presence API")
struct OriginalAPITests {
    /// The device ids Redis holds for `user`.
    private func deviceIDs(_ user: String, prefix: String) async throws -> Set<String> {
        try await withRedisCommands(configuration: TestRedis.configuration(), logger: TestRedis.logger()) { redis in
            let reply = try await redis.send("HKEYS", RedisArgument("\(prefix):{u:\(user)}:devices"))
            guard case .array(let items) = reply else { return [] }
            return Set(items.compactMap { item -> String? in
                guard case .bulkString(let bytes) = item else { return nil }
                return String(decoding: bytes, as: UTF8.self)
            })
        }
    }

    @Test("a WebSocket without device_id (token in the query or the header) is a device of its own: two are two devices")
    func withoutDeviceID() async throws {
        let prefix = TestRedis.uniquePrefix("nodev")
        try await withNodes(1, prefix: prefix) { ports in
            let port = ports[0]
            _ = try await call(port, "PUT", "/api/admin/conversations/pair", token: adminToken, body: #"{"member_ids":["alice","bob"]}"#)
            let bob = TestSocket(port: port, token: try await token("bob"), device: "phone")
            _ = try await bob.next("initial_state")

            let byQuery = TestSocket(port: port, token: try await token("alice"), device: nil)
            let first = try await byQuery.next("initial_state")
            #expect(first.presences.map { $0["user_id"] as? String } == ["bob"])
            let online = try await bob.next("presence_update")
            #expect(online.userID == "alice" && online.status == "online")

            let byHeader = TestSocket(port: port, token: try await token("alice"), device: nil, tokenInHeader: true)
            _ = try await byHeader.next("initial_state")
            let devices = try await deviceIDs("alice", prefix: prefix)
            #expect(devices.count == 2, "two connections without device_id are two devices: \(devices)")
            #expect(devices.allSatisfy { $0.hasPrefix("~") }, "server-made ids start with ~, which no client may send: \(devices)")

            byQuery.closeNormally()
            #expect(await byQuery.closed() == 1000)
            #expect(await bob.staysQuiet(for: .milliseconds(600)), "the other connection keeps alice online")
            let rest = try await call(port, "GET", "/api/presence/users/alice", token: try await token("bob"))
            #expect((rest.json as? [String: Any])?["status"] as? String == "online")
            #expect(try await deviceIDs("alice", prefix: prefix).count == 1, "a clean close took its own device only")

            byHeader.closeNormally()
            #expect(try await bob.next("presence_update").status == "offline")
        }
    }

    @Test("a device_id shaped like a server-made one is refused, so such a device cannot be taken over")
    func serverMadeIDsCannotBeClaimed() async throws {
        try await withNodes(1) { ports in
            let claim = TestSocket(port: ports[0], token: try await token("alice"), device: "~0b5c6a38-6cf5-4f5c-9d6e-3f0b1e6f7a11")
            #expect(await claim.closed() == 1008)
            #expect(claim.frames.first?.type == "error" && claim.frames.first?.data["code"] as? String == "invalid_request")
        }
    }

    /// A token whose `sub` is a JSON number, as issuers of integer user ids write it.
    private func numericToken(_ user: Int64) async throws -> String {
        let keys = JWTKeyCollection()
        await keys.add(hmac: HMACKey(from: testSecret), digestAlgorithm: .sha256)
        return try await keys.sign(ClientClaims(sub: .number(user), exp: .init(value: Date(timeIntervalSinceNow: 3600)), nbf: nil))
    }

    @Test("PRESENCE_ID_FORMAT=numeric: integer ids in and out; the original API's backend checklist passes")
    func numericBackendChecklist() async throws {
        try await withNodes(2, configure: { $0.idFormat = .numeric }) { ports in
            // Members given as numbers and as strings (with a leading zero): stored as 1, 2, 3.
            let created = try await call(ports[0], "PUT", "/api/admin/conversations/123", token: adminToken, body: #"{"member_ids":[1,2,"03"]}"#)
            let createdBody = created.json as? [String: Any]
            #expect(created.status == 200)
            #expect(createdBody?["conversation_id"] as? Int == 123 && !(createdBody?["conversation_id"] is String))
            #expect(createdBody?["member_ids"] as? [Int] == [1, 2, 3])
            let one = try await numericToken(1)
            let two = try await numericToken(2)
            // A string sub names the same user.
            let twoAsString = try await token("2")

            // WebSocket authentication with a Bearer header, no device_id: initial_state lists the
            // contacts with integer ids.
            let watcher = TestSocket(port: ports[1], token: two, device: nil, tokenInHeader: true)
            let initial = try await watcher.next("initial_state")
            #expect(Set(initial.presences.compactMap { $0["user_id"] as? Int }) == [1, 3])
            #expect(initial.presences.allSatisfy { !($0["user_id"] is String) }, "\(initial)")

            // POST /presence/status updates the user's presence and broadcasts it.
            let posted = try await call(ports[0], "POST", "/api/presence/status", token: one, body: #"{"status":"online"}"#)
            let postedBody = posted.json as? [String: Any]
            #expect(posted.status == 200)
            #expect(postedBody?["user_id"] as? Int == 1 && postedBody?["status"] as? String == "online")
            #expect((postedBody?["last_seen"] as? String)?.hasSuffix("Z") == true)
            let update = try await watcher.next("presence_update")
            #expect(update.data["user_id"] as? Int == 1 && update.status == "online")
            #expect(!(update.data["user_id"] is String), "\(update)")

            // GET /presence/users: the visible users, with integer ids.
            let all = try await call(ports[1], "GET", "/api/presence/users", token: twoAsString)
            let listed = all.json as? [[String: Any]] ?? []
            #expect(Set(listed.compactMap { $0["user_id"] as? Int }) == [1, 3] && listed.allSatisfy { $0["is_typing"] as? Bool == false })
            let some = try await call(ports[1], "GET", "/api/presence/users?user_ids=1,99", token: two)
            #expect((some.json as? [[String: Any]])?.compactMap { $0["user_id"] as? Int } == [1], "99 shares no conversation: left out")

            // GET /presence/users/{id}: 200 with an integer id, 404 for a user not visible,
            // 422 for an id that is not an integer.
            let single = try await call(ports[1], "GET", "/api/presence/users/001", token: two)
            #expect((single.json as? [String: Any])?["user_id"] as? Int == 1)
            #expect(try await call(ports[1], "GET", "/api/presence/users/99", token: two).status == 404)
            #expect(try await call(ports[1], "GET", "/api/presence/users/alice", token: two).status == 422)
            #expect(try await call(ports[1], "GET", "/api/presence/users/1", token: try await token("alice")).status == 401, "a sub that is not an integer")

            // Subscribing by integer ids answers with integer ids.
            watcher.send("subscribe", ["user_ids": [1]], id: "s")
            let answer = try await watcher.next("initial_state")
            #expect(answer.id == "s")
            #expect(answer.presences.compactMap { $0["user_id"] as? Int } == [1])
            watcher.send("subscribe", ["user_ids": [1.5]], id: "bad")
            #expect(try await watcher.next("error").data["code"] as? String == "invalid_request")
            watcher.send("subscribe", ["conversation_id": 123], id: "g")
            let group = try await watcher.next("group_presence")
            #expect(group.id == "g" && group.data["conversation_id"] as? Int == 123 && group.data["online"] as? Int == 2, "users 1 and 2 are online: \(group)")

            // Typing: broadcast with integer ids, and expires by itself after PRESENCE_TYPING_TTL.
            let typed = try await call(ports[0], "POST", "/api/conversations/123/typing", token: one, body: #"{"is_typing":true}"#)
            #expect(typed.status == 200)
            let typing = try await watcher.next("typing_update")
            #expect(typing.data["user_id"] as? Int == 1 && typing.data["conversation_id"] as? Int == 123 && typing.data["is_typing"] as? Bool == true)
            let started = ContinuousClock.now
            let stopped = try await watcher.next("typing_update", timeout: .seconds(9))
            let waited = ContinuousClock.now - started
            #expect(stopped.data["is_typing"] as? Bool == false && stopped.data["user_id"] as? Int == 1)
            #expect(waited >= .seconds(4), "typing expires after the TTL (5 s), not before: \(waited)")

            // The conversation's presence, with integer ids throughout.
            let conversation = try await call(ports[0], "GET", "/api/conversations/123/presence", token: one)
            let counts = conversation.json as? [String: Any]
            #expect(counts?["conversation_id"] as? Int == 123 && counts?["total"] as? Int == 3 && counts?["online"] as? Int == 2)
            #expect(Set((counts?["members"] as? [[String: Any]] ?? []).compactMap { $0["user_id"] as? Int }) == [1, 2, 3])

            // Reconnecting restores what a client watches: the same contacts, with their state.
            watcher.closeAbruptly()
            _ = await watcher.closed()
            let again = TestSocket(port: ports[0], token: two, device: nil)
            let restored = try await again.next("initial_state")
            let byUser = Dictionary(uniqueKeysWithValues: restored.presences.compactMap { p in (p["user_id"] as? Int).map { ($0, p["status"] as? String) } })
            #expect(byUser == [1: "online", 3: "offline"])
            again.closeNormally()
        }
    }
}
