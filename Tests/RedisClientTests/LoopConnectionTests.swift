import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import RedisTestSupport
import Testing

@testable import RedisClient

/// A task executor on one event loop, as a gateway session's work runs.
private final class OnLoop: TaskExecutor {
    let loop: any EventLoop

    init(_ loop: any EventLoop) {
        self.loop = loop
    }

    func enqueue(_ job: consuming ExecutorJob) {
        let job = UnownedJob(job)
        loop.execute { job.runSynchronously(on: self.asUnownedTaskExecutor()) }
    }

    /// Runs `body` in a task on the loop and returns its result.
    func run<T: Sendable>(_ body: @escaping @Sendable () async throws -> T) async throws -> T {
        try await Task(executorPreference: self) {
            precondition(self.loop.inEventLoop, "the task runs on its loop")
            return try await body()
        }.value
    }
}

@Suite("A Redis connection per event loop")
struct LoopConnectionTests {
    let logger = TestRedis.logger()

    /// `CLIENT ID` as the connection a command from each loop takes answers it.
    private func ids(_ client: RedisClient, loops: [OnLoop]) async throws -> [Int] {
        var ids: [Int] = []
        for loop in loops {
            ids.append(try await loop.run { try await client.send("CLIENT", "ID").int ?? -1 })
        }
        return ids
    }

    /// Runs `body` with a client of a three-loop group, named `prefix` made unique, and the loops.
    private func withLoops(_ base: RedisConfiguration = TestRedis.configuration(), named prefix: String, _ body: (RedisClient, [OnLoop], String) async throws -> Void) async throws {
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 3)
        let loops = group.makeIterator().map { OnLoop($0) }
        var configuration = base
        configuration.clientName = TestRedis.uniquePrefix(prefix)
        let name = configuration.clientName!
        do {
            try await RedisClient.withClient(configuration: configuration, eventLoopGroup: group, logger: logger) { client in
                try await body(client, loops, name)
            }
        } catch {
            try await group.shutdownGracefully()
            throw error
        }
        try await group.shutdownGracefully()
    }

    /// Waits until every loop but the first connection's has a connection of its own: they open
    /// beside the first, after it.
    private func joined(_ client: RedisClient, loops: Int) async -> Bool {
        await eventually { client.loopConnectionCount == loops - 1 }
    }

    private func connections(named name: String, admin: RedisClient) async throws -> Int {
        let list = try await admin.send("CLIENT", "LIST", "TYPE", "normal").string ?? ""
        return list.split(separator: "\n").filter { $0.contains("name=\(name) ") }.count
    }

    /// Fails before the change: every command took the one connection (one id for all loops).
    @Test("a command sent from an event loop goes out on that loop's own connection, the same one each time; one from elsewhere on one of them")
    func ownConnection() async throws {
        try await withLoops(named: "loops") { client, loops, name in
            try #require(await joined(client, loops: 3))
            let first = try await ids(client, loops: loops)
            let again = try await ids(client, loops: loops)
            #expect(Set(first).count == 3, "three loops, three connections: \(first)")
            #expect(again == first, "each loop keeps its connection: \(first) then \(again)")
            let elsewhere = try await client.send("CLIENT", "ID").int ?? -1
            #expect(first.contains(elsewhere), "a command off the loops takes one of the client's connections (\(elsewhere), loops \(first))")
            try await RedisClient.withClient(configuration: TestRedis.configuration(), logger: logger) { admin in
                let open = try await connections(named: name, admin: admin)
                #expect(open == 3, "one connection per loop under the client's name")
            }
        }
    }

    /// Fails before the change in its first expectation (one connection), so it guards what the
    /// change adds: a loop's connection lost takes the others with it, and all come back.
    @Test("when one loop's connection is killed, all are made again: observers hear one disconnect and one reconnect, and each loop has a new connection of its own")
    func oneLostAllRenewed() async throws {
        let events = NIOLockedValueBox<[RedisConnectionEvent]>([])
        try await withLoops(named: "loopkill") { client, loops, name in
            client.addConnectionObserver { event in events.withLockedValue { $0.append(event) } }
            try #require(await joined(client, loops: 3))
            let before = try await ids(client, loops: loops)
            #expect(Set(before).count == 3, "\(before)")
            try await RedisClient.withClient(configuration: TestRedis.configuration(), logger: logger) { admin in
                // The last loop's: most likely not the first connection, whose loss a single connection client already handled.
                let killed = try await admin.send("CLIENT", "KILL", "ID", RedisArgument(before[2]))
                #expect(killed == .simpleString("OK") || killed == .integer(1))
                // The first connect may be heard too: the client announces it once it runs.
                let back = await eventually { events.withLockedValue { $0.filter { $0 != .connected(reconnect: false) } } == [.disconnected, .connected(reconnect: true)] }
                #expect(back, "events: \(events.withLockedValue { $0 })")
                try #require(await joined(client, loops: 3))
                let after = try await ids(client, loops: loops)
                #expect(Set(after).count == 3, "\(after)")
                #expect(Set(after).isDisjoint(with: before), "every connection is new: \(before) → \(after)")
                let settled = await eventually { (try? await connections(named: name, admin: admin)) == 3 }
                #expect(settled, "the old connections are closed, three new ones open")
            }
        }
    }

    /// Fails without the PING a loop's connection answers before it joins: the refused one
    /// joined, closed, and took the others with it, again and again.
    @Test("a server at maxclients refuses one loop's connection: the client stays connected, and that loop's commands take the first connection")
    func maxClients() async throws {
        let server = try RedisServerProcess(arguments: ["--maxclients", "2"])
        let events = NIOLockedValueBox<[RedisConnectionEvent]>([])
        try await withLoops(RedisConfiguration(url: server.url()), named: "maxclients") { client, loops, _ in
            client.addConnectionObserver { event in events.withLockedValue { $0.append(event) } }
            let one = await eventually { client.loopConnectionCount == 1 }
            #expect(one, "one of the two other loops has a connection")
            try await Task.sleep(for: .milliseconds(500))
            #expect(!events.withLockedValue { $0 }.contains(.disconnected), "\(events.withLockedValue { $0 })")
            #expect(client.loopConnectionCount == 1)
            let answered = try await ids(client, loops: loops)
            #expect(Set(answered).count == 2, "two connections serve three loops: \(answered)")
        }
    }

    /// The first half fails if only one connection is asked (the write went out on a loop's
    /// connection, the `WAIT` comes from off the loops; checked). The second half asks from each
    /// loop after a write on the first connection; it passed all the same on a version whose
    /// `WAIT` from a loop left the first connection out (Redis 7.0.15 answered 0 there too), so it
    /// holds the result, not that version's mistake.
    @Test("waiting for replicas asks every connection: a write on any loop's connection that the replica has not got counts it missing")
    func waitAsksEveryConnection() async throws {
        let primary = try RedisServerProcess()
        let replica = try RedisServerProcess(arguments: ["--replicaof", "127.0.0.1", "\(primary.port)"])
        let key = TestRedis.uniquePrefix("wait")
        try await withLoops(RedisConfiguration(url: primary.url()), named: "wait") { client, loops, _ in
            let linked = await eventually(timeout: .seconds(10)) {
                (try? await client.send("INFO", "replication").string)?.contains("connected_slaves:1") ?? false
            }
            try #require(linked, "the replica follows the primary")
            try #require(await joined(client, loops: 3))
            for loop in loops { _ = try await loop.run { try await client.send("SET", RedisArgument(key), "1") } }
            // `connected_slaves:1` comes before the replica's first sync ends: wait for its ack.
            let acked = await eventually(timeout: .seconds(15)) { (try? await client.waitForReplicas(1, timeoutMilliseconds: 1_000, afterWriting: key)) == 1 }
            #expect(acked, "the running replica has every write")
            let pid = try #require(replica.pid)
            kill(pid, SIGSTOP)
            defer { kill(pid, SIGCONT) }
            // One write on the last loop's connection, which the stopped replica cannot have.
            _ = try await loops[2].run { try await client.send("SET", RedisArgument(key), "2") }
            #expect(try await client.waitForReplicas(1, timeoutMilliseconds: 300, afterWriting: key) == 0)
            kill(pid, SIGCONT)
            let caughtUp = await eventually { (try? await client.waitForReplicas(1, timeoutMilliseconds: 200, afterWriting: key)) == 1 }
            try #require(caughtUp, "the replica has every write again")
            kill(pid, SIGSTOP)
            // One write on the first connection (from off the loops), waited for from each loop,
            // where a loop's own connection is at hand but has written nothing missing.
            try await client.send("SET", RedisArgument(key), "3")
            for (index, loop) in loops.enumerated() {
                let counted = try await loop.run { try await client.waitForReplicas(1, timeoutMilliseconds: 300, afterWriting: key) }
                #expect(counted == 0, "asked from loop \(index)")
            }
        }
    }
}
