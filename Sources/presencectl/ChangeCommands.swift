import ArgumentParser
import CommandLineOutput
import Foundation
import Logging
import PresenceEngine
import RedisClient

struct SetMembersCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "set-members",
        abstract: "Create a conversation or replace its members; live sessions see the change within seconds.",
        discussion: "Example: presencectl set-members team alice bob carol"
    )
    @OptionGroup var options: GlobalOptions
    @Argument(help: "The conversation id.") var conversationID: String
    @Argument(help: "The member user ids.") var members: [String] = []

    func run() async throws {
        let conversation = try validID(conversationID, "conversation id")
        let users = try members.map { try validID($0, "user id") }
        try await options.withEngine { engine in
            let change = try await engine.setMembers(of: conversation, to: users)
            options.output(json: ["conversation_id": conversation, "added": change.added, "removed": change.removed]) {
                "\(conversation): \(change.added.count) added, \(change.removed.count) removed, \(Set(users).count) member(s)"
            }
        }
    }
}

struct AddMembersCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "add-members",
        abstract: "Add members to a conversation (created if needed).",
        discussion: "Example: presencectl add-members team dave"
    )
    @OptionGroup var options: GlobalOptions
    @Argument(help: "The conversation id.") var conversationID: String
    @Argument(help: "The user ids to add.") var users: [String]

    func run() async throws {
        let conversation = try validID(conversationID, "conversation id")
        let added = try users.map { try validID($0, "user id") }
        try await options.withEngine { engine in
            let change = try await engine.addMembers(to: conversation, added)
            options.output(json: ["conversation_id": conversation, "added": change.added]) { "\(conversation): \(change.added.count) added" }
        }
    }
}

struct RemoveMemberCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "remove-member",
        abstract: "Remove one member from a conversation.",
        discussion: "Example: presencectl remove-member team dave"
    )
    @OptionGroup var options: GlobalOptions
    @Argument(help: "The conversation id.") var conversationID: String
    @Argument(help: "The user id to remove.") var userID: String

    func run() async throws {
        let conversation = try validID(conversationID, "conversation id")
        let user = try validID(userID, "user id")
        try await options.withEngine { engine in
            guard try await engine.members(of: conversation) != nil else { throw CLIError("no such conversation: \(conversation)") }
            guard try await engine.removeMember(from: conversation, user) else { throw CLIError("\(user) is not a member of \(conversation)") }
            options.output(json: ["conversation_id": conversation, "removed": user]) { "\(conversation): removed \(user)" }
        }
    }
}

struct DeleteConversationCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "delete-conversation",
        abstract: "Delete a conversation.",
        discussion: "Example: presencectl delete-conversation team"
    )
    @OptionGroup var options: GlobalOptions
    @Argument(help: "The conversation id.") var conversationID: String

    func run() async throws {
        let conversation = try validID(conversationID, "conversation id")
        try await options.withEngine { engine in
            guard try await engine.deleteConversation(conversation) else { throw CLIError("no such conversation: \(conversation)") }
            options.output(json: ["conversation_id": conversation, "deleted": true]) { "deleted \(conversation)" }
        }
    }
}

struct DisconnectCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "disconnect",
        abstract: "Close every session of a user on every node (close code 4003).",
        discussion: "Example: presencectl disconnect mallory"
    )
    @OptionGroup var options: GlobalOptions
    @Argument(help: "The user id.") var userID: String

    func run() async throws {
        let user = try validID(userID, "user id")
        try await options.withEngine { engine in
            let nodes = try await engine.requestDisconnect(user: user)
            options.output(json: ["user_id": user, "nodes_notified": nodes]) { "asked \(nodes) node(s) to close the sessions of \(user)" }
        }
    }
}

struct WatchCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "watch",
        abstract: "A live tail of presence and membership events, until Ctrl-C.",
        discussion: "Without --user or --conversation, every user's events (not with sharded pub/sub, a Redis Cluster's: sharded channels cannot be watched by pattern). Example: presencectl watch --user alice --user bob"
    )
    @OptionGroup var options: GlobalOptions
    @Option(help: "Only this user's events (repeatable).") var user: [String] = []
    @Option(help: "Only the events of this conversation's members.") var conversation: String?

    func validate() throws {
        for id in user { _ = try validID(id, "user id") }
        if let conversation { _ = try validID(conversation, "conversation id") }
    }

    func run() async throws {
        var users = user
        try await options.withEngine { engine in
            if let conversation {
                guard let members = try await engine.members(of: conversation) else {
                    throw CLIError("no such conversation: \(conversation)")
                }
                users += members
            }
            let subscriber = try await options.subscriber(engine, clientName: "presencectl-watch", command: "watch", needsPattern: users.isEmpty)
            StandardOutput.exitWhenReaderCloses()
            try await subscriber.whileRunning {
                if users.isEmpty, let classic = subscriber as? RedisSubscriber {
                    try await classic.subscribe(pattern: engine.keys.allUserChannelsPattern)
                } else {
                    try await subscriber.subscribe(users.map { engine.keys.userChannel($0) })
                }
                // Once subscribed, on standard error even with --json: a script knows from this
                // line that no event from now on is missed.
                FileHandle.standardError.write(Data("watching \(users.isEmpty ? "every user" : users.joined(separator: ", ")); Ctrl-C to stop\n".utf8))
                var memberships = MembershipLines()
                for await event in subscriber.events {
                    guard case .message(let channel, let payload) = event else {
                        if case .disconnected = event { FileHandle.standardError.write(Data("(lost Redis; reconnecting)\n".utf8)) }
                        continue
                    }
                    let subject = engine.keys.user(fromKey: channel, suffix: "events") ?? channel
                    if let presence = engine.decodeEvent(payload) {
                        let real = presence.views.real
                        options.output(json: ["type": "presence", "user_id": subject, "status": real.status.rawValue,
                                              "last_seen": Format.jsonTimestamp(real.lastSeen), "shown_to_others": presence.views.shown.status.rawValue,
                                              "at": Format.timestamp(presence.at)], line: true) {
                            "\(Format.timestamp(presence.at))  \(subject)  \(real.status.rawValue)" + (presence.views.hidden ? " (hidden: others see \(presence.views.shown.status.rawValue))" : "")
                        }
                    } else if let membership = engine.decodeMembership(payload), memberships.isNew(membership) {
                        options.output(json: ["type": "membership", "conversation_id": membership.conversationID,
                                              "added": membership.added, "removed": membership.removed], line: true) {
                            "\(Format.timestamp(SystemPresenceClock().nowMilliseconds()))  conversation \(membership.conversationID)  \(MembershipLines.describe(membership))"
                        }
                    }
                }
            }
        }
    }
}

/// A membership change is published on the channel of every member it concerns, one copy each,
/// one after another: a watch of several of them prints it once.
struct MembershipLines {
    private var last: (event: MembershipEvent, at: ContinuousClock.Instant)?

    /// Whether `event` is not a copy of the one just printed (the copies come within moments).
    mutating func isNew(_ event: MembershipEvent, now: ContinuousClock.Instant = .now) -> Bool {
        defer { last = (event, now) }
        guard let last else { return true }
        return last.event != event || now - last.at > .seconds(1)
    }

    /// "added dave; removed erin".
    static func describe(_ event: MembershipEvent) -> String {
        var parts: [String] = []
        if !event.added.isEmpty { parts.append("added " + event.added.joined(separator: ", ")) }
        if !event.removed.isEmpty { parts.append("removed " + event.removed.joined(separator: ", ")) }
        return parts.isEmpty ? "members unchanged" : parts.joined(separator: "; ")
    }
}
