import ArgumentParser
import Foundation
import Glibc
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix

/// The least CPU a delivery can cost on this machine: one small WebSocket frame written with
/// one `write(2)` to each of N loopback connections, from a writer that does nothing else,
/// while the readers wait in epoll as the sessions' clients do. What no gateway can avoid (the
/// kernel's send and loopback receive, the readers' wake-ups, charged to the writer's thread),
/// for the node's CPU per delivery to be set beside.
///
/// With `--writer nio` the same frame goes through NIO instead: the connections are channels of
/// one event loop with no handler on their write path, and each round writes the one buffer to every
/// channel and then flushes every one, as a gateway's loop delivers a burst. The difference from
/// the kernel's floor is what NIO's write path costs a delivery, before any of the gateway's own
/// work.
struct DeliveryFloor: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "floor",
        abstract: "The kernel's floor for a delivery: one small frame written to each of N loopback connections by a minimal writer, CPU per write."
    )

    @Option(help: "Loopback connections, each read by a client waiting in epoll.") var connections = 4_000
    @Option(help: "Deliveries to every connection.") var rounds = 50
    @Option(help: "Bytes of text in each frame (a presence_update is some 150).") var payload = 150
    @Option(help: "Milliseconds between rounds, so that the readers are asleep again when the next comes, as between changes.") var pause = 20
    @Option(help: "Who writes: 'syscall' (one write(2) a connection from a plain thread) or 'nio' (NIO channels on one event loop).")
    var writer: FloorWriter = .syscall
    @Option(help: "Write the figures as JSON to this file.") var json: String?

    func validate() throws {
        guard (1...9_000).contains(connections) else { throw ValidationError("--connections must be 1 to 9000 (each takes two open files)") }
        guard rounds >= 1 else { throw ValidationError("--rounds must be at least 1") }
        guard (1...65_535).contains(payload) else { throw ValidationError("--payload must be 1 to 65535 bytes") }
        guard pause >= 0 else { throw ValidationError("--pause must not be negative") }
    }

    func run() throws {
        let floor = try FloorMeasurement(connections: connections, rounds: rounds, payload: payload, pause: pause, writer: writer)
        let how = writer == .syscall ? "one write(2) each" : "written and flushed through NIO channels"
        try report("delivery floor: a \(floor.frameBytes)-byte frame, \(how), to \(connections) loopback connections, \(rounds) rounds \(pause) ms apart", [
            ("writer CPU per delivery", floor.line),
            ("writing time per round", String(format: "%.2f ms (wall, pauses left out)", floor.roundMilliseconds)),
        ], json: ["scenario": "floor", "writer": writer.rawValue, "connections": connections, "rounds": rounds, "frame_bytes": floor.frameBytes, "pause_ms": pause,
                  "cpu_us_per_delivery": floor.perDelivery.total, "user_us_per_delivery": floor.perDelivery.user,
                  "system_us_per_delivery": floor.perDelivery.system], to: json)
    }

    /// A server's unmasked text frame of `bytes` bytes of text.
    static func textFrame(bytes: Int) -> [UInt8] {
        let header: [UInt8] = bytes < 126 ? [0x81, UInt8(bytes)] : [0x81, 126, UInt8(bytes >> 8), UInt8(bytes & 0xFF)]
        return header + [UInt8](repeating: UInt8(ascii: "x"), count: bytes)
    }
}

/// One measurement of the floor (see ``DeliveryFloor``): the writer's CPU per delivery, user
/// and system apart, in microseconds. Blocks its thread while it runs.
struct FloorMeasurement {
    let frameBytes: Int
    let perDelivery: (user: Double, system: Double, total: Double)
    let roundMilliseconds: Double

    var line: String { String(format: "%.2f µs (user %.2f, system %.2f)", perDelivery.total, perDelivery.user, perDelivery.system) }

    init(connections: Int, rounds: Int, payload: Int, pause: Int, writer: FloorWriter = .syscall) throws {
        let frame = DeliveryFloor.textFrame(bytes: payload)
        let readers = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        defer { try? readers.syncShutdownGracefully() }
        let received = NIOLockedValueBox(0)
        var clients: [any Channel] = []
        defer { for client in clients { client.close(promise: nil) } }
        func connect(_ count: Int, to port: Int) -> [EventLoopFuture<any Channel>] {
            (0..<count).map { _ in
                ClientBootstrap(group: readers)
                    .channelInitializer { channel in
                        channel.eventLoop.makeCompletedFuture { try channel.pipeline.syncOperations.addHandler(CountingReader(received: received)) }
                    }
                    .connect(host: "127.0.0.1", port: port)
            }
        }

        let side: any FloorWritingSide
        switch writer {
        case .syscall:
            side = try SocketWriters(connections: connections) { batch, port in
                let opening = connect(batch, to: port)
                return { clients += try opening.map { try $0.wait() } }
            }
        case .nio:
            side = try ChannelWriters(connections: connections) { batch, port in
                clients += try connect(batch, to: port).map { try $0.wait() }
            }
        }
        defer { side.close() }
        endProgress()

        let expected = frame.count * connections * rounds
        var spent = ThreadCPU()
        var writing = Duration.zero
        for round in 0..<rounds {
            let (cpu, wall) = try side.writeRound(frame)
            spent += cpu
            writing += wall
            if pause > 0, round < rounds - 1 { Thread.sleep(forTimeInterval: Double(pause) / 1000) }
        }
        let deadline = ContinuousClock.now + .seconds(10)
        while received.withLockedValue({ $0 }) < expected, ContinuousClock.now < deadline { Thread.sleep(forTimeInterval: 0.01) }
        let arrived = received.withLockedValue { $0 }
        guard arrived == expected else { throw BenchError("the readers got \(arrived) of \(expected) bytes") }

        let deliveries = Double(connections * rounds)
        frameBytes = frame.count
        perDelivery = (spent.user / deliveries * 1e6, spent.system / deliveries * 1e6, spent.total / deliveries * 1e6)
        roundMilliseconds = seconds(writing) / Double(rounds) * 1000
    }
}

/// Who writes the floor's frames (see ``DeliveryFloor``).
enum FloorWriter: String, ExpressibleByArgument, CaseIterable {
    /// One `write(2)` a connection, from a plain thread.
    case syscall
    /// NIO channels of one event loop: every channel written, then every one flushed.
    case nio
}

/// The server side of the floor's connections: writes one round and says what the writer's
/// thread spent on it.
private protocol FloorWritingSide {
    /// Writes `frame` once to every connection: the writer's CPU and the wall time it took.
    func writeRound(_ frame: [UInt8]) throws -> (cpu: ThreadCPU, wall: Duration)
    func close()
}

/// Raw sockets written from the calling thread.
private struct SocketWriters: FloorWritingSide {
    let sockets: [Int32]

    /// Accepts `connections` connections in batches of 500: `open(batch, port)` starts a batch of
    /// client connects and returns what waits for them, run once the batch is accepted.
    init(connections: Int, open: (Int, Int) throws -> () throws -> Void) throws {
        let listener = try ListeningSocket()
        defer { listener.close() }
        var sockets: [Int32] = []
        do {
            while sockets.count < connections {
                let batch = min(500, connections - sockets.count)
                let opened = try open(batch, listener.port)
                for _ in 0..<batch { sockets.append(try listener.accept()) }
                try opened()
                progress("floor: connections \(sockets.count)/\(connections)")
            }
        } catch {
            for socket in sockets { Glibc.close(socket) }
            throw error
        }
        self.sockets = sockets
    }

    func writeRound(_ frame: [UInt8]) throws -> (cpu: ThreadCPU, wall: Duration) {
        let (before, started) = (ThreadCPU.now(), ContinuousClock.now)
        for socket in sockets {
            let written = frame.withUnsafeBytes { Glibc.write(socket, $0.baseAddress, $0.count) }
            guard written == frame.count else { throw BenchError("write returned \(written) (errno \(errno)): a reader fell behind by a socket buffer") }
        }
        return (ThreadCPU.now() - before, ContinuousClock.now - started)
    }

    func close() { for socket in sockets { Glibc.close(socket) } }
}

/// NIO channels accepted on one event loop of their own, with no handler on their write path
/// (one inbound handler notes each as it becomes active).
private struct ChannelWriters: FloorWritingSide {
    let group: MultiThreadedEventLoopGroup
    let server: any Channel
    let channels: [any Channel]

    /// Accepts `connections` connections in batches of 500: `open(batch, port)` connects a batch
    /// of clients and returns once they are connected.
    init(connections: Int, open: (Int, Int) throws -> Void) throws {
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let accepted = NIOLockedValueBox<[any Channel]>([])
        do {
            let server = try ServerBootstrap(group: group)
                .serverChannelOption(.backlog, value: 1_024)
                .childChannelOption(.tcpOption(.tcp_nodelay), value: 1)
                .childChannelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture { try channel.pipeline.syncOperations.addHandler(ActiveChannels(accepted)) }
                }
                .bind(host: "127.0.0.1", port: 0).wait()
            guard let port = server.localAddress?.port else { throw BenchError("the floor's server has no port") }
            var connected = 0
            while connected < connections {
                let batch = min(500, connections - connected)
                try open(batch, port)
                connected += batch
                progress("floor: connections \(connected)/\(connections)")
            }
            // Every connection is active on the writers' loop before the first round.
            let deadline = ContinuousClock.now + .seconds(10)
            while accepted.withLockedValue({ $0.count }) < connections, ContinuousClock.now < deadline { Thread.sleep(forTimeInterval: 0.01) }
            let channels = accepted.withLockedValue { $0 }
            guard channels.count == connections else { throw BenchError("the floor's server has \(channels.count) of \(connections) connections active") }
            (self.group, self.server, self.channels) = (group, server, channels)
        } catch {
            try? group.syncShutdownGracefully()
            throw error
        }
    }

    func writeRound(_ frame: [UInt8]) throws -> (cpu: ThreadCPU, wall: Duration) {
        let buffer = ByteBuffer(bytes: frame)
        let channels = channels
        return try group.next().submit {
            let (before, started) = (ThreadCPU.now(), ContinuousClock.now)
            for channel in channels { channel.write(buffer, promise: nil) }
            for channel in channels { channel.flush() }
            return (ThreadCPU.now() - before, ContinuousClock.now - started)
        }.wait()
    }

    func close() {
        for channel in channels { channel.close(promise: nil) }
        server.close(promise: nil)
        try? group.syncShutdownGracefully()
    }
}

/// Records each accepted channel once it is active.
private final class ActiveChannels: ChannelInboundHandler, Sendable {
    typealias InboundIn = ByteBuffer
    let accepted: NIOLockedValueBox<[any Channel]>

    init(_ accepted: NIOLockedValueBox<[any Channel]>) { self.accepted = accepted }

    func channelActive(context: ChannelHandlerContext) {
        let channel = context.channel
        accepted.withLockedValue { $0.append(channel) }
        context.fireChannelActive()
    }
}

/// CPU time of the calling thread: in all, to the nanosecond (`CLOCK_THREAD_CPUTIME_ID`), and
/// user and system apart as the kernel samples them (`getrusage(RUSAGE_THREAD)`, coarse for a
/// short run).
private struct ThreadCPU: Sendable {
    var user = 0.0
    var system = 0.0
    var total = 0.0

    static func now() -> ThreadCPU {
        var usage = rusage()
        getrusage(__rusage_who_t(1), &usage)  // RUSAGE_THREAD, which Glibc does not export
        // A timespec is two longs on Linux (seconds, nanoseconds), read as such: its fields come
        // from a module this target does not import.
        var clock: (seconds: Int, nanoseconds: Int) = (0, 0)
        withUnsafeMutableBytes(of: &clock) { bytes in
            if let base = bytes.baseAddress { _ = clock_gettime(CLOCK_THREAD_CPUTIME_ID, base.assumingMemoryBound(to: timespec.self)) }
        }
        let seconds = { (time: timeval) in Double(time.tv_sec) + Double(time.tv_usec) / 1e6 }
        return ThreadCPU(user: seconds(usage.ru_utime), system: seconds(usage.ru_stime), total: Double(clock.seconds) + Double(clock.nanoseconds) / 1e9)
    }

    static func - (later: ThreadCPU, earlier: ThreadCPU) -> ThreadCPU {
        ThreadCPU(user: later.user - earlier.user, system: later.system - earlier.system, total: later.total - earlier.total)
    }

    static func += (sum: inout ThreadCPU, more: ThreadCPU) {
        sum.user += more.user
        sum.system += more.system
        sum.total += more.total
    }
}

/// A blocking TCP listener on 127.0.0.1 and a free port, with raw sockets: the writer's side
/// has no event loop.
private struct ListeningSocket {
    let descriptor: Int32
    let port: Int

    init() throws {
        let listener = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        guard listener >= 0 else { throw BenchError("socket: errno \(errno)") }
        let bound = try SocketAddress(ipAddress: "127.0.0.1", port: 0).withSockAddr { address, size in bind(listener, address, socklen_t(size)) }
        guard bound == 0, listen(listener, 1_024) == 0 else {
            Glibc.close(listener)
            throw BenchError("bind or listen on 127.0.0.1: errno \(errno)")
        }
        // The port the kernel chose: bytes 2 and 3 of the socket's address, in network order.
        var address = [UInt8](repeating: 0, count: 128)
        var length = socklen_t(address.count)
        _ = address.withUnsafeMutableBytes { getsockname(listener, $0.baseAddress?.assumingMemoryBound(to: sockaddr.self), &length) }
        descriptor = listener
        port = Int(address[2]) << 8 | Int(address[3])
    }

    /// The next connection, with Nagle off as a gateway's are.
    func accept() throws -> Int32 {
        let connection = Glibc.accept(descriptor, nil, nil)
        guard connection >= 0 else { throw BenchError("accept: errno \(errno)") }
        var on: Int32 = 1
        setsockopt(connection, Int32(IPPROTO_TCP), TCP_NODELAY, &on, socklen_t(MemoryLayout<Int32>.size))
        return connection
    }

    func close() { Glibc.close(descriptor) }
}

/// Counts the bytes a reader got and drops them.
private final class CountingReader: ChannelInboundHandler, Sendable {
    typealias InboundIn = ByteBuffer
    let received: NIOLockedValueBox<Int>

    init(received: NIOLockedValueBox<Int>) { self.received = received }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let bytes = unwrapInboundIn(data).readableBytes
        received.withLockedValue { $0 += bytes }
    }
}
