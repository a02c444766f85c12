import ArgumentParser
import Foundation
#if canImport(Glibc)
import Glibc
#endif
import Logging
import PresenceGateway

/// The entry point: the command runs in a task while the main thread waits for it. Not an async
/// `main`: Swift parks the main thread of one in libdispatch's `dispatch_main`, whose
/// `sigsuspend` valgrind cannot run (it faults there, 3.24 as well as 3.19), and the node's
/// instruction counts (`presence-bench instructions`) are taken under valgrind. Nothing may run
/// on the main actor then (its queue is never drained): the task is detached, since one made here
/// would inherit `main`'s main-actor isolation.
@main
enum PresenceGatewayMain {
    static func main() {
        let finished = DispatchSemaphore(value: 0)
        Task.detached {
            await PresenceGatewayCommand.main()
            finished.signal()
        }
        finished.wait()
    }
}

/// `presence-gateway`: one gateway node. Its flags are the settings of
/// ``GatewaySetting/all``, each also a `PRESENCE_*` environment variable.
struct PresenceGatewayCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "presence-gateway",
        abstract: "A presence gateway node: WebSocket and REST presence over Redis.",
        usage: "presence-gateway [--<setting> <value> ...] [--print-config-schema]",
        discussion: settingsHelp
    )

    @Flag(help: "Print every setting (variable, flag, type, range, default) as JSON, and exit.") var printConfigSchema = false
    @Argument(parsing: .allUnrecognized, help: .hidden) var settings: [String] = []

    /// The settings, one per line: flag, variable, default and what it does.
    static var settingsHelp: String {
        var lines = ["Each setting is a flag or the environment variable in brackets; flags win.", "", "SETTINGS:"]
        for setting in GatewaySetting.all {
            let value: String
            switch setting.kind {
            case .text, .secret: value = "<text>"
            case .integer(let range): value = "<\(range.lowerBound)-\(range.upperBound)>"
            case .choice(let names): value = "<\(names.joined(separator: "|"))>"
            }
            let fallback = setting.defaultText ?? setting.defaultValue
            lines.append("  \(setting.flag) \(value)")
            lines += wrapped("\(setting.help) [\(setting.name)]\(fallback.map { " (default: \($0))" } ?? "")", indent: 8)
        }
        return lines.joined(separator: "\n")
    }

    /// `text` in lines of at most 79 characters, each indented by `indent` spaces (the help
    /// would otherwise be wrapped at the terminal's width with no indent).
    static func wrapped(_ text: String, indent: Int) -> [String] {
        let margin = String(repeating: " ", count: indent)
        var lines: [String] = []
        var line = ""
        for word in text.split(separator: " ") {
            if !line.isEmpty, indent + line.count + 1 + word.count > 79 {
                lines.append(margin + line)
                line = ""
            }
            line += line.isEmpty ? word : " " + word
        }
        if !line.isEmpty { lines.append(margin + line) }
        return lines
    }

    /// The values of the settings given as flags, `--name value` or `--name=value`, by variable.
    func flagValues() throws(ValidationError) -> [String: String] {
        var values: [String: String] = [:]
        var rest = settings[...]
        while let word = rest.popFirst() {
            let (flag, inline) = word.firstIndex(of: "=").map { (String(word[..<$0]), String(word[word.index(after: $0)...])) } ?? (word, nil)
            guard flag.hasPrefix("--"), let setting = GatewaySetting.named(flag) else {
                // The flag alone: `--jwt-secrt=...` must not print the secret.
                throw ValidationError("unknown option '\(flag)'; presence-gateway --help lists the settings")
            }
            guard let value = inline ?? rest.popFirst() else { throw ValidationError("\(flag) needs a value") }
            values[setting.name] = value
        }
        return values
    }

    func validate() throws {
        _ = try flagValues()
    }

    func run() async throws {
        if printConfigSchema {
            print(GatewaySetting.schema)
            return
        }
        var values = ProcessInfo.processInfo.environment.filter { $0.key.hasPrefix("PRESENCE_") }
        values.merge(try flagValues()) { _, flag in flag }
        // Before the configuration reads it: its default session limit follows the open-file limit.
        let openFiles = GatewayConfiguration.raiseOpenFileLimit()
        let configuration: GatewayConfiguration
        do {
            configuration = try GatewayConfiguration(environment: values)
            try configuration.validate()
        } catch {
            FileHandle.standardError.write(Data("presence-gateway: \(error)\n".utf8))
            throw ExitCode(2)
        }
        if let reason = Self.listenerInTheWay(host: configuration.host, port: configuration.port) {
            FileHandle.standardError.write(Data("presence-gateway: cannot listen on \(configuration.host):\(configuration.port): \(reason); stop what uses it, or choose another port with PRESENCE_PORT (--port)\n".utf8))
            throw ExitCode(2)
        }
        var logger = Logger(label: "presence-gateway")
        logger.logLevel = configuration.logLevel
        logger[metadataKey: "presence.node_id"] = "\(configuration.nodeID)"
        logger.info("starting", metadata: ["presence.max_sessions": "\(configuration.maxSessions)", "presence.open_file_limit": "\(openFiles.map(String.init) ?? "unknown")"])
        for (name, meant) in GatewaySetting.unknown(among: values.keys) {
            logger.warning("\(name) is not a setting; it is ignored\(meant.map { " (did you mean \($0)?)" } ?? "")")
        }
        try await buildGateway(configuration: configuration, logger: logger).run()
    }

    /// Why the listening address cannot be bound, found before anything starts (a second node
    /// on a taken port printed a misleading Redis error, then errno 98 without the port); nil
    /// when it can, or when the check cannot tell (the server's own bind then reports).
    static func listenerInTheWay(host: String, port: Int) -> String? {
        var hints = addrinfo()
        hints.ai_socktype = Int32(SOCK_STREAM.rawValue)
        hints.ai_flags = AI_PASSIVE
        var found: UnsafeMutablePointer<addrinfo>?
        guard getaddrinfo(host, String(port), &hints, &found) == 0, let address = found else { return nil }
        defer { freeaddrinfo(found) }
        let descriptor = socket(address.pointee.ai_family, Int32(SOCK_STREAM.rawValue), 0)
        guard descriptor >= 0 else { return nil }
        defer { close(descriptor) }
        // As the server binds: with SO_REUSEADDR, so only a live listener is in the way.
        var on: Int32 = 1
        setsockopt(descriptor, SOL_SOCKET, SO_REUSEADDR, &on, socklen_t(MemoryLayout<Int32>.size))
        guard bind(descriptor, address.pointee.ai_addr, address.pointee.ai_addrlen) != 0 else { return nil }
        switch errno {
        case EADDRINUSE: return "the port is in use by another process"
        case EADDRNOTAVAIL: return "no interface of this machine has that address"
        case EACCES: return "ports below 1024 need privileges"
        default: return String(cString: strerror(errno))
        }
    }
}
