import Foundation

#if canImport(Glibc)
import Glibc
#endif

/// A TCP forwarder on loopback in front of a Redis server, for a process whose pub/sub
/// connection must go deaf: ``deafenSubscribers()`` makes every connection that has sent a
/// `SUBSCRIBE` half-open, as after a network fault that sends no FIN. Nothing crosses it any
/// more in either direction, and it stays open; connections made after that are forwarded as
/// usual. ``redirect(to:)`` moves it to another server, as a managed endpoint moves to a
/// promoted replica: every connection through it ends, and new ones reach the new server.
/// ``cut(for:)`` holds every byte in either direction for a while and then lets it through, as a
/// network partition does that TCP's resends outlast. Point a gateway at ``url``.
public final class RedisProxy: @unchecked Sendable {
    // Safe: `connections`, `listening` and `upstreamPort` are touched only under `lock`.
    public let port: Int
    private var upstreamPort: Int
    /// Until when bytes are held (a cut); in the past when none is.
    private var cutUntil = ContinuousClock.now
    private let listener: Int32
    private let lock = NSLock()
    private var connections: [Connection] = []
    private var listening = true

    /// One client connection and its upstream one.
    private final class Connection: @unchecked Sendable {
        // Safe: the flags are touched only under the proxy's lock.
        let client: Int32
        let server: Int32
        var subscriber = false
        var deaf = false
        /// Pumps that have ended; the second closes both descriptors.
        var ended = 0
        init(client: Int32, server: Int32) {
            self.client = client
            self.server = server
        }
    }

    /// Listens on a free loopback port and forwards to Redis on `upstreamPort`.
    public init(upstreamPort: Int) throws {
        self.upstreamPort = upstreamPort
        port = try RedisServerProcess.freePort()
        listener = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        var yes: Int32 = 1
        setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &yes, socklen_t(MemoryLayout<Int32>.size))
        var address = Self.loopback(port: port)
        let bound = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(listener, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard bound == 0, listen(listener, 64) == 0 else {
            Glibc.close(listener)
            throw GatewayProcessError("the proxy could not listen on 127.0.0.1:\(port)")
        }
        Thread.detachNewThread { [self] in acceptLoop() }
    }

    deinit { stop() }

    /// `redis://127.0.0.1:PORT/0` through the proxy.
    public var url: String { "redis://127.0.0.1:\(port)/0" }

    /// Every connection that has subscribed goes deaf; returns how many did.
    @discardableResult
    public func deafenSubscribers() -> Int {
        lock.withLock {
            let subscribers = connections.filter(\.subscriber)
            for connection in subscribers { connection.deaf = true }
            return subscribers.count
        }
    }

    /// Connections made from now on reach the server on `port`; every open one ends (both
    /// ways shut, as a failover's endpoint change ends them).
    public func redirect(to port: Int) {
        lock.withLock {
            upstreamPort = port
            for connection in connections {
                shutdown(connection.client, Int32(SHUT_RDWR))
                shutdown(connection.server, Int32(SHUT_RDWR))
            }
        }
    }

    /// From now until `duration` has passed, nothing crosses: bytes read on either side wait and
    /// then go on in order, and connections stay open (no reset, as with packets dropped).
    public func cut(for duration: Duration) {
        lock.withLock { cutUntil = ContinuousClock.now + duration }
    }

    /// Closes the listener and every connection.
    public func stop() {
        lock.withLock {
            guard listening else { return }
            listening = false
            shutdown(listener, Int32(SHUT_RDWR))
            Glibc.close(listener)
            // Each pump then ends and closes its descriptors.
            for connection in connections {
                shutdown(connection.client, Int32(SHUT_RDWR))
                shutdown(connection.server, Int32(SHUT_RDWR))
            }
        }
    }

    private func acceptLoop() {
        while true {
            let client = accept(listener, nil, nil)
            guard client >= 0 else { return }
            let server = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
            var address = Self.loopback(port: lock.withLock { upstreamPort })
            let connected = withUnsafePointer(to: &address) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(server, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
            }
            let connection = Connection(client: client, server: server)
            let kept = lock.withLock {
                guard listening, connected == 0 else { return false }
                connections.append(connection)
                return true
            }
            guard kept else {
                Glibc.close(client)
                Glibc.close(server)
                continue
            }
            Thread.detachNewThread { [self] in pump(connection, from: client, to: server, upstream: true) }
            Thread.detachNewThread { [self] in pump(connection, from: server, to: client, upstream: false) }
        }
    }

    /// Copies bytes one way until either side ends; a deaf connection's bytes are read and
    /// dropped. The side that ends shuts both down; the second to end closes the descriptors.
    private func pump(_ connection: Connection, from source: Int32, to target: Int32, upstream: Bool) {
        var buffer = [UInt8](repeating: 0, count: 16 * 1024)
        while true {
            let count = read(source, &buffer, buffer.count)
            guard count > 0 else { break }
            let (forward, heldUntil) = lock.withLock {
                if upstream, !connection.subscriber, Self.contains(buffer[0..<count], "SUBSCRIBE") { connection.subscriber = true }
                return (!connection.deaf, cutUntil)
            }
            guard forward else { continue }
            // Read during a cut: it goes on when the cut ends.
            let wait = heldUntil - ContinuousClock.now
            if wait > .zero { Thread.sleep(forTimeInterval: Double(wait.components.seconds) + Double(wait.components.attoseconds) / 1e18) }
            var sent = 0
            while sent < count {
                let written = buffer[sent..<count].withUnsafeBytes { write(target, $0.baseAddress, $0.count) }
                guard written > 0 else { break }
                sent += written
            }
            guard sent == count else { break }
        }
        shutdown(connection.client, Int32(SHUT_RDWR))
        shutdown(connection.server, Int32(SHUT_RDWR))
        // Under the lock, so that stop() never shuts a descriptor number already given back.
        lock.withLock {
            connection.ended += 1
            guard connection.ended == 2 else { return }
            connections.removeAll { $0 === connection }
            Glibc.close(connection.client)
            Glibc.close(connection.server)
        }
    }

    private static func contains(_ bytes: ArraySlice<UInt8>, _ text: String) -> Bool {
        let needle = Array(text.utf8)
        guard bytes.count >= needle.count else { return false }
        let start = bytes.startIndex
        for offset in 0...(bytes.count - needle.count) where bytes[(start + offset)..<(start + offset + needle.count)].elementsEqual(needle) {
            return true
        }
        return false
    }

    private static func loopback(port: Int) -> sockaddr_in {
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = in_port_t(UInt16(port).bigEndian)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        return address
    }
}
