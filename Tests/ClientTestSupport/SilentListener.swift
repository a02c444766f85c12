import Foundation

/// A listening socket on 127.0.0.1 that never answers: the kernel completes the TCP handshake,
/// and a WebSocket upgrade request sent to it then waits for an answer that never comes.
public final class SilentListener: @unchecked Sendable {
    public let port: Int
    private let listener: Int32
    private var accepted: [Int32] = []

    public init() throws {
        listener = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        guard listener >= 0 else { throw POSIXError(POSIXErrorCode(rawValue: errno) ?? .EMFILE) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let listener = listener
        let bound = withUnsafeMutablePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                bind(listener, $0, length) == 0 && listen(listener, 16) == 0 && getsockname(listener, $0, &length) == 0
            }
        }
        guard bound else {
            close(listener)
            throw POSIXError(POSIXErrorCode(rawValue: errno) ?? .EADDRINUSE)
        }
        port = Int(UInt16(bigEndian: address.sin_port))
    }

    /// Takes the next connection off the queue, still without a word to it; false if none came
    /// within `timeout`. Not thread-safe: one caller at a time.
    public func accept(within timeout: Duration) -> Bool {
        var poller = pollfd(fd: listener, events: Int16(POLLIN), revents: 0)
        let milliseconds = Int32(timeout.components.seconds * 1_000 + timeout.components.attoseconds / 1_000_000_000_000_000)
        guard poll(&poller, 1, milliseconds) == 1 else { return false }
        let connection = Foundation.accept(listener, nil, nil)
        guard connection >= 0 else { return false }
        accepted.append(connection)
        return true
    }

    deinit {
        for connection in accepted { close(connection) }
        close(listener)
    }
}
