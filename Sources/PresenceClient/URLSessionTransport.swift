import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif

/// A transport on Foundation's `URLSessionWebSocketTask`: the default on Apple platforms (an app
/// that adds the package builds nothing else), and usable on Linux through FoundationNetworking.
/// It pings the gateway every `pingInterval`; a ping unanswered by the next one drops the
/// connection.
public struct URLSessionTransport: PresenceTransport {
    /// Largest frame accepted from the gateway.
    public var maxFrameSize: Int
    /// How often to ping.
    public var pingInterval: Duration
    /// How long to wait for the gateway's answer to a close before dropping the connection.
    public var closeTimeout: Duration

    /// A transport.
    public init(maxFrameSize: Int = 4 << 20, pingInterval: Duration = .seconds(15), closeTimeout: Duration = .seconds(2)) {
        self.maxFrameSize = maxFrameSize
        self.pingInterval = pingInterval
        self.closeTimeout = closeTimeout
    }

    public func session(url: URL, outgoing: AsyncStream<OutgoingFrame>, received: @escaping @Sendable (String) async -> Void) async throws -> UInt16? {
        let session = URLSession(configuration: .ephemeral)
        defer { session.invalidateAndCancel() }
        let task = session.webSocketTask(with: url)
        task.maximumMessageSize = maxFrameSize
        task.resume()
        let pingInterval = self.pingInterval
        let closeTimeout = self.closeTimeout
        return try await withTaskCancellationHandler {
            try await withThrowingTaskGroup(of: UInt16?.self) { group in
                // Only the reader ends the session: with the close code, or the drop it saw.
                group.addTask { try await Self.read(task, received: received) }
                group.addTask {
                    for await frame in outgoing {
                        switch frame {
                        case .text(let text):
                            try await task.send(.string(text))
                        case .close(let code):
                            task.cancel(with: URLSessionWebSocketTask.CloseCode(rawValue: Int(code.rawValue)) ?? .normalClosure, reason: nil)
                            // The reader ends when the close is answered; this bounds the wait.
                            try await Task.sleep(for: closeTimeout)
                            return nil
                        }
                    }
                    try await Task.sleep(for: .seconds(86_400 * 365))
                    return nil
                }
                group.addTask {
                    while true {
                        try await Task.sleep(for: pingInterval)
                        try await Self.ping(task, within: pingInterval)
                    }
                }
                defer { group.cancelAll() }
                return try await group.next() ?? nil
            }
        } onCancel: {
            task.cancel(with: .goingAway, reason: nil)
        }
    }

    /// Whether this Foundation's URLSession opens WebSockets: Apple's does; Linux's only on a
    /// libcurl built with them. Asks it to open one to a port nothing listens on: an unsupported
    /// scheme is said before any connection.
    public static func isSupported() async -> Bool {
        let (outgoing, _) = AsyncStream.makeStream(of: OutgoingFrame.self)
        do {
            _ = try await URLSessionTransport().session(url: URL(string: "ws://127.0.0.1:9/")!, outgoing: outgoing) { _ in }
        } catch PresenceTransportError.unsupported {
            return false
        } catch {}
        return true
    }

    /// Hands on text frames until the connection ends; returns the gateway's close code, or
    /// `nil` when it dropped without one. An upgrade answered with another status than 101 is
    /// ``PresenceTransportError/upgradeRefused``.
    private static func read(_ task: URLSessionWebSocketTask, received: @escaping @Sendable (String) async -> Void) async throws -> UInt16? {
        var opened = false
        while true {
            let message: URLSessionWebSocketTask.Message
            do {
                message = try await task.receive()
            } catch {
                if !opened, let failure = error as? URLError, failure.code == .unsupportedURL {
                    throw PresenceTransportError.unsupported("URLSession cannot open \(task.originalRequest?.url?.scheme ?? "ws")://: \(failure.localizedDescription)")
                }
                if task.closeCode != .invalid { return UInt16(clamping: task.closeCode.rawValue) }
                if !opened, let response = task.response as? HTTPURLResponse, response.statusCode != 101 {
                    throw PresenceTransportError.upgradeRefused
                }
                return nil
            }
            opened = true
            if case .string(let text) = message { await received(text) }
        }
    }

    /// Pings, and throws unless the pong comes within `limit`.
    private static func ping(_ task: URLSessionWebSocketTask, within limit: Duration) async throws {
        let answered = Locked(false)
        try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask {
                try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Void, any Error>) in
                    task.sendPing { error in
                        answered.withLock { $0 = true }
                        if let error { continuation.resume(throwing: error) } else { continuation.resume() }
                    }
                }
            }
            group.addTask {
                try await Task.sleep(for: limit)
                if !answered.withLock({ $0 }) { throw URLError(.timedOut) }
            }
            try await group.next()
            group.cancelAll()
        }
    }
}
