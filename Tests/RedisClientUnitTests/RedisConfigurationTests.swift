import Testing

@testable import RedisClient

@Suite("redis:// and rediss:// URLs")
struct RedisConfigurationTests {
    @Test("host, port, credentials and database")
    func full() throws {
        let configuration = try RedisConfiguration(url: "redis://alice:s%40cret@redis.internal:6380/3")
        #expect(configuration.host == "redis.internal")
        #expect(configuration.port == 6380)
        #expect(configuration.username == "alice")
        #expect(configuration.password == "s@cret")
        #expect(configuration.database == 3)
        #expect(!configuration.redactedURL.contains("cret"))
    }

    @Test("defaults and password-only forms")
    func shortForms() throws {
        let plain = try RedisConfiguration(url: "redis://localhost")
        #expect(plain.port == 6379 && plain.database == 0 && plain.password == nil)
        let passwordOnly = try RedisConfiguration(url: "redis://:pw@127.0.0.1:7000")
        #expect(passwordOnly.username == nil && passwordOnly.password == "pw" && passwordOnly.port == 7000)
        let ipv6 = try RedisConfiguration(url: "redis://[::1]:7001/2")
        #expect(ipv6.host == "::1" && ipv6.port == 7001 && ipv6.database == 2)
    }

    @Test("bad URLs are refused with a reason", arguments: [
        "localhost:6379", "http://localhost", "redis://", "redis://host:0", "redis://host:abc", "redis://host/x", "redis://host:70000",
        "redis://host?ca=/ca.pem", "rediss://host?cert=/c.pem", "rediss://host?key=/k.pem", "rediss://host?ca=", "rediss://host?ca",
        "rediss://host?verify=none", "rediss://host/1?ca=%zz",
    ])
    func invalid(url: String) {
        #expect(throws: RedisError.self) { try RedisConfiguration(url: url) }
    }

    @Test("redis+sentinel:// names Sentinels (port 26379 by default), the primary's name and a database; the credentials are the primary's")
    func sentinel() throws {
        let configuration = try RedisConfiguration(url: "redis+sentinel://:s%40cret@10.0.0.1,10.0.0.2:26380,[::1]/my%20primary/2")
        #expect(configuration.topology == .sentinel(sentinels: [
            .init(host: "10.0.0.1", port: 26379), .init(host: "10.0.0.2", port: 26380), .init(host: "::1", port: 26379),
        ], primaryName: "my primary"))
        #expect(configuration.password == "s@cret" && configuration.database == 2)
        #expect(configuration.redactedURL == "redis+sentinel://:***@10.0.0.1:26379,10.0.0.2:26380,[::1]:26379/my primary/2")
        let noDatabase = try RedisConfiguration(url: "redis+sentinel://127.0.0.1:5000/mymaster")
        #expect(noDatabase.database == 0 && noDatabase.topology == .sentinel(sentinels: [.init(host: "127.0.0.1", port: 5000)], primaryName: "mymaster"))
    }

    @Test("redis+cluster:// names seed nodes (port 6379 by default), database 0 only")
    func cluster() throws {
        let configuration = try RedisConfiguration(url: "redis+cluster://user:pw@a.internal:7000,b.internal")
        #expect(configuration.topology == .cluster(seeds: [.init(host: "a.internal", port: 7000), .init(host: "b.internal", port: 6379)]))
        #expect(configuration.username == "user" && configuration.password == "pw")
        #expect(configuration.redactedURL == "redis+cluster://user:***@a.internal:7000,b.internal:6379")
        #expect(try RedisConfiguration(url: "redis+cluster://127.0.0.1:7000/0").database == 0)
        #expect(configuration.tls == nil)
    }

    @Test("rediss+sentinel:// reaches the Sentinels and the primary over TLS, with the query of rediss://")
    func sentinelOverTLS() throws {
        let configuration = try RedisConfiguration(url: "rediss+sentinel://:pw@10.0.0.1,10.0.0.2:26380/mymaster/1?ca=/ca.pem&cert=/c.pem&key=/k.pem")
        #expect(configuration.topology == .sentinel(sentinels: [.init(host: "10.0.0.1", port: 26379), .init(host: "10.0.0.2", port: 26380)], primaryName: "mymaster"))
        #expect(configuration.tls == RedisConfiguration.TLS(caFile: "/ca.pem", certificateFile: "/c.pem", keyFile: "/k.pem"))
        #expect(configuration.database == 1 && configuration.password == "pw")
        #expect(configuration.redactedURL == "rediss+sentinel://:***@10.0.0.1:26379,10.0.0.2:26380/mymaster/1")
        #expect(try RedisConfiguration(url: "redis+sentinel://10.0.0.1/mymaster").tls == nil)
    }

    @Test("rediss+cluster:// reaches the cluster over TLS, with the query of rediss://")
    func clusterOverTLS() throws {
        let files = try RedisConfiguration(url: "rediss+cluster://:pw@a.internal:7000,b.internal/0?ca=/etc/redis/ca.pem&cert=/c.pem&key=/k.pem")
        #expect(files.topology == .cluster(seeds: [.init(host: "a.internal", port: 7000), .init(host: "b.internal", port: 6379)]))
        #expect(files.tls == RedisConfiguration.TLS(caFile: "/etc/redis/ca.pem", certificateFile: "/c.pem", keyFile: "/k.pem"))
        #expect(files.password == "pw" && files.pubSub == .sharded)
        #expect(files.redactedURL == "rediss+cluster://:***@a.internal:7000,b.internal:6379")
        let systemRoots = try RedisConfiguration(url: "rediss+cluster://clustercfg.example.com:6379")
        #expect(systemRoots.tls == RedisConfiguration.TLS() && systemRoots.host == "clustercfg.example.com")
    }

    @Test("bad Sentinel and Cluster URLs are refused with a reason", arguments: [
        ("redis+sentinel://127.0.0.1:26379", "names the primary"),
        ("redis+sentinel://127.0.0.1:26379/", "names the primary"),
        ("redis+sentinel://127.0.0.1:26379/m/x", "not a non-negative number"),
        ("redis+sentinel://127.0.0.1:26379/m/1/2", "primary-name[/db]"),
        ("redis+sentinel://127.0.0.1:0/m", "between 1 and 65535"),
        ("redis+sentinel://127.0.0.1,,127.0.0.2/m", "no host"),
        ("redis+cluster://127.0.0.1:7000/1", "database 0 only"),
        ("redis+cluster://127.0.0.1:7000?ca=/ca.pem", "use rediss+cluster:// to connect over TLS"),
        ("redis+sentinel://127.0.0.1:26379/m?ca=/ca.pem", "use rediss+sentinel:// to connect over TLS"),
        ("rediss+sentinel://127.0.0.1:26379?ca=/ca.pem", "names the primary"),
        ("rediss+sentinel://127.0.0.1:26379/m?key=/k.pem", "needs both cert and key"),
        ("rediss+cluster://127.0.0.1:7000?cert=/c.pem", "needs both cert and key"),
        ("rediss+cluster://127.0.0.1:7000?verify=none", "unknown URL parameter 'verify'"),
        ("rediss+cluster://127.0.0.1:7000/2", "database 0 only"),
        ("redis+cluster://", "no host"),
        ("redis+tcp://127.0.0.1", "unsupported scheme"),
    ])
    func invalidTopologies(url: String, reason: String) {
        do {
            _ = try RedisConfiguration(url: url)
            Issue.record("\(url) must be refused")
        } catch {
            #expect(error.code == .invalidURL)
            #expect(error.message.contains(reason), "\(error.message)")
        }
    }

    @Test("rediss:// turns TLS on; its query names the CA and the client certificate")
    func tls() throws {
        let plain = try RedisConfiguration(url: "redis://127.0.0.1:6379/0")
        #expect(plain.tls == nil)
        let systemRoots = try RedisConfiguration(url: "rediss://:pw@redis.example.com:6380")
        #expect(systemRoots.tls == RedisConfiguration.TLS())
        #expect(systemRoots.host == "redis.example.com" && systemRoots.port == 6380 && systemRoots.password == "pw")
        #expect(systemRoots.redactedURL == "rediss://:***@redis.example.com:6380/0")
        let files = try RedisConfiguration(url: "rediss://localhost:6380/2?ca=/etc/redis/ca.pem&cert=/etc/my%20app/client.crt&key=/k.pem")
        #expect(files.tls == RedisConfiguration.TLS(caFile: "/etc/redis/ca.pem", certificateFile: "/etc/my app/client.crt", keyFile: "/k.pem"))
        #expect(files.database == 2 && files.port == 6380)
        let noPath = try RedisConfiguration(url: "rediss://localhost:6380?ca=/ca.pem")
        #expect(noPath.port == 6380 && noPath.tls?.caFile == "/ca.pem")
    }

    @Test("a wrong URL parameter says which and what is known")
    func unknownParameter() {
        #expect { try RedisConfiguration(url: "rediss://host?verify=none") } throws: { error in
            "\(error)".contains("verify") && "\(error)".contains("known: ca, cert, key")
        }
        #expect { try RedisConfiguration(url: "redis://host?ca=/ca.pem") } throws: { error in
            "\(error)".contains("rediss://")
        }
    }
}
