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
    private let loops = SessionLoops()

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
        // A session that is cancelled before its upgrade is answered has its event loop shut
        // down, which closes its connection: the library's wait for the upgrade does not end on
        // cancellation, and a gateway that never answers would hold it forever. Once upgraded,
        // cancelling ends the session the ordinary way.
        let loop = loops.current()
        let upgraded = NIOLockedValueBox(false)
        let close: WebSocketCloseFrame?
        do {
            close = try await withTaskCancellationHandler {
                try await connect(url: url, configuration: configuration, on: loop, outgoing: outgoing, received: received) {
                    upgraded.withLockedValue { $0 = true }
                }
            } onCancel: {
                if !upgraded.withLockedValue({ $0 }) { loops.abandon(loop) }
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

/// The event loop a transport's sessions run on: one thread, made when first needed, shared by
/// the transport's copies, and shut down when the last copy goes. An attempt given up before its
/// upgrade was answered takes the loop down with it, which closes its connection; the next
/// attempt gets a new one.
final class SessionLoops: Sendable {
    private let group = NIOLockedValueBox<MultiThreadedEventLoopGroup?>(nil)

    /// The loop for the next session.
    func current() -> MultiThreadedEventLoopGroup {
        group.withLockedValue { group in
            if let group { return group }
            let made = MultiThreadedEventLoopGroup(numberOfThreads: 1)
            group = made
            return made
        }
    }

    /// Shuts `loop` down, closing every connection on it, and forgets it.
    func abandon(_ loop: MultiThreadedEventLoopGroup) {
        group.withLockedValue { group in
            if group === loop { group = nil }
        }
        loop.shutdownGracefully { _ in }
    }

    deinit {
        group.withLockedValue { $0 }?.shutdownGracefully { _ in }
    }
}
#endif
