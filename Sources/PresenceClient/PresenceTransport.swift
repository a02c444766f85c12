import Foundation
import Logging
import PresenceProtocol

/// A frame the client writes.
public enum OutgoingFrame: Sendable, Hashable {
    /// A text frame.
    case text(String)
    /// A close frame with this code; the session ends once the gateway answers it.
    case close(CloseCode)
}

/// How the gateway failed a session before it opened.
public enum PresenceTransportError: Error, Sendable {
    /// The HTTP upgrade was refused (a bad token, a bad parameter, or a node not serving).
    case upgradeRefused
    /// This transport cannot open WebSockets here (Linux's FoundationNetworking on a libcurl
    /// built without them, as Debian 12's).
    case unsupported(String)
}

/// Opens WebSocket sessions: the seam between the client's logic and the network.
public protocol PresenceTransport: Sendable {
    /// Runs one session with `url`: writes every frame of `outgoing` in order and hands every
    /// text frame received to `received`, until the gateway closes, `outgoing` closes it, or
    /// the connection drops. Cancelling the calling task aborts the session. Returns the close
    /// code the gateway sent, or `nil` when the connection ended without one.
    func session(url: URL, outgoing: AsyncStream<OutgoingFrame>, received: @escaping @Sendable (String) async -> Void) async throws -> UInt16?
}

/// The transport a client uses unless given one: SwiftNIO WebSockets on Linux, where the package
/// builds them; `URLSessionWebSocketTask` on Apple platforms, where an app that adds the package
/// builds no SwiftNIO.
func defaultPresenceTransport(logger: Logger) -> any PresenceTransport {
    #if canImport(HummingbirdWSClient) && canImport(NIOPosix)
    WebSocketTransport(logger: logger)
    #else
    URLSessionTransport()
    #endif
}
