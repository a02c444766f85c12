import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import RedisTestSupport
import Testing

@testable import RedisClient

@Suite("Redis client against a real redis-server")
struct RedisClientIntegrationTests {
    let logger = TestRedis.logger()

    @Test("100,000 commands from 100 tasks: every reply reaches its own caller, in order")
    func concurrentPipelining() async throws {
        let prefix = TestRedis.uniquePrefix("pipe")
        try await RedisClient.withClient(configuration: TestRedis.configuration(), logger: logger) { client in
            try await withThrowingTaskGroup(of: Void.self) { group in
                for task in 0..<100 {
                    group.addTask {
                        let key = "\(prefix):counter:\(task)"
                        for expected in 1...1000 {
                            // Each INCR's reply is the count so far: a reply delivered to the wrong
                            // caller or out of order would show up as a wrong number.
                            let reply = try await client.send("INCR", RedisArgument(key))
                            #expect(reply == .integer(Int64(expected)))
                            if reply != .integer(Int64(expected)) { return }
                        }
                    }
                }
                try await group.waitForAll()
            }
            let keys = (0..<100).map { RedisArgument("\(prefix):counter:\($0)") }
            #expect(try await client.send([RedisArgument("DEL")] + keys) == .integer(100))
        }
    }

    /// Fails before the fix: the connection asked for `.socketOption(.tcp_nodelay)`, which is
    /// SOL_SOCKET's option 1, SO_DEBUG: set as root (debug 1 read here), refused with EACCES to
    /// a plain user, whose every connection failed (the image runs as uid 10001).
    @Test("a connection's socket has TCP_NODELAY on and SO_DEBUG off, so that a node run as a plain user can connect")
    func socketOptions() async throws {
        let connection = try await RedisConnection.connect(configuration: TestRedis.configuration(), eventLoopGroup: MultiThreadedEventLoopGroup.singleton, logger: logger)
        let noDelay = try await connection.channel.getOption(.tcpOption(.tcp_nodelay)).get()
        let debug = try await connection.channel.getOption(.socket(SocketOptionLevel(SOL_SOCKET), SocketOptionName(SO_DEBUG))).get()
        await connection.close()
        #expect(noDelay != 0, "TCP_NODELAY is on")
        #expect(debug == 0, "SO_DEBUG is off")
    }

    @Test("an error reply fails only its own command")
    func errorReply() async throws {
        let key = TestRedis.uniquePrefix("err") + ":k"
        try await RedisClient.withClient(configuration: TestRedis.configuration(), logger: logger) { client in
            try await client.send("SET", RedisArgument(key), "v")
            async let bad = outcome { try await client.send("LPUSH", RedisArgument(key), "x") }
            async let good = client.send("GET", RedisArgument(key))
            let (badResult, goodResult) = try await (bad, good)
            guard case .failure(let error) = badResult else {
                Issue.record("LPUSH on a string should fail")
                return
            }
            #expect(error.code == .server)
            #expect(error.serverErrorPrefix == "WRONGTYPE")
            #expect(goodResult.string == "v")
            try await client.send("DEL", RedisArgument(key))
        }
    }

    @Test("a pipeline returns each command's own outcome")
    func pipeline() async throws {
        let key = TestRedis.uniquePrefix("pl") + ":k"
        try await RedisClient.withClient(configuration: TestRedis.configuration(), logger: logger) { client in
            let results = try await client.pipeline([["SET", RedisArgument(key), "1"], ["NOPE"], ["INCR", RedisArgument(key)], ["DEL", RedisArgument(key)]])
            #expect(try results[0].get() == .simpleString("OK"))
            #expect((try? results[1].get()) == nil)
            #expect(try results[2].get() == .integer(2))
            #expect(try results[3].get() == .integer(1))
        }
    }

    /// Fails before the fix (several flushes, as many as the loop, woken by the first command,
    /// found the outbox with commands in it while the task still queued the rest).
    @Test("a pipeline is written in one flush, however many commands it holds")
    func pipelineOneFlush() async throws {
        let key = TestRedis.uniquePrefix("flush") + ":n"
        let connection = try await RedisConnection.connect(configuration: TestRedis.configuration(), eventLoopGroup: MultiThreadedEventLoopGroup.singleton, logger: logger)
        let flushes = FlushCounter()
        try await connection.channel.pipeline.addHandler(flushes, position: .first).get()
        for round in 0..<5 {
            let before = flushes.count
            let results = try await connection.pipeline(Array(repeating: ["INCR", RedisArgument(key)], count: 300))
            #expect(results.compactMap { try? $0.get().int } == Array((round * 300 + 1)...(round * 300 + 300)), "every reply to its own command, in order")
            #expect(flushes.count - before == 1, "one flush for 300 commands (round \(round))")
        }
        _ = try await connection.send(["DEL", RedisArgument(key)])
        await connection.close()
    }

    @Test("CLIENT KILL mid-pipeline fails the pending commands and the client reconnects")
    func clientKill() async throws {
        var configuration = TestRedis.configuration()
        configuration.clientName = TestRedis.uniquePrefix("victim")
        let name = configuration.clientName!
        try await RedisClient.withClient(configuration: configuration, logger: logger) { client in
            try await RedisClient.withClient(configuration: TestRedis.configuration(), logger: logger) { admin in
                // A blocking pop keeps a command pending on the victim's connection while it dies.
                async let blocked = outcome { try await client.send("BLPOP", RedisArgument(name + ":never"), "3") }
                try await Task.sleep(for: .milliseconds(200))
                let killed = try await admin.send("CLIENT", "KILL", "SKIPME", "yes", "TYPE", "normal", "ID", RedisArgument(TestRedis.clientID(admin, name: name)))
                #expect(killed == .integer(1))
                guard case .failure(let error) = await blocked else {
                    Issue.record("the pending command should fail when its connection is killed")
                    return
                }
                #expect(error.code == .connectionClosed)
                let back = await eventually { (try? await client.send("PING")) == .simpleString("PONG") }
                #expect(back)
            }
        }
    }

    @Test("a redis-server restart is survived; commands meanwhile fail fast")
    func serverRestart() async throws {
        let server = try RedisServerProcess()
        var configuration = try RedisConfiguration(url: server.url())
        configuration.maximumBackoff = .milliseconds(200)
        try await RedisClient.withClient(configuration: configuration, logger: logger) { client in
            try await client.send("SET", "k", "before")
            server.stop()
            let started = ContinuousClock.now
            await #expect(throws: RedisError.self) { try await client.send("GET", "k") }
            #expect(ContinuousClock.now - started < .seconds(2), "a command on a dead Redis must fail fast")
            #expect(!client.isConnected)
            try server.start()
            let back = await eventually { (try? await client.send("SET", "k", "after")) == .simpleString("OK") }
            #expect(back)
            #expect(try await client.send("GET", "k").string == "after")
        }
    }

    @Test("pipelines of a script while another client keeps flushing the script cache: every call runs exactly once")
    func scriptsUnderFlush() async throws {
        let server = try RedisServerProcess()
        let script = RedisScript("return redis.call('INCR', KEYS[1])")
        let configuration = try RedisConfiguration(url: server.url())
        try await RedisClient.withClient(configuration: configuration, logger: logger) { flusher in
            try await RedisClient.withClient(configuration: configuration, logger: logger) { client in
                let flushing = Task {
                    var flushes = 0
                    while !Task.isCancelled, (try? await flusher.send("SCRIPT", "FLUSH")) != nil { flushes += 1 }
                    return flushes
                }
                let calls = Array(repeating: (keys: ["n"], arguments: [RedisArgument]()), count: 500)
                var failures = 0
                for _ in 0..<20 {
                    failures += try await client.evaluate(script, calls: calls).filter { if case .failure = $0 { true } else { false } }.count
                }
                flushing.cancel()
                let flushes = await flushing.value
                // A flush landing inside a pipeline refuses its later calls only: those, and
                // only those, run again (a whole pipeline sent again would count some twice).
                #expect(failures == 0)
                #expect(try await client.send("GET", "n").int == 20 * 500, "every call ran once, with \(flushes) flushes meanwhile")
            }
        }
    }

    @Test("scripts run by SHA and still run after SCRIPT FLUSH")
    func scripts() async throws {
        let server = try RedisServerProcess()
        let script = RedisScript("return redis.call('INCRBY', KEYS[1], ARGV[1])")
        #expect(script.sha1.count == 40)
        try await RedisClient.withClient(configuration: RedisConfiguration(url: server.url()), logger: logger) { client in
            #expect(try await client.evaluate(script, keys: ["n"], arguments: ["5"]) == .integer(5))
            let exists = try await client.send("SCRIPT", "EXISTS", RedisArgument(script.sha1))
            #expect(exists == .array([.integer(1)]))
            try await client.send("SCRIPT", "FLUSH")
            #expect(try await client.evaluate(script, keys: ["n"], arguments: ["2"]) == .integer(7))
            try await client.send("SCRIPT", "FLUSH")
            let many = try await client.evaluate(script, calls: [(keys: ["a"], arguments: ["1"]), (keys: ["b"], arguments: ["2"]), (keys: ["a"], arguments: ["3"])])
            #expect(try many.map { try $0.get() } == [.integer(1), .integer(2), .integer(4)], "a pipeline of scripts survives SCRIPT FLUSH too")
            let failing = RedisScript("return redis.error_reply('CUSTOM nope')")
            await #expect(throws: RedisError.self) { try await client.evaluate(failing, keys: []) }
        }
    }

    @Test("AUTH with requirepass, with an ACL user, and a clear error for a wrong password")
    func authentication() async throws {
        let server = try RedisServerProcess(arguments: ["--requirepass", "right-password", "--user", "app", "on", ">app-secret", "~*", "&*", "+@all"])
        try await RedisClient.withClient(configuration: patient(server.url(credentials: ":right-password", database: 2)), logger: logger) { client in
            #expect(try await client.send("PING") == .simpleString("PONG"))
            try await client.send("SET", "in-db-2", "1")
        }
        try await RedisClient.withClient(configuration: patient(server.url(credentials: "app:app-secret", database: 2)), logger: logger) { client in
            let value = try await client.send("GET", "in-db-2")
            #expect(value.string == "1")
        }
        do {
            _ = try await RedisClient.withClient(configuration: patient(server.url(credentials: ":wrong")), logger: logger) { _ in }
            Issue.record("a wrong password must not connect")
        } catch let error as RedisError {
            #expect(error.code == .authentication)
            #expect(error.description.contains("refused"))
            #expect(!error.description.contains("wrong"), "the message must not echo the password")
        }
        do {
            _ = try await RedisClient.withClient(configuration: patient(server.url()), logger: logger) { client in
                try await client.send("PING")
            }
            Issue.record("no password must not be allowed to run commands")
        } catch let error as RedisError {
            #expect(error.serverErrorPrefix == "NOAUTH")
        }
    }

    @Test("a READONLY reply (the server was demoted to a replica) fails the command as unavailable and drops the connection, so the next one goes to wherever the primary is now")
    func demoted() async throws {
        let server = try RedisServerProcess()
        let other = try RedisServerProcess()
        try await RedisClient.withClient(configuration: patient(server.url()), logger: logger) { client in
            try await client.send("SET", "k", "1")
            let before = try await client.send("CLIENT", "ID").int
            #expect(try server.cli("REPLICAOF", "127.0.0.1", "\(other.port)").contains("OK"))
            do {
                try await client.send("SET", "k", "2")
                Issue.record("a write to a replica must fail")
            } catch let error as RedisError {
                #expect(error.code == .unavailable)
                #expect(error.message.contains("is a replica now"), "\(error.message)")
            }
            #expect(try server.cli("REPLICAOF", "NO", "ONE").contains("OK"))
            let after = try await client.send("CLIENT", "ID").int
            #expect(after != before, "a new connection (\(String(describing: before)) → \(String(describing: after)))")
            try await client.send("SET", "k", "3")
        }
    }

    @Test("connecting to a port where nothing listens fails with a clear error")
    func unreachable() async throws {
        let refusing = try RefusingPort()
        do {
            _ = try await RedisClient.withClient(configuration: RedisConfiguration(url: "redis://127.0.0.1:\(refusing.port)/0"), logger: logger) { _ in }
            Issue.record("connect must fail")
        } catch let error as RedisError {
            #expect(error.code == .unavailable)
            #expect(error.message.contains("127.0.0.1:\(refusing.port)"))
        }
    }
}

@Suite("rediss:// against redis-server --tls-port")
struct RedisTLSTests {
    let logger = TestRedis.logger()

    @Test("commands and pub/sub over TLS, with the CA and a client certificate, by IP and by host name")
    func tls() async throws {
        let certificates = try TestCertificates()
        let tlsPort = try RedisServerProcess.freePort()
        let server = try RedisServerProcess(arguments: certificates.redisArguments(tlsPort: tlsPort, clientCertificates: true))
        let files = "ca=\(certificates.caFile)&cert=\(certificates.clientCertificateFile)&key=\(certificates.clientKeyFile)"
        for host in ["127.0.0.1", "localhost"] {
            let configuration = try patient("rediss://\(host):\(tlsPort)/0?\(files)")
            try await RedisClient.withClient(configuration: configuration, logger: logger) { client in
                try await client.send("SET", "over-tls", RedisArgument(host))
                #expect(try await client.send("GET", "over-tls").string == host)
                // 200 commands in one burst: pipelining through the TLS handler keeps each reply with its caller.
                let replies = try await withThrowingTaskGroup(of: (Int, RESPValue).self) { group in
                    for index in 0..<200 { group.addTask { (index, try await client.send("ECHO", RedisArgument("\(index)"))) } }
                    return try await group.reduce(into: [:]) { $0[$1.0] = $1.1 }
                }
                #expect((0..<200).allSatisfy { replies[$0]?.string == "\($0)" })
            }
        }
        // The plain port holds what the TLS connections wrote: they reached this server.
        try await RedisClient.withClient(configuration: patient(server.url()), logger: logger) { client in
            let written = try await client.send("GET", "over-tls")
            #expect(written.string == "localhost")
        }

        let configuration = try patient("rediss://127.0.0.1:\(tlsPort)/0?\(files)")
        try await RedisSubscriber.withSubscriber(configuration: configuration, logger: logger) { subscriber in
            try await subscriber.subscribe(["tls-channel"])
            _ = try await RedisClient.withClient(configuration: configuration, logger: logger) { client in
                try await client.send("PUBLISH", "tls-channel", "hello")
            }
            var iterator = subscriber.events.makeAsyncIterator()
            var message: RedisSubscriberEvent?
            while let event = await iterator.next() {
                if case .message = event { message = event; break }
            }
            #expect(message == .message(channel: "tls-channel", payload: Array("hello".utf8)))
        }
    }

    @Test("a server certificate from another CA, a missing client certificate and a plain port are refused with the reason")
    func refusals() async throws {
        let certificates = try TestCertificates()
        let tlsPort = try RedisServerProcess.freePort()
        let server = try RedisServerProcess(arguments: certificates.redisArguments(tlsPort: tlsPort, clientCertificates: true))
        let client = "cert=\(certificates.clientCertificateFile)&key=\(certificates.clientKeyFile)"
        let cases = [
            ("another CA", "rediss://127.0.0.1:\(tlsPort)/0?ca=\(certificates.otherCAFile)&\(client)"),
            ("the system's roots", "rediss://127.0.0.1:\(tlsPort)/0?\(client)"),
            ("no client certificate", "rediss://127.0.0.1:\(tlsPort)/0?ca=\(certificates.caFile)"),
            ("TLS to the plain port", "rediss://127.0.0.1:\(server.port)/0?ca=\(certificates.caFile)&\(client)"),
        ]
        for (name, url) in cases {
            var configuration = try RedisConfiguration(url: url)
            configuration.connectTimeout = .seconds(2)
            configuration.commandTimeout = .seconds(2)
            do {
                try await RedisClient.withClient(configuration: configuration, logger: logger) { client in
                    _ = try await client.send("PING")
                }
                Issue.record("\(name): must not connect")
            } catch let error as RedisError {
                #expect(error.code == .unavailable, "\(name): \(error)")
                #expect(error.description.contains("TLS"), "\(name): \(error)")
                if name == "another CA" {
                    // The handshake's own reason, not only that the connection closed.
                    #expect(error.description.contains("CERTIFICATE_VERIFY_FAILED"), "\(name): \(error)")
                }
            }
        }
        let missing = try RedisConfiguration(url: "rediss://127.0.0.1:\(tlsPort)/0?ca=/nonexistent/ca.pem")
        do {
            try await RedisClient.withClient(configuration: missing, logger: logger) { _ in }
            Issue.record("a missing CA file must not connect")
        } catch let error as RedisError {
            #expect(error.code == .unavailable && error.description.contains("TLS"), "\(error)")
        }
    }
}

@Suite("rediss+sentinel:// against Sentinels and servers that speak TLS")
struct RedisSentinelTLSTests {
    let logger = TestRedis.logger()

    @Test("the Sentinels asked over TLS name the primary's TLS port; after SENTINEL FAILOVER writes reach the new primary, over TLS; no connection at a plain port")
    func sentinel() async throws {
        let certificates = try TestCertificates()
        let set = try await LocalSentinels(tls: certificates)
        var configuration = try patient(set.url())
        configuration.clientName = "tls-sentinel-test"
        /// This client's connections at TLS ports, and every connection at a plain one (of this
        /// client, or of the servers and Sentinels among themselves) but the test's redis-cli.
        func connections() throws -> (tls: Int, plain: Int) {
            (try set.clients(onTLSPort: true).count { $0.contains(" name=tls-sentinel-test ") }, try set.clients(onTLSPort: false).count)
        }
        let before = try #require(try set.primaryPort())
        try await RedisClient.withClient(configuration: configuration, logger: logger) { client in
            try await client.send("SET", "tls-sentinel", "before")
            #expect(try set.server(port: before)?.cli("GET", "tls-sentinel").trimmingCharacters(in: .whitespacesAndNewlines) == "before")
            let first = try connections()
            #expect(first.plain == 0 && first.tls >= 1, "this client at TLS ports only: \(first)")

            _ = try set.sentinelCLI(0, "SENTINEL", "FAILOVER", set.name)
            let moved = await eventually(timeout: .seconds(30), poll: .milliseconds(100)) { (try? set.primaryPort()).flatMap { $0 } != before }
            #expect(moved, "the Sentinels fail over")
            let after = try #require(try set.primaryPort())
            // Writes fail while the client drops the demoted primary and asks the Sentinels again.
            let written = await eventually(timeout: .seconds(30), poll: .milliseconds(100)) {
                (try? await client.send("SET", "tls-sentinel", "after")) != nil
                    && (try? set.server(port: after)?.cli("GET", "tls-sentinel").trimmingCharacters(in: .whitespacesAndNewlines)) == "after"
            }
            #expect(written, "a write after the failover reaches the new primary")
            // The write went over the client's connection to the new primary, at its TLS port.
            let atNewPrimary = try set.clients(onTLSPort: true, of: [#require(set.server(port: after))]).filter { $0.contains(" name=tls-sentinel-test ") }
            #expect(!atNewPrimary.isEmpty, "the client's connection to the new primary is at its TLS port")
            let counts = try connections()
            #expect(counts.plain == 0, "nothing at a plain port after the failover: \(counts)")
        }
    }
}

@Suite("rediss+cluster:// against a Redis Cluster that speaks TLS")
struct RedisClusterTLSTests {
    let logger = TestRedis.logger()

    @Test("from one seed over TLS: every primary reached at its TLS port (none at a plain one), redirections followed, a script run, sharded pub/sub heard from every shard")
    func cluster() async throws {
        let cluster = try await LocalTLSCluster(clientCertificates: true)
        var configuration = try patient(cluster.url())
        configuration.clientName = "tls-cluster-test"
        let channels = try await RedisClusterClient.withClient(seeds: [("127.0.0.1", cluster.tlsPorts[0])], configuration: configuration, logger: logger) { router in
            // One key per primary: most of them are not the seed's, so reaching them means
            // following the slot map (or a MOVED) to a TLS port.
            var keys: [String: String] = [:]
            var channels: [String: String] = [:]
            for index in 0..<10_000 where keys.count < 3 || channels.count < 3 {
                guard let node = router.primary(for: HashSlot(of: "k\(index)")) else { continue }
                if keys["\(node)"] == nil { keys["\(node)"] = "k\(index)" } else if channels["\(node)"] == nil { channels["\(node)"] = "k\(index)" }
            }
            #expect(Set(keys.keys) == Set(cluster.tlsPorts.map { "127.0.0.1:\($0)" }), "the slot map names the TLS ports: \(keys.keys.sorted())")
            for key in keys.values {
                try await router.send("SET", RedisArgument(key), "over TLS")
                #expect(try await router.send("GET", RedisArgument(key)).string == "over TLS")
                #expect(try await router.evaluate(RedisScript("return redis.call('STRLEN', KEYS[1])"), keys: [key]).int == 8)
            }
            // Each node holds the keys of its slots: every write reached the node that owns it.
            for server in cluster.servers { #expect(try server.cli("DBSIZE").trimmingCharacters(in: .whitespacesAndNewlines) == "1", "node \(server.port) holds its key") }
            return Array(channels.values)
        }
        #expect(channels.count == 3)
        let plain = try cluster.clients(onTLSPort: false)
        #expect(plain.isEmpty, "no client connection came in on a plain port: \(plain)")

        try await RedisClusterClient.withClient(seeds: [("127.0.0.1", cluster.tlsPorts[1])], configuration: configuration, logger: logger) { router in
            try await RedisClusterSubscriber.withSubscriber(router: router, logger: logger) { subscriber in
                try await subscriber.subscribe(channels)
                let listener = Task {
                    var heard: [String] = []
                    for await event in subscriber.events {
                        if case .message(let channel, let payload) = event, String(decoding: payload, as: UTF8.self) == "hello \(channel)" { heard.append(channel) }
                        if heard.count == channels.count { break }
                    }
                    return heard
                }
                for channel in channels { _ = try await router.send("SPUBLISH", RedisArgument(channel), RedisArgument("hello \(channel)")) }
                let timeout = Task {
                    try await Task.sleep(for: .seconds(10))
                    listener.cancel()
                }
                let heard = await listener.value
                timeout.cancel()
                #expect(Set(heard) == Set(channels), "a message on each shard's channel is heard: \(heard)")
                // A shard subscription on each primary, through its TLS port.
                let subscribed = try cluster.clients(onTLSPort: true).filter { line in
                    line.split(separator: " ").contains { $0.hasPrefix("ssub=") && $0 != "ssub=0" }
                }
                #expect(Set(subscribed.compactMap { $0.split(separator: " ").first { $0.hasPrefix("laddr=") } }).count == 3, "\(subscribed)")
            }
        }
        let plainAfter = try cluster.clients(onTLSPort: false)
        #expect(plainAfter.isEmpty, "no client connection came in on a plain port: \(plainAfter)")
    }

    @Test("another CA, or no client certificate where the cluster asks for one: refused with the reason, no slot map taken")
    func refusals() async throws {
        let cluster = try await LocalTLSCluster(clientCertificates: true)
        for (name, url) in [("another CA", cluster.url(ca: cluster.certificates.otherCAFile)), ("no client certificate", cluster.url(clientCertificate: false))] {
            var configuration = try RedisConfiguration(url: url)
            configuration.connectTimeout = .seconds(2)
            configuration.commandTimeout = .seconds(2)
            do {
                try await RedisClusterClient.withClient(seeds: [("127.0.0.1", cluster.tlsPorts[0])], configuration: configuration, logger: logger) { router in
                    _ = try await router.send("GET", "k")
                }
                Issue.record("\(name): must not connect")
            } catch let error as RedisError {
                #expect(error.description.contains("TLS"), "\(name): \(error)")
                if name == "another CA" {
                    #expect(error.description.contains("CERTIFICATE_VERIFY_FAILED"), "\(name): \(error)")
                }
            }
        }
    }
}

/// A configuration that waits 5 s for its connection rather than 500 ms: these tests check
/// authentication and TLS, not how fast a fresh redis-server answers beside the parallel suites
/// (in fresh-clone CI runs the 500 ms ran out there: "unreachable").
func patient(_ url: String) throws -> RedisConfiguration {
    var configuration = try RedisConfiguration(url: url)
    configuration.waitForConnection = .seconds(5)
    return configuration
}

/// Counts the flushes that reach the socket.
private final class FlushCounter: ChannelOutboundHandler, Sendable {
    typealias OutboundIn = ByteBuffer
    private let flushes = NIOLockedValueBox(0)
    var count: Int { flushes.withLockedValue { $0 } }

    func flush(context: ChannelHandlerContext) {
        flushes.withLockedValue { $0 += 1 }
        context.flush()
    }
}
