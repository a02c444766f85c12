import Testing

@testable import RedisClient

@Suite("redis:// URLs")
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
    ])
    func invalid(url: String) {
        #expect(throws: RedisError.self) { try RedisConfiguration(url: url) }
    }
}
