// What the client's tests and the gateway's fault tests share: tokens, the environment of a test's
// gateway processes, and a client that records everything it reports.

import Foundation
import JWTKit
import Logging
import NIOConcurrencyHelpers
import PresenceClient
import RedisTestSupport

public let secret = "client-test-secret-that-is-long-enough-for-hs256"
public let adminToken = "client-test-admin-token"

struct Claims: JWTPayload {
    var sub: SubjectClaim
    var exp: ExpirationClaim
    public func verify(using algorithm: some JWTAlgorithm) async throws {}
}

/// An HS256 token for `user` that expires in `seconds`.
public func mint(_ user: String, expiresIn seconds: TimeInterval = 3600, secret: String = secret) async throws -> String {
    let keys = JWTKeyCollection()
    await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
    return try await keys.sign(Claims(sub: .init(value: user), exp: .init(value: Date(timeIntervalSinceNow: seconds))))
}

/// Environment for gateway processes of one test: its own key prefix, short lease and linger.
public func nodeEnvironment(prefix: String, redisURL: String = TestRedis.url, extra: [String: String] = [:]) -> [String: String] {
    [
        "PRESENCE_REDIS_URL": redisURL, "PRESENCE_KEY_PREFIX": prefix, "PRESENCE_JWT_SECRET": secret,
        "PRESENCE_ADMIN_TOKEN": adminToken, "PRESENCE_LEASE_TTL": "3", "PRESENCE_LINGER": "2",
    ].merging(extra) { _, new in new }
}

public func admin(_ node: GatewayProcess, _ method: String, _ path: String, _ body: String? = nil) -> (status: Int, body: String)? {
    GatewayProcess.http(port: node.port, method: method, path: path, headers: ["Authorization": "Bearer \(adminToken)"], body: body)
}

/// A client of `user` and everything it reported, running until the test ends.
public final class LiveClient: Sendable {
    public let client: PresenceClient
    public let user: String
    public let calls = NIOLockedValueBox<[Bool]>([])
    private let log = NIOLockedValueBox<[(at: ContinuousClock.Instant, event: PresenceClientEvent)]>([])
    private let running: Task<Void, Never>
    private let listening: Task<Void, Never>

    public convenience init(_ user: String, device: String, nodes: [GatewayProcess], tokenLifetime: TimeInterval = 3600,
                     outboxStore: any MessageOutboxStore = MemoryMessageOutboxStore(),
                     configure: (inout PresenceClientConfiguration) -> Void = { _ in }) async throws {
        try await self.init(user, device: device, ports: nodes.map(\.port), tokenLifetime: tokenLifetime, outboxStore: outboxStore, configure: configure)
    }

    public init(_ user: String, device: String, ports: [Int], tokenLifetime: TimeInterval = 3600, secret: String = secret,
         outboxStore: any MessageOutboxStore = MemoryMessageOutboxStore(),
         configure: (inout PresenceClientConfiguration) -> Void = { _ in }) async throws {
        self.user = user
        var configuration = try PresenceClientConfiguration(
            gatewayURLs: ports.map { URL(string: "ws://127.0.0.1:\($0)")! }, deviceID: device
        )
        configure(&configuration)
        let calls = self.calls
        client = PresenceClient(configuration: configuration, tokenProvider: { refresh in
            calls.withLockedValue { $0.append(refresh) }
            return try await mint(user, expiresIn: tokenLifetime, secret: secret)
        }, outboxStore: outboxStore, logger: TestRedis.logger("client-\(user)"))
        let events = await client.events()
        let log = self.log
        listening = Task { for await event in events { log.withLockedValue { $0.append((ContinuousClock.now, event)) } } }
        let client = self.client
        running = Task { await client.run() }
    }

    deinit {
        running.cancel()
        listening.cancel()
    }

    public var events: [PresenceClientEvent] { log.withLockedValue { $0.map(\.event) } }

    /// When each session became connected.
    public var connectedAt: [ContinuousClock.Instant] {
        log.withLockedValue { $0.filter { $0.event == .connection(.connected) }.map(\.at) }
    }

    /// Statuses heard for `user`, in order.
    public func statuses(of user: String) -> [PresenceStatus] {
        events.compactMap { if case .presence(let presence) = $0, presence.userID == user { presence.status } else { nil } }
    }

    /// Statuses heard for `user` once it was first seen online (an `initial_state` may say
    /// offline before it connects).
    public func statusesSinceOnline(of user: String) -> [PresenceStatus] {
        Array(statuses(of: user).drop { $0 != .online })
    }

    /// Connection states, and what was heard of `peer`, since `start`: for explaining a failure.
    public func timeline(since start: ContinuousClock.Instant, peer: String? = nil) -> [String] {
        log.withLockedValue { entries in
            entries.filter { $0.at >= start }.compactMap { entry in
                let offset = String(format: "+%.3fs", Double((entry.at - start).components.attoseconds) / 1e18 + Double((entry.at - start).components.seconds))
                switch entry.event {
                case .connection(let state): return "\(offset) \(state)"
                case .presence(let presence) where presence.userID == peer: return "\(offset) \(presence.userID) \(presence.status.rawValue)"
                default: return nil
                }
            }
        }
    }

    /// Every presence update, when it arrived.
    public var arrivalsOfAll: [(at: ContinuousClock.Instant, presence: PresenceSnapshot)] {
        log.withLockedValue { entries in
            entries.compactMap { entry in if case .presence(let presence) = entry.event { (entry.at, presence) } else { nil } }
        }
    }

    /// When each update about `user` arrived, with its status.
    public func arrivals(of user: String) -> [(at: ContinuousClock.Instant, status: PresenceStatus)] {
        log.withLockedValue { entries in
            entries.compactMap { entry in
                if case .presence(let presence) = entry.event, presence.userID == user { (entry.at, presence.status) } else { nil }
            }
        }
    }

    /// How many times the session became connected.
    public var connections: Int { events.filter { $0 == .connection(.connected) }.count }

    public func waitUntil(_ timeout: Duration = .seconds(10), _ condition: @escaping @Sendable (PresenceClient) async -> Bool) async -> Bool {
        let client = self.client
        return await eventually(timeout: timeout, poll: .milliseconds(10)) { await condition(client) }
    }

    public func connected(_ timeout: Duration = .seconds(10)) async -> Bool {
        await waitUntil(timeout) { await $0.connectionState == .connected }
    }

    public func sees(_ user: String, _ status: PresenceStatus, within timeout: Duration = .seconds(5)) async -> Bool {
        await waitUntil(timeout) { await $0.presence(of: user)?.status == status }
    }

    public func finished(within timeout: Duration) async -> Bool {
        await eventually(timeout: timeout, poll: .milliseconds(10)) { [running] in
            await withTaskGroup(of: Bool.self) { group in
                group.addTask { await running.value; return true }
                group.addTask { try? await Task.sleep(for: .milliseconds(10)); return false }
                let first = await group.next() ?? false
                group.cancelAll()
                return first
            }
        }
    }
}


/// Clients changing status in turn until stopped, one change every `interval`: each client away,
/// then each online, and so on. Remembers the status each was last set to, which a watcher must
/// end up seeing whatever faults came meanwhile.
public final class StatusChurn: Sendable {
    private let lastSet = NIOLockedValueBox<[String: PresenceStatus]>([:])
    private let task: Task<Void, Never>

    public init(_ clients: [LiveClient], every interval: Duration) {
        let lastSet = lastSet
        task = Task {
            var round = 0
            while !Task.isCancelled {
                let client = clients[round % clients.count]
                let status: PresenceStatus = (round / clients.count).isMultiple(of: 2) ? .away : .online
                await client.client.setStatus(status)
                lastSet.withLockedValue { $0[client.user] = status }
                round += 1
                try? await Task.sleep(for: interval)
            }
        }
    }

    /// Stops, once the change under way is made.
    public func stop() async {
        task.cancel()
        _ = await task.value
    }

    /// The status `user` was last set to; `nil` before their first change.
    public func lastStatus(of user: String) -> PresenceStatus? {
        lastSet.withLockedValue { $0[user] }
    }
}
