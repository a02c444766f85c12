import ArgumentParser
import Foundation
import Logging
import RedisClient

/// Measures pipelined throughput of the Redis client on one connection, beside redis-benchmark.
@main
struct RedisClientBench: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "redis-client-bench",
        abstract: "Pipelined SET, GET and EVALSHA throughput through the Redis client, beside redis-benchmark -P 16.",
        discussion: "Example: redis-client-bench --redis-url redis://127.0.0.1:6379/0 --requests 200000"
    )

    @Option(help: "The Redis server to measure.")
    var redisURL = ProcessInfo.processInfo.environment["PRESENCE_REDIS_URL"] ?? "redis://127.0.0.1:6379/0"

    @Option(help: "Commands per measurement.")
    var requests = 200_000

    @Option(help: "Tasks sending at once; the client pipelines them on one connection.")
    var concurrency = 64

    @Flag(help: "Skip running redis-benchmark for comparison.")
    var skipRedisBenchmark = false

    func run() async throws {
        let configuration = try RedisConfiguration(url: redisURL)
        var logger = Logger(label: "redis-client-bench")
        logger.logLevel = .warning
        let prefix = "bench-\(UUID().uuidString.prefix(8))"
        let script = RedisScript("return redis.call('SET', KEYS[1], ARGV[1])")
        var rows: [(String, Double)] = []
        try await RedisClient.withClient(configuration: configuration, logger: logger) { client in
            rows.append(("SET", try await measure("SET") { index in
                try await client.execute(SET(key: "\(prefix):\(index % 1000)", value: "value"))
            }))
            rows.append(("GET", try await measure("GET") { index in
                try await client.execute(GET(key: "\(prefix):\(index % 1000)"))
            }))
            rows.append(("EVALSHA", try await measure("EVALSHA") { index in
                try await client.evaluate(script, keys: ["\(prefix):\(index % 1000)"], arguments: ["value"])
            }))
            for start in stride(from: 0, to: 1000, by: 100) {
                try await client.execute(DEL(keys: (start..<start + 100).map { "\(prefix):\($0)" }))
            }
        }
        print("")
        print("command   this client (1 connection, \(concurrency) tasks)")
        for (name, rate) in rows {
            print(name.padding(toLength: 10, withPad: " ", startingAt: 0) + String(format: "%10.0f requests/s", rate))
        }
        if !skipRedisBenchmark {
            print("")
            print("redis-benchmark -P 16 -q -t set,get -n \(requests) (50 connections):")
            runRedisBenchmark(configuration)
        }
    }

    private func measure(_ name: String, _ command: @escaping @Sendable (Int) async throws -> Void) async throws -> Double {
        let started = ContinuousClock.now
        let perTask = requests / concurrency
        try await withThrowingTaskGroup(of: Void.self) { group in
            for task in 0..<concurrency {
                group.addTask {
                    for index in 0..<perTask { try await command(task * perTask + index) }
                }
            }
            try await group.waitForAll()
        }
        let elapsed = ContinuousClock.now - started
        let seconds = Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18
        FileHandle.standardError.write(Data("\(name): \(perTask * concurrency) commands in \(String(format: "%.2f", seconds)) s\n".utf8))
        return Double(perTask * concurrency) / seconds
    }

    private func runRedisBenchmark(_ configuration: RedisConfiguration) {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        var arguments = ["redis-benchmark", "-h", configuration.host, "-p", "\(configuration.port)", "-P", "16", "-q", "-t", "set,get", "-n", "\(requests)"]
        if let password = configuration.password { arguments += ["-a", password] }
        process.arguments = arguments
        do {
            try process.run()
            process.waitUntilExit()
        } catch {
            print("redis-benchmark could not run: \(error)")
        }
    }
}
