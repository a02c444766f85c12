import Foundation
import RedisTestSupport
import Testing

/// The throwaway `redis-server`s the tests start keep to themselves.
@Suite("Test Redis servers")
struct TestServerTests {
    /// Fails with Redis's default (`dump.rdb` in the working directory): replicas of the
    /// parallel tests shared that one file, and it was left in the package root.
    @Test("a replica's full sync goes to a file of the replica's own, which goes when the server does")
    func replicaSyncFile() async throws {
        let primary = try RedisServerProcess()
        var replica: RedisServerProcess? = try RedisServerProcess(arguments: ["--replicaof", "127.0.0.1", "\(primary.port)"])
        let file = try #require(replica?.dataFile)
        let synced = await eventually(timeout: .seconds(10)) {
            (try? replica?.cli("INFO", "replication"))?.contains("master_link_status:up") ?? false
        }
        try #require(synced, "the replica follows the primary")
        #expect(FileManager.default.fileExists(atPath: file.path), "the replica loaded its copy from \(file.path)")
        let other = try RedisServerProcess()
        #expect(other.dataFile != file)
        replica = nil
        #expect(!FileManager.default.fileExists(atPath: file.path), "removed with the server")
    }
}
