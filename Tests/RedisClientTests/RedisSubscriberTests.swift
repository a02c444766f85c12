import RedisClient
import RedisTestSupport
import Testing

@Suite("Pub/sub on a dedicated connection")
struct RedisSubscriberTests {
    let logger = TestRedis.logger()

    @Test("delivery, unsubscribe, counted retain and release, and re-subscribe after the server kills the connection; sharded pub/sub on one server as well as classic", arguments: RedisPubSub.allCases)
    func lifecycle(pubSub: RedisPubSub) async throws {
        let prefix = TestRedis.uniquePrefix("ps")
        var configuration = TestRedis.configuration()
        configuration.pubSub = pubSub
        let publishing = configuration
        configuration.clientName = prefix
        configuration.maximumBackoff = .milliseconds(200)
        let other: RedisPubSub = pubSub == .classic ? .sharded : .classic
        try await RedisClient.withClient(configuration: publishing, logger: logger) { publisher in
            try await RedisSubscriber.withSubscriber(configuration: configuration, logger: logger) { subscriber in
                var events = subscriber.events.makeAsyncIterator()
                #expect(await events.next() == .subscribed(reconnect: false))

                try await subscriber.subscribe(["\(prefix):a", "\(prefix):b"])
                #expect(try await publisher.publish(Array("one".utf8), on: "\(prefix):a") == 1)
                #expect(await events.next() == .message(channel: "\(prefix):a", payload: Array("one".utf8)))
                // The other kind of channel of the same name is another channel.
                #expect(try await publisher.send(other.publishCommand, RedisArgument("\(prefix):a"), "unheard") == .integer(0))

                try await subscriber.unsubscribe(["\(prefix):a"])
                #expect(try await publisher.publish(Array("lost".utf8), on: "\(prefix):a") == 0)
                try await publisher.publish(Array("two".utf8), on: "\(prefix):b")
                #expect(await events.next() == .message(channel: "\(prefix):b", payload: Array("two".utf8)))

                // Two users of one channel: it stays subscribed until the second release.
                try await subscriber.retain(["\(prefix):c"])
                try await subscriber.retain(["\(prefix):c"])
                try await subscriber.release(["\(prefix):c"])
                #expect(try await publisher.publish(Array("kept".utf8), on: "\(prefix):c") == 1)
                #expect(await events.next() == .message(channel: "\(prefix):c", payload: Array("kept".utf8)))
                try await subscriber.release(["\(prefix):c"])
                #expect(try await publisher.publish(Array("gone".utf8), on: "\(prefix):c") == 0)

                if pubSub == .sharded {
                    await #expect(throws: RedisError.self) { try await subscriber.subscribe(pattern: "\(prefix):*") }
                }

                let killed = try await publisher.send("CLIENT", "KILL", "ID", RedisArgument(TestRedis.clientID(publisher, name: prefix)))
                #expect(killed == .integer(1))
                #expect(await events.next() == .disconnected)
                #expect(await events.next() == .subscribed(reconnect: true))
                #expect(subscriber.channels == ["\(prefix):b"])
                try await publisher.publish(Array("three".utf8), on: "\(prefix):b")
                #expect(await events.next() == .message(channel: "\(prefix):b", payload: Array("three".utf8)))
            }
        }
    }

    @Test("a server that stops answering is found out by PING: the connection is dropped, not ready, and made again once it answers")
    func deafConnection() async throws {
        let server = try RedisServerProcess()
        defer { server.thaw() }
        var configuration = try RedisConfiguration(url: server.url())
        configuration.subscriberPingInterval = .milliseconds(500)
        configuration.commandTimeout = .milliseconds(500)
        configuration.maximumBackoff = .milliseconds(200)
        try await RedisSubscriber.withSubscriber(configuration: configuration, logger: logger) { subscriber in
            let events = subscriber.events
            /// The next event, or nil when none comes within `timeout`.
            func next(within timeout: Duration) async -> RedisSubscriberEvent? {
                await withTaskGroup(of: RedisSubscriberEvent?.self) { group in
                    group.addTask { var iterator = events.makeAsyncIterator(); return await iterator.next() }
                    group.addTask { try? await Task.sleep(for: timeout); return nil }
                    let first = await group.next() ?? nil
                    group.cancelAll()
                    return first
                }
            }
            #expect(await next(within: .seconds(5)) == .subscribed(reconnect: false))
            try await subscriber.subscribe(["deaf:a"])
            server.freeze()
            let frozen = ContinuousClock.now
            #expect(await next(within: .seconds(5)) == .disconnected, "the dead connection is dropped")
            print("frozen server: the subscriber dropped its connection after \(ContinuousClock.now - frozen)")
            #expect(!subscriber.isConnected)
            server.thaw()
            #expect(await next(within: .seconds(10)) == .subscribed(reconnect: true))
            #expect(subscriber.isConnected && subscriber.channels == ["deaf:a"])
        }
    }

    @Test("the event stream ends cleanly when the subscriber stops")
    func endsCleanly() async throws {
        let subscriber = RedisSubscriber(configuration: TestRedis.configuration(), logger: logger)
        let runner = Task { try await subscriber.run() }
        try await subscriber.waitUntilConnected()
        subscriber.shutdown()
        var count = 0
        for await _ in subscriber.events { count += 1 }
        #expect(count == 1, "only the first subscribed event, then the end")
        try await runner.value
    }
}
