/// Where and how to reach Redis, parsed from a `redis://[user:password@]host:port/db` URL, or a
/// `rediss://` one for TLS.
public struct RedisConfiguration: Sendable, Equatable {
    /// TLS settings of a `rediss://` connection. Files are PEM and read at each connect, so a
    /// rotated certificate is picked up by the next reconnect.
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
    /// How long a command may wait for its reply before the connection is dropped.
    public var commandTimeout: Duration
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
    /// TLS for the connection (`rediss://`); plain TCP when nil. The server's certificate is
    /// always verified, against the URL's host name or IP address.
    public var tls: TLS?

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
    /// (the system's when absent), `cert` and `key` a client certificate. User and password may
    /// be percent-encoded. Throws ``RedisError/Code/invalidURL`` with the reason, never echoing
    /// the password.
    public init(url: String) throws(RedisError) {
        self.init()
        let parts = url.split(separator: "://", maxSplits: 1, omittingEmptySubsequences: false)
        guard parts.count == 2 else {
            throw RedisError(.invalidURL, "a Redis URL starts with redis:// or rediss://, as in redis://127.0.0.1:6379/0")
        }
        let scheme = parts[0].lowercased()
        guard scheme == "redis" || scheme == "rediss" else {
            throw RedisError(.invalidURL, "unsupported scheme '\(scheme)'; use redis:// or rediss:// (TLS)")
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
        if hostPort.hasPrefix("["), let close = hostPort.firstIndex(of: "]") {
            host = String(hostPort[hostPort.index(after: hostPort.startIndex)..<close])
            hostPort = hostPort[hostPort.index(after: close)...]
            if hostPort.hasPrefix(":") { try parsePort(hostPort.dropFirst()) }
        } else if let colon = hostPort.lastIndex(of: ":") {
            host = String(hostPort[..<colon])
            try parsePort(hostPort[hostPort.index(after: colon)...])
        } else {
            host = String(hostPort)
        }
        guard !host.isEmpty else { throw RedisError(.invalidURL, "the Redis URL has no host") }
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
            default: throw RedisError(.invalidURL, "unknown URL parameter '\(name)'; known: ca, cert, key (rediss:// only)")
            }
        }
        guard scheme == "rediss" else {
            guard tls == TLS() else {
                throw RedisError(.invalidURL, "ca, cert and key are TLS settings; use rediss:// to connect over TLS")
            }
            return nil
        }
        guard (tls.certificateFile == nil) == (tls.keyFile == nil) else {
            throw RedisError(.invalidURL, "a client certificate needs both cert and key")
        }
        return tls
    }

    private mutating func parsePort(_ text: Substring) throws(RedisError) {
        guard let value = Int(text), (1...65535).contains(value) else {
            throw RedisError(.invalidURL, "port '\(text)' is not between 1 and 65535")
        }
        port = value
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
        let hostText = host.contains(":") ? "[\(host)]" : host
        return "\(tls == nil ? "redis" : "rediss")://\(credentials)\(hostText):\(port)/\(database)"
    }
}
