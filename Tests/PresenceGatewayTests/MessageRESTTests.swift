import Foundation
import PresenceEngine
import RedisTestSupport
import Testing

@testable import PresenceGateway

/// The message routes over HTTP, against live nodes sharing one Redis.
@Suite("Message routes of live nodes")
struct MessageRESTTests {
    static func errorCode(_ json: Any?) -> String? {
        ((json as? [String: Any])?["error"] as? [String: Any])?["code"] as? String
    }

    static func body(_ fields: [String: Any]) -> String {
        String(decoding: try! JSONSerialization.data(withJSONObject: fields), as: UTF8.self)
    }

    @Test("a message sent on one node is in the history on the other; a retry is 200 duplicate; pages go both ways")
    func sendAndRead() async throws {
        try await withNodes(2) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            let alice = try await token("alice"), bob = try await token("bob")
            let path = "/api/conversations/room/messages"
            let first = try await call(ports[0], "POST", path, token: alice, body: Self.body([
                "client_message_id": "local-1", "text": "hello", "client_created_at": "2026-11-27T01:02:03.456Z",
            ]))
            #expect(first.status == 201)
            let message = try #require(first.json as? [String: Any])
            #expect(message["seq"] as? Int == 1 && message["sender_id"] as? String == "alice" && message["conversation_id"] as? String == "room")
            #expect(message["type"] as? String == "text" && message["text"] as? String == "hello" && message["duplicate"] as? Bool == false)
            #expect(message["client_created_at"] as? String == "2026-11-27T01:02:03.456Z")
            #expect((message["created_at"] as? String)?.hasSuffix("Z") == true && message["image_url"] is NSNull)
            let retry = try await call(ports[1], "POST", path, token: alice, body: Self.body(["client_message_id": "local-1", "text": "changed"]))
            #expect(retry.status == 200)
            let again = try #require(retry.json as? [String: Any])
            #expect(again["duplicate"] as? Bool == true && again["id"] as? String == message["id"] as? String && again["text"] as? String == "hello")
            for index in 2...5 {
                let sent = try await call(ports[index % 2], "POST", path, token: index % 2 == 0 ? bob : alice,
                                          body: Self.body(["client_message_id": "m\(index)", "text": "#\(index)"]))
                #expect(sent.status == 201)
            }
            let image = try await call(ports[0], "POST", path, token: bob, body: Self.body([
                "client_message_id": "pic", "type": "image", "text": "a cat", "image_url": "https://img.test/cat.png",
            ]))
            #expect(image.status == 201 && (image.json as? [String: Any])?["image_url"] as? String == "https://img.test/cat.png")

            func page(_ query: String) async throws -> (seqs: [Int], json: [String: Any]) {
                let read = try await call(ports[1], "GET", path + query, token: bob)
                #expect(read.status == 200, "\(query): \(read.status)")
                let json = read.json as? [String: Any] ?? [:]
                return ((json["messages"] as? [[String: Any]] ?? []).compactMap { $0["seq"] as? Int }, json)
            }
            let latest = try await page("")
            #expect(latest.seqs == [1, 2, 3, 4, 5, 6] && latest.json["first_seq"] as? Int == 1 && latest.json["last_seq"] as? Int == 6)
            #expect((latest.json["epoch"] as? String)?.isEmpty == false)
            #expect(try await page("?after_seq=4").seqs == [5, 6])
            #expect(try await page("?after_seq=1&limit=2").seqs == [2, 3])
            #expect(try await page("?before_seq=4&limit=2").seqs == [2, 3])
            #expect(try await page("?limit=1").seqs == [6])
        }
    }

    @Test("every refusal is the API's: 401, 403 for a non-member or a removed member, 404, 413, 422, 429")
    func refusals() async throws {
        try await withNodes(1, configure: { $0.messageMaxBytes = 100; $0.messageRate = 5 }) { ports in
            let port = ports[0]
            try await ConversationTests.setUp(port, ["alice", "bob"])
            let alice = try await token("alice"), mallory = try await token("mallory")
            let path = "/api/conversations/room/messages"
            func status(_ method: String, _ path: String, token: String?, _ body: String? = nil) async throws -> (Int, String?) {
                let answer = try await call(port, method, path, token: token, body: body)
                return (answer.status, Self.errorCode(answer.json))
            }
            let good = Self.body(["client_message_id": "x1", "text": "hi"])
            #expect(try await status("POST", path, token: nil, good) == (401, "unauthorized"))
            #expect(try await status("POST", path, token: mallory, good) == (403, "forbidden"))
            #expect(try await status("GET", path, token: mallory) == (403, "forbidden"))
            // Every way of reading the history checks membership, paging included.
            for query in ["?after_seq=0", "?after_seq=5&limit=3", "?before_seq=9"] {
                #expect(try await status("GET", path + query, token: mallory) == (403, "forbidden"), "\(query)")
            }
            #expect(try await status("POST", "/api/conversations/room/read", token: mallory, #"{"seq":1}"#) == (403, "forbidden"))
            #expect(try await status("GET", "/api/conversations/room/receipts", token: mallory) == (403, "forbidden"))
            #expect(try await status("POST", "/api/conversations/nowhere/messages", token: alice, good) == (404, "not_found"))
            #expect(try await status("GET", "/api/conversations/nowhere/messages", token: alice) == (404, "not_found"))
            #expect(try await status("POST", path, token: alice, Self.body(["client_message_id": "x2", "text": String(repeating: "é", count: 51)])) == (413, "payload_too_large"))
            for bad in [
                Self.body(["text": "no id"]), Self.body(["client_message_id": "x3"]), Self.body(["client_message_id": "bad id", "text": "hi"]),
                Self.body(["client_message_id": "x4", "text": ""]), Self.body(["client_message_id": "x5", "text": "hi", "type": "video"]),
                Self.body(["client_message_id": "x6", "text": "hi", "type": "image"]),
                Self.body(["client_message_id": "x7", "text": "hi", "client_created_at": "yesterday"]), "not json",
                // Found by schemathesis: a moment before 1970 came back as "0026-05-30T01:11:01.-988Z".
                Self.body(["client_message_id": "x9", "text": "hi", "client_created_at": "0026-05-30T01:10:60.01272Z"]),
            ] {
                #expect(try await status("POST", path, token: alice, bad) == (422, "invalid_request"), "\(bad)")
            }
            for query in ["?after_seq=1&before_seq=5", "?after_seq=-1", "?limit=0", "?limit=1001", "?before_seq=x"] {
                #expect(try await status("GET", path + query, token: alice) == (422, "invalid_request"), "\(query)")
            }
            #expect(try await status("POST", "/api/conversations/room/read", token: alice, #"{"seq":-1}"#) == (422, "invalid_request"))
            #expect(try await status("GET", "/api/conversations/room/history", token: alice).0 == 404, "no such route")

            // Removed: refused from the moment the removal is answered.
            #expect(try await call(port, "DELETE", "/api/admin/conversations/room/members/alice", token: adminToken).status == 200)
            #expect(try await status("POST", path, token: alice, Self.body(["client_message_id": "x8", "text": "still here?"])) == (403, "forbidden"))
            #expect(try await status("GET", path, token: alice) == (403, "forbidden"))

            // Five a second, a burst of ten: sent one after the other, at least the first ten are
            // taken and then one is refused (on a busy machine a slow burst earns a token back
            // every 200 ms, so the refusal may come a little later than the eleventh).
            let bob = try await token("bob")
            var answers: [Int] = []
            for index in 0..<40 where answers.last != 429 {
                answers.append(try await call(port, "POST", path, token: bob, body: Self.body(["client_message_id": "r\(index)", "text": "r"])).status)
            }
            #expect(answers.count >= 11 && answers.last == 429 && answers.dropLast().allSatisfy { $0 == 201 }, "\(answers)")
        }
    }

    @Test("read cursors, receipts and the conversation list with unread counts and the last message")
    func cursorsAndList() async throws {
        try await withNodes(2) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            try await ConversationTests.setUp(ports[0], ["alice"], conversation: "notes")
            let alice = try await token("alice"), bob = try await token("bob")
            for index in 1...3 {
                _ = try await call(ports[0], "POST", "/api/conversations/room/messages", token: alice, body: Self.body(["client_message_id": "m\(index)", "text": "#\(index)"]))
            }
            let read = try await call(ports[1], "POST", "/api/conversations/room/read", token: bob, body: #"{"seq":2}"#)
            #expect(read.status == 200)
            #expect((read.json as? [String: Any]).map { [$0["delivered_seq"] as? Int, $0["read_seq"] as? Int] } == [2, 2])
            let back = try await call(ports[1], "POST", "/api/conversations/room/read", token: bob, body: #"{"seq":1}"#)
            #expect((back.json as? [String: Any])?["read_seq"] as? Int == 2, "never backwards")
            let receipts = try await call(ports[0], "GET", "/api/conversations/room/receipts", token: alice)
            let rows = (receipts.json as? [[String: Any]] ?? []).map { "\($0["user_id"] as? String ?? "?") \($0["delivered_seq"] as? Int ?? -1) \($0["read_seq"] as? Int ?? -1)" }
            #expect(rows == ["alice 3 3", "bob 2 2"], "\(rows)")

            let list = try await call(ports[1], "GET", "/api/conversations", token: bob)
            let entries = list.json as? [[String: Any]] ?? []
            #expect(entries.count == 1, "bob is in room only: \(entries)")
            let room = try #require(entries.first)
            #expect(room["conversation_id"] as? String == "room" && room["last_seq"] as? Int == 3 && room["unread"] as? Int == 1)
            #expect((room["last_message"] as? [String: Any])?["text"] as? String == "#3" && (room["epoch"] as? String)?.isEmpty == false)
            let mine = try await call(ports[0], "GET", "/api/conversations", token: alice).json as? [[String: Any]] ?? []
            #expect(mine.map { $0["conversation_id"] as? String } == ["notes", "room"])
            #expect(mine.first?["last_message"] is NSNull && mine.first?["epoch"] is NSNull && mine.first?["unread"] as? Int == 0)
        }
    }

    @Test("the admin's view of a conversation: its newest messages with how far each got, and every member's cursors")
    func adminConversation() async throws {
        try await withNodes(1) { ports in
            let port = ports[0]
            try await ConversationTests.setUp(port, ["alice", "bob", "carol"])
            let alice = try await token("alice"), bob = try await token("bob"), carol = try await token("carol")
            let empty = try await call(port, "GET", "/api/admin/conversations/room", token: adminToken)
            #expect(empty.status == 200)
            #expect((empty.json as? [String: Any])?["epoch"] is NSNull && (empty.json as? [String: Any])?["last_seq"] as? Int == 0)
            for index in 1...3 {
                _ = try await call(port, "POST", "/api/conversations/room/messages", token: alice, body: Self.body(["client_message_id": "m\(index)", "text": "#\(index)"]))
            }
            _ = try await call(port, "POST", "/api/conversations/room/read", token: bob, body: #"{"seq":3}"#)
            // carol's device has 1 and 2, and she read 1.
            let device = TestSocket(port: port, token: carol, device: "phone")
            _ = try await device.next("initial_state")
            device.send("delivered", ["conversation_id": "room", "seq": 2], id: "d")
            #expect(try await device.pick("ack").id == "d")
            _ = try await call(port, "POST", "/api/conversations/room/read", token: carol, body: #"{"seq":1}"#)
            let detail = try await call(port, "GET", "/api/admin/conversations/room?limit=3", token: adminToken)
            #expect(detail.status == 200)
            let body = try #require(detail.json as? [String: Any])
            #expect(body["conversation_id"] as? String == "room" && body["last_seq"] as? Int == 3 && (body["epoch"] as? String)?.isEmpty == false)
            let messages = (body["messages"] as? [[String: Any]] ?? []).map { "\($0["seq"] as? Int ?? -1) \($0["text"] as? String ?? "?") \($0["status"] as? String ?? "?")" }
            #expect(messages == ["1 #1 read", "2 #2 delivered", "3 #3 sent"], "\(messages)")
            let members = (body["members"] as? [[String: Any]] ?? []).map { "\($0["user_id"] as? String ?? "?") \($0["delivered_seq"] as? Int ?? -1) \($0["read_seq"] as? Int ?? -1)" }
            #expect(members == ["alice 3 3", "bob 3 3", "carol 2 1"], "\(members)")
            let newest = try await call(port, "GET", "/api/admin/conversations/room?limit=1", token: adminToken).json as? [String: Any]
            #expect((newest?["messages"] as? [[String: Any]])?.map { $0["seq"] as? Int } == [3], "limit keeps the newest")
            #expect(try await call(port, "GET", "/api/admin/conversations/nope", token: adminToken).status == 404)
            #expect(try await call(port, "GET", "/api/admin/conversations/room", token: alice).status == 401)
            #expect(try await call(port, "GET", "/api/admin/conversations/room?limit=0", token: adminToken).status == 422)
        }
    }

    @Test("with numeric ids, conversation and user ids are JSON numbers in every message body")
    func numericIDs() async throws {
        try await withNodes(1, configure: { $0.idFormat = .numeric }) { ports in
            let port = ports[0]
            #expect(try await call(port, "PUT", "/api/admin/conversations/42", token: adminToken, body: #"{"member_ids":[7, 8]}"#).status == 200)
            let seven = try await token("7")
            let sent = try await call(port, "POST", "/api/conversations/42/messages", token: seven, body: Self.body(["client_message_id": "n1", "text": "hi"]))
            #expect(sent.status == 201)
            let message = try #require(sent.json as? [String: Any])
            #expect(message["conversation_id"] as? Int == 42 && message["sender_id"] as? Int == 7)
            let page = try await call(port, "GET", "/api/conversations/42/messages", token: try await token("8")).json as? [String: Any]
            #expect(page?["conversation_id"] as? Int == 42 && (page?["messages"] as? [[String: Any]])?.first?["sender_id"] as? Int == 7)
            let receipts = try await call(port, "GET", "/api/conversations/42/receipts", token: seven).json as? [[String: Any]] ?? []
            #expect(receipts.compactMap { $0["user_id"] as? Int } == [7, 8])
        }
    }
}

/// `PRESENCE_MESSAGE_REPLICAS`: an acknowledgement waits for replicas (`WAIT N 1000`).
@Suite("Message acknowledgements that wait for replicas")
struct MessageReplicaTests {
    @Test("with replicas asked for, a send is acknowledged once they have it; with more than there are, 503 within about a second and the message stays stored")
    func replicas() async throws {
        let primary = try RedisServerProcess()
        let replica = try RedisServerProcess(arguments: ["--replicaof", "127.0.0.1", "\(primary.port)"])
        _ = await eventually(timeout: .seconds(10)) { (try? replica.cli("INFO", "replication"))?.contains("master_link_status:up") == true }
        let prefix = TestRedis.uniquePrefix("replicas")
        let alice = try await token("alice")
        let path = "/api/conversations/room/messages"
        try await withNodes(1, prefix: prefix, configure: { $0.redisURL = primary.url(); $0.messageReplicas = 1 }) { ports in
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            let bob = try await MessageSessionTests.open(ports[0], "bob", device: "phone")
            bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": 0]]])
            _ = try await bob.next("synced")
            let sent = try await call(ports[0], "POST", path, token: alice, body: MessageRESTTests.body(["client_message_id": "one", "text": "kept twice"]))
            #expect(sent.status == 201)
            let copied = try replica.cli("XLEN", "\(prefix):{c:room}:history")
            #expect(copied.trimmingCharacters(in: .whitespacesAndNewlines) == "1", "the replica has the message once it is acknowledged")
            #expect(MessageSessionTests.seqs(await MessageSessionTests.messages(bob, count: 1)) == [1], "delivered once the replica has it")
        }
        try await withNodes(1, prefix: prefix, configure: { $0.redisURL = primary.url(); $0.messageReplicas = 2 }) { ports in
            let bob = try await MessageSessionTests.open(ports[0], "bob", device: "phone")
            bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": 1]]])
            _ = try await bob.next("synced")
            let started = ContinuousClock.now
            let refused = try await call(ports[0], "POST", path, token: alice, body: MessageRESTTests.body(["client_message_id": "two", "text": "only one replica"]))
            let took = ContinuousClock.now - started
            #expect(refused.status == 503 && MessageRESTTests.errorCode(refused.json) == "unavailable")
            #expect(took >= .milliseconds(900) && took < .seconds(3), "\(took) \(refused.json ?? "")")
            let history = try await call(ports[0], "GET", path, token: alice)
            let texts = ((history.json as? [String: Any])?["messages"] as? [[String: Any]] ?? []).compactMap { $0["text"] as? String }
            #expect(texts == ["kept twice", "only one replica"], "the message is stored all the same")
            let retry = try await call(ports[0], "POST", path, token: alice, body: MessageRESTTests.body(["client_message_id": "two", "text": "only one replica"]))
            #expect(retry.status == 503)
            #expect(try await call(ports[0], "GET", path, token: alice).json.map { (($0 as? [String: Any])?["last_seq"] as? Int) } == 2, "a retry stores nothing twice")
            #expect(await MessageSessionTests.messages(bob, count: 1, timeout: .milliseconds(500)).isEmpty,
                    "a message the replicas did not confirm is not delivered live (a failover could give its seq to another)")
        }
    }
}
