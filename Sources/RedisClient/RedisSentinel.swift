import Logging
import NIOCore

/// Finding the primary a set of Sentinels names, and noticing at once when they name another.
///
/// A client of a `redis+sentinel://` URL asks for the primary at every connect, confirms it with
/// `ROLE` (a Sentinel's answer can lag a failover), and while connected listens on a Sentinel for
/// `+switch-master`. When the primary changes it drops its connection rather than keep writing to
/// a demoted primary, which goes on taking writes for seconds after a failover before it turns
/// read-only (11 s in one measurement), and which are lost.
enum RedisSentinel {
    /// A connection to what `configuration` names: the server of a standalone URL, or the primary
    /// the Sentinels name right now.
    static func connect(
        configuration: RedisConfiguration,
        eventLoopGroup: any EventLoopGroup,
        logger: Logger,
        onPush: (@Sendable (RedisPush) -> Void)? = nil
    ) async throws(RedisError) -> RedisConnection {
        switch configuration.topology {
        case .standalone:
            return try await RedisConnection.connect(configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger, onPush: onPush)
        case .sentinel(let sentinels, let name):
            var reasons: [String] = []
            for sentinel in sentinels {
                let named: RedisConfiguration.Address
                do {
                    guard let address = try await primary(named: name, asking: sentinel, configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger) else {
                        reasons.append("\(sentinel) knows no primary named '\(name)'")
                        continue
                    }
                    named = address
                } catch {
                    reasons.append("\(sentinel): \(error.message)")
                    continue
                }
                let connection: RedisConnection
                do {
                    connection = try await RedisConnection.connect(configuration: configuration.standalone(at: named), eventLoopGroup: eventLoopGroup, logger: logger, onPush: onPush)
                } catch where error.code == .authentication {
                    throw error
                } catch {
                    reasons.append("primary \(named) (named by \(sentinel)): \(error.message)")
                    continue
                }
                let role: String?
                do {
                    role = try await connection.send(["ROLE"]).array?.first?.string
                } catch where error.code == .server {
                    // An ACL user without ROLE: the Sentinel's word has to do.
                    role = "master"
                } catch {
                    role = nil
                }
                guard role == "master" else {
                    await connection.close()
                    reasons.append("\(named), named by \(sentinel), is not a primary (role \(role ?? "unknown"); a failover is under way)")
                    continue
                }
                return connection
            }
            throw RedisError(.unavailable, "no Sentinel named a reachable primary '\(name)': \(reasons.joined(separator: "; "))")
        case .cluster:
            throw RedisError(.invalidURL, "a redis+cluster:// or rediss+cluster:// URL is for RedisClusterClient and RedisClusterSubscriber; this client reaches one server (redis://, rediss://) or a Sentinel-named primary (redis+sentinel://, rediss+sentinel://)")
        }
    }

    /// Waits until `connection` closes; under Sentinel, closes it as soon as the Sentinels name
    /// another primary than the one it reached.
    static func hold(_ connection: RedisConnection, configuration: RedisConfiguration, eventLoopGroup: any EventLoopGroup, logger: Logger) async {
        guard case .sentinel = configuration.topology else {
            await connection.closed()
            return
        }
        let reached = RedisConfiguration.Address(host: connection.configuration.host, port: connection.configuration.port)
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await connection.closed() }
            group.addTask {
                guard await waitForSwitch(from: reached, configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger) else { return }
                logger.warning("the Sentinels name a new primary; dropping the connection to the old one", metadata: ["redis.primary": "\(reached)"])
                await connection.close()
            }
            await group.next()
            group.cancelAll()
        }
    }

    /// Returns true once the Sentinels name a primary other than `current`; false when cancelled.
    ///
    /// Listens for `+switch-master` on one Sentinel at a time, moving to the next when it fails
    /// or stops answering PING; after subscribing it asks that Sentinel for the primary, so a
    /// switch announced while no Sentinel was listened to is not missed.
    static func waitForSwitch(from current: RedisConfiguration.Address, configuration: RedisConfiguration, eventLoopGroup: any EventLoopGroup, logger: Logger) async -> Bool {
        guard case .sentinel(let sentinels, let name) = configuration.topology else { return false }
        let backoff = Backoff(minimum: configuration.minimumBackoff, maximum: configuration.maximumBackoff)
        var attempt = 0
        var index = 0
        while !Task.isCancelled {
            let sentinel = sentinels[index % sentinels.count]
            index += 1
            let (announcements, continuation) = AsyncStream.makeStream(of: String.self)
            do {
                let connection = try await RedisConnection.connect(
                    configuration: sentinelConfiguration(configuration, at: sentinel),
                    eventLoopGroup: eventLoopGroup,
                    logger: logger,
                    onPush: { push in continuation.yield(String(decoding: push.payload, as: UTF8.self)) }
                )
                let named: RedisConfiguration.Address?
                do {
                    _ = try await connection.sendRaw(["SUBSCRIBE", "+switch-master"], expectedReplies: 1)
                    named = try await primary(named: name, asking: sentinel, configuration: configuration, eventLoopGroup: eventLoopGroup, logger: logger)
                } catch {
                    await connection.close()
                    throw error
                }
                if let named, named != current {
                    await connection.close()
                    return true
                }
                attempt = 0
                let switched = await withTaskGroup(of: Bool?.self) { group in
                    group.addTask {
                        for await text in announcements {
                            // "<name> <old ip> <old port> <new ip> <new port>"
                            let words = text.split(separator: " ")
                            guard words.count == 5, words[0] == name, let port = Int(words[4]) else { continue }
                            if RedisConfiguration.Address(host: String(words[3]), port: port) != current { return true }
                        }
                        return nil
                    }
                    group.addTask {
                        // A Sentinel that stops answering fails the PING within the command
                        // timeout, which closes the connection and ends this loop.
                        while connection.isActive {
                            guard (try? await Task.sleep(for: configuration.subscriberPingInterval)) != nil else { break }
                            _ = try? await connection.sendRaw(["PING"], expectedReplies: 1)
                        }
                        return nil
                    }
                    group.addTask {
                        await connection.closed()
                        return nil
                    }
                    // The first to end decides: an announcement, a lost Sentinel, or cancellation.
                    let outcome = await group.next() ?? nil
                    group.cancelAll()
                    continuation.finish()
                    await connection.close()
                    return outcome
                }
                if switched == true { return true }
                if Task.isCancelled { return false }
                logger.warning("lost the connection to Sentinel \(sentinel); listening on the next one")
            } catch {
                continuation.finish()
                logger.log(level: attempt == 0 ? .warning : .debug, "cannot listen to Sentinel \(sentinel)", metadata: ["error": "\(error)"])
            }
            // After a whole round of Sentinels failed, wait before the next round.
            if index % sentinels.count == 0 {
                guard (try? await Task.sleep(for: backoff.delay(attempt: attempt))) != nil else { return false }
                attempt += 1
            }
        }
        return false
    }

    /// The primary `sentinel` names for `name`, or nil when it knows none by that name.
    private static func primary(
        named name: String,
        asking sentinel: RedisConfiguration.Address,
        configuration: RedisConfiguration,
        eventLoopGroup: any EventLoopGroup,
        logger: Logger
    ) async throws(RedisError) -> RedisConfiguration.Address? {
        let connection = try await RedisConnection.connect(configuration: sentinelConfiguration(configuration, at: sentinel), eventLoopGroup: eventLoopGroup, logger: logger)
        let reply: RESPValue
        do {
            reply = try await connection.send(["SENTINEL", "GET-MASTER-ADDR-BY-NAME", RedisArgument(name)])
        } catch {
            await connection.close()
            throw error
        }
        await connection.close()
        guard let parts = reply.array?.compactMap(\.string), parts.count == 2, let port = Int(parts[1]) else { return nil }
        return RedisConfiguration.Address(host: parts[0], port: port)
    }

    /// How a Sentinel is reached: the URL's timeouts, client name and TLS settings, without the
    /// primary's credentials and database.
    private static func sentinelConfiguration(_ configuration: RedisConfiguration, at sentinel: RedisConfiguration.Address) -> RedisConfiguration {
        var sentinelConfiguration = configuration.standalone(at: sentinel)
        sentinelConfiguration.username = nil
        sentinelConfiguration.password = nil
        sentinelConfiguration.database = 0
        return sentinelConfiguration
    }
}
