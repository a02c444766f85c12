import Foundation
import RedisClient

#if canImport(Glibc)
import Glibc
#endif

/// The live Redis Cluster that `scripts/with-redis-cluster` starts, and ways to look at and
/// change its nodes directly (with `redis-cli`), past the client under test.
public enum TestRedisCluster {
    /// Whether a cluster was started for this run (`PRESENCE_TEST_REDIS_CLUSTER_URL` is set).
    public static var isAvailable: Bool { url != nil }

    /// `redis+cluster://host:port,host:port,...`, the primaries when the cluster started.
    public static var url: String? {
        ProcessInfo.processInfo.environment["PRESENCE_TEST_REDIS_CLUSTER_URL"]
    }

    /// The seed addresses in ``url``.
    public static var seeds: [(host: String, port: Int)] {
        guard let url, let list = url.split(separator: "://", maxSplits: 1).last else { return [] }
        return list.split(separator: ",").compactMap { address in
            guard let colon = address.lastIndex(of: ":"), let port = Int(address[address.index(after: colon)...]) else { return nil }
            return (String(address[..<colon]), port)
        }
    }

    /// Every node's port, the primaries at start first (`PRESENCE_TEST_REDIS_CLUSTER_PORTS`).
    public static var ports: [Int] {
        (ProcessInfo.processInfo.environment["PRESENCE_TEST_REDIS_CLUSTER_PORTS"] ?? "").split(separator: " ").compactMap { Int($0) }
    }

    /// A node configuration template that waits 5 s for connections, as the shared test
    /// server's does: all tests start at once on 2 cores.
    public static func configuration() -> RedisConfiguration {
        RedisConfiguration(waitForConnection: .seconds(5))
    }

    /// One line of `CLUSTER NODES`.
    public struct Node: Sendable {
        public var id: String
        public var port: Int
        public var flags: [String]
        /// Slot ranges served (migration markers left out).
        public var slots: [ClosedRange<Int>]

        public var isPrimary: Bool { flags.contains("master") }
        public var isFailed: Bool { flags.contains("fail") || flags.contains("fail?") }

        public func serves(_ slot: Int) -> Bool { slots.contains { $0.contains(slot) } }
    }

    /// The cluster as the node on `port` sees it.
    public static func nodes(askingPort port: Int) throws -> [Node] {
        try cli(port: port, "CLUSTER", "NODES").split(separator: "\n").compactMap { line in
            let fields = line.split(separator: " ")
            guard fields.count >= 8, let colon = fields[1].firstIndex(of: ":") else { return nil }
            let portText = fields[1][fields[1].index(after: colon)...].prefix { $0.isNumber }
            guard let port = Int(portText) else { return nil }
            let slots: [ClosedRange<Int>] = fields.dropFirst(8).compactMap { range in
                guard !range.hasPrefix("[") else { return nil }
                let bounds = range.split(separator: "-").compactMap { Int($0) }
                guard let first = bounds.first else { return nil }
                return first...(bounds.last ?? first)
            }
            return Node(id: String(fields[0]), port: port, flags: fields[2].split(separator: ",").map(String.init), slots: slots)
        }
    }

    /// The node serving `slot`, as the node on `port` sees it.
    public static func owner(of slot: Int, askingPort port: Int) throws -> Node? {
        try nodes(askingPort: port).first { $0.isPrimary && !$0.isFailed && $0.serves(slot) }
    }

    /// Moves `slot` with its keys to the primary on `port`, as `redis-cli --cluster reshard`
    /// does (see ``SlotMove``). Returns the primary it came from; `nil` when `port` already
    /// served it.
    @discardableResult
    public static func moveSlot(_ slot: Int, to port: Int) throws -> Int? {
        guard let move = try SlotMove.begin(slot, to: port) else { return nil }
        try move.migrateAll()
        try move.finish()
        return move.source.port
    }

    /// A slot's move between primaries in the steps `redis-cli --cluster reshard` takes, for
    /// tests that act between them: the target imports and the source migrates, the keys go over
    /// in batches, and the slot is given to the target (the target first, then the source, then
    /// every other primary). Each step throws when a node does not answer OK.
    public struct SlotMove: Sendable {
        public let slot: Int
        public let source: Node
        public let target: Node
        /// The other live primaries, told last.
        let others: [Int]

        /// Marks `slot` importing on the primary on `port` and migrating on its owner; `nil`
        /// when `port` serves it already.
        public static func begin(_ slot: Int, to port: Int) throws -> SlotMove? {
            let nodes = try TestRedisCluster.nodes(askingPort: port)
            guard let target = nodes.first(where: { $0.port == port && $0.isPrimary }) else {
                throw RedisError(.unavailable, "no primary on port \(port)")
            }
            guard let source = nodes.first(where: { $0.isPrimary && !$0.isFailed && $0.serves(slot) }) else {
                throw RedisError(.unavailable, "no primary serves slot \(slot)")
            }
            guard source.port != port else { return nil }
            for (at, state, id) in [(target.port, "IMPORTING", source.id), (source.port, "MIGRATING", target.id)] {
                try Self.expectOK(cli(port: at, "CLUSTER", "SETSLOT", "\(slot)", state, id), "SETSLOT \(slot) \(state) on \(at)")
            }
            let others = nodes.filter { $0.isPrimary && !$0.isFailed && $0.port != port && $0.port != source.port }.map(\.port)
            return SlotMove(slot: slot, source: source, target: target, others: others)
        }

        /// Keys of the slot still on the source, at most `count`.
        public func keysLeft(count: Int = 100) throws -> [String] {
            try cli(port: source.port, "CLUSTER", "GETKEYSINSLOT", "\(slot)", "\(count)").split(whereSeparator: \.isNewline).map(String.init)
        }

        /// Moves `keys` to the target (none: nothing).
        public func migrate(_ keys: [String]) throws {
            guard !keys.isEmpty else { return }
            let answer = try cli(port: source.port, ["MIGRATE", "127.0.0.1", "\(target.port)", "", "0", "5000", "KEYS"] + keys)
            guard answer == "OK" || answer == "NOKEY" else { throw RedisError(.unavailable, "MIGRATE from \(source.port): \(answer)") }
        }

        /// Moves every key left, in batches.
        public func migrateAll() throws {
            while case let keys = try keysLeft(), !keys.isEmpty { try migrate(keys) }
        }

        /// Gives the slot to the target: the target first, then the source (`givingUp` runs just
        /// before: from then on the source refuses the slot), then every other primary.
        public func finish(givingUp: () -> Void = {}) throws {
            for at in [target.port, source.port] + others {
                if at == source.port { givingUp() }
                try Self.expectOK(cli(port: at, "CLUSTER", "SETSLOT", "\(slot)", "NODE", target.id), "SETSLOT \(slot) NODE on \(at)")
            }
        }

        /// Leaves a move half made: the slot stays the source's.
        public func abandon() {
            for at in [source.port, target.port] { _ = try? cli(port: at, "CLUSTER", "SETSLOT", "\(slot)", "STABLE") }
        }

        private static func expectOK(_ answer: String, _ what: String) throws {
            guard answer == "OK" else { throw RedisError(.unavailable, "\(what): \(answer)") }
        }
    }

    /// Runs `redis-cli -p port arguments...`; its output, trimmed.
    @discardableResult
    public static func cli(port: Int, _ arguments: String...) throws -> String {
        try cli(port: port, arguments)
    }

    /// Runs `redis-cli -p port arguments...`; its output, trimmed.
    @discardableResult
    public static func cli(port: Int, _ arguments: [String]) throws -> String {
        try RedisServerProcess.cli(port: port, arguments).trimmingCharacters(in: .whitespacesAndNewlines)
    }

    /// The process id of the server on `port`, from its `INFO server`.
    public static func processID(port: Int) throws -> Int32 {
        let info = try cli(port: port, "INFO", "server")
        guard let line = info.split(whereSeparator: \.isNewline).first(where: { $0.hasPrefix("process_id:") }),
              let pid = Int32(line.dropFirst("process_id:".count).trimmingCharacters(in: .whitespaces))
        else { throw RedisError(.unavailable, "no process_id in INFO of the node on port \(port)") }
        return pid
    }

    /// Kills the server on `port` with SIGKILL, as a crash would; returns once it is gone.
    public static func kill9(port: Int) throws {
        kill(try processID(port: port), SIGKILL)
        // The server is not our child, so wait for its port rather than for the process.
        for _ in 0..<200 {
            guard let fd = connectLoopback(port: port) else { return }
            close(fd)
            usleep(10_000)
        }
    }
}
