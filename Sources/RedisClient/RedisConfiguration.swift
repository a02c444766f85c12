/// Where and how to reach Redis, parsed from a `redis://[user:password@]host:port/db` URL, a
/// `rediss://` one for TLS, a `redis+sentinel://` one (the primary a set of Sentinels names) or a
/// `redis+cluster://` one (a Redis Cluster's seed nodes); `rediss+sentinel://` and
/// `rediss+cluster://` reach them over TLS.
public struct RedisConfiguration: Sendable, Equatable {
    /// A host and port.
    public struct Address: Sendable, Hashable, CustomStringConvertible {
        public var host: String
        public var port: Int

        public init(host: String, port: Int) {
            self.host = host
            self.port = port
        }

        public var description: String { host.contains(":") ? "[\(host)]:\(port)" : "\(host):\(port)" }
    }

    /// How the Redis deployment is found.
    public enum Topology: Sendable, Equatable {
        /// One server at `host:port`.
        case standalone
        /// The primary named `primaryName` by these Sentinels, asked again at every connect.
        case sentinel(sentinels: [Address], primaryName: String)
        /// A Redis Cluster, discovered from these seed nodes.
        case cluster(seeds: [Address])
    }


    /// TLS settings of a `rediss://`, `rediss+sentinel://` or `rediss+cluster://` connection.
    /// Files are PEM and read at each connect, so a rotated certificate is picked up by the next
    /// reconnect.
    public struct TLS: Sendable, Equatable {
        /// Certificates that may sign the server's; the system's trust store when nil.
        public var caFile: String?
        /// The client's certificate chain, for servers that ask for one (`tls-auth-clients`).
        public var certificateFile: String?
        /// The client certificate's private key; required with `certificateFile`.
        public var keyFile: String?

        public init(caFile: String? = nil, certificateFile: String? = nil, keyFile: String? = nil) {
            self.caFile = caFile
            self.certificateFile = certificateFile
            self.keyFile = keyFile
        }
    }

    /// Host name or address.
    public var host: String
    /// TCP port; 6379 unless the URL says otherwise.
    public var port: Int
    /// ACL user name, if any (Redis 6+ `AUTH user password`).
    public var username: String?
    /// Password for `AUTH`, if any.
    public var password: String?
    /// Database selected after connecting.
    public var database: Int
    /// Name given with `CLIENT SETNAME`, visible in `CLIENT LIST`.
    public var clientName: String?
    /// How long connecting (TCP plus handshake) may take.
    public var connectTimeout: Duration
    /// How long a command may take, retries included, where the client retries (a cluster's
    /// redirections and failovers); and how long a subscriber's connection may stay silent.
    public var commandTimeout: Duration
    /// How long the oldest command on a connection may wait for its reply before the connection
    /// is taken for stalled (a network that drops packets, a stopped server) and dropped: its
    /// commands fail, and later ones go to a fresh connection rather than wait behind it.
    public var stallTimeout: Duration = .seconds(5)
    /// When set, a command connection that heard nothing for this long and has nothing under
    /// way sends a `PING`, so that a network that went silent is found by ``stallTimeout`` while
    /// the connection is idle, not only once a command waits on it. Nil: no heartbeat.
    public var heartbeatInterval: Duration?
    /// When set, a client reconnecting starts another attempt this often while earlier ones
    /// hang (at most 10 at once): a partition drops the connection's SYN, which TCP resends only
    /// a second later, so a fresh attempt reaches a network that came back sooner. Nil: one
    /// attempt at a time.
    public var connectHedgeInterval: Duration?
    /// How long a command waits for a connection that is being (re)established before failing.
    public var waitForConnection: Duration
    /// First reconnect delay; doubled on each failure up to `maximumBackoff`, with jitter.
    public var minimumBackoff: Duration
    /// Longest reconnect delay.
    public var maximumBackoff: Duration
    /// Most bytes one reply may occupy before the connection is rejected as hostile.
    public var maxReplyBytes: Int
    /// How often a subscriber PINGs its connection. A connection that then stays silent for
    /// `commandTimeout` (no answer, no message) is taken for dead (a half-open TCP connection, a
    /// hung server) and made again.
    public var subscriberPingInterval: Duration = .seconds(2)
    /// TLS for the connection (`rediss://`, `rediss+sentinel://`, `rediss+cluster://`); plain
    /// TCP when nil. The server's certificate is always verified, against the host name or IP
    /// address connected to: the URL's, the one the Sentinels name, or on a cluster the one the
    /// slot map or a redirection names.
    public var tls: TLS?
    /// Standalone, Sentinel or Cluster. For the latter two `host` and `port` are the first
    /// Sentinel or seed of the URL, and a connection's own configuration holds the node it reached.
    public var topology: Topology = .standalone
    /// How messages reach subscribers on one server or through Sentinel: classic by default,
    /// or sharded (`SPUBLISH`/`SSUBSCRIBE`, as on a cluster: the same commands in every mode,
    /// no pattern subscriptions). A cluster always uses sharded pub/sub. Every client of one
    /// deployment must use the same: a classic subscriber does not hear `SPUBLISH`, nor a
    /// sharded one `PUBLISH`.
    public var pubSub: RedisPubSub = .classic

    /// A configuration for `host:port` with defaults for everything else.
    public init(
        host: String = "127.0.0.1",
        port: Int = 6379,
        username: String? = nil,
        password: String? = nil,
        database: Int = 0,
        clientName: String? = nil,
        connectTimeout: Duration = .seconds(2),
        commandTimeout: Duration = .seconds(5),
        waitForConnection: Duration = .milliseconds(500),
        minimumBackoff: Duration = .milliseconds(100),
        maximumBackoff: Duration = .seconds(5),
        maxReplyBytes: Int = 512 * 1024 * 1024,
        tls: TLS? = nil
    ) {
        self.host = host
        self.port = port
        self.username = username
        self.password = password
        self.database = database
        self.clientName = clientName
        self.connectTimeout = connectTimeout
        self.commandTimeout = commandTimeout
        self.waitForConnection = waitForConnection
        self.minimumBackoff = minimumBackoff
        self.maximumBackoff = maximumBackoff
        self.maxReplyBytes = maxReplyBytes
        self.tls = tls
    }

    /// Parses `redis[s]://[user:password@]host[:port][/db][?ca=FILE&cert=FILE&key=FILE]`; the
    /// password may be given alone (`:pw@`).
    ///
    /// `rediss://` connects over TLS; its query names PEM files: `ca` the certificates to trust
    /// (the system's when absent), `cert` and `key` a client certificate.
    /// `redis+sentinel://[user:password@]host[:port][,host[:port]...]/primary-name[/db]` asks the
    /// Sentinels (port 26379 unless given) for the primary; the credentials are the primary's,
    /// Sentinels are asked without them. `redis+cluster://[user:password@]host[:port][,...]`
    /// names a Redis Cluster's seed nodes (database 0 only). `rediss+sentinel://` and
    /// `rediss+cluster://` reach every node (Sentinels and primaries, or the cluster's nodes) over
    /// TLS, with the settings of the query of `rediss://`. User and password may be
    /// percent-encoded. Throws ``RedisError/Code/invalidURL`` with the reason, never echoing
    /// the password.
    public init(url: String) throws(RedisError) {
        self.init()
        let parts = url.split(separator: "://", maxSplits: 1, omittingEmptySubsequences: false)
        guard parts.count == 2 else {
            throw RedisError(.invalidURL, "a Redis URL starts with redis:// or rediss://, as in redis://127.0.0.1:6379/0")
        }
        let scheme = parts[0].lowercased()
        guard ["redis", "rediss", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster"].contains(scheme) else {
            throw RedisError(.invalidURL, "unsupported scheme '\(scheme)'; use redis://, redis+sentinel:// or redis+cluster://, each with rediss for TLS (rediss://, rediss+sentinel://, rediss+cluster://)")
        }
        var rest = parts[1]
        var query: Substring = ""
        if let mark = rest.firstIndex(of: "?") {
            query = rest[rest.index(after: mark)...]
            rest = rest[..<mark]
        }
        tls = try Self.tls(scheme: scheme, query: query)
        if let at = rest.lastIndex(of: "@") {
            let credentials = rest[..<at]
            rest = rest[rest.index(after: at)...]
            if let colon = credentials.firstIndex(of: ":") {
                let user = String(credentials[..<colon])
                username = user.isEmpty ? nil : try Self.percentDecoded(user)
                password = try Self.percentDecoded(String(credentials[credentials.index(after: colon)...]))
            } else if !credentials.isEmpty {
                // `redis://secret@host` is the common shorthand for a password without a user.
                password = try Self.percentDecoded(String(credentials))
            }
        }
        if scheme.hasSuffix("+sentinel") || scheme.hasSuffix("+cluster") {
            try parseNodeList(rest, sentinel: scheme.hasSuffix("+sentinel"))
            return
        }
        var hostPort = rest
        if let slash = rest.firstIndex(of: "/") {
            hostPort = rest[..<slash]
            let path = rest[rest.index(after: slash)...]
            if !path.isEmpty {
                guard let db = Int(path), db >= 0 else {
                    throw RedisError(.invalidURL, "database '\(path)' is not a non-negative number")
                }
                database = db
            }
        }
        let address = try Self.address(hostPort, defaultPort: 6379)
        host = address.host
        port = address.port
    }

    /// `host:port,host:port[/name[/db]]` of a Sentinel or Cluster URL.
    private mutating func parseNodeList(_ text: Substring, sentinel: Bool) throws(RedisError) {
        let pieces = text.split(separator: "/", omittingEmptySubsequences: false)
        var addresses: [Address] = []
        for node in pieces[0].split(separator: ",", omittingEmptySubsequences: false) {
            addresses.append(try Self.address(node, defaultPort: sentinel ? 26379 : 6379))
        }
        let path = pieces.dropFirst().filter { !$0.isEmpty }
        if sentinel {
            guard let name = path.first else {
                throw RedisError(.invalidURL, "a Sentinel URL names the primary after the nodes, as in redis+sentinel://127.0.0.1:26379/mymaster/0")
            }
            guard path.count <= 2 else { throw RedisError(.invalidURL, "a Sentinel URL's path is /primary-name[/db]") }
            if path.count == 2 {
                guard let db = Int(path[path.startIndex + 1]), db >= 0 else {
                    throw RedisError(.invalidURL, "database '\(path[path.startIndex + 1])' is not a non-negative number")
                }
                database = db
            }
            topology = .sentinel(sentinels: addresses, primaryName: try Self.percentDecoded(String(name)))
        } else {
            guard path.isEmpty || path == ["0"] else {
                throw RedisError(.invalidURL, "a Redis Cluster has database 0 only; its URL has no path other than /0")
            }
            topology = .cluster(seeds: addresses)
            pubSub = .sharded
        }
        host = addresses[0].host
        port = addresses[0].port
    }

    private static func address(_ text: Substring, defaultPort: Int) throws(RedisError) -> Address {
        var hostPort = text
        var address = Address(host: "", port: defaultPort)
        if hostPort.hasPrefix("["), let close = hostPort.firstIndex(of: "]") {
            address.host = String(hostPort[hostPort.index(after: hostPort.startIndex)..<close])
            hostPort = hostPort[hostPort.index(after: close)...]
            if hostPort.hasPrefix(":") { address.port = try port(hostPort.dropFirst()) }
        } else if let colon = hostPort.lastIndex(of: ":") {
            address.host = String(hostPort[..<colon])
            address.port = try port(hostPort[hostPort.index(after: colon)...])
        } else {
            address.host = String(hostPort)
        }
        guard !address.host.isEmpty else { throw RedisError(.invalidURL, "the Redis URL has no host") }
        return address
    }

    private static func tls(scheme: String, query: Substring) throws(RedisError) -> TLS? {
        var tls = TLS()
        for pair in query.split(separator: "&") {
            let field = pair.split(separator: "=", maxSplits: 1, omittingEmptySubsequences: false)
            let name = String(field[0])
            guard field.count == 2, !field[1].isEmpty else {
                throw RedisError(.invalidURL, "URL parameter '\(name)' needs a value, as in ?\(name)=/path/file.pem")
            }
            let value = try percentDecoded(String(field[1]))
            switch name {
            case "ca": tls.caFile = value
            case "cert": tls.certificateFile = value
            case "key": tls.keyFile = value
            default: throw RedisError(.invalidURL, "unknown URL parameter '\(name)'; known: ca, cert, key (with rediss only)")
            }
        }
        guard scheme.hasPrefix("rediss") else {
            guard tls == TLS() else {
                throw RedisError(.invalidURL, "ca, cert and key are TLS settings; use \("rediss" + scheme.dropFirst("redis".count)):// to connect over TLS")
            }
            return nil
        }
        guard (tls.certificateFile == nil) == (tls.keyFile == nil) else {
            throw RedisError(.invalidURL, "a client certificate needs both cert and key")
        }
        return tls
    }

    private static func port(_ text: Substring) throws(RedisError) -> Int {
        guard let value = Int(text), (1...65535).contains(value) else {
            throw RedisError(.invalidURL, "port '\(text)' is not between 1 and 65535")
        }
        return value
    }

    private static func percentDecoded(_ text: String) throws(RedisError) -> String {
        guard text.contains("%") else { return text }
        var bytes: [UInt8] = []
        var iterator = Array(text.utf8).makeIterator()
        while let byte = iterator.next() {
            guard byte == UInt8(ascii: "%") else { bytes.append(byte); continue }
            guard let high = iterator.next(), let low = iterator.next(),
                  let value = UInt8(String(decoding: [high, low], as: UTF8.self), radix: 16)
            else { throw RedisError(.invalidURL, "bad percent-encoding in the URL") }
            bytes.append(value)
        }
        return String(decoding: bytes, as: UTF8.self)
    }

    /// The URL without its password, for logs and messages.
    public var redactedURL: String {
        var credentials = ""
        if username != nil || password != nil {
            credentials = (username ?? "") + (password != nil ? ":***" : "") + "@"
        }
        switch topology {
        case .standalone:
            return "\(tls == nil ? "redis" : "rediss")://\(credentials)\(Address(host: host, port: port))/\(database)"
        case .sentinel(let sentinels, let name):
            return "\(tls == nil ? "redis" : "rediss")+sentinel://\(credentials)\(sentinels.map(\.description).joined(separator: ","))/\(name)/\(database)"
        case .cluster(let seeds):
            return "\(tls == nil ? "redis" : "rediss")+cluster://\(credentials)\(seeds.map(\.description).joined(separator: ","))"
        }
    }

    /// This configuration aimed at one server, as a standalone connection to it.
    public func standalone(at address: Address) -> RedisConfiguration {
        var copy = self
        copy.host = address.host
        copy.port = address.port
        copy.topology = .standalone
        return copy
    }
}
