import Foundation
import PresenceGateway
import RedisClient
import RedisTestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// Runs the built `presencectl` (from `swift build --build-tests`) and captures its output.
struct CTL {
    static var binary: URL {
        var root = URL(fileURLWithPath: #filePath)
        for _ in 0..<3 { root.deleteLastPathComponent() }
        return root.appendingPathComponent(".build/debug/presencectl")
    }

    /// Output goes to files, not pipes: a pipe's end can be inherited by a long-lived child
    /// another test starts at the same moment, and reading it to the end would then wait for that
    /// child.
    /// The wait for the process happens off the cooperative pool (see `offThePool`).
    static func run(_ arguments: [String], inheritPubSub: Bool = true, program: String = "presencectl") async throws -> (status: Int32, out: String, err: String) {
        try await offThePool {
            let (process, out, err) = try start(arguments, inheritPubSub: inheritPubSub, program: program)
            process.waitUntilExit()
            return (process.terminationStatus, read(out), read(err))
        }
    }

    /// With `inheritPubSub`, the tests' pub/sub (``TestRedis/pubSub``) as `PRESENCE_REDIS_PUBSUB`;
    /// without, none: presencectl picks the nodes'. `program` is another binary of the build.
    static func start(_ arguments: [String], inheritPubSub: Bool = true, program: String = "presencectl") throws -> (Process, URL, URL) {
        let directory = FileManager.default.temporaryDirectory
        let out = directory.appendingPathComponent("presencectl-\(UUID().uuidString).out")
        let err = directory.appendingPathComponent("presencectl-\(UUID().uuidString).err")
        _ = FileManager.default.createFile(atPath: out.path, contents: nil)
        _ = FileManager.default.createFile(atPath: err.path, contents: nil)
        let process = Process()
        process.executableURL = binary.deletingLastPathComponent().appendingPathComponent(program)
        process.arguments = arguments
        var environment = ProcessInfo.processInfo.environment
        environment["PRESENCE_REDIS_PUBSUB"] = inheritPubSub ? TestRedis.pubSub : nil
        process.environment = environment
        process.standardOutput = try FileHandle(forWritingTo: out)
        process.standardError = try FileHandle(forWritingTo: err)
        try process.run()
        return (process, out, err)
    }

    static func read(_ url: URL) -> String {
        defer { try? FileManager.default.removeItem(at: url) }
        return (try? String(contentsOf: url, encoding: .utf8)) ?? ""
    }

    static func json(_ arguments: [String]) async throws -> [String: Any] {
        let result = try await run(arguments + ["--json"])
        return (try? JSONSerialization.jsonObject(with: Data(result.out.utf8))) as? [String: Any] ?? ["_raw": result.out + result.err]
    }
}

@Suite("presencectl against Redis with a live node beside it")
struct PresencectlTests {
    @Test("user, online, nodes, conversation, stats, watch and disconnect see what the node does")
    func commands() async throws {
        let prefix = TestRedis.uniquePrefix("ctl")
        try await withNodes(1, prefix: prefix) { ports in
            let common = ["--redis-url", TestRedis.url, "--key-prefix", prefix]
            let alice = TestSocket(port: ports[0], token: try await token("alice"), device: "phone")
            _ = try await alice.next("initial_state")

            let table = try await CTL.run(["user", "alice"] + common)
            #expect(table.status == 0)
            #expect(table.out.contains("online") && table.out.contains("phone") && table.out.contains("node-0"), "\(table.out)")
            let user = try await CTL.json(["user", "alice"] + common)
            #expect(user["status"] as? String == "online")
            #expect((user["devices"] as? [[String: Any]])?.first?["node"] as? String == "node-0")

            let online = try await CTL.json(["online"] + common)
            #expect(online["count"] as? Int == 1)
            let onlineTable = try await CTL.run(["online"] + common).out
            #expect(onlineTable.contains("USER") && onlineTable.contains("alice") && onlineTable.contains("1 user(s) present: 1 online"), "\(onlineTable)")
            let nodesTable = try await CTL.run(["nodes"] + common).out
            #expect(nodesTable.contains("node-0") && nodesTable.contains("live") && nodesTable.contains("1 live node(s)"), "\(nodesTable)")
            let nodes = try await CTL.run(["nodes", "--json"] + common)
            let nodeList = (try? JSONSerialization.jsonObject(with: Data(nodes.out.utf8))) as? [[String: Any]]
            #expect(nodeList?.first?["node_id"] as? String == "node-0" && nodeList?.first?["state"] as? String == "live")
            #expect(nodeList?.first?["pubsub"] as? String == TestRedis.configuration().pubSub.rawValue, "as its renewals record it")

            let set = try await CTL.run(["set-members", "team", "alice", "bob"] + common)
            #expect(set.status == 0 && set.out.contains("2 added"))
            let update = try await alice.next("presence_update")
            #expect(update.userID == "bob", "the node applies a membership change made by presencectl")
            let conversation = try await CTL.json(["conversation", "team"] + common)
            #expect(conversation["total"] as? Int == 2 && conversation["online"] as? Int == 1)
            let conversationTable = try await CTL.run(["conversation", "team"] + common).out
            #expect(conversationTable.contains("bob") && conversationTable.contains("1 of 2 online"), "\(conversationTable)")
            let stats = try await CTL.json(["stats"] + common)
            #expect(stats["users_online"] as? Int == 1 && stats["nodes"] as? Int == 1 && (stats["keys"] as? Int ?? 0) > 0)
            let statsTable = try await CTL.run(["stats"] + common).out.replacingOccurrences(of: " +", with: " ", options: .regularExpression)
            #expect(statsTable.contains("users online 1") && statsTable.contains("live nodes 1") && statsTable.contains("messages kept 0"), "\(statsTable)")
            let add = try await CTL.json(["add-members", "team", "carol"] + common)
            #expect(add["added"] as? [String] == ["carol"])
            let remove = try await CTL.run(["remove-member", "team", "carol"] + common)
            #expect(remove.status == 0 && remove.out.contains("removed carol"))
            let help = try await CTL.run(["user", "--help"])
            #expect(help.out.contains("Example: presencectl user alice"))

            let (watcher, watchOut, watchErr) = try CTL.start(["watch", "--user", "alice", "--json"] + common)
            try await Task.sleep(for: .milliseconds(700))
            alice.send("status", ["status": "away"])
            _ = try await alice.next("ack")
            try await Task.sleep(for: .milliseconds(500))
            kill(watcher.processIdentifier, SIGKILL)
            watcher.waitUntilExit()
            let tail = CTL.read(watchOut)
            _ = CTL.read(watchErr)
            #expect(tail.contains("\"away\"") && tail.contains("\"alice\""), "watch saw the gateway's event: \(tail)")
            if TestRedis.isSharded {
                // Sharded channels have no pattern subscription: an unfiltered watch says so.
                let unfiltered = try await CTL.run(["watch"] + common)
                #expect(unfiltered.status == 1 && unfiltered.err.contains("watch needs --user or --conversation"), "\(unfiltered)")
            }

            let disconnect = try await CTL.run(["disconnect", "alice"] + common)
            #expect(disconnect.status == 0 && disconnect.out.contains("asked 1 node(s)"))
            #expect(await alice.closed() == 4003)
            let deleted = try await CTL.run(["delete-conversation", "team"] + common)
            #expect(deleted.status == 0 && deleted.out == "deleted team\n")
            #expect(try await CTL.run(["delete-conversation", "team"] + common).status == 1)
        }
    }

    @Test("messages lists a history (latest, --after, --limit, --json) and --follow prints each new message once, in order; stats counts them")
    func messages() async throws {
        let prefix = TestRedis.uniquePrefix("ctlmsg")
        try await withNodes(1, prefix: prefix) { ports in
            let common = ["--redis-url", TestRedis.url, "--key-prefix", prefix]
            try await ConversationTests.setUp(ports[0], ["alice", "bob"])
            let alice = try await token("alice")
            @Sendable func send(_ number: Int) async throws {
                let body = MessageRESTTests.body(["client_message_id": "m\(number)", "text": "message \(number)"])
                #expect(try await call(ports[0], "POST", "/api/conversations/room/messages", token: alice, body: body).status == 201)
            }
            for number in 1...5 { try await send(number) }
            let latest = try await CTL.run(["messages", "room", "--limit", "2"] + common)
            #expect(latest.status == 0 && latest.out.contains("seqs 1-5 kept") && latest.out.contains("message 5") && !latest.out.contains("message 3"), "\(latest)")
            let after = try await CTL.json(["messages", "room", "--after", "3"] + common)
            #expect((after["messages"] as? [[String: Any]])?.compactMap { $0["seq"] as? Int } == [4, 5] && after["last_seq"] as? Int == 5)
            #expect(try await CTL.run(["messages", "nowhere"] + common).err.contains("no such conversation: nowhere"))
            #expect(try await CTL.run(["messages", "room", "--limit", "0"] + common).status != 0)
            let stats = try await CTL.json(["stats"] + common)
            #expect(stats["messages_kept"] as? Int == 5 && stats["conversations_with_history"] as? Int == 1 && stats["message_retry_records"] as? Int == 5)

            let (follower, out, err) = try CTL.start(["messages", "room", "--follow", "--json", "--after", "3"] + common)
            _ = await eventually(timeout: .seconds(5)) { (try? String(contentsOf: err, encoding: .utf8))?.contains("following room") == true }
            for number in 6...8 { try await send(number) }
            _ = await eventually(timeout: .seconds(5)) { (try? String(contentsOf: out, encoding: .utf8))?.contains("message 8") == true }
            kill(follower.processIdentifier, SIGKILL)
            follower.waitUntilExit()
            let lines = CTL.read(out).split(separator: "\n")
            _ = CTL.read(err)
            // JSON Lines from the first line: the kept page's messages, then the new ones.
            let objects = lines.compactMap { try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any] }
            #expect(objects.count == lines.count, "every line is one object: \(lines)")
            #expect(objects.compactMap { $0["seq"] as? Int } == [4, 5, 6, 7, 8], "\(lines)")
        }
    }

    @Test(
        "nodes that publish differently would not hear each other: a node of the other pub/sub is refused at start, and presencectl watch follows the live nodes' pub/sub",
        .enabled(if: !TestRedis.url.hasPrefix("redis+cluster://"), "a cluster has one pub/sub, sharded")
    )
    func pubSubAgreement() async throws {
        let prefix = TestRedis.uniquePrefix("ctl-pubsub")
        let mine = TestRedis.isSharded ? "sharded" : "classic"
        let theirs = TestRedis.isSharded ? "classic" : "sharded"
        try await withNodes(1, prefix: prefix, configure: { $0.redisPubSub = theirs }) { ports in
            let common = ["--redis-url", TestRedis.url, "--key-prefix", prefix]
            let alice = TestSocket(port: ports[0], token: try await token("alice"), device: "phone")
            _ = try await alice.next("initial_state")
            #expect(await eventually(timeout: .seconds(10)) { (try? await CTL.json(["stats"] + common))?["nodes"] as? Int == 1 }, "node-0 registered")

            // A node of this run's pub/sub beside it ends at once, saying why.
            let gateway = Process()
            gateway.executableURL = CTL.binary.deletingLastPathComponent().appendingPathComponent("presence-gateway")
            gateway.arguments = ["--port", "\(try RedisServerProcess.freePort())", "--redis-url", TestRedis.url, "--key-prefix", prefix, "--node-id", "other",
                                 "--redis-pubsub", mine, "--jwt-secret", testSecret, "--log-level", "error"]
            let log = FileManager.default.temporaryDirectory.appendingPathComponent("gateway-other-\(UUID().uuidString).log")
            _ = FileManager.default.createFile(atPath: log.path, contents: nil)
            gateway.standardOutput = try FileHandle(forWritingTo: log)
            gateway.standardError = try FileHandle(forWritingTo: log)
            try gateway.run()
            defer { if gateway.isRunning { kill(gateway.processIdentifier, SIGKILL) } }
            let deadline = ContinuousClock.now + .seconds(20)
            while gateway.isRunning, ContinuousClock.now < deadline { try await Task.sleep(for: .milliseconds(50)) }
            let output = CTL.read(log)
            #expect(!gateway.isRunning, "the mismatched node stops by itself: \(output)")
            #expect(!gateway.isRunning && gateway.terminationStatus != 0, "\(output)")
            #expect(output.contains("live nodes use another pub/sub") && output.contains("node-0 (\(theirs))"), "\(output)")

            // Without --redis-pubsub, watch takes node-0's and hears its events.
            let (watcher, watchOut, watchErr) = try CTL.start(["watch", "--user", "alice", "--json"] + common, inheritPubSub: false)
            try await Task.sleep(for: .milliseconds(700))
            alice.send("status", ["status": "away"])
            _ = try await alice.next("ack")
            let heard = await eventually(timeout: .seconds(5)) { ((try? String(contentsOf: watchOut, encoding: .utf8)) ?? "").contains("\"away\"") }
            kill(watcher.processIdentifier, SIGKILL)
            watcher.waitUntilExit()
            let tail = CTL.read(watchOut)
            _ = CTL.read(watchErr)
            #expect(heard && tail.contains("\"alice\""), "watch heard node-0's \(theirs) event: \(tail)")
            // Told to use the other one, it refuses rather than hear nothing.
            let wrong = try await CTL.run(["watch", "--user", "alice", "--redis-pubsub", mine] + common, inheritPubSub: false)
            #expect(wrong.status == 1 && wrong.err.contains("the gateway nodes use \(theirs) pub/sub"), "\(wrong)")
            if theirs == "sharded" {
                let unfiltered = try await CTL.run(["watch"] + common, inheritPubSub: false)
                #expect(unfiltered.status == 1 && unfiltered.err.contains("watch needs --user or --conversation"), "\(unfiltered)")
            }
        }
    }

    /// Fails before the change: the membership change printed once per member's channel (three
    /// lines for a three-member conversation, none naming dave), pretty JSON over several lines,
    /// and a watch whose reader had gone ran on until killed.
    @Test("watch --json in a pipe: one object per line, a membership change once with who joined, and the end of its reader ends it")
    func watchInAPipe() async throws {
        let prefix = TestRedis.uniquePrefix("ctl-pipe")
        let common = ["--redis-url", TestRedis.url, "--key-prefix", prefix]
        #expect(try await CTL.run(["set-members", "team", "alice", "bob", "carol"] + common).status == 0)
        // Both ends close-on-exec at once (the child gets the write end as its standard output
        // all the same): no other test's child keeps the read end, so closing it here is the
        // reader going away.
        var ends: [Int32] = [0, 0]
        #expect(pipe(&ends) == 0)
        for end in ends { _ = fcntl(end, F_SETFD, FD_CLOEXEC) }
        let readEnd = ends[0]
        let reader = FileHandle(fileDescriptor: readEnd, closeOnDealloc: true)
        let errors = FileManager.default.temporaryDirectory.appendingPathComponent("presencectl-\(UUID().uuidString).err")
        _ = FileManager.default.createFile(atPath: errors.path, contents: nil)
        defer { try? FileManager.default.removeItem(at: errors) }
        let process = Process()
        process.executableURL = CTL.binary
        process.arguments = ["watch", "--conversation", "team", "--json"] + common
        var environment = ProcessInfo.processInfo.environment
        environment["PRESENCE_REDIS_PUBSUB"] = TestRedis.pubSub
        process.environment = environment
        process.standardOutput = FileHandle(fileDescriptor: ends[1], closeOnDealloc: false)
        process.standardError = try FileHandle(forWritingTo: errors)
        try process.run()
        close(ends[1])
        defer { if process.isRunning { kill(process.processIdentifier, SIGKILL) } }
        // Subscribed once it says so.
        #expect(await eventually(timeout: .seconds(10)) { ((try? String(contentsOf: errors, encoding: .utf8)) ?? "").contains("watching") })
        #expect(try await CTL.run(["add-members", "team", "dave"] + common).status == 0)
        #expect(try await CTL.run(["remove-member", "team", "carol"] + common).status == 0)
        // What comes within 3 s after the second change: both changes, each once, each on a line
        // of its own.
        let text = try await offThePool { () -> String in
            var text = ""
            let end = ContinuousClock.now + .seconds(3)
            while ContinuousClock.now < end {
                var pending = pollfd(fd: readEnd, events: Int16(POLLIN), revents: 0)
                guard poll(&pending, 1, 100) > 0 else { continue }
                // One read(2): FileHandle's reads wait for the whole count or the end.
                var chunk = [UInt8](repeating: 0, count: 4096)
                let count = read(readEnd, &chunk, chunk.count)
                guard count > 0 else { break }
                text += String(decoding: chunk.prefix(count), as: UTF8.self)
            }
            return text
        }
        let lines = text.split(separator: "\n").map(String.init)
        let objects = lines.map { (try? JSONSerialization.jsonObject(with: Data($0.utf8))) as? [String: Any] }
        #expect(objects.count == 2 && objects.allSatisfy { $0?["type"] as? String == "membership" }, "\(lines)")
        #expect(objects.first??["added"] as? [String] == ["dave"] && objects.last??["removed"] as? [String] == ["carol"], "\(lines)")
        try reader.close()
        #expect(await eventually(timeout: .seconds(3)) { !process.isRunning }, "its reader gone, a quiet watch ends")
        #expect(!process.isRunning && process.terminationReason == .exit && process.terminationStatus == 0)
    }

    /// Fails before the change: each exited 1 after trying Redis ("cannot reach Redis"), or
    /// with the setting's error as if Redis had answered it.
    @Test("a bad --redis-url, --redis-pubsub, --key-prefix or id is a usage error (64) found before connecting")
    func badSettings() async throws {
        for arguments in [
            ["user", "alice", "--redis-url", "http://127.0.0.1:6379"],
            ["user", "alice", "--redis-pubsub", "bogus"],
            ["stats", "--key-prefix", ""],
            ["watch", "--conversation", "a b", "--redis-url", "redis://127.0.0.1:1/0"],
            ["watch", "--user", "a b", "--redis-url", "redis://127.0.0.1:1/0"],
        ] {
            let result = try await CTL.run(arguments, inheritPubSub: false)
            #expect(result.status == 64, "\(arguments): \(result.err)")
            #expect(!result.err.contains("cannot reach Redis") && result.err.contains("Usage:"), "\(arguments): \(result.err)")
        }
    }

    @Test("errors are one line on stderr and a non-zero exit")
    func errors() async throws {
        let prefix = TestRedis.uniquePrefix("ctl")
        let common = ["--redis-url", TestRedis.url, "--key-prefix", prefix]
        let unknownUser = try await CTL.run(["user", "nobody"] + common)
        #expect(unknownUser.status == 1 && unknownUser.err == "presencectl: no such user: nobody\n")
        let unknownConversation = try await CTL.run(["conversation", "none"] + common)
        #expect(unknownConversation.status == 1 && unknownConversation.err.contains("no such conversation"))
        let badID = try await CTL.run(["user", "a b"] + common)
        #expect(badID.status != 0 && badID.err.contains("is not an id"))

        let server = try RedisServerProcess(arguments: ["--requirepass", "right"])
        let wrong = try await CTL.run(["stats", "--redis-url", server.url(credentials: ":wrong")])
        #expect(wrong.status == 1 && wrong.err.contains("refused") && !wrong.err.contains("wrong"), "\(wrong.err)")
        let refusing = try RefusingPort()
        let down = try await CTL.run(["stats", "--redis-url", "redis://127.0.0.1:\(refusing.port)/0"])
        #expect(down.status == 1)
        #expect(down.err.hasPrefix("presencectl: cannot reach Redis at") && down.err.split(separator: "\n").count == 1, "\(down.err)")
    }
}
