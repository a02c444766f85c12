import Foundation
import RedisTestSupport

#if canImport(Glibc)
import Glibc
#endif

/// A WebSocket client on a blocking socket with a small receive buffer: it opens a session,
/// subscribes, and then reads nothing until told to (a stalled client), or reads and discards
/// everything on a thread of its own (``startReading()``).
public final class RawWebSocketClient: @unchecked Sendable {
    // Safe: used by one test, one call at a time.
    private let fd: Int32

    public init(port: Int, token: String, device: String, watching users: [String], receiveBuffer: Int32? = 4096) throws {
        guard let fd = connectLoopback(port: port, receiveBuffer: receiveBuffer) else { throw GatewayProcessError("cannot connect to \(port)") }
        self.fd = fd
        let key = Data((0..<16).map { _ in UInt8.random(in: 0...255) }).base64EncodedString()
        try send(Array("""
            GET /api/presence/subscribe?token=\(token)&device_id=\(device) HTTP/1.1\r
            Host: 127.0.0.1:\(port)\r
            Upgrade: websocket\r
            Connection: Upgrade\r
            Sec-WebSocket-Key: \(key)\r
            Sec-WebSocket-Version: 13\r
            \r

            """.utf8))
        var response: [UInt8] = []
        var byte: UInt8 = 0
        while !response.ends(with: Array("\r\n\r\n".utf8)), read(fd, &byte, 1) == 1 { response.append(byte) }
        guard String(decoding: response, as: UTF8.self).hasPrefix("HTTP/1.1 101") else {
            close(fd)
            throw GatewayProcessError("the upgrade was refused: \(String(decoding: response, as: UTF8.self))")
        }
        guard !users.isEmpty else { return }
        let ids = users.map { "\"\($0)\"" }.joined(separator: ",")
        try sendText(#"{"type":"subscribe","data":{"user_ids":[\#(ids)]},"id":"s"}"#)
    }

    deinit { close(fd) }

    /// One masked text frame, as a client must send it.
    public func sendText(_ text: String) throws {
        try sendFrame(opcode: 0x1, payload: Array(text.utf8))
    }

    /// One masked frame of any opcode (0x0 continuation, 0x1 text, 0x8 close, 0x9 ping), final
    /// or not, with any payload: what a client may send, and what a hostile one would.
    public func sendFrame(opcode: UInt8, payload: [UInt8], fin: Bool = true) throws {
        var frame: [UInt8] = [(fin ? 0x80 : 0) | opcode]
        if payload.count < 126 {
            frame.append(0x80 | UInt8(payload.count))
        } else if payload.count <= 0xFFFF {
            frame += [0x80 | 126, UInt8(payload.count >> 8), UInt8(payload.count & 0xFF)]
        } else {
            frame.append(0x80 | 127)
            frame += (0..<8).reversed().map { UInt8((payload.count >> ($0 * 8)) & 0xFF) }
        }
        let mask = (0..<4).map { _ in UInt8.random(in: 0...255) }
        frame += mask
        frame += payload.enumerated().map { $1 ^ mask[$0 % 4] }
        try send(frame)
    }

    private func send(_ bytes: [UInt8]) throws {
        var offset = 0
        while offset < bytes.count {
            let written = bytes[offset...].withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
            guard written > 0 else { throw GatewayProcessError("write failed: \(errno)") }
            offset += written
        }
    }

    /// Reads frames until the server's close frame, the end of the connection or `limit`
    /// frames, for at most `timeout`: each frame's opcode and payload (a close frame's payload
    /// starts with its code).
    public func readFrames(within timeout: Duration, limit: Int = .max) -> [(opcode: UInt8, payload: [UInt8])] {
        var wait = timeval(tv_sec: 1, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, socklen_t(MemoryLayout<timeval>.size))
        let deadline = ContinuousClock.now + timeout
        var stream: [UInt8] = []
        var frames: [(opcode: UInt8, payload: [UInt8])] = []
        var buffer = [UInt8](repeating: 0, count: 65_536)
        while ContinuousClock.now < deadline {
            let count = read(fd, &buffer, buffer.count)
            if count == 0 || (count < 0 && errno != EAGAIN && errno != EWOULDBLOCK) { break }
            if count > 0 { stream += buffer[..<count] }
            // Server frames are unmasked: opcode, a 7-bit, 16-bit or 64-bit length, the payload.
            while stream.count >= 2 {
                var length = Int(stream[1] & 0x7F)
                var header = 2
                if length == 126 {
                    guard stream.count >= 4 else { break }
                    length = Int(stream[2]) << 8 | Int(stream[3])
                    header = 4
                } else if length == 127 {
                    guard stream.count >= 10 else { break }
                    length = stream[2..<10].reduce(0) { $0 << 8 | Int($1) }
                    header = 10
                }
                guard stream.count >= header + length else { break }
                frames.append((stream[0] & 0x0F, Array(stream[header..<(header + length)])))
                stream.removeFirst(header + length)
                if frames.last?.opcode == 8 || frames.count >= limit { return frames }
            }
        }
        return frames
    }

    /// Reads and discards everything on a thread of its own, until ``shutDown()``.
    public func startReading() {
        Thread.detachNewThread { _ = self.drainUntilClosed(within: .seconds(600)) }
    }

    /// Ends the connection (a reading thread sees its end).
    public func shutDown() { shutdown(fd, Int32(SHUT_RDWR)) }

    /// Reads everything the server left in the socket until it ends (EOF or reset), for at most
    /// `timeout`; returns the bytes read and whether the end came.
    public func drainUntilClosed(within timeout: Duration) -> (bytes: Int, closed: Bool) {
        var wait = timeval(tv_sec: 1, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, socklen_t(MemoryLayout<timeval>.size))
        let deadline = ContinuousClock.now + timeout
        var total = 0
        var buffer = [UInt8](repeating: 0, count: 65_536)
        while ContinuousClock.now < deadline {
            let count = read(fd, &buffer, buffer.count)
            if count > 0 { total += count; continue }
            if count == 0 || errno == ECONNRESET { return (total, true) }
        }
        return (total, false)
    }
}

extension Array where Element: Equatable {
    fileprivate func ends(with suffix: [Element]) -> Bool { count >= suffix.count && Array(self[(count - suffix.count)...]) == suffix }
}

extension GatewayProcess {
    /// `presence_sessions` from the node's /metrics; `nil` when it does not answer.
    public var openSessions: Int? {
        guard let metrics = GatewayProcess.httpGet(port: port, path: "/metrics")?.body else { return nil }
        let line = metrics.split(separator: "\n").first { $0.hasPrefix("presence_sessions ") }
        return line.flatMap { Double($0.split(separator: " ").last ?? "") }.map { Int($0) }
    }
}
