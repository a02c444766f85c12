import ArgumentParser
import Foundation
#if canImport(Glibc)
import Glibc
#endif
import Logging
import PresenceGateway

/// `presence-gateway`: one gateway node. Every flag is also a `PRESENCE_*` environment variable.
@main
struct PresenceGatewayCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "presence-gateway",
        abstract: "A presence gateway node: WebSocket and REST presence over Redis.",
        discussion: "Each option can also be set by the environment variable in brackets; flags win."
    )

    @Option(help: "Listen host [PRESENCE_HOST].") var host: String?
    @Option(help: "Listen port [PRESENCE_PORT].") var port: String?
    @Option(help: "redis://[user:password@]host:port/db [PRESENCE_REDIS_URL].") var redisURL: String?
    @Option(help: "classic or sharded pub/sub on one server or through Sentinel; a cluster: sharded only [PRESENCE_REDIS_PUBSUB].") var redisPubsub: String?
    @Option(help: "Prefix of every Redis key and channel [PRESENCE_KEY_PREFIX].") var keyPrefix: String?
    @Option(help: "This node's id [PRESENCE_NODE_ID].") var nodeID: String?
    @Option(help: "HS256 secret, at least 32 bytes [PRESENCE_JWT_SECRET].") var jwtSecret: String?
    @Option(help: "RS256/ES256 public key, PEM text [PRESENCE_JWT_PUBLIC_KEY].") var jwtPublicKey: String?
    @Option(help: "Admin bearer token; admin routes are off without it [PRESENCE_ADMIN_TOKEN].") var adminToken: String?
    @Option(help: "conversations or open [PRESENCE_VISIBILITY].") var visibility: String?
    @Option(help: "string or numeric: user and conversation ids as JSON strings or numbers [PRESENCE_ID_FORMAT].") var idFormat: String?
    @Option(help: "Seconds a node lease lives [PRESENCE_LEASE_TTL].") var leaseTTL: String?
    @Option(help: "Seconds an abruptly disconnected device stays live [PRESENCE_LINGER].") var linger: String?
    @Option(help: "Seconds a REST device stays live after a post [PRESENCE_HEARTBEAT_TTL].") var heartbeatTTL: String?
    @Option(help: "Seconds a typing state lives [PRESENCE_TYPING_TTL].") var typingTTL: String?
    @Option(help: "Above this many members a conversation gives counts, not member lists or automatic contacts [PRESENCE_LARGE_GROUP].") var largeGroup: String?
    @Option(help: "Most WebSocket sessions this node holds; default: the open-file limit less 256 [PRESENCE_MAX_SESSIONS].") var maxSessions: String?
    @Option(help: "trace, debug, info, notice, warning, error, critical [PRESENCE_LOG_LEVEL].") var logLevel: String?

    func run() async throws {
        var values = ProcessInfo.processInfo.environment.filter { $0.key.hasPrefix("PRESENCE_") }
        let flags: [(String, String?)] = [
            ("PRESENCE_HOST", host), ("PRESENCE_PORT", port), ("PRESENCE_REDIS_URL", redisURL), ("PRESENCE_REDIS_PUBSUB", redisPubsub), ("PRESENCE_KEY_PREFIX", keyPrefix),
            ("PRESENCE_NODE_ID", nodeID), ("PRESENCE_JWT_SECRET", jwtSecret), ("PRESENCE_JWT_PUBLIC_KEY", jwtPublicKey),
            ("PRESENCE_ADMIN_TOKEN", adminToken), ("PRESENCE_VISIBILITY", visibility), ("PRESENCE_ID_FORMAT", idFormat), ("PRESENCE_LEASE_TTL", leaseTTL),
            ("PRESENCE_LINGER", linger), ("PRESENCE_HEARTBEAT_TTL", heartbeatTTL), ("PRESENCE_TYPING_TTL", typingTTL),
            ("PRESENCE_LARGE_GROUP", largeGroup), ("PRESENCE_MAX_SESSIONS", maxSessions), ("PRESENCE_LOG_LEVEL", logLevel),
        ]
        // Before the configuration reads it: its default session limit follows the open-file limit.
        let openFiles = GatewayConfiguration.raiseOpenFileLimit()
        for case let (name, value?) in flags { values[name] = value }
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
