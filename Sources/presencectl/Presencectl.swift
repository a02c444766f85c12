import ArgumentParser
import CommandLineOutput
import Foundation
import Logging
import PresenceEngine
import RedisClient

/// `presencectl`: reads and changes presence in Redis directly, through the engine's own code.
@main
struct Presencectl: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "presencectl",
        abstract: "Inspect and administer presence data in Redis.",
        discussion: """
        Every command takes --redis-url, --redis-pubsub, --key-prefix and --json (also from
        PRESENCE_REDIS_URL, PRESENCE_REDIS_PUBSUB and PRESENCE_KEY_PREFIX). Tables for people by default, JSON for scripts with --json.

        Examples:
          presencectl user alice
          presencectl online --limit 50
          presencectl conversation team --json
          presencectl set-members team alice bob carol
          presencectl watch --user alice --user bob
        """,
        subcommands: [
            UserCommand.self, OnlineCommand.self, NodesCommand.self, ConversationCommand.self, WatchCommand.self,
            StatsCommand.self, SetMembersCommand.self, AddMembersCommand.self, RemoveMemberCommand.self,
            DeleteConversationCommand.self, DisconnectCommand.self, MessagesCommand.self,
        ]
    )
}

/// Options every command takes.
struct GlobalOptions: ParsableArguments {
    @Option(help: "The presence store, redis://[user:password@]host:port/db [PRESENCE_REDIS_URL].")
    var redisURL = ProcessInfo.processInfo.environment["PRESENCE_REDIS_URL"] ?? "redis://127.0.0.1:6379/0"

    @Option(name: .customLong("redis-pubsub"), help: "The gateway nodes' pub/sub, classic or sharded (a Redis Cluster: sharded only) [PRESENCE_REDIS_PUBSUB].")
    var redisPubSubOption: String?

    /// `--redis-pubsub`, else `PRESENCE_REDIS_PUBSUB`.
    var redisPubSub: String? { redisPubSubOption ?? ProcessInfo.processInfo.environment["PRESENCE_REDIS_PUBSUB"] }

    @Option(help: "Prefix of every key and channel [PRESENCE_KEY_PREFIX].")
    var keyPrefix = ProcessInfo.processInfo.environment["PRESENCE_KEY_PREFIX"] ?? "presence"

    @Flag(help: "Print JSON instead of a table (a live tail: one object per line).")
    var json = false

    /// Bad settings are bad arguments (exit status 64), found before any connection is tried.
    func validate() throws {
        let configuration: RedisConfiguration
        do {
            configuration = try RedisConfiguration(url: redisURL)
        } catch {
            throw ValidationError("--redis-url (PRESENCE_REDIS_URL): \(error.message)")
        }
        if let redisPubSub {
            do {
                _ = try RedisPubSub(setting: redisPubSub, topology: configuration.topology)
            } catch {
                throw ValidationError("--redis-pubsub (PRESENCE_REDIS_PUBSUB): \(error.message)")
            }
        }
        guard !keyPrefix.isEmpty else { throw ValidationError("--key-prefix (PRESENCE_KEY_PREFIX) must not be empty") }
    }

    /// Runs `body` with an engine connected to Redis; any failure becomes one line on stderr and
    /// exit status 1.
    func withEngine(_ body: (PresenceEngine) async throws -> Void) async throws {
        var logger = Logger(label: "presencectl")
        logger.logLevel = .critical
        do {
            var configuration = try RedisConfiguration(url: redisURL)
            if let redisPubSub { configuration.pubSub = try RedisPubSub(setting: redisPubSub, topology: configuration.topology) }
            configuration.clientName = "presencectl"
            configuration.connectTimeout = .seconds(3)
            try await withRedisCommands(configuration: configuration, logger: logger) { redis in
                let engine = PresenceEngine(redis: redis, configuration: PresenceConfiguration(keyPrefix: keyPrefix, nodeID: "presencectl"), logger: logger)
                try await body(engine)
            }
        } catch let error as RedisError {
            let cause = "\(error.underlying.map { "\($0)" } ?? error.message)".contains("refused") ? "connection refused" : error.message
            fail(error.code == .unavailable ? "cannot reach Redis at \(redactedURL): \(cause)" : error.message)
        } catch let error as PresenceError {
            fail(error.code == .unavailable ? "cannot reach Redis at \(redactedURL)" : error.message)
        } catch let error as CLIError {
            fail(error.message)
        }
    }

    private var redactedURL: String {
        (try? RedisConfiguration(url: redisURL).redactedURL) ?? redisURL
    }

    private func fail(_ message: String) -> Never {
        FileHandle.standardError.write(Data("presencectl: \(message)\n".utf8))
        Foundation.exit(1)
    }

    /// Prints `value` as JSON, or `table` for people. A `line` of a live tail is one JSON
    /// object per line (what `jq` and scripts read), an answer is indented.
    func output(json value: Any, line: Bool = false, table: () -> String) {
        if json {
            let options: JSONSerialization.WritingOptions = line ? [.sortedKeys, .withoutEscapingSlashes] : [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
            let data = (try? JSONSerialization.data(withJSONObject: value, options: options)) ?? Data()
            StandardOutput.say(String(decoding: data, as: UTF8.self))
        } else {
            StandardOutput.say(table())
        }
    }
}

/// A failure to report as one line.
struct CLIError: Error {
    let message: String
    init(_ message: String) { self.message = message }
}

/// Checks an id argument the way docs/API.md defines ids.
func validID(_ id: String, _ what: String) throws -> String {
    guard PresenceID.isValid(id) else { throw ValidationError("\(what) '\(id)' is not an id: 1-128 characters of A-Z a-z 0-9 . _ : @ -") }
    return id
}
