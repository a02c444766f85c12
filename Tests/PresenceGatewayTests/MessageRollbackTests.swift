import Foundation
import PresenceEngine
import RedisTestSupport
import Testing

@testable import PresenceGateway

/// Redis going back in time under a conversation (docs/API.md, "Forks"; DESIGN.md invariant 10):
/// a restart from a snapshot taken before the last messages.
@Suite("Messages across a Redis rollback")
struct MessageRollbackTests {
    typealias Sessions = MessageSessionTests

    /// A message sent over REST by `user`: status and body.
    static func send(_ port: Int, _ user: String, _ clientID: String, _ text: String) async throws -> (status: Int, message: [String: Any]) {
        let sent = try await call(port, "POST", "/api/conversations/room/messages", token: try await token(user),
                                  body: MessageRESTTests.body(["client_message_id": clientID, "text": text]))
        return (sent.status, sent.json as? [String: Any] ?? [:])
    }

    /// Alice sends four messages, a snapshot of `server` taken before the third: their ids by
    /// client id, and their epoch.
    static func fourWithSnapshot(_ port: Int, _ server: RedisServerProcess) async throws -> (ids: [String: String], epoch: String) {
        var ids: [String: String] = [:]
        var epoch = ""
        for number in 1...4 {
            if number == 3 { try server.cli("SAVE") }
            let sent = try await send(port, "alice", "m\(number)", "before #\(number)")
            #expect(sent.status == 201 && sent.message["seq"] as? Int == number)
            ids["m\(number)"] = sent.message["id"] as? String
            epoch = sent.message["epoch"] as? String ?? ""
        }
        return (ids, epoch)
    }

    @Test("a restart from an older snapshot forks the epoch: no id reused, the new messages reach a member live and by sync, which names the lost seqs in truncated")
    func restartFromSnapshot() async throws {
        let server = try RedisServerProcess()
        try await withNodes(1, configure: { $0.redisURL = server.url() }) { ports in
            let port = ports[0]
            try await ConversationTests.setUp(port, ["alice", "bob"])
            let bob = try await Sessions.open(port, "bob", device: "phone")
            try await Task.sleep(for: SessionHub.messageOpeningHold + .milliseconds(200))
            let (ids, epoch) = try await Self.fourWithSnapshot(port, server)
            #expect(!epoch.isEmpty)
            let live = await Sessions.messages(bob, count: 4)
            #expect(Sessions.seqs(live) == [1, 2, 3, 4] && live.allSatisfy { $0.data["epoch"] as? String == epoch })

            // Back to the snapshot: seqs 3 and 4 are gone.
            server.stop()
            try server.start()
            let ready = await eventually(timeout: .seconds(15)) {
                (try? await call(port, "GET", "/api/conversations/room/messages", token: try await token("bob")).status) == 200
            }
            #expect(ready)
            let after = try await Self.send(port, "alice", "m5", "after the rollback")
            let forked = after.message["epoch"] as? String ?? ""
            #expect(after.status == 201 && after.message["seq"] as? Int == 3, "\(after)")
            #expect(!forked.isEmpty && forked != epoch)
            let newID = after.message["id"] as? String ?? ""
            #expect(!ids.values.contains(newID), "\(newID) was given before: \(ids)")

            // Live, to the member connected throughout, in the new epoch.
            let next = await Sessions.messages(bob, count: 1, timeout: .seconds(10))
            #expect(next.first?.data["seq"] as? Int == 3 && next.first?.data["epoch"] as? String == forked, "\(next.map(\.data))")
            #expect(next.first?.data["id"] as? String == newID)

            // By sync from where the member stood: the lost seqs are named, and the answer goes
            // on from the fork point.
            let tablet = try await Sessions.open(port, "bob", device: "tablet")
            tablet.send("sync", ["positions": [["conversation_id": "room", "after_seq": 4, "epoch": epoch]]], id: "s")
            let synced = await Sessions.messages(tablet, count: 1)
            #expect(Sessions.seqs(synced) == [3] && synced.first?.data["id"] as? String == newID)
            let answer = try await tablet.next("synced")
            #expect(answer.data["epoch"] as? String == forked && answer.data["last_seq"] as? Int == 3 && answer.data["complete"] as? Bool == true)
            let truncated = answer.data["truncated"] as? [[String: Any]] ?? []
            #expect(truncated.count == 1 && truncated.first?["epoch"] as? String == epoch, "\(answer.data)")
            #expect(truncated.first?["from_seq"] as? Int == 3 && truncated.first?["to_seq"] as? Int == 4)

            // A position at or below the fork point simply goes on, with nothing truncated.
            tablet.send("sync", ["positions": [["conversation_id": "room", "after_seq": 2, "epoch": epoch]]], id: "kept")
            let kept = try await tablet.next("synced")
            #expect((kept.data["truncated"] as? [Any])?.isEmpty == true && kept.data["complete"] as? Bool == true && kept.id == "kept")

            // The sender's retry of a lost message is stored again; one kept is a duplicate.
            let resent = try await Self.send(port, "alice", "m3", "before #3")
            #expect(resent.status == 201 && resent.message["seq"] as? Int == 4 && resent.message["epoch"] as? String == forked, "\(resent)")
            #expect(!ids.values.contains(resent.message["id"] as? String ?? ""))
            let kept1 = try await Self.send(port, "alice", "m1", "before #1")
            #expect(kept1.status == 200 && kept1.message["seq"] as? Int == 1 && kept1.message["id"] as? String == ids["m1"], "\(kept1)")
            #expect(kept1.message["epoch"] as? String == forked)

            // Cursors up to the fork point carry over.
            let mine = try await call(port, "GET", "/api/conversations", token: try await token("alice"))
            let row = (mine.json as? [[String: Any]])?.first
            #expect(row?["epoch"] as? String == forked && row?["last_seq"] as? Int == 4 && row?["read_seq"] as? Int == 4, "\(String(describing: row))")
        }
    }

    @Test("a sync that crossed live messages on the wire, answered after a fork below them: they are named in truncated, as the session holds them")
    func crossedSyncAfterFork() async throws {
        let server = try RedisServerProcess()
        try await withNodes(1, configure: { $0.redisURL = server.url() }) { ports in
            let port = ports[0]
            try await ConversationTests.setUp(port, ["alice", "bob"])
            let bob = try await Sessions.open(port, "bob", device: "phone")
            try await Task.sleep(for: SessionHub.messageOpeningHold + .milliseconds(200))
            let (_, epoch) = try await Self.fourWithSnapshot(port, server)
            let live = await Sessions.messages(bob, count: 4)
            #expect(Sessions.seqs(live) == [1, 2, 3, 4])

            server.stop()
            try server.start()
            let ready = await eventually(timeout: .seconds(15)) {
                (try? await call(port, "GET", "/api/conversations/room/messages", token: try await token("bob")).status) == 200
            }
            #expect(ready)
            // The client syncs from 2, as a sync written before 3 and 4 arrived would: the
            // session was sent them, so the client holds them, and Redis lost them.
            bob.send("sync", ["positions": [["conversation_id": "room", "after_seq": 2, "epoch": epoch]]], id: "crossed")
            let answer = try await bob.next("synced")
            #expect(answer.id == "crossed" && answer.data["epoch"] as? String != epoch && answer.data["last_seq"] as? Int == 2, "\(answer.data)")
            let truncated = answer.data["truncated"] as? [[String: Any]] ?? []
            #expect(truncated.count == 1 && truncated.first?["epoch"] as? String == epoch, "\(answer.data)")
            #expect(truncated.first?["from_seq"] as? Int == 3 && truncated.first?["to_seq"] as? Int == 4)
        }
    }
}
