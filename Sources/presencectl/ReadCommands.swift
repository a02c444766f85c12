import ArgumentParser
import Foundation
import PresenceEngine
import RedisClient

struct UserCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "user",
        abstract: "A user's aggregate status, last seen, privacy, and each device with its node, status and since when.",
        discussion: "Example: presencectl user alice"
    )
    @OptionGroup var options: GlobalOptions
    @Argument(help: "The user id.") var userID: String

    func run() async throws {
        let user = try validID(userID, "user id")
        try await options.withEngine { engine in
            guard try await engine.userExists(user) else { throw CLIError("no such user: \(user)") }
            let views = try await engine.views(of: user)
            let devices = try await engine.devices(of: user)
            options.output(json: [
                "user_id": user, "status": views.real.status.rawValue, "last_seen": Format.jsonTimestamp(views.real.lastSeen),
                "show_online_status": !views.hidden, "shown_to_others": Format.json(views.shown),
                "devices": devices.map { device in
                    ["device_id": device.deviceID, "status": device.status.rawValue, "node": device.node.isEmpty ? NSNull() : device.node,
                     "since": Format.timestamp(device.since), "deadline": Format.jsonTimestamp(device.deadline),
                     "last_alive": Format.timestamp(device.lastAlive)] as [String: Any]
                },
            ]) {
                var lines = [
                    "user         \(user)",
                    "status       \(views.real.status.rawValue)",
                    "last seen    \(Format.timestamp(views.real.lastSeen)) (\(Format.relative(views.real.lastSeen)))",
                    "privacy      \(views.hidden ? "hidden: others see \(views.shown.status.rawValue), last seen \(Format.timestamp(views.shown.lastSeen))" : "visible")",
                    "",
                ]
                if devices.isEmpty {
                    lines.append("no devices")
                } else {
                    lines.append(Format.table(["DEVICE", "STATUS", "NODE", "SINCE", "LIVE UNTIL"], devices.map { device in
                        [device.deviceID, device.status.rawValue, device.node.isEmpty ? (device.deadline == nil ? "-" : "(rest/lingering)") : device.node,
                         "\(Format.timestamp(device.since)) (\(Format.relative(device.since)))",
                         device.deadline.map { "\(Format.timestamp($0)) (\(Format.relative($0)))" } ?? "while its session lives"]
                    }))
                }
                return lines.joined(separator: "\n")
            }
        }
    }
}

struct OnlineCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "online",
        abstract: "Who is online or away now, with a count; paged for large numbers.",
        discussion: "Example: presencectl online --limit 100, then --cursor with the printed next cursor."
    )
    @OptionGroup var options: GlobalOptions
    @Option(help: "Most users to list.") var limit = 100
    @Option(help: "Continue from a previous page's cursor.") var cursor = "0"

    func run() async throws {
        guard limit > 0 else { throw ValidationError("--limit must be positive") }
        try await options.withEngine { engine in
            var present: [Presence] = []
            var next = cursor
            repeat {
                let page = try await engine.usersWithDevices(cursor: next, count: max(100, limit))
                next = page.cursor
                present += try await engine.views(of: page.users).map(\.real).filter { $0.status != .offline }
            } while next != "0" && present.count < limit
            present.sort { $0.userID < $1.userID }
            let online = present.count { $0.status == .online }
            options.output(json: ["count": present.count, "online": online, "away": present.count - online,
                                  "users": present.map { Format.json($0) }, "next_cursor": next == "0" ? NSNull() : next as Any]) {
                var text = Format.table(["USER", "STATUS", "LAST SEEN"], present.map { [$0.userID, $0.status.rawValue, Format.timestamp($0.lastSeen)] })
                text += "\n\n\(present.count) user(s) present: \(online) online, \(present.count - online) away"
                if next != "0" { text += "\nmore: presencectl online --cursor \(next)" }
                return text
            }
        }
    }
}

struct NodesCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "nodes",
        abstract: "Gateway nodes: live ones with sessions, pub/sub and lease expiry, and lapsed ones not reaped yet.",
        discussion: "Example: presencectl nodes"
    )
    @OptionGroup var options: GlobalOptions

    func run() async throws {
        try await options.withEngine { engine in
            let nodes = try await engine.nodes()
            options.output(json: nodes.map { node in
                ["node_id": node.nodeID, "sessions": node.sessions, "lease_expires_at": Format.timestamp(node.leaseExpiresAt),
                 "renewed_at": Format.jsonTimestamp(node.renewedAt), "state": node.lapsed ? "lapsed" : "live",
                 "pubsub": node.pubSub.map { $0.rawValue as Any } ?? NSNull()] as [String: Any]
            }) {
                Format.table(["NODE", "STATE", "SESSIONS", "PUB/SUB", "LEASE EXPIRES"], nodes.map { node in
                    [node.nodeID, node.lapsed ? "lapsed, not reaped yet" : "live", "\(node.sessions)", node.pubSub?.rawValue ?? "not recorded",
                     "\(Format.timestamp(node.leaseExpiresAt)) (\(Format.relative(node.leaseExpiresAt)))"]
                }) + "\n\n\(nodes.count { !$0.lapsed }) live node(s)"
            }
        }
    }
}

struct ConversationCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "conversation",
        abstract: "A conversation's members with their status, and the counts.",
        discussion: "Example: presencectl conversation team"
    )
    @OptionGroup var options: GlobalOptions
    @Argument(help: "The conversation id.") var conversationID: String

    func run() async throws {
        let conversation = try validID(conversationID, "conversation id")
        try await options.withEngine { engine in
            guard let members = try await engine.members(of: conversation) else { throw CLIError("no such conversation: \(conversation)") }
            let presences = try await engine.views(of: members).map(\.real)
            let online = presences.count { $0.status == .online }, away = presences.count { $0.status == .away }
            options.output(json: ["conversation_id": conversation, "total": presences.count, "online": online, "away": away,
                                  "members": presences.map(Format.json)]) {
                Format.table(["MEMBER", "STATUS", "LAST SEEN"], presences.map { [$0.userID, $0.status.rawValue, Format.timestamp($0.lastSeen)] })
                    + "\n\n\(online) of \(presences.count) online, \(away) away"
            }
        }
    }
}

struct StatsCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "stats",
        abstract: "Users online and away, devices, live nodes, keys and memory used under the prefix, and the messages kept.",
        discussion: "Walks every key under the prefix (SCAN): for operators, not for monitoring at a high rate.\nExample: presencectl stats --json"
    )
    @OptionGroup var options: GlobalOptions

    func run() async throws {
        try await options.withEngine { engine in
            let stats = try await engine.stats()
            options.output(json: ["users_online": stats.usersOnline, "users_away": stats.usersAway, "devices": stats.devices,
                                  "nodes": stats.nodes, "keys": stats.keys, "memory_bytes": stats.memoryBytes,
                                  "conversations_with_history": stats.histories, "messages_kept": stats.messagesKept,
                                  "history_memory_bytes": stats.historyBytes, "message_retry_records": stats.retryRecords]) {
                Format.table(["WHAT", "COUNT"], [
                    ["users online", "\(stats.usersOnline)"], ["users away", "\(stats.usersAway)"], ["devices", "\(stats.devices)"],
                    ["live nodes", "\(stats.nodes)"], ["keys", "\(stats.keys)"], ["memory", "\(stats.memoryBytes) bytes"],
                    ["conversations with history", "\(stats.histories)"], ["messages kept", "\(stats.messagesKept)"],
                    ["history memory", "\(stats.historyBytes) bytes"], ["message retry records", "\(stats.retryRecords)"],
                ])
            }
        }
    }
}
