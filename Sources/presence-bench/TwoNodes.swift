import Foundation
import HummingbirdWSClient
import JWTKit
import Logging
import NIOConcurrencyHelpers
import PresenceEngine
import PresenceGateway
import PresenceProtocol
import ServiceLifecycle

/// Two gateway nodes in this process on one Redis, and WebSocket clients for them.
struct TwoNodes {
    let ports: [Int]
    let prefix: String
    let logger: Logger
    private let keys: JWTKeyCollection
    private let group: ServiceGroup
    private let running: Task<Void, any Error>

    struct Claims: JWTPayload {
        var sub: SubjectClaim
        var exp: ExpirationClaim
        func verify(using algorithm: some JWTAlgorithm) async throws {}
    }

    /// Starts nodes "a" and "b" with the given visibility (open by default) and status rate.
    static func start(redisURL: String, statusRate: Double, maxIDs: Int, visibility: Visibility = .open,
                      configure: (inout GatewayConfiguration) -> Void = { _ in }) async throws -> TwoNodes {
        var logger = Logger(label: "presence-bench")
        logger.logLevel = .warning
        let prefix = "bench-\(UUID().uuidString.prefix(8).lowercased())"
        let secret = "bench-secret-bench-secret-bench-secret"
        let bound = NIOLockedValueBox<[String: Int]>([:])
        var services: [any Service] = []
        for name in ["a", "b"] {
            var configuration = GatewayConfiguration()
            configuration.port = 0
            configuration.redisURL = redisURL
            configuration.keyPrefix = prefix
            configuration.nodeID = "bench-\(name)"
            configuration.jwtSecret = secret
            configuration.visibility = visibility
            configuration.statusRate = statusRate
            configuration.typingRate = statusRate
            configuration.maxIDsPerRequest = max(500, maxIDs)
            configure(&configuration)
            let node = try await buildGateway(configuration: configuration, logger: logger) { port in
                bound.withLockedValue { $0[name] = port }
            }
            services.append(node.application)
        }
        let group = ServiceGroup(configuration: .init(services: services, logger: logger))
        let running = Task { try await group.run() }
        while bound.withLockedValue({ $0.count }) < 2 { try await Task.sleep(for: .milliseconds(10)) }
        let keys = JWTKeyCollection()
        await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
        let ports = bound.withLockedValue { [$0["a"]!, $0["b"]!] }
        return TwoNodes(ports: ports, prefix: prefix, logger: logger, keys: keys, group: group, running: running)
    }

    /// A token for `user`, valid for an hour.
    func token(_ user: String) async throws -> String {
        try await keys.sign(Claims(sub: .init(value: user), exp: .init(value: Date(timeIntervalSinceNow: 3600))))
    }

    /// Opens a session on node `node` (0 or 1); every text frame received goes to `onText`.
    /// Returns the continuation that sends frames.
    func connect(node: Int, user: String, device: String, onText: @escaping @Sendable (String) -> Void) async throws -> (AsyncStream<String>.Continuation, Task<Void, any Error>) {
        let token = try await keys.sign(Claims(sub: .init(value: user), exp: .init(value: Date(timeIntervalSinceNow: 3600))))
        let url = "ws://127.0.0.1:\(ports[node])/api/presence/subscribe?token=\(token)&device_id=\(device)"
        let (stream, continuation) = AsyncStream.makeStream(of: String.self)
        let logger = self.logger
        let task = Task {
            try await WebSocketClient.connect(url: url, logger: logger) { inbound, outbound, _ in
                async let writer: Void = { for await text in stream { try await outbound.writeTextMessage(text) } }()
                for try await message in inbound.messages(maxSize: 1 << 22) {
                    if case .text(let text) = message { onText(text) }
                }
                try await writer
            }
            return
        }
        return (continuation, task)
    }

    func stop() async {
        await group.triggerGracefulShutdown()
        running.cancel()
    }
}

/// A frame from a node, or `nil` for text that is none this version knows.
func serverFrame(_ text: String) -> ServerFrame? {
    try? benchFrames.serverMessage(text).frame
}

/// The text of a client frame.
func clientText(_ frame: ClientFrame, id: String? = nil) -> String {
    benchFrames.text(ClientMessage(frame, id: id))
}

/// Frames as a client writes and reads them.
let benchFrames = FrameCoder()

/// Prints a latency line from milliseconds.
func latencyLine(_ values: [Double]) -> String {
    let sorted = values.sorted()
    return String(format: "p50 %.2f ms   p90 %.2f ms   p99 %.2f ms   p99.9 %.2f ms   max %.2f ms",
                  percentile(sorted, 0.5), percentile(sorted, 0.9), percentile(sorted, 0.99), percentile(sorted, 0.999), sorted.last ?? .nan)
}
