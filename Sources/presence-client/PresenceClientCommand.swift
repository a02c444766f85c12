import ArgumentParser
import CommandLineOutput
import Foundation
import Logging
import PresenceClient

/// A terminal client on the SDK: connects as one user, prints what it hears, and takes commands.
@main
struct PresenceClientCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "presence-client",
        abstract: "Connect to a presence gateway as a user and watch presence live.",
        discussion: """
        Type commands on standard input: online, away, offline, watch USER..., unwatch USER...,
        join CONVERSATION, leave CONVERSATION, type CONVERSATION, send CONVERSATION,
        read CONVERSATION, list, background, foreground, help, quit. End of input signs out
        cleanly.

        With --chat CONVERSATION, each line typed is a message to that conversation, and
        messages print with their status as it changes (sending, sent, delivered, read,
        failed); what it prints counts as read (the others see it read). Commands then start
        with a slash: /offline (the app's offline switch: the session closes, messages wait in
        the outbox), /online, /retry ID, /read (marks the conversation read now), /list, /help,
        /quit, and the others above. The outbox is kept in --outbox (by default a file per
        device), so messages written before a quit go out on the next run.

        Each reconnect says why (a refused token, a refused connection, a node starting or
        full, a dropped connection). A token refused twice in a row (close 4001) stops the
        client with exit status 77, as does a refused --token, which cannot be refreshed.

        Example, with a gateway from `make run`:
          presence-client --url ws://127.0.0.1:8080 --token-command 'scripts/token alice' --device laptop
          presence-client --token-command 'scripts/token alice' --device laptop --chat room
        """
    )

    @Option(name: .customLong("url"), help: "Gateway base URL; repeat for several nodes, tried in turn.")
    var urls: [String] = ["ws://127.0.0.1:8080"]

    @Option(help: "A token (or PRESENCE_TOKEN). It cannot be refreshed: prefer --token-command.")
    var token: String?

    @Option(help: "A shell command that prints a fresh token; run again when the token expires.")
    var tokenCommand: String?

    @Option(help: "This device's id (stable across runs).")
    var device: String = "terminal"

    @Option(help: "Users to watch from the start, comma-separated.")
    var watch: String?

    @Option(help: "A conversation to follow from the start.")
    var join: String?

    @Option(help: "A conversation to chat in: typed lines are sent to it as messages.")
    var chat: String?

    @Option(help: "The file that keeps unsent messages (default: a file per device in the user's data folder).")
    var outbox: String?

    @Option(help: "Log level of the client library (trace, debug, info, warning, error).")
    var logLevel: String = "warning"

    mutating func run() async throws {
        let gatewayURLs = try urls.map { text in
            guard let url = URL(string: text) else { throw ValidationError("--url \(text) is not a URL") }
            return url
        }
        let provider = try tokenProvider()
        let configuration: PresenceClientConfiguration
        do {
            configuration = try PresenceClientConfiguration(gatewayURLs: gatewayURLs, deviceID: device)
        } catch {
            throw ValidationError(error.message)
        }
        guard let level = Logger.Level(rawValue: logLevel) else { throw ValidationError("--log-level \(logLevel) is not a log level") }
        var logger = Logger(label: "presence-client")
        logger.logLevel = level
        let store = FileMessageOutboxStore(url: outbox.map { URL(fileURLWithPath: $0) } ?? FileMessageOutboxStore.defaultURL(deviceID: device))
        let client = PresenceClient(configuration: configuration, tokenProvider: provider, outboxStore: store, logger: logger)
        let display = Display(chat: chat, stopsOnRefusedToken: tokenCommand != nil)
        if let chat { try await display.apply(client, "/join \(chat)") }
        if let watch {
            try await display.apply(client, "watch " + watch.split(separator: ",").joined(separator: " "))
        }
        if let join { try await display.apply(client, "join \(join)") }
        let events = await client.events()
        StandardOutput.exitWhenReaderCloses()
        say("connecting to \(urls.joined(separator: ", ")) as device \(device); \(Display.banner(chat: chat))")
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await client.run() }
            group.addTask {
                for await event in events { await display.show(event, client: client) }
            }
            group.addTask {
                for await line in Self.standardInputLines() {
                    do {
                        if try await display.apply(client, line) == false { break }
                    } catch {
                        say("! \(error)")
                    }
                }
                await client.outboxSaved()
                await client.signOut()
            }
            await group.next()
            group.cancelAll()
        }
    }

    private func tokenProvider() throws -> PresenceClient.TokenProvider {
        if let tokenCommand {
            return { _ in try Self.runTokenCommand(tokenCommand) }
        }
        guard let fixed = token ?? ProcessInfo.processInfo.environment["PRESENCE_TOKEN"] else {
            throw ValidationError("give --token-command (preferred), --token or PRESENCE_TOKEN")
        }
        return { refresh in
            // A fixed token the gateway refused is refused again on every retry: stop, and say how
            // to go on. EX_NOPERM (77): the credentials were not accepted.
            if refresh {
                FileHandle.standardError.write(Data("presence-client: the token was refused or has expired; start again with a new one, or use --token-command\n".utf8))
                Foundation.exit(77)
            }
            return fixed
        }
    }

    private static func runTokenCommand(_ command: String) throws -> String {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/bin/sh")
        process.arguments = ["-c", command]
        let output = Pipe()
        process.standardOutput = output
        try process.run()
        let data = output.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        let token = String(decoding: data, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        guard process.terminationStatus == 0, !token.isEmpty else {
            throw ValidationError("--token-command exited with \(process.terminationStatus) and printed no token")
        }
        return token
    }

    /// Lines of standard input, read on a thread of their own so the event loop never blocks.
    private static func standardInputLines() -> AsyncStream<String> {
        AsyncStream { continuation in
            let thread = Thread {
                while let line = readLine() { continuation.yield(line) }
                continuation.finish()
            }
            thread.start()
        }
    }
}

/// Prints events and runs typed commands.
actor Display {
    /// The conversation typed lines go to, in chat mode.
    let chat: String?
    /// Whether a token refused twice in a row ends the client (the token comes from a command,
    /// run again after each refusal; a fixed token ends it at the first refusal, in its provider).
    let stopsOnRefusedToken: Bool
    private var refusals = TokenRefusals(limit: 2)
    /// Others' messages in the chat printed and marked read: their change to `read` is not
    /// printed again.
    private var readHere: Set<String> = []
    /// A `read` for the chat is about to be sent: the messages printed meanwhile go with it.
    private var readPending = false

    init(chat: String?, stopsOnRefusedToken: Bool = false) {
        self.chat = chat
        self.stopsOnRefusedToken = stopsOnRefusedToken
    }

    /// What the first line says about commands: in chat mode a bare word is a message, so the
    /// commands are named with their slash.
    static func banner(chat: String?) -> String {
        guard let chat else { return "type help for commands" }
        return "lines you type are sent to \(chat); type /help for commands"
    }

    private func stamp() -> String {
        let time = Date().formatted(Date.ISO8601FormatStyle(timeZone: .current).time(includingFractionalSeconds: false))
        return time
    }

    func show(_ event: PresenceClientEvent, client: PresenceClient) async {
        switch event {
        case .connection(let state):
            say("\(stamp()) [\(Self.describe(state))]")
        case .presence(let presence):
            say("\(stamp()) \(presence.userID): \(PresenceText.status(presence, now: Date()))")
        case .removed(let user):
            say("\(stamp()) \(user): no longer visible")
        case .typing(let conversation, let user, let isTyping):
            say("\(stamp()) \(conversation): \(isTyping ? PresenceText.typing([user]) : "\(user) stopped typing")")
        case .group(let group):
            say("\(stamp()) \(group.conversationID): \(Self.describe(group))")
        case .error(let code, let message):
            say("\(stamp()) ! \(code.rawValue): \(message)")
        case .message(let message):
            say("\(stamp()) \(Self.describe(message))")
            // Others' messages in the chat are on screen: read.
            if message.conversationID == chat, message.status == .delivered {
                readHere.insert(message.clientMessageID)
                markShownRead(client)
            }
        case .messageStatus(let change):
            if change.status == .read, readHere.remove(change.clientMessageID) != nil { return }
            let reason = change.failure.map { ": \($0)" } ?? ""
            let message = await client.messages(in: change.conversationID).last { $0.clientMessageID == change.clientMessageID }
            say("\(stamp()) \(message.map(Self.describe) ?? "\(change.conversationID) (\(change.clientMessageID.prefix(8)))")\(reason)")
        case .messageGap(let gap):
            say("\(stamp()) \(gap.conversationID): messages \(gap.fromSeq)…\(gap.toSeq.map(String.init) ?? "end") of epoch \(gap.epoch ?? "?") cannot be given")
        case .messageTruncated(let range):
            say("\(stamp()) \(range.conversationID): messages \(range.fromSeq)…\(range.toSeq.map(String.init) ?? "end") of epoch \(range.epoch ?? "?") were lost by the gateway's Redis; yours among them are sent again")
        case .sessionEnded(let end):
            say("\(stamp()) [\(Self.describe(end))]")
            if stopsOnRefusedToken, refusals.record(end) {
                FileHandle.standardError.write(Data("presence-client: the token from --token-command was refused twice in a row (4001); check the command and the gateway's secret\n".utf8))
                // EX_NOPERM (77): the credentials were not accepted.
                Foundation.exit(77)
            }
        }
    }

    /// "the gateway refused the token (4001); reconnecting now with a new token".
    static func describe(_ end: SessionEnd) -> String {
        end.outcome.isEmpty ? "session ended: \(end.reason)" : "session ended: \(end.reason); \(end.outcome)"
    }

    /// Marks the chat read a moment after a message of it was printed, once for all printed
    /// meanwhile (a sync of hundreds of messages sends one `read`, not hundreds).
    private func markShownRead(_ client: PresenceClient) {
        guard let chat, !readPending else { return }
        readPending = true
        Task {
            try? await Task.sleep(for: .milliseconds(200))
            await self.markRead(client, chat)
        }
    }

    private func markRead(_ client: PresenceClient, _ conversation: String) async {
        readPending = false
        await client.markRead(conversation)
    }

    /// `room #3 alice: hi  [delivered] (1c0e2b7a)`; `me` for this device's messages until the
    /// gateway's copy names the sender, `-` for a seq not given yet.
    static func describe(_ message: ChatMessage) -> String {
        let seq = message.seq.map { "#\($0)" } ?? "-"
        return "\(message.conversationID) \(seq) \(message.senderID ?? "me"): \(message.text)  [\(message.status.rawValue)] (\(message.clientMessageID.prefix(8)))"
    }

    /// "3 of 5 online, 1 away": the SDK's text, and the members away beside it.
    static func describe(_ group: GroupPresence) -> String {
        PresenceText.group(group) + (group.away > 0 ? ", \(group.away) away" : "")
    }

    static func describe(_ state: ConnectionState) -> String {
        switch state {
        case .idle: "idle"
        case .connecting: "connecting"
        case .connected: "connected"
        case .waiting(let retryAt): "disconnected; retrying in \(max(0, Int(retryAt.timeIntervalSinceNow.rounded(.up)))) s"
        case .stopped(.signedOut): "signed out"
        case .stopped(.disconnectedByAdmin): "disconnected by an admin"
        case .stopped(.replaced): "this device connected elsewhere"
        }
    }

    /// Runs one command line; returns false for `quit`.
    @discardableResult
    func apply(_ client: PresenceClient, _ line: String) async throws -> Bool {
        if let chat, !line.hasPrefix("/") {
            guard !line.trimmingCharacters(in: .whitespaces).isEmpty else { return true }
            try await client.send(line, to: chat)
            return true
        }
        let words = (line.hasPrefix("/") ? String(line.dropFirst()) : line).split(separator: " ").map(String.init)
        guard let command = words.first else { return true }
        let arguments = Array(words.dropFirst())
        func one() throws -> String {
            guard arguments.count == 1 else { throw ValidationError("\(command) takes one conversation id") }
            return arguments[0]
        }
        switch command {
        case "online" where chat != nil:
            await client.setOffline(false)
        case "offline" where chat != nil:
            await client.setOffline(true)
        case "read":
            guard let conversation = arguments.first ?? chat, arguments.count <= 1 else { throw ValidationError("read takes one conversation id") }
            await client.markRead(conversation)
            say("\(stamp()) \(conversation): marked read")
        case "retry":
            let prefix = try one()
            let matching = await client.messages(in: chat ?? "").filter { $0.status == .failed && $0.clientMessageID.hasPrefix(prefix) }
            guard let message = matching.first else { throw ValidationError("no failed message \(prefix) here") }
            await client.retry(message.clientMessageID)
        case "online", "away", "offline":
            await client.setStatus(PresenceStatus(rawValue: command)!)
            say("\(stamp()) you: \(command) on this device")
        case "watch": try await client.watch(arguments)
        case "unwatch": try await client.unwatch(arguments)
        case "join": try await client.join(conversation: try one())
        case "leave": try await client.leave(conversation: try one())
        case "type": try await client.userTyped(in: try one())
        case "send": try await client.messageSent(in: try one())
        case "background": await client.didEnterBackground()
        case "foreground": await client.didBecomeActive()
        case "list": await list(client)
        case "quit", "exit": return false
        case "help": say(PresenceClientCommand.configuration.discussion)
        default: say("! unknown command \(command); type \(chat == nil ? "help" : "/help")")
        }
        return true
    }

    private func list(_ client: PresenceClient) async {
        let presences = await client.presences
        let now = Date()
        say("\(presences.count) users; this device is \(await client.status.rawValue), \(Self.describe(await client.connectionState))")
        let width = max(4, presences.map(\.userID.count).max() ?? 0)
        for presence in presences {
            let typing = await client.cache.isTyping(presence.userID) ? "  typing…" : ""
            say("  \(presence.userID.padding(toLength: width, withPad: " ", startingAt: 0))  \(PresenceText.status(presence, now: now))\(typing)")
        }
        for conversation in await client.joinedConversations.sorted() {
            if let group = await client.group(conversation) {
                let typing = PresenceText.typing(await client.typingUsers(in: conversation))
                say("  #\(conversation): \(Self.describe(group))\(typing.isEmpty ? "" : "; " + typing)")
            }
        }
    }
}

/// Prints a line unbuffered, so that it shows at once also when the output is a file or a pipe;
/// a closed pipe ends the client quietly.
func say(_ line: String) {
    StandardOutput.say(line)
}
