import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import Hummingbird
import HummingbirdTesting
import HummingbirdWSClient
import JWTKit
import Logging
import NIOWebSocket
import NIOConcurrencyHelpers
import RedisTestSupport
import PresenceProtocol
import Testing

@testable import PresenceGateway

let testSecret = "test-secret-that-is-long-enough-for-hs256"
let adminToken = "test-admin-token"

/// A configuration on a free port, with the shared test Redis and a fresh key prefix.
func testConfiguration(prefix: String, node: String, redisURL: String = TestRedis.url) -> GatewayConfiguration {
    var configuration = GatewayConfiguration()
    configuration.port = 0
    configuration.redisURL = redisURL
    configuration.redisPubSub = TestRedis.pubSub
    configuration.keyPrefix = prefix
    configuration.nodeID = node
    configuration.jwtSecret = testSecret
    configuration.adminToken = adminToken
    configuration.linger = 1
    configuration.leaseTTL = 3
    return configuration
}

/// A signed client token for `user`.
func token(_ user: String, expiresIn: TimeInterval = 3600, secret: String = testSecret) async throws -> String {
    let keys = JWTKeyCollection()
    await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
    return try await keys.sign(ClientClaims(sub: .string(user), exp: .init(value: Date(timeIntervalSinceNow: expiresIn)), nbf: nil))
}

/// Runs `body` with live gateway nodes sharing one Redis and one key prefix, once each node's
/// `/readyz` says it reaches Redis (as a balancer would wait; on a Redis Cluster a node first
/// learns the slot map and connects to every primary), or after 10 s.
func withNodes(
    _ count: Int,
    prefix: String = TestRedis.uniquePrefix("gw"),
    configure: (inout GatewayConfiguration) -> Void = { _ in },
    _ body: @escaping @Sendable ([Int]) async throws -> Void
) async throws {
    var apps: [Application<RouterResponder<GatewayRequestContext>>] = []
    for index in 0..<count {
        var configuration = testConfiguration(prefix: prefix, node: "node-\(index)")
        configure(&configuration)
        apps.append(try await buildApplication(configuration: configuration, logger: TestRedis.logger()))
    }
    try await nest(apps, ports: []) { ports in
        for port in ports {
            _ = await eventually(timeout: .seconds(10)) { (try? await call(port, "GET", "/readyz").status) == 200 }
        }
        try await body(ports)
    }
}

/// Runs `body` with one live node (as ``withNodes(_:prefix:configure:_:)`` does) and the node
/// itself, for tests that set its hub's probes or ask it for a catch-up.
func withGateway(
    prefix: String = TestRedis.uniquePrefix("gw"),
    configure: (inout GatewayConfiguration) -> Void = { _ in },
    _ body: @escaping @Sendable (Int, Gateway) async throws -> Void
) async throws {
    var configuration = testConfiguration(prefix: prefix, node: "node-0")
    configure(&configuration)
    let node = try await buildGateway(configuration: configuration, logger: TestRedis.logger())
    let gateway = node.gateway
    try await nest([node.application], ports: []) { ports in
        _ = await eventually(timeout: .seconds(10)) { (try? await call(ports[0], "GET", "/readyz").status) == 200 }
        try await body(ports[0], gateway)
    }
}

private func nest<App: ApplicationProtocol>(_ apps: [App], ports: [Int], _ body: @escaping @Sendable ([Int]) async throws -> Void) async throws {
    guard let first = apps.first else {
        try await body(ports)
        return
    }
    let rest = Array(apps.dropFirst())
    try await first.test(.live) { client in
        try await nest(rest, ports: ports + [client.port!], body)
    }
}

/// A received frame: its type, id and data.
struct Frame: @unchecked Sendable, CustomStringConvertible {
    // Safe: built once from JSON and only read afterwards.
    let type: String
    let id: String?
    let data: [String: Any]
    let text: String

    var description: String { text }
    var presences: [[String: Any]] { data["presences"] as? [[String: Any]] ?? [] }
    var userID: String? { data["user_id"] as? String }
    var status: String? { data["status"] as? String }
}

/// A real WebSocket client of the gateway that records every frame it receives.
final class TestSocket: Sendable {
    private let received = NIOLockedValueBox<[Frame]>([])
    /// Every frame received so far.
    var frames: [Frame] { received.withLockedValue { $0 } }
    private let cursor = NIOLockedValueBox(0)
    private let closeCode = NIOLockedValueBox<UInt16?>(nil)
    private let closeReasonBox = NIOLockedValueBox<String?>(nil)
    /// The reason of the server's close frame, once closed.
    var closeReason: String? { closeReasonBox.withLockedValue { $0 } }
    private let outgoing: AsyncStream<String?>.Continuation
    private let task: Task<Void, Never>

    /// Connects as `device` (`nil`: no `device_id`, as clients of the original API connect), with
    /// the token in the query or, with `tokenInHeader`, as `Authorization: Bearer`.
    init(port: Int, token: String, device: String?, tokenInHeader: Bool = false) {
        var query: [String] = tokenInHeader ? [] : ["token=\(token)"]
        if let device { query.append("device_id=\(device)") }
        let url = "ws://127.0.0.1:\(port)/api/presence/subscribe" + (query.isEmpty ? "" : "?" + query.joined(separator: "&"))
        var headers = HTTPFields()
        if tokenInHeader { headers[.authorization] = "Bearer \(token)" }
        // Frames as large as the API allows (128 KiB and more; the client's default is 16 KiB).
        let configuration = WebSocketClientConfiguration(maxFrameSize: 1 << 20, additionalHeaders: headers)
        let (stream, continuation) = AsyncStream.makeStream(of: String?.self)
        self.outgoing = continuation
        let received = self.received
        let closeCode = self.closeCode
        let closeReason = self.closeReasonBox
        task = Task {
            do {
                let close = try await WebSocketClient.connect(
                    url: url, configuration: configuration,
                    logger: TestRedis.logger()
                ) { inbound, outbound, _ in
                    try await withThrowingTaskGroup(of: Void.self) { group in
                        group.addTask {
                            for await text in stream {
                                guard let text else {
                                    try await outbound.close(.goingAway, reason: nil)
                                    return
                                }
                                if text == "\u{0}close-normal" {
                                    try await outbound.close(.normalClosure, reason: nil)
                                    return
                                }
                                try await outbound.writeTextMessage(text)
                            }
                        }
                        for try await message in inbound.messages(maxSize: 1 << 20) {
                            guard case .text(let text) = message,
                                  let object = try? JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any] else { continue }
                            let frame = Frame(type: object["type"] as? String ?? "", id: object["id"] as? String, data: object["data"] as? [String: Any] ?? [:], text: text)
                            received.withLockedValue { $0.append(frame) }
                        }
                        group.cancelAll()
                    }
                }
                closeReason.withLockedValue { $0 = close?.reason }
                closeCode.withLockedValue { $0 = close.map { UInt16(webSocketErrorCode: $0.closeCode) } ?? 1006 }
            } catch {
                closeCode.withLockedValue { $0 = $0 ?? 1006 }
            }
        }
    }

    /// Sends a frame `{"type", "data", "id"?}`.
    func send(_ type: String, _ data: [String: Any] = [:], id: String? = nil) {
        var object: [String: Any] = ["type": type, "data": data]
        if let id { object["id"] = id }
        outgoing.yield(String(decoding: try! JSONSerialization.data(withJSONObject: object), as: UTF8.self))
    }

    /// Sends raw text.
    func sendRaw(_ text: String) { outgoing.yield(text) }

    /// The next frame not read yet, waiting up to `timeout`.
    func next(timeout: Duration = .seconds(5)) async throws -> Frame {
        let deadline = ContinuousClock.now + timeout
        while ContinuousClock.now < deadline {
            let index = cursor.withLockedValue { $0 }
            if let frame = received.withLockedValue({ index < $0.count ? $0[index] : nil }) {
                cursor.withLockedValue { $0 += 1 }
                return frame
            }
            try await Task.sleep(for: .milliseconds(5))
        }
        throw TestSocketError.timeout("no frame within \(timeout)")
    }

    /// The next frame of `type`, skipping others.
    func next(_ type: String, timeout: Duration = .seconds(5)) async throws -> Frame {
        let deadline = ContinuousClock.now + timeout
        while true {
            let frame = try await next(timeout: deadline - ContinuousClock.now)
            if frame.type == type { return frame }
        }
    }

    /// The first unread frame of `type`, waiting up to `timeout`; frames of other types stay
    /// unread. For answers whose order against other frames is not fixed: the `message_ack` of
    /// a `send` and the live `message` it makes reach the sender's session in either order.
    func pick(_ type: String, timeout: Duration = .seconds(5)) async throws -> Frame {
        let deadline = ContinuousClock.now + timeout
        while ContinuousClock.now < deadline {
            let start = cursor.withLockedValue { $0 }
            let found = received.withLockedValue { received -> Frame? in
                guard let index = received.indices.dropFirst(start).first(where: { received[$0].type == type }) else { return nil }
                return received.remove(at: index)
            }
            if let found { return found }
            try await Task.sleep(for: .milliseconds(5))
        }
        throw TestSocketError.timeout("no \(type) frame within \(timeout)")
    }

    /// Every frame that arrives within `window`.
    func drain(for window: Duration) async -> [Frame] {
        let deadline = ContinuousClock.now + window
        var frames: [Frame] = []
        while ContinuousClock.now < deadline, let frame = try? await next(timeout: deadline - ContinuousClock.now) {
            frames.append(frame)
        }
        return frames
    }

    /// Whether no frame arrives within `window`.
    func staysQuiet(for window: Duration) async -> Bool {
        (try? await next(timeout: window)) == nil
    }

    /// Closes with 1000 (a clean sign-off).
    func closeNormally() { outgoing.yield("\u{0}close-normal") }
    /// Closes with 1001 (the app went away; the device lingers).
    func closeAbruptly() { outgoing.yield(nil) }

    /// The close code the server sent, waiting for the connection to end.
    func closed(timeout: Duration = .seconds(10)) async -> UInt16? {
        let deadline = ContinuousClock.now + timeout
        while ContinuousClock.now < deadline {
            if let code = closeCode.withLockedValue({ $0 }) { return code }
            try? await Task.sleep(for: .milliseconds(10))
        }
        return nil
    }
}

enum TestSocketError: Error { case timeout(String) }

/// A REST call against a live node: status and the decoded JSON body.
func call(_ port: Int, _ method: String, _ path: String, token: String? = nil, body: String? = nil) async throws -> (status: Int, json: Any?, headers: [AnyHashable: Any]) {
    var request = URLRequest(url: URL(string: "http://127.0.0.1:\(port)\(path)")!)
    request.httpMethod = method
    if let token { request.setValue("Bearer \(token)", forHTTPHeaderField: "Authorization") }
    if let body { request.httpBody = Data(body.utf8) }
    let (data, response) = try await URLSession.shared.data(for: request)
    let http = response as! HTTPURLResponse
    return (http.statusCode, try? JSONSerialization.jsonObject(with: data), http.allHeaderFields)
}
