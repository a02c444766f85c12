import ClientTestSupport
import Foundation
import NIOConcurrencyHelpers
import PresenceClient
import RedisClient
import RedisTestSupport
import Testing

/// `redis+sentinel://`: a primary, a replica and three Sentinels of the test's own, failed over by
/// hand and by killing the primary, under a steady stream of writes.
///
/// Run with the heavy tests: each test waits for real Sentinels (about 7 s to know each other,
/// 1 s of silence to call a primary down).
@Suite("Redis Sentinel", .serialized)
struct SentinelTests {
    let logger = TestRedis.logger()

    /// Writes `INCR key` every 5 ms until cancelled, recording each outcome and when.
    final class Writer: Sendable {
        struct Outcome { var at: ContinuousClock.Instant; var ok: Bool; var error: String? }
        let outcomes = NIOLockedValueBox<[Outcome]>([])
        private let task: Task<Void, Never>

        init(_ client: RedisClient, key: String) {
            let outcomes = outcomes
            task = Task {
                while !Task.isCancelled {
                    let result = await outcome { try await client.send("INCR", RedisArgument(key)) }
                    let now = ContinuousClock.now
                    switch result {
                    case .success: outcomes.withLockedValue { $0.append(Outcome(at: now, ok: true)) }
                    case .failure(let error): outcomes.withLockedValue { $0.append(Outcome(at: now, ok: false, error: "\(error.code): \(error.message)")) }
                    }
                    try? await Task.sleep(for: .milliseconds(5))
                }
            }
        }

        func stop() { task.cancel() }

        /// The longest run of time without a successful write after `start`.
        func longestGap(after start: ContinuousClock.Instant) -> Duration {
            var last = start
            var longest = Duration.zero
            for outcome in outcomes.withLockedValue({ $0 }) where outcome.at >= start && outcome.ok {
                longest = max(longest, outcome.at - last)
                last = outcome.at
            }
            return max(longest, ContinuousClock.now - last)
        }

        var successes: Int { outcomes.withLockedValue { $0.filter(\.ok).count } }
        var errors: [String] { outcomes.withLockedValue { $0.compactMap(\.error) } }
    }

    static func configuration(_ url: String) throws -> RedisConfiguration {
        var configuration = try RedisConfiguration(url: url)
        configuration.waitForConnection = .seconds(1)
        configuration.commandTimeout = .seconds(2)
        configuration.subscriberPingInterval = .milliseconds(500)
        return configuration
    }

    /// Runs the built `presencectl`; its exit status and output (both streams, through a file).
    static func presencectl(_ arguments: [String]) throws -> (status: Int32, output: String) {
        var binary = URL(fileURLWithPath: #filePath)
        for _ in 0..<3 { binary.deleteLastPathComponent() }
        let output = FileManager.default.temporaryDirectory.appendingPathComponent("presencectl-\(UUID().uuidString).out")
        _ = FileManager.default.createFile(atPath: output.path, contents: nil)
        defer { try? FileManager.default.removeItem(at: output) }
        let process = Process()
        process.executableURL = binary.appendingPathComponent(".build/debug/presencectl")
        process.arguments = arguments
        process.standardOutput = try FileHandle(forWritingTo: output)
        process.standardError = process.standardOutput
        try process.run()
        process.waitUntilExit()
        return (process.terminationStatus, (try? String(contentsOf: output, encoding: .utf8)) ?? "")
    }

    static func count(_ server: RedisServerProcess?, _ key: String) -> Int {
        guard let server, let text = try? server.cli("GET", key) else { return -1 }
        return Int(text.trimmingCharacters(in: .whitespacesAndNewlines)) ?? 0
    }

    @Test("the client finds the primary through the Sentinels, past one that is down and one that is named first but unreachable, and never writes to the replica")
    func discovery() async throws {
        let set = try await LocalSentinels()
        set.sentinels[0].stop()
        let dead = try RefusingPort()
        let url = set.url().replacingOccurrences(of: "sentinel://", with: "sentinel://127.0.0.1:\(dead.port),")
        let key = TestRedis.uniquePrefix("sentinel") + ":k"
        _ = try await RedisClient.withClient(configuration: try Self.configuration(url), logger: logger) { client in
            try await client.send("SET", RedisArgument(key), "written")
        }
        #expect(try set.servers[0].cli("GET", key).contains("written"), "the write is on the primary")
        // The replica has it by replication only; a write sent to it would have been refused.
        #expect(await eventually { (try? set.servers[1].cli("GET", key))?.contains("written") == true })

        let missing = try RedisConfiguration(url: set.url().replacingOccurrences(of: "/\(set.name)/", with: "/nobody/"))
        do {
            try await RedisClient.withClient(configuration: missing, logger: logger) { _ in }
            Issue.record("a primary no Sentinel knows must not connect")
        } catch let error as RedisError {
            #expect(error.message.contains("knows no primary named 'nobody'"), "\(error.message)")
        }
    }

    @Test("SENTINEL FAILOVER under writes: the client and the subscriber follow the new primary, and no write reaches the demoted one after +switch-master")
    func forcedFailover() async throws {
        let set = try await LocalSentinels()
        let configuration = try Self.configuration(set.url())
        let key = TestRedis.uniquePrefix("failover") + ":n"
        let channel = TestRedis.uniquePrefix("failover") + ":events"
        let switched = NIOLockedValueBox<ContinuousClock.Instant?>(nil)
        // The test's own ear on a Sentinel: when +switch-master is announced.
        let announcements = RedisSubscriber(configuration: try RedisConfiguration(url: "redis://127.0.0.1:\(set.sentinels[2].port)"), logger: logger)
        let subscriber = RedisSubscriber(configuration: configuration, logger: logger)
        let subscribed = NIOLockedValueBox<[Bool]>([])
        let received = NIOLockedValueBox<[String]>([])
        try await RedisClient.withClient(configuration: configuration, logger: logger) { client in
            try await withThrowingTaskGroup(of: Void.self) { group in
                group.addTask { try await announcements.run() }
                group.addTask { try await subscriber.run() }
                group.addTask {
                    for await event in announcements.events {
                        if case .message = event { switched.withLockedValue { $0 = $0 ?? ContinuousClock.now } }
                    }
                }
                group.addTask {
                    for await event in subscriber.events {
                        switch event {
                        case .subscribed(let reconnect): subscribed.withLockedValue { $0.append(reconnect) }
                        case .message(_, let payload): received.withLockedValue { $0.append(String(decoding: payload, as: UTF8.self)) }
                        case .disconnected, .resubscribed: break
                        }
                    }
                }
                defer {
                    announcements.shutdown()
                    subscriber.shutdown()
                    group.cancelAll()
                }
                try await announcements.waitUntilConnected()
                try await announcements.subscribe(["+switch-master"])
                try await subscriber.waitUntilConnected()
                try await subscriber.subscribe([channel])

                let writer = Writer(client, key: key)
                try await Task.sleep(for: .milliseconds(500))
                let old = try #require(try set.primaryPort())
                let started = ContinuousClock.now
                #expect(try set.sentinelCLI(0, "SENTINEL", "FAILOVER", set.name).contains("OK"))
                let heard = await eventually(timeout: .seconds(10), poll: .milliseconds(10)) { switched.withLockedValue { $0 } != nil }
                try #require(heard, "+switch-master within 10 s")
                let announced = try #require(switched.withLockedValue { $0 })
                let new = try #require(try set.primaryPort())
                #expect(new != old)
                // The client drops the old primary as the announcement reaches it; allow it that.
                try await Task.sleep(for: .milliseconds(300))
                let onOld = Self.count(set.server(port: old), key)
                // The old primary goes on taking writes for seconds after a failover: any write
                // of ours landing there now would raise its count.
                try await Task.sleep(for: .seconds(2))
                let onOldLater = Self.count(set.server(port: old), key)
                let onNew = Self.count(set.server(port: new), key)
                writer.stop()
                print("forced failover: +switch-master after \(announced - started); longest time without a write \(writer.longestGap(after: started)); \(writer.successes) writes, \(writer.errors.count) failed; old primary \(onOld) → \(onOldLater), new \(onNew)")
                #expect(onOldLater == onOld, "no write on the demoted primary after +switch-master (\(onOld) → \(onOldLater))")
                #expect(onNew > 0, "writes go to the new primary")
                #expect(writer.longestGap(after: started) < .seconds(5), "writes resume within 5 s")

                // The subscriber is on the new primary: a message published there arrives.
                #expect(await eventually(timeout: .seconds(5)) { subscribed.withLockedValue { $0 }.contains(true) }, "the subscriber subscribed again")
                let delivered = await eventually(timeout: .seconds(5), poll: .milliseconds(100)) {
                    _ = try? set.server(port: new)?.cli("PUBLISH", channel, "after")
                    return received.withLockedValue { $0 }.contains("after")
                }
                #expect(delivered, "a message published on the new primary reaches the subscriber")
            }
        }
    }

    @Test("kill -9 of the primary under writes: writes fail only until the replica is promoted, then go on; a Sentinel down changes nothing")
    func killedPrimary() async throws {
        let set = try await LocalSentinels()
        set.sentinels[1].stop()
        let configuration = try Self.configuration(set.url())
        let key = TestRedis.uniquePrefix("kill") + ":n"
        try await RedisClient.withClient(configuration: configuration, logger: logger) { client in
            let writer = Writer(client, key: key)
            try await Task.sleep(for: .milliseconds(500))
            let old = try #require(try set.primaryPort())
            let killed = ContinuousClock.now
            set.server(port: old)?.stop()
            let promoted = await eventually(timeout: .seconds(15), poll: .milliseconds(50)) { (try? set.primaryPort()).flatMap { $0 } != old }
            try #require(promoted, "a replica is promoted within 15 s")
            let resumed = await eventually(timeout: .seconds(10), poll: .milliseconds(20)) {
                writer.outcomes.withLockedValue { $0.contains { $0.at > killed && $0.ok } }
            }
            try await Task.sleep(for: .seconds(1))
            writer.stop()
            let outcomes = writer.outcomes.withLockedValue { $0 }
            // A write sent just before the kill may still succeed just after it: writes resume
            // with the first success after the outage's first failure.
            let outage = outcomes.first { $0.at > killed && !$0.ok }?.at ?? killed
            let firstAfter = outcomes.first { $0.at > outage && $0.ok }?.at
            print("kill -9: writes resumed after \(firstAfter.map { $0 - killed } ?? .zero); \(outcomes.filter { !$0.ok }.count) failed meanwhile: \(Set(writer.errors.map { String($0.prefix(60)) }).sorted())")
            #expect(resumed, "writes resume on the promoted replica")
            // Once resumed, every later write succeeds.
            if let firstAfter {
                #expect(!outcomes.contains { $0.at > firstAfter && !$0.ok }, "no failure after writes resumed")
            }
            // Every failure was the outage's, said in words, and none took longer than the budget.
            #expect(writer.errors.allSatisfy { $0.contains("unavailable") || $0.contains("connectionClosed") || $0.contains("timeout") })
        }
    }

    @Test("two nodes on Sentinel through a forced failover and a kill -9 of the primary, with users changing status throughout: no live user is ever shown offline, changes flow again after each, and none is lost")
    func gatewayFailovers() async throws {
        let set = try await LocalSentinels()
        let lease = 3
        let environment = nodeEnvironment(prefix: TestRedis.uniquePrefix("sentinel-gw"), redisURL: set.url(),
                                          extra: ["PRESENCE_VISIBILITY": "open", "PRESENCE_LEASE_TTL": "\(lease)"])
        let a = try await GatewayProcess(nodeID: "a", environment: environment)
        let b = try await GatewayProcess(nodeID: "b", environment: environment)
        let users = (0..<12).map { "user\($0)" }
        var clients: [LiveClient] = []
        for (index, user) in users.enumerated() {
            clients.append(try await LiveClient(user, device: "phone", nodes: [index.isMultiple(of: 2) ? a : b]))
        }
        let watcher = try await LiveClient("watcher", device: "laptop", nodes: [b])
        for client in clients + [watcher] { #expect(await client.connected(), "\(client.user) is connected") }
        try await watcher.client.watch(users)
        for user in users { #expect(await watcher.sees(user, .online), "the watcher sees \(user) online") }
        let start = ContinuousClock.now
        // Load through both failovers: users 4… change status every 50 ms, in turn.
        let churning = Array(clients[4...])
        let churn = StatusChurn(churning, every: .milliseconds(50))

        /// A change made now on node a reaches the watcher on node b: writes and events flow.
        func changesFlow(_ index: Int, _ label: String) async {
            let before = await watcher.client.presence(of: users[index])?.status
            #expect(before == .online, "the watcher sees \(users[index]) online before the change")
            let changed = ContinuousClock.now
            await clients[index].client.setStatus(.away)
            let seen = await watcher.sees(users[index], .away, within: .seconds(8))
            #expect(seen, "after \(label): the watcher sees \(users[index]) away within 8 s: \(watcher.timeline(since: start, peer: users[index]))")
            print("sentinel gateway, \(label): \(users[index]) → away seen after \(ContinuousClock.now - changed)")
        }

        #expect(try set.sentinelCLI(0, "SENTINEL", "FAILOVER", set.name).contains("OK"))
        let old = try #require(try set.primaryPort())
        #expect(await eventually(timeout: .seconds(10)) { (try? set.primaryPort()).flatMap { $0 } != old }, "the forced failover happens")
        await changesFlow(0, "forced failover")

        #expect(await set.waitHealthy(), "the replica synced again")
        let current = try #require(try set.primaryPort())
        set.server(port: current)?.stop()
        #expect(await eventually(timeout: .seconds(15)) { (try? set.primaryPort()).flatMap { $0 } != current }, "the replica is promoted")
        await changesFlow(2, "kill -9 of the primary")

        // Past a lease and the grace after it, when a lost lease would have turned users offline.
        await churn.stop()
        try await Task.sleep(for: .seconds(lease + 3))
        // Nothing the churn set was lost for good: each user ends as last set.
        for client in churning {
            let wanted = churn.lastStatus(of: client.user)
            #expect(await watcher.sees(client.user, wanted ?? .online, within: .seconds(1)), "\(client.user) ends \(String(describing: wanted)): \(watcher.timeline(since: start, peer: client.user).suffix(6))")
        }
        for user in users {
            #expect(!watcher.statusesSinceOnline(of: user).contains(.offline), "\(user) was never shown offline: \(watcher.timeline(since: start, peer: user))")
        }
        for node in [a, b] { #expect(GatewayProcess.httpStatus(port: node.port, path: "/readyz") == 200, "node \(node.nodeID) is ready") }
        // presencectl reads through the Sentinels too, from the promoted primary.
        let user = try Self.presencectl(["user", users[2], "--redis-url", set.url(), "--key-prefix", environment["PRESENCE_KEY_PREFIX"]!, "--json"])
        let read = (try? JSONSerialization.jsonObject(with: Data(user.output.utf8))) as? [String: Any]
        #expect(user.status == 0 && read?["status"] as? String == "away", "presencectl user: \(user.output)")
        #expect(await watcher.sees(users[1], .online), "the watcher still sees user1 online")
        // A change the old primary took in the moment before the client left it is lost with
        // it; the node's audit after the reconnect writes it again. The watcher may see the older
        // status for that moment, never for long, and ends with the change.
        for index in [0, 2] {
            let arrivals = watcher.arrivals(of: users[index]).drop { $0.status != .away }
            #expect(arrivals.last?.status == .away, "\(users[index]) ends away: \(watcher.timeline(since: start, peer: users[index]))")
            for (position, arrival) in zip(arrivals.indices, arrivals) where arrival.status != .away {
                let healed = arrivals[position...].first { $0.status == .away }.map { $0.at - arrival.at }
                print("sentinel gateway: \(users[index]) shown \(arrival.status) again for \(healed.map { "\($0)" } ?? "ever")")
                #expect(healed.map { $0 < .seconds(3) } == true, "\(users[index])'s lost change is written again within 3 s: \(watcher.timeline(since: start, peer: users[index]))")
            }
        }
    }

    @Test("kill -9 of the primary while members send, with PRESENCE_MESSAGE_REPLICAS=1: no acknowledged message is lost; sends answer 503 until a replica is back, and their retries then find them")
    func messagesThroughFailover() async throws {
        let set = try await LocalSentinels()
        let prefix = TestRedis.uniquePrefix("sentinel-messages")
        let environment = nodeEnvironment(prefix: prefix, redisURL: set.url(), extra: ["PRESENCE_VISIBILITY": "open", "PRESENCE_MESSAGE_REPLICAS": "1"])
        let a = try await GatewayProcess(nodeID: "a", environment: environment)
        let b = try await GatewayProcess(nodeID: "b", environment: environment)
        #expect(admin(a, "PUT", "/api/admin/conversations/room", #"{"member_ids":["alice","bob"]}"#)?.status == 200)
        let alice = MessageDevice(user: "alice", device: "phone", conversations: ["room"])
        let bob = MessageDevice(user: "bob", device: "phone", conversations: ["room"])
        try await alice.connect(port: a.port)
        try await bob.connect(port: b.port)
        try await Task.sleep(for: .milliseconds(500))
        let sending = Task {
            var number = 0
            while !Task.isCancelled {
                number += 1
                let device = number.isMultiple(of: 2) ? alice : bob
                device.send("\(device.user) \(number)", to: "room", clientID: "\(device.user)-\(number)")
                try? await Task.sleep(for: .milliseconds(20))
            }
        }
        try await Task.sleep(for: .seconds(1))
        let old = try #require(try set.primaryPort())
        let acknowledgedBefore = alice.acknowledged.count + bob.acknowledged.count
        set.server(port: old)?.stop()
        #expect(await eventually(timeout: .seconds(15)) { (try? set.primaryPort()).flatMap { $0 } != old }, "the replica is promoted")
        try await Task.sleep(for: .seconds(1))
        sending.cancel()
        _ = await sending.value
        // The promoted primary has no replica: sends are stored but not acknowledged (503).
        let refused = (alice.errors + bob.errors).filter { $0.contains("unavailable") }
        // The old primary comes back empty; the Sentinels make it the new primary's replica.
        try set.server(port: old)?.start()
        #expect(await set.waitHealthy(), "the old primary is a replica again")
        let drained = await eventually(timeout: .seconds(20), poll: .milliseconds(500)) {
            for device in [alice, bob] where device.unacknowledged > 0 { device.resend() }
            return alice.unacknowledged == 0 && bob.unacknowledged == 0
        }
        #expect(drained, "every message acknowledged in the end: \(alice.unacknowledged + bob.unacknowledged) left")
        let primary = try #require(try set.primaryPort().flatMap { set.server(port: $0) })
        let raw = try primary.cli("EVAL", "local out = {} for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do for i = 1, #e[2], 2 do if e[2][i] == 'c' then table.insert(out, e[1] .. '|' .. e[2][i + 1]) end end end return table.concat(out, ' ')",
                                  "1", "\(prefix):{c:room}:history")
        var stored: [String: Int] = [:]
        var twice: [String] = []
        for entry in raw.split(whereSeparator: { $0 == " " || $0 == "\n" }) {
            let parts = entry.split(separator: "|")
            guard parts.count == 2, let seq = parts[0].split(separator: "-").first.flatMap({ Int($0) }) else { continue }
            if stored.updateValue(seq, forKey: String(parts[1])) != nil { twice.append(String(parts[1])) }
        }
        var lost: [String] = []
        for device in [alice, bob] {
            for (clientID, ack) in device.acknowledged where stored[clientID] != Int(ack.seq) { lost.append("\(clientID) acknowledged at \(ack.seq), stored at \(stored[clientID].map(String.init) ?? "none")") }
        }
        print("sentinel messages: \(acknowledgedBefore) acknowledged before the kill, \(refused.count) sends answered unavailable while no replica was there, \(alice.acknowledged.count + bob.acknowledged.count) acknowledged in the end, \(stored.count) stored")
        #expect(lost.isEmpty, "acknowledged and then lost: \(lost.prefix(5))")
        #expect(twice.isEmpty, "stored twice: \(twice.prefix(5))")
        #expect(!refused.isEmpty, "with no replica, sends were answered unavailable")
        // Delivered live only once a replica had it: no device holds a seq the failover gave
        // again to another message; each ends with the stream, in order, once it syncs.
        for device in [alice, bob] { try await device.connect(port: b.port) }
        let want = stored.values.sorted()
        let agreed = await eventually(timeout: .seconds(10)) { [alice, bob].allSatisfy { $0.received("room").map { Int($0.seq) } == want } }
        #expect(agreed, "devices hold the stream: \([alice, bob].map { $0.received("room").count }) of \(want.count); repeats \((alice.repeats + bob.repeats).prefix(3))")
        for device in [alice, bob] {
            let byClient = Dictionary(device.received("room").map { ($0.clientMessageID, Int($0.seq)) }) { first, _ in first }
            #expect(byClient.allSatisfy { stored[$0.key] == $0.value }, "\(device.user) holds each message at its stored seq")
        }
        for node in [a, b] { node.terminate() }
    }
}
