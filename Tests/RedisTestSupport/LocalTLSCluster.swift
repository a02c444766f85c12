import Foundation
import RedisClient

/// A small Redis Cluster of its own that speaks TLS: three primaries (no replicas), each with a
/// plain port for the test's `redis-cli` and a TLS port for the client under test, the cluster
/// bus over TLS too (`tls-cluster yes`). Over TLS a node names its peers' TLS ports (in
/// `CLUSTER SHARDS` and in redirections), over the plain port their plain ones, so a client that
/// reached a plain port anywhere would show in `CLIENT LIST` there.
public final class LocalTLSCluster: Sendable {
    public let certificates: TestCertificates
    public let servers: [RedisServerProcess]
    /// Each server's TLS port, in the order of ``servers``.
    public let tlsPorts: [Int]

    /// Starts the servers (asking clients for a certificate when `clientCertificates`) and
    /// joins them into a cluster; returns once every node says `cluster_state:ok`.
    public init(clientCertificates: Bool) async throws {
        certificates = try TestCertificates()
        var nodes: [(server: RedisServerProcess, tlsPort: Int)] = []
        for _ in 0..<3 { nodes.append(try Self.startNode(certificates, clientCertificates: clientCertificates)) }
        let servers = nodes.map(\.server)
        self.servers = servers
        self.tlsPorts = nodes.map(\.tlsPort)
        try await LocalRedisCluster.join(servers)
    }

    /// One node on three ports handed out free: its plain one, its TLS one and its bus. A port
    /// handed out is free only until something else takes it (a parallel test's connection gets
    /// it as its source port), and then the server exits at once: the node is started again on
    /// three new ports, up to three times (a light run here failed once, it seems on that).
    private static func startNode(_ certificates: TestCertificates, clientCertificates: Bool) throws -> (server: RedisServerProcess, tlsPort: Int) {
        var attempt = 1
        while true {
            let tlsPort = try RedisServerProcess.freePort()
            let configFile = certificates.directory + "/nodes-\(tlsPort).conf"
            do {
                let server = try RedisServerProcess(arguments: certificates.redisArguments(tlsPort: tlsPort, clientCertificates: clientCertificates) + [
                    // A bus port of its own: the default, the port plus 10,000, is past 65,535 for
                    // a high port the kernel handed out.
                    "--cluster-enabled", "yes", "--cluster-config-file", configFile, "--cluster-port", "\(try RedisServerProcess.freePort())",
                    "--tls-cluster", "yes", "--tls-replication", "yes",
                    // The bus connects as a client of the other nodes: with the client
                    // certificate, which a node asking for one accepts (the server's is for
                    // serving only).
                    "--tls-client-cert-file", certificates.clientCertificateFile, "--tls-client-key-file", certificates.clientKeyFile,
                ])
                return (server, tlsPort)
            } catch where attempt < 3 {
                attempt += 1
            }
        }
    }

    /// `rediss+cluster://` naming `seeds` of the nodes (the first by default), with the CA and,
    /// when `clientCertificate`, the client's certificate; `ca` overrides the CA file.
    public func url(seeds: [Int] = [0], ca: String? = nil, clientCertificate: Bool = true) -> String {
        let nodes = seeds.map { "127.0.0.1:\(tlsPorts[$0])" }.joined(separator: ",")
        var query = "ca=\(ca ?? certificates.caFile)"
        if clientCertificate { query += "&cert=\(certificates.clientCertificateFile)&key=\(certificates.clientKeyFile)" }
        return "rediss+cluster://\(nodes)?\(query)"
    }

    /// The `CLIENT LIST` lines of every node whose connection came in on `port` of that node's
    /// two: the TLS one or the plain one (this call's own connection left out).
    public func clients(onTLSPort tls: Bool) throws -> [String] {
        try zip(servers, tlsPorts).flatMap { server, tlsPort in
            let port = tls ? tlsPort : server.port
            return try server.cli("CLIENT", "LIST").split(whereSeparator: \.isNewline).map(String.init).filter { line in
                line.contains(" laddr=127.0.0.1:\(port) ") && !line.contains(" cmd=client|list ")
            }
        }
    }
}
