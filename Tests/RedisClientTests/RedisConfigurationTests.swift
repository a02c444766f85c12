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
