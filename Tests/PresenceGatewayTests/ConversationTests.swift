import Foundation
import PresenceEngine
import RedisClient
import RedisTestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

@testable import PresenceGateway

@Suite("Typing and group presence across two live nodes")
struct ConversationTests {
    static func setUp(_ port: Int, _ members: [String], conversation: String = "room") async throws {
        let body = #"{"member_ids":["# + members.map { "\"\($0)\"" }.joined(separator: ",") + "]}"
        #expect(try await call(port, "PUT", "/api/admin/conversations/\(conversation)", token: adminToken, body: body).status == 200)
    }

    @Test("membership changes published while the node's subscriber was down are caught up on reconnect")
    func missedMembership() async throws {
        let server = try RedisServerProcess()
        let prefix = TestRedis.uniquePrefix("missed")
        try await withNodes(1, prefix: prefix, configure: { $0.redisURL = server.url() }) { ports in
            try await Self.setUp(ports[0], ["alice", "bob"])
            let carol = TestSocket(port: ports[0], token: try await token("carol"), device: "phone")
            _ = try await carol.next("initial_state")
            let bob = TestSocket(port: ports[0], token: try await token("bob"), device: "phone")
            _ = try await bob.next("initial_state")
            bob.send("subscribe", ["conversation_id": "room"], id: "c")
            let group = try await bob.next("group_presence")
            #expect(group.data["total"] as? Int == 2 && group.data["online"] as? Int == 1)
            _ = try await bob.next("initial_state")
            // carol joins while the node hears nothing: the change is in Redis, its events are lost.
            try server.cli("SADD", "\(prefix):{c:room}:members", "carol")
            try server.cli("SADD", "\(prefix):{u:carol}:convs", "room")
            try server.cli("CLIENT", "KILL", "TYPE", "pubsub")
            // After the reconnect bob sees carol: she counts in the group, and he hears of her.
            var heard: [Frame] = []
            let deadline = ContinuousClock.now + .seconds(5)
            while ContinuousClock.now < deadline {
                guard let frame = try? await bob.next(timeout: .milliseconds(200)) else { continue }
                heard.append(frame)
                if heard.contains(where: { $0.type == "group_presence" && $0.data["total"] as? Int == 3 && $0.data["online"] as? Int == 2 }),
                   heard.contains(where: { $0.type == "presence_update" && $0.userID == "carol" && $0.status == "online" }) { break }
            }
            #expect(heard.contains { $0.type == "group_presence" && $0.data["total"] as? Int == 3 && $0.data["online"] as? Int == 2 }, "2 of 3 online: \(heard)")
            #expect(heard.contains { $0.type == "presence_update" && $0.userID == "carol" && $0.status == "online" }, "carol is visible now: \(heard)")
        }
    }

    @Test("typing reaches the conversation's subscribers on the other node once per 2 s, and stops")
    func typing() async throws {
        // A typing state outlives the test's slowest step on a loaded machine: expiry is another
        // test's, and an expired state would make the next refresh a start, published at once.
        try await withNodes(2, configure: { $0.typingTTL = 10 }) { ports in
            try await Self.setUp(ports[0], ["alice", "bob", "carol"])
            let bob = TestSocket(port: ports[1], token: try await token("bob"), device: "phone")
            _ = try await bob.next("initial_state")
            bob.send("subscribe", ["conversation_id": "room"], id: "c")
            let group = try await bob.next("group_presence")
            #expect(group.id == "c" && group.data["total"] as? Int == 3 && group.data["online"] as? Int == 1)
            _ = try await bob.next("initial_state")

            let alice = TestSocket(port: ports[0], token: try await token("alice"), device: "phone")
            _ = try await alice.next("initial_state")
            let online = try await bob.next("group_presence")
            #expect(online.data["online"] as? Int == 2, "alice came online: 2 of 3")

            alice.send("typing", ["conversation_id": "room", "is_typing": true], id: "t1")
            #expect(try await alice.next("ack").id == "t1")
            let started = try await bob.next("typing_update")
            #expect(started.userID == "alice" && started.data["is_typing"] as? Bool == true && started.data["conversation_id"] as? String == "room")
            let read = try await call(ports[1], "GET", "/api/presence/users/alice", token: try await token("bob"))
            #expect((read.json as? [String: Any])?["is_typing"] as? Bool == true)
            // The list reads everyone's typing at once: alice typing, bob (not typing) beside her.
            let list = try await call(ports[1], "GET", "/api/presence/users?user_ids=bob,alice", token: try await token("bob"))
            let typing = (list.json as? [[String: Any]])?.map { ($0["user_id"] as? String ?? "?") + "=" + (($0["is_typing"] as? Bool).map { "\($0)" } ?? "?") }
            #expect(typing == ["bob=false", "alice=true"], "\(String(describing: list.json))")
            alice.send("typing", ["conversation_id": "room", "is_typing": true])
            alice.send("typing", ["conversation_id": "room", "is_typing": true])
            #expect(await bob.staysQuiet(for: .milliseconds(500)), "refreshes within 2 s are coalesced")
            alice.send("typing", ["conversation_id": "room", "is_typing": false])
            let stopped = try await bob.next("typing_update")
            #expect(stopped.data["is_typing"] as? Bool == false)

            alice.send("status", ["status": "away"])
            let away = try await bob.next("group_presence")
            #expect(away.data["online"] as? Int == 1 && away.data["away"] as? Int == 1)

            bob.send("status", ["status": "offline"], id: "off")
            _ = try await bob.next("ack")
            alice.send("typing", ["conversation_id": "room", "is_typing": true])
            let whileOffline = await bob.drain(for: .milliseconds(600))
            #expect(!whileOffline.contains { $0.type == "typing_update" }, "a watcher whose own device is offline gets no typing: \(whileOffline)")
            bob.send("status", ["status": "online"], id: "on")
            _ = try await bob.next("ack")

            bob.send("unsubscribe", ["conversation_id": "room"], id: "u")
            #expect(try await bob.next("ack").id == "u")
            // alice is still typing: this stop is published, but bob no longer follows the room.
            alice.send("typing", ["conversation_id": "room", "is_typing": false])
            let afterUnsubscribe = await bob.drain(for: .milliseconds(500))
            #expect(!afterUnsubscribe.contains { $0.type == "typing_update" || $0.type == "group_presence" }, "no typing after unsubscribing: \(afterUnsubscribe)")
        }
    }

    @Test("a typing state expires by itself; going offline clears it; offline users never type")
    func expiryAndOffline() async throws {
        try await withNodes(2, configure: { $0.typingTTL = 1 }) { ports in
            try await Self.setUp(ports[0], ["alice", "bob"])
            let bob = TestSocket(port: ports[1], token: try await token("bob"), device: "phone")
            _ = try await bob.next("initial_state")
            bob.send("subscribe", ["conversation_id": "room"], id: "c")
            _ = try await bob.next("initial_state")
            let aliceToken = try await token("alice")

            let offline = try await call(ports[0], "POST", "/api/conversations/room/typing", token: aliceToken, body: #"{"is_typing":true}"#)
            #expect(offline.status == 200)
            #expect(await bob.staysQuiet(for: .milliseconds(500)), "alice has no live device: never shown typing")

            _ = try await call(ports[0], "POST", "/api/presence/status", token: aliceToken, body: #"{"status":"online","device_id":"web"}"#)
            _ = try await call(ports[0], "POST", "/api/conversations/room/typing", token: aliceToken, body: #"{"is_typing":true}"#)
            #expect(try await bob.next("typing_update").data["is_typing"] as? Bool == true)
            let expired = try await bob.next("typing_update", timeout: .seconds(4))
            #expect(expired.data["is_typing"] as? Bool == false, "no refresh: it ends after the typing TTL")

            _ = try await call(ports[0], "POST", "/api/conversations/room/typing", token: aliceToken, body: #"{"is_typing":true}"#)
            #expect(try await bob.next("typing_update").data["is_typing"] as? Bool == true)
            _ = try await call(ports[0], "POST", "/api/presence/status", token: aliceToken, body: #"{"status":"offline","device_id":"web"}"#)
            let cleared = try await bob.next("typing_update", timeout: .milliseconds(800))
            #expect(cleared.data["is_typing"] as? Bool == false, "going offline clears typing at once")
            // A user who went offline (her state says so, unlike one never seen) is not shown
            // typing either: a guard that only asked for some stored status passed this.
            _ = await bob.drain(for: .milliseconds(100))
            let afterOffline = try await call(ports[0], "POST", "/api/conversations/room/typing", token: aliceToken, body: #"{"is_typing":true}"#)
            #expect(afterOffline.status == 200)
            #expect(await bob.staysQuiet(for: .milliseconds(500)), "alice went offline: never shown typing")
        }
    }

    @Test("a large group's subscription gets counts and typing, not every member's update")
    func largeGroup() async throws {
        try await withNodes(2, configure: { $0.visibility = .open }) { ports in
            let members = ["bob"] + (0...1000).map { "m\($0)" }
            try await Self.setUp(ports[0], members, conversation: "big")
            let bob = TestSocket(port: ports[1], token: try await token("bob"), device: "phone")
            _ = try await bob.next("initial_state")
            bob.send("subscribe", ["conversation_id": "big"], id: "big")
            let counts = try await bob.next("group_presence")
            #expect(counts.data["total"] as? Int == 1002 && counts.data["online"] as? Int == 1)
            #expect(try await bob.next("initial_state").presences.isEmpty, "no member list for a large group")
            _ = try await call(ports[0], "POST", "/api/presence/status", token: try await token("m7"), body: #"{"status":"online"}"#)
            let more = try await bob.next()
            #expect(more.type == "group_presence" && more.data["online"] as? Int == 2, "\(more)")
            #expect(await bob.staysQuiet(for: .milliseconds(300)), "no presence_update for a member of a large group")
            bob.send("subscribe", ["user_ids": ["m7"]], id: "m7")
            #expect(try await bob.next("initial_state").presences.first?["status"] as? String == "online")
            _ = try await call(ports[0], "POST", "/api/presence/status", token: try await token("m7"), body: #"{"status":"away"}"#)
            #expect(try await bob.next("presence_update").status == "away", "explicitly watched now")
        }
    }

    @Test("PRESENCE_LARGE_GROUP: members of a larger conversation are not automatic contacts, yet still see each other")
    func largeGroupContacts() async throws {
        try await withNodes(1, configure: { $0.largeGroup = 3 }) { ports in
            let port = ports[0]
            _ = try await call(port, "PUT", "/api/admin/conversations/big", token: adminToken, body: #"{"member_ids":["alice","bob","carol","dan"]}"#)
            _ = try await call(port, "PUT", "/api/admin/conversations/small", token: adminToken, body: #"{"member_ids":["alice","erin"]}"#)
            let alice = TestSocket(port: port, token: try await token("alice"), device: "phone")
            let contacts = try await alice.next("initial_state").presences.compactMap { $0["user_id"] as? String }
            #expect(contacts == ["erin"], "only the small conversation's member is listed and watched: \(contacts)")
            _ = try await call(port, "POST", "/api/presence/status", token: try await token("bob"), body: #"{"status":"online"}"#)
            #expect(await alice.staysQuiet(for: .milliseconds(300)), "bob is not watched automatically")
            alice.send("subscribe", ["user_ids": ["bob"]], id: "b")
            #expect(try await alice.next("initial_state").presences.first?["status"] as? String == "online", "but alice may see him")
            let listed = try await call(port, "GET", "/api/presence/users", token: try await token("alice")).json as? [[String: Any]]
            #expect(Set(listed?.compactMap { $0["user_id"] as? String } ?? []) == ["bob", "carol", "dan", "erin"], "REST lists everyone alice may see")
            alice.closeNormally()
        }
    }

    @Test("someone removed from a large group is no longer shown to those who could see them only through it, on another node too")
    func largeGroupDeparture() async throws {
        try await withNodes(2, configure: { $0.largeGroup = 3 }) { ports in
            _ = try await call(ports[0], "PUT", "/api/admin/conversations/big", token: adminToken, body: #"{"member_ids":["alice","bob","carol","dan","frank"]}"#)
            _ = try await call(ports[0], "PUT", "/api/admin/conversations/small", token: adminToken, body: #"{"member_ids":["bob","carol"]}"#)
            let alice = TestSocket(port: ports[1], token: try await token("alice"), device: "phone")
            let carol = TestSocket(port: ports[1], token: try await token("carol"), device: "phone")
            _ = try await alice.next("initial_state")
            _ = try await carol.next("initial_state")
            alice.send("subscribe", ["user_ids": ["bob"]], id: "b")
            #expect(try await alice.next("initial_state").presences.map { $0["user_id"] as? String } == ["bob"], "alice may see bob through the big group")
            let bob = try await token("bob")
            _ = try await call(ports[0], "POST", "/api/presence/status", token: bob, body: #"{"status":"online"}"#)
            #expect(try await alice.next("presence_update").status == "online")
            #expect(try await carol.next("presence_update").status == "online")

            // 5 → 4 members: still large, so the change goes to bob's channel alone, which alice
            // and carol hear because they watch him. Carol still shares the small group with him.
            #expect(try await call(ports[0], "DELETE", "/api/admin/conversations/big/members/bob", token: adminToken).status == 200)
            try await Task.sleep(for: .seconds(1))
            _ = try await call(ports[0], "POST", "/api/presence/status", token: bob, body: #"{"status":"away"}"#)
            #expect(try await carol.next("presence_update").status == "away", "carol still sees bob")
            #expect(await alice.staysQuiet(for: .milliseconds(300)), "alice no longer does")
            let read = try await call(ports[1], "GET", "/api/presence/users/bob", token: try await token("alice"))
            #expect(read.status == 404, "nor over REST")
        }
    }

    @Test("only members may type or subscribe to a conversation")
    func membersOnly() async throws {
        try await withNodes(1) { ports in
            try await Self.setUp(ports[0], ["alice", "bob"])
            let mallory = try await token("mallory")
            let rest = try await call(ports[0], "POST", "/api/conversations/room/typing", token: mallory, body: #"{"is_typing":true}"#)
            #expect(rest.status == 403 && RESTTests.errorCode(rest.json) == "forbidden")
            #expect(try await call(ports[0], "POST", "/api/conversations/room/typing", token: mallory, body: #"{"is_typing":"yes"}"#).status == 422)
            let socket = TestSocket(port: ports[0], token: mallory, device: "d")
            _ = try await socket.next("initial_state")
            socket.send("subscribe", ["conversation_id": "room"], id: "s")
            let refused = try await socket.next("error")
            #expect(refused.id == "s" && refused.data["code"] as? String == "forbidden")
            socket.send("typing", ["conversation_id": "room", "is_typing": true], id: "t")
            #expect(try await socket.next("error").data["code"] as? String == "forbidden")
        }
    }
}

@Suite("A gateway process killed with SIGKILL")
struct NodeDeathTests {
    @Test("its typing states expire and its devices go offline within the lease, seen from another node")
    func killedNode() async throws {
        let prefix = TestRedis.uniquePrefix("kill")
        try await withNodes(1, prefix: prefix, configure: { $0.typingTTL = 1 }) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            let port = try RedisServerProcess.freePort()
            let process = Process()
            process.executableURL = CTL.binary.deletingLastPathComponent().appendingPathComponent("presence-gateway")
            process.arguments = ["--port", "\(port)", "--redis-url", TestRedis.url, "--key-prefix", prefix, "--node-id", "doomed",
                                 "--jwt-secret", testSecret, "--lease-ttl", "3", "--typing-ttl", "1", "--log-level", "error"]
                + (TestRedis.pubSub.map { ["--redis-pubsub", $0] } ?? [])
            process.standardOutput = FileHandle.nullDevice
            process.standardError = FileHandle.nullDevice
            try process.run()
            defer { if process.isRunning { kill(process.processIdentifier, SIGKILL) } }
            let listening = await eventually(timeout: .seconds(20)) { (try? await call(port, "GET", "/healthz").status) == 200 }
            #expect(listening)

            let bob = TestSocket(port: ports[0], token: try await token("bob"), device: "phone")
            _ = try await bob.next("initial_state")
            bob.send("subscribe", ["conversation_id": "room"], id: "c")
            _ = try await bob.next("initial_state")
            let alice = TestSocket(port: port, token: try await token("alice"), device: "phone")
            _ = try await alice.next("initial_state")
            #expect(try await bob.next("presence_update").status == "online")
            alice.send("typing", ["conversation_id": "room", "is_typing": true])
            #expect(try await bob.next("typing_update").data["is_typing"] as? Bool == true)

            let killedAt = ContinuousClock.now
            kill(process.processIdentifier, SIGKILL)
            process.waitUntilExit()
            // In either order: a reaper pass that finds both due (late, on a loaded machine)
            // takes the node first, and alice's going offline is what ends her typing.
            var typingEnded: Duration?
            var offline: Duration?
            while typingEnded == nil || offline == nil, let frame = try? await bob.next(timeout: killedAt + .seconds(12) - .now) {
                if frame.type == "typing_update", frame.data["is_typing"] as? Bool == false { typingEnded = .now - killedAt }
                if frame.type == "presence_update", frame.status == "offline" { offline = .now - killedAt }
            }
            #expect(typingEnded.map { $0 < .seconds(4) } == true, "the typing state ends though its node is dead: after \(String(describing: typingEnded))")
            // Lease 3 s plus a reaper period (0.5 s), with slack for a loaded machine.
            #expect(offline.map { $0 < .seconds(6) } == true, "offline within the lease plus one reaper period: after \(String(describing: offline))")
            if offline == nil { Issue.record("alice not shown offline; the registry: \(await Self.registry(prefix))") }
            let nodes = try await call(ports[0], "GET", "/api/admin/nodes", token: adminToken)
            #expect((nodes.json as? [[String: Any]])?.contains { $0["node_id"] as? String == "doomed" } == false, "the dead node is not listed")
        }
    }

    /// What a reaper sees: each registered node's score (its lease end, or a claim's end) and
    /// lease time left, against Redis's clock; said when the dead node is not reaped in time.
    static func registry(_ prefix: String) async -> String {
        let keys = PresenceKeys(prefix: prefix)
        let found = try? await withRedisCommands(configuration: TestRedis.configuration(), logger: TestRedis.logger()) { redis in
            let now = try await redis.send("TIME").array?.first?.string ?? "?"
            let scores = try await redis.send("ZRANGE", RedisArgument(keys.nodes), "0", "-1", "WITHSCORES").array?.compactMap(\.string) ?? []
            var leases: [String] = []
            for node in stride(from: 0, to: scores.count, by: 2).map({ scores[$0] }) {
                leases.append("\(node): \(try await redis.send("PTTL", RedisArgument(keys.lease(node))).int ?? 0) ms")
            }
            return "Redis time \(now) s, scores \(scores), lease left \(leases)"
        }
        return found ?? "unreadable"
    }
}

