import ArgumentParser
import Foundation
import HummingbirdWSClient
import JWTKit
import Logging
import NIOConcurrencyHelpers
import PresenceEngine
import PresenceGateway
import ServiceLifecycle

/// Time from a status change on node A to the watcher's `presence_update` on node B.
struct LatencyBench: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "latency",
        abstract: "Starts two gateway nodes in this process; users on node A change status at a fixed rate over WebSocket; a watcher on node B times each presence_update."
    )

    @OptionGroup var common: CommonOptions
    @Option(help: "Status changes per second.") var rate = 1000
    @Option(help: "Seconds to measure.") var duration = 10
    @Option(help: "Users changing status (one WebSocket session each, on node A).") var users = 100

    struct Claims: JWTPayload {
        var sub: SubjectClaim
        var exp: ExpirationClaim
        func verify(using algorithm: some JWTAlgorithm) async throws {}
    }

    func run() async throws {
        var logger = Logger(label: "presence-bench")
        logger.logLevel = .warning
        let prefix = "bench-\(UUID().uuidString.prefix(8).lowercased())"
        let secret = "bench-secret-bench-secret-bench-secret"
        let ports = NIOLockedValueBox<[String: Int]>([:])
        var services: [any Service] = []
        for name in ["a", "b"] {
            var configuration = GatewayConfiguration()
            configuration.port = 0
            configuration.redisURL = common.redisURL
            configuration.keyPrefix = prefix
            configuration.nodeID = "bench-\(name)"
            configuration.jwtSecret = secret
            configuration.visibility = .open
            configuration.statusRate = Double(rate)
            configuration.maxIDsPerRequest = max(500, users)
            let node = try await buildGateway(configuration: configuration, logger: logger) { port in
                ports.withLockedValue { $0[name] = port }
            }
            services.append(node.application)
        }
        let group = ServiceGroup(configuration: .init(services: services, logger: logger))
        let running = Task { try await group.run() }
        while ports.withLockedValue({ $0.count }) < 2 { try await Task.sleep(for: .milliseconds(10)) }
        let portA = ports.withLockedValue { $0["a"]! }, portB = ports.withLockedValue { $0["b"]! }

        let keys = JWTKeyCollection()
        await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
        func url(_ port: Int, _ user: String, _ device: String) async throws -> String {
            let token = try await keys.sign(Claims(sub: .init(value: user), exp: .init(value: Date(timeIntervalSinceNow: 3600))))
            return "ws://127.0.0.1:\(port)/api/presence/subscribe?token=\(token)&device_id=\(device)"
        }

        // Send times of pending changes, by "user/status", oldest first.
        let pending = NIOLockedValueBox<[String: [ContinuousClock.Instant]]>([:])
        let latencies = NIOLockedValueBox<[Double]>([])
        let ready = NIOLockedValueBox(0)
        var senders: [AsyncStream<String>.Continuation] = []
        var clients: [Task<Void, any Error>] = []
        let names = (0..<users).map { "bench-user-\($0)" }

        let (watcherOut, watcherContinuation) = AsyncStream.makeStream(of: String.self)
        let watcherURL = try await url(portB, "bench-watcher", "w")
        clients.append(Task {
            try await WebSocketClient.connect(url: watcherURL, logger: logger) { inbound, outbound, _ in
                async let writer: Void = { for await text in watcherOut { try await outbound.writeTextMessage(text) } }()
                for try await message in inbound.messages(maxSize: 1 << 22) {
                    guard case .text(let text) = message,
                          let object = try? JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any] else { continue }
                    if object["type"] as? String == "initial_state" { ready.withLockedValue { $0 += 1 } }
                    guard object["type"] as? String == "presence_update", let data = object["data"] as? [String: Any],
                          let user = data["user_id"] as? String, let status = data["status"] as? String else { continue }
                    let now = ContinuousClock.now
                    if let sent = pending.withLockedValue({ $0["\(user)/\(status)"]?.isEmpty == false ? $0["\(user)/\(status)"]!.removeFirst() : nil }) {
                        latencies.withLockedValue { $0.append(seconds(now - sent) * 1000) }
                    }
                }
                try await writer
            }
        })
        for (index, name) in names.enumerated() {
            let (stream, continuation) = AsyncStream.makeStream(of: String.self)
            senders.append(continuation)
            let userURL = try await url(portA, name, "d\(index)")
            clients.append(Task {
                try await WebSocketClient.connect(url: userURL, logger: logger) { inbound, outbound, _ in
                    async let writer: Void = { for await text in stream { try await outbound.writeTextMessage(text) } }()
                    for try await message in inbound.messages(maxSize: 1 << 22) {
                        if case .text(let text) = message, text.contains("initial_state") { ready.withLockedValue { $0 += 1 } }
                    }
                    try await writer
                }
            })
        }
        while ready.withLockedValue({ $0 }) < users + 1 { try await Task.sleep(for: .milliseconds(20)) }
        watcherContinuation.yield(#"{"type":"subscribe","data":{"user_ids":["# + names.map { "\"\($0)\"" }.joined(separator: ",") + "]},\"id\":\"s\"}")
        try await Task.sleep(for: .seconds(1))

        // Every user is online; each change flips one user between away and online.
        var away = [Bool](repeating: false, count: users)
        let total = rate * duration
        let start = ContinuousClock.now
        for step in 0..<total {
            let due = start + .nanoseconds(Int64(step) * 1_000_000_000 / Int64(rate))
            if due > ContinuousClock.now { try await Task.sleep(until: due) }
            let index = step % users
            away[index].toggle()
            let status = away[index] ? "away" : "online"
            pending.withLockedValue { $0["\(names[index])/\(status)", default: []].append(.now) }
            senders[index].yield(#"{"type":"status","data":{"status":""# + status + #""}}"#)
            if step % rate == 0 { progress("latency: \(step / rate)/\(duration) s, \(latencies.withLockedValue { $0.count }) updates timed") }
        }
        try await Task.sleep(for: .seconds(2))
        endProgress()
        let measured = latencies.withLockedValue { $0 }.sorted()
        let elapsed = seconds(ContinuousClock.now - start) - 2
        print("")
        print("status change on node A → presence_update at a watcher on node B, \(rate)/s for \(duration) s, \(users) users")
        print(String(format: "  sent %d, timed %d (%.0f/s achieved)", total, measured.count, Double(total) / elapsed))
        print(String(format: "  p50 %.2f ms   p90 %.2f ms   p99 %.2f ms   p99.9 %.2f ms   max %.2f ms",
                     percentile(measured, 0.5), percentile(measured, 0.9), percentile(measured, 0.99), percentile(measured, 0.999), measured.last ?? .nan))
        for client in clients { client.cancel() }
        await group.triggerGracefulShutdown()
        running.cancel()
    }
}
