import ArgumentParser
import Foundation
import Logging
import PresenceEngine
import PresenceProtocol
import RedisClient

extension GlobalOptions {
    /// A subscriber that hears what the gateway nodes publish: with their pub/sub (classic or
    /// sharded, as their node records say) unless `--redis-pubsub` gave one, which must match.
    func subscriber(_ engine: PresenceEngine, clientName: String, command: String, needsPattern: Bool = false) async throws -> any RedisChannelSubscriber {
        var redisConfiguration = engine.redis.configuration
        let nodes = Set(try await engine.otherNodesPubSub().values)
        if let given = redisPubSub {
            if let theirs = nodes.first(where: { $0.rawValue != given }) {
                throw CLIError("the gateway nodes use \(theirs.rawValue) pub/sub, not \(given): \(command) would hear nothing; leave out --redis-pubsub (PRESENCE_REDIS_PUBSUB) to use theirs")
            }
        } else if nodes.count == 1, let theirs = nodes.first {
            redisConfiguration.pubSub = theirs
        }
        if needsPattern, redisConfiguration.pubSub == .sharded {
            throw CLIError("with sharded pub/sub (a Redis Cluster, or PRESENCE_REDIS_PUBSUB=sharded), \(command) needs --user or --conversation: sharded channels cannot be subscribed by pattern")
        }
        redisConfiguration.clientName = clientName
        return redisConfiguration.pubSub == engine.redis.pubSub
            ? makeRedisSubscriber(for: engine.redis, clientName: clientName, logger: .init(label: "presencectl"))
            : RedisSubscriber(configuration: redisConfiguration, logger: .init(label: "presencectl"))
    }
}

struct MessagesCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "messages",
        abstract: "A conversation's kept messages, oldest first; with --follow, then each new one until Ctrl-C.",
        discussion: """
            Reads the history as an operator: no membership is needed. Without --after, the latest
            --limit messages. Example: presencectl messages team --after 120 --limit 50; presencectl messages team --follow
            """
    )
    @OptionGroup var options: GlobalOptions
    @Argument(help: "The conversation id.") var conversationID: String
    @Option(help: "Only messages after this seq.") var after: Int64?
    @Option(help: "Most messages to list (1-1000).") var limit = 20
    @Flag(help: "Then print each new message as it is stored, until Ctrl-C.") var follow = false

    func validate() throws {
        guard (1...PresenceEngine.maxHistoryPage).contains(limit) else { throw ValidationError("--limit must be 1 to \(PresenceEngine.maxHistoryPage)") }
        if let after, after < 0 { throw ValidationError("--after must be a whole number from 0") }
    }

    func run() async throws {
        let conversation = try validID(conversationID, "conversation id")
        try await options.withEngine { engine in
            guard try await engine.members(of: conversation) != nil else { throw CLIError("no such conversation: \(conversation)") }
            guard follow else {
                let page = try await engine.deliveryPage(of: conversation, after.map(HistoryRange.after) ?? .latest, limit: limit)
                printPage(page, conversation)
                return
            }
            let subscriber = try await options.subscriber(engine, clientName: "presencectl-messages", command: "messages --follow")
            try await subscriber.whileRunning {
                // Subscribed first: a message stored after the read below arrives as an event.
                try await subscriber.subscribe([engine.keys.messageChannel(conversation)])
                var tail = Tail(engine: engine, conversation: conversation, json: options.json)
                let page = try await engine.deliveryPage(of: conversation, after.map(HistoryRange.after) ?? .latest, limit: limit)
                if options.json {
                    // One object per line from the first: the page's messages, then each new one.
                    for message in page.messages { tail.emit(message) }
                } else {
                    printPage(page, conversation)
                }
                tail.position = (page.epoch, page.messages.last?.seq ?? page.lastSeq)
                FileHandle.standardError.write(Data("following \(conversation); Ctrl-C to stop\n".utf8))
                for await event in subscriber.events {
                    switch event {
                    case .message(_, let payload):
                        guard case .message(let message) = engine.decodeMessageEvent(payload) else { continue }
                        try await tail.take(message)
                    case .subscribed(reconnect: true), .resubscribed:
                        // What was published while away is in the history.
                        try await tail.catchUp()
                    case .disconnected:
                        FileHandle.standardError.write(Data("(lost Redis; reconnecting)\n".utf8))
                    case .subscribed(reconnect: false):
                        break
                    }
                }
            }
        }
    }

    private func printPage(_ page: HistoryPage, _ conversation: String) {
        if options.json {
            let messages = page.messages.map(Self.json)
            options.output(json: ["conversation_id": conversation, "epoch": page.epoch.isEmpty ? NSNull() : page.epoch as Any,
                                  "first_seq": page.firstSeq, "last_seq": page.lastSeq, "messages": messages]) { "" }
        } else {
            let head = page.epoch.isEmpty ? "no history yet" : "epoch \(page.epoch), seqs \(page.firstSeq)-\(page.lastSeq) kept (last \(page.lastSeq))"
            print(head)
            if !page.messages.isEmpty { print(Format.table(["SEQ", "STORED", "SENDER", "TEXT"], page.messages.map(Self.row))) }
        }
        fflush(nil)
    }

    static func row(_ message: StoredMessage) -> [String] {
        let text = message.type == .image ? "[image \(message.imageURL ?? "")] \(message.text)" : message.text
        let line = text.replacingOccurrences(of: "\n", with: " ")
        return ["\(message.seq)", Format.timestamp(message.createdAt), message.senderID, line.count > 72 ? String(line.prefix(71)) + "…" : line]
    }

    static func json(_ message: StoredMessage) -> [String: Any] {
        ["seq": message.seq, "id": message.id, "sender_id": message.senderID, "client_message_id": message.clientMessageID,
         "type": message.type.rawValue, "text": message.text, "image_url": message.imageURL ?? NSNull(),
         "created_at": Format.timestamp(message.createdAt), "client_created_at": Format.jsonTimestamp(message.clientCreatedAt),
         "epoch": message.epoch]
    }

    /// Prints new messages in seq order, reading any gap (a reconnect, a lost publish) from the
    /// history first; an epoch change (the history started again) is said, then followed.
    struct Tail {
        let engine: PresenceEngine
        let conversation: String
        let json: Bool
        var position: (epoch: String, seq: Int64) = ("", 0)

        mutating func take(_ message: StoredMessage) async throws {
            if message.epoch != position.epoch {
                FileHandle.standardError.write(Data("(the history started again: epoch \(message.epoch))\n".utf8))
                position = (message.epoch, 0)
            }
            if message.seq > position.seq + 1 { try await catchUp() }
            if message.seq == position.seq + 1 { emit(message) }
        }

        mutating func catchUp() async throws {
            while true {
                let page = try await engine.deliveryPage(of: conversation, .after(position.epoch.isEmpty ? 0 : position.seq))
                if page.epoch != position.epoch, !page.epoch.isEmpty {
                    if !position.epoch.isEmpty { FileHandle.standardError.write(Data("(the history started again: epoch \(page.epoch))\n".utf8)) }
                    position = (page.epoch, 0)
                    continue
                }
                if let first = page.messages.first, first.seq > position.seq + 1 {
                    FileHandle.standardError.write(Data("(seqs \(position.seq + 1)-\(first.seq - 1) were trimmed before they could be read)\n".utf8))
                }
                for message in page.messages where message.seq > position.seq { emit(message) }
                if page.messages.count < PresenceEngine.maxHistoryPage { return }
            }
        }

        mutating func emit(_ message: StoredMessage) {
            position = (message.epoch, message.seq)
            if json {
                if let data = try? JSONSerialization.data(withJSONObject: MessagesCommand.json(message), options: [.sortedKeys]) {
                    print(String(decoding: data, as: UTF8.self))
                }
            } else {
                print(MessagesCommand.row(message).joined(separator: "  "))
            }
            fflush(nil)
        }
    }
}
