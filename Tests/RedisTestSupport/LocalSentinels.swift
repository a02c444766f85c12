import Foundation
import RedisClient

/// A primary, its replica and three Sentinels (quorum 2) on loopback ports of their own, for
/// tests of failover. Everything is killed when the value goes away.
///
/// With certificates, every server and Sentinel also listens with TLS, replication and the
/// Sentinels' own connections to the servers go over TLS, and the Sentinels name the servers'
/// TLS ports: a client of ``url(sentinels:credentials:)`` (then `rediss+sentinel://`) uses TLS
/// throughout, while the test's `redis-cli` keeps the plain ports.
///
/// Sentinels take 1 s of silence to call a primary down and wait 3 s between failovers of the
/// same primary (`failover-timeout`): a test that fails over twice waits for ``waitHealthy()``.
public final class LocalSentinels: @unchecked Sendable {
    // Safe: used by one test at a time, as RedisServerProcess is.
    /// The name the Sentinels know the primary by.
    public let name = "presence-primary"
    /// The two data servers: the first starts as the primary.
    public let servers: [RedisServerProcess]
    public private(set) var sentinels: [RedisServerProcess] = []
    /// With TLS: the certificates, and the TLS port of each plain one (servers and Sentinels).
    public let certificates: TestCertificates?
    private var tlsPorts: [Int: Int] = [:]
    private let directory: URL

    /// Starts everything and returns once the replica has synced and the Sentinels know each
    /// other (10 s at most; about 7 s for the Sentinels here).
    public init(tls certificates: TestCertificates? = nil) async throws {
        self.certificates = certificates
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("sentinels-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        var tlsPorts: [Int: Int] = [:]
        /// Arguments for TLS beside the plain port (none without certificates), noting the port.
        func tls() throws -> (arguments: [String], port: Int?) {
            guard let certificates else { return ([], nil) }
            let port = try RedisServerProcess.freePort()
            return (certificates.redisArguments(tlsPort: port, clientCertificates: false) + ["--tls-replication", "yes"], port)
        }
        let primaryTLS = try tls()
        let primary = try RedisServerProcess(arguments: primaryTLS.arguments)
        tlsPorts[primary.port] = primaryTLS.port
        let replicaTLS = try tls()
        let replica = try RedisServerProcess(arguments: replicaTLS.arguments + ["--replicaof", "127.0.0.1", "\(primaryTLS.port ?? primary.port)"])
        tlsPorts[replica.port] = replicaTLS.port
        servers = [primary, replica]
        for index in 0..<3 {
            let file = directory.appendingPathComponent("sentinel-\(index).conf")
            let sentinelTLS = try tls()
            // TLS settings go in the file: a Sentinel rewrites it, and keeps what it finds there.
            let tlsLines = certificates.map { certificates in
                """
                tls-port \(sentinelTLS.port!)
                tls-cert-file \(certificates.serverCertificateFile)
                tls-key-file \(certificates.serverKeyFile)
                tls-ca-cert-file \(certificates.caFile)
                tls-auth-clients no
                tls-replication yes

                """
            } ?? ""
            let config = """
                sentinel monitor \(name) 127.0.0.1 \(primaryTLS.port ?? primary.port) 2
                sentinel down-after-milliseconds \(name) 1000
                sentinel failover-timeout \(name) 3000
                sentinel parallel-syncs \(name) 1
                dir \(directory.path)

                """ + tlsLines
            try config.write(to: file, atomically: true, encoding: .utf8)
            let sentinel = try RedisServerProcess(arguments: ["--sentinel"], configFile: file.path)
            tlsPorts[sentinel.port] = sentinelTLS.port
            sentinels.append(sentinel)
        }
        self.tlsPorts = tlsPorts
        guard await waitHealthy(timeout: .seconds(15)) else {
            throw RedisError(.unavailable, "the Sentinels did not settle within 15 s: \(try sentinelCLI(0, "SENTINEL", "CKQUORUM", name))")
        }
    }

    deinit {
        for process in sentinels + servers { process.stop() }
        try? FileManager.default.removeItem(at: directory)
    }

    /// `redis+sentinel://` naming every Sentinel (or those given); with certificates
    /// `rediss+sentinel://` at their TLS ports, trusting the test CA.
    public func url(sentinels indices: [Int]? = nil, credentials: String? = nil) -> String {
        let ports = (indices ?? Array(sentinels.indices)).map { "127.0.0.1:\(announced(sentinels[$0].port))" }
        let query = certificates.map { "?ca=\($0.caFile)" } ?? ""
        return "\(certificates == nil ? "redis" : "rediss")+sentinel://\(credentials.map { $0 + "@" } ?? "")\(ports.joined(separator: ","))/\(name)/0\(query)"
    }

    /// The port clients are given for the server or Sentinel on plain `port`: its TLS one with
    /// certificates.
    public func announced(_ port: Int) -> Int { tlsPorts[port] ?? port }

    /// The (plain) port of the primary the first live Sentinel names.
    public func primaryPort() throws -> Int? {
        for index in sentinels.indices {
            let words = try sentinelCLI(index, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", name).split(whereSeparator: \.isNewline)
            if words.count == 2, let port = Int(words[1]) { return servers.first { announced($0.port) == port }?.port ?? port }
        }
        return nil
    }

    /// The data server on `port`.
    public func server(port: Int) -> RedisServerProcess? { servers.first { $0.port == port } }

    /// The `CLIENT LIST` lines of the live servers and Sentinels (or only `processes`) whose
    /// connection came in on the process's TLS port, or on its plain one (this call's own
    /// connection left out).
    public func clients(onTLSPort tls: Bool, of processes: [RedisServerProcess]? = nil) throws -> [String] {
        try (processes ?? servers + sentinels).filter { $0.pid != nil }.flatMap { process in
            let port = tls ? announced(process.port) : process.port
            return try process.cli("CLIENT", "LIST").split(whereSeparator: \.isNewline).map(String.init).filter { line in
                line.contains(" laddr=127.0.0.1:\(port) ") && !line.contains(" cmd=client|list ")
            }
        }
    }

    /// Runs `redis-cli` against Sentinel `index`.
    @discardableResult
    public func sentinelCLI(_ index: Int, _ arguments: String...) throws -> String {
        try RedisServerProcess.cli(port: sentinels[index].port, arguments)
    }

    /// Waits until the primary has a synced replica, every Sentinel agrees on it, the quorum can
    /// authorize a failover, and the last failover is past its timeout.
    @discardableResult
    public func waitHealthy(timeout: Duration = .seconds(20)) async -> Bool {
        await eventually(timeout: timeout, poll: .milliseconds(200)) {
            guard let port = try? primaryPort(), let primary = server(port: port),
                  let replication = try? primary.cli("INFO", "replication"),
                  replication.contains("role:master"), replication.contains("connected_slaves:1"),
                  let replica = servers.first(where: { $0.port != port }),
                  (try? replica.cli("INFO", "replication"))?.contains("master_link_status:up") == true
            else { return false }
            for index in sentinels.indices where sentinels[index].pid != nil {
                guard let quorum = try? sentinelCLI(index, "SENTINEL", "CKQUORUM", name), quorum.hasPrefix("OK"),
                      let named = try? sentinelCLI(index, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", name), named.contains("\(announced(port))")
                else { return false }
                // A Sentinel refuses a new failover of the same primary for 2 × failover-timeout.
                if let state = try? sentinelCLI(index, "SENTINEL", "MASTER", name), state.contains("failover_in_progress") { return false }
            }
            return true
        }
    }
}
