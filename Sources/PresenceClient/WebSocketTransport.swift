#if canImport(HummingbirdWSClient) && canImport(NIOPosix)
import Foundation
import HummingbirdWSClient
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import NIOWebSocket
import PresenceProtocol

/// The default transport on Linux: SwiftNIO WebSockets (`ws://` and `wss://`), with pings that
/// notice a dead connection. Built where the package's SwiftNIO dependencies are (Linux).
public struct WebSocketTransport: PresenceTransport {
    /// Largest frame accepted from the gateway (an `initial_state` of thousands of users).
    public var maxFrameSize: Int
    /// How often to ping; a ping without a pong by the next one drops the connection.
    public var pingInterval: Duration
    /// How long to wait for the gateway's answer to a close before dropping the connection.
    public var closeTimeout: Duration
    private let logger: Logger

    /// A transport; `logger` gets connection-level detail at `debug` and below.
    public init(maxFrameSize: Int = 4 << 20, pingInterval: Duration = .seconds(15), closeTimeout: Duration = .seconds(2), logger: Logger) {
        self.maxFrameSize = maxFrameSize
        self.pingInterval = pingInterval
        self.closeTimeout = closeTimeout
        self.logger = logger
    }

    public func session(url: URL, outgoing: AsyncStream<OutgoingFrame>, received: @escaping @Sendable (String) async -> Void) async throws -> UInt16? {
        let configuration = WebSocketClientConfiguration(
            maxFrameSize: maxFrameSize, closeTimeout: closeTimeout, autoPing: .enabled(timePeriod: pingInterval)
        )
        // Each session runs on an event loop of its own, shut down when the session ends. A
        // session cancelled before its upgrade is answered has its loop shut down at once, which
        // closes its connection: the library's wait for the upgrade does not end on
        // cancellation, and a gateway that never answers would hold it forever. Its own loop
        // means that shutdown ends nothing else: a session opened while an earlier attempt of
        // this transport was still waiting for its upgrade goes on.
        let attempt = SessionAttempt()
        defer { attempt.end() }
        let close: WebSocketCloseFrame?
        do {
            close = try await withTaskCancellationHandler {
                try await connect(url: url, configuration: configuration, on: attempt.loop, outgoing: outgoing, received: received) {
                    attempt.upgraded()
                }
            } onCancel: {
                attempt.cancelled()
            }
        } catch let error as WebSocketClientError where error == .webSocketUpgradeFailed {
            throw PresenceTransportError.upgradeRefused
        }
        return close.map { UInt16(webSocketErrorCode: $0.closeCode) }
    }

    private func connect(
        url: URL,
        configuration: WebSocketClientConfiguration,
        on loop: MultiThreadedEventLoopGroup,
        outgoing: AsyncStream<OutgoingFrame>,
        received: @escaping @Sendable (String) async -> Void,
        upgraded: @escaping @Sendable () -> Void
    ) async throws -> WebSocketCloseFrame? {
        let maxFrameSize = self.maxFrameSize
        return try await WebSocketClient.connect(url: url.absoluteString, configuration: configuration, eventLoopGroup: loop, logger: logger) { inbound, outbound, _ in
            upgraded()
            try await withThrowingTaskGroup(of: Void.self) { group in
                group.addTask {
                    for await frame in outgoing {
                        switch frame {
                        case .text(let text):
                            try await outbound.writeTextMessage(text)
                        case .close(let code):
                            try await outbound.close(.init(codeNumber: Int(code.rawValue)), reason: nil)
                            return
                        }
                    }
                }
                for try await message in inbound.messages(maxSize: maxFrameSize) {
                    if case .text(let text) = message { await received(text) }
                }
                group.cancelAll()
            }
        }
    }
}

/// One session's event loop (one thread) and whether its upgrade was answered. The loop is shut
/// down once: when the session ends, or at once when the session is cancelled before its
/// upgrade was answered (which closes the connection that waits for it).
final class SessionAttempt: Sendable {
    let loop = MultiThreadedEventLoopGroup(numberOfThreads: 1)
    private let state = NIOLockedValueBox((upgraded: false, shutDown: false))

    func upgraded() {
        state.withLockedValue { $0.upgraded = true }
    }

    /// The session's task was cancelled: before the upgrade, nothing else would end the wait.
    func cancelled() {
        if state.withLockedValue({ !$0.upgraded }) { shutDown() }
    }

    /// The session is over, whichever way it ended.
    func end() { shutDown() }

    private func shutDown() {
        let first = state.withLockedValue { state -> Bool in
            defer { state.shutDown = true }
            return !state.shutDown
        }
        if first { loop.shutdownGracefully { _ in } }
    }
}
#endif
