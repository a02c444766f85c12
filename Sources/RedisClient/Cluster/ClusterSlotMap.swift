/// Where a cluster node listens, as the cluster announces it (or as a seed was given).
public typealias ClusterNodeAddress = RedisConfiguration.Address

extension RedisConfiguration.Address: Comparable {
    /// Parses `host:port` as in a `MOVED` or `ASK` redirection; an empty host (a node that does
    /// not know its own address) is `defaultHost`, the host of the node that answered.
    init?(redirection text: Substring, defaultHost: String) {
        guard let colon = text.lastIndex(of: ":"), let port = Int(text[text.index(after: colon)...]), (1...65535).contains(port) else {
            return nil
        }
        var host = text[..<colon]
        if host.hasPrefix("["), host.hasSuffix("]") { host = host.dropFirst().dropLast() }
        self.init(host: host.isEmpty ? defaultHost : String(host), port: port)
    }

    public static func < (lhs: Self, rhs: Self) -> Bool {
        (lhs.host, lhs.port) < (rhs.host, rhs.port)
    }
}

/// Which primary serves each hash slot: what the cluster router learns from `CLUSTER SHARDS`,
/// corrected slot by slot by `MOVED` redirections.
struct ClusterSlotMap: Sendable {
    /// Every node some slot has pointed to; `owners` holds indices into it.
    private var nodes: [ClusterNodeAddress] = []
    /// Index into `nodes` of each slot's primary, or `unowned`.
    private var owners = [UInt16](repeating: unowned, count: HashSlot.count)
    /// Slots whose primary the answering node considered healthy (`health` "online").
    private(set) var healthySlots = 0

    private static let unowned = UInt16.max

    /// The primary serving `slot`, if any does.
    func primary(for slot: HashSlot) -> ClusterNodeAddress? {
        let index = owners[slot.value]
        return index == Self.unowned ? nil : nodes[Int(index)]
    }

    /// The primaries that serve at least one slot, sorted.
    private(set) var primaries: [ClusterNodeAddress] = []

    private mutating func updatePrimaries() {
        var used = [Bool](repeating: false, count: nodes.count)
        for index in owners where index != Self.unowned { used[Int(index)] = true }
        primaries = nodes.indices.filter { used[$0] }.map { nodes[$0] }.sorted()
    }

    /// How many slots have a primary.
    var coveredSlots: Int { owners.count { $0 != Self.unowned } }

    /// Whether every slot has a healthy primary.
    var isComplete: Bool { healthySlots == HashSlot.count }

    /// Points `slot` at `node`, as a `MOVED` redirection says.
    mutating func assign(_ slot: HashSlot, to node: ClusterNodeAddress) {
        setOwner(of: slot, to: node)
        updatePrimaries()
    }

    private mutating func setOwner(of slot: HashSlot, to node: ClusterNodeAddress) {
        let index: Int
        if let known = nodes.firstIndex(of: node) {
            index = known
        } else {
            index = nodes.count
            nodes.append(node)
        }
        owners[slot.value] = UInt16(index)
    }

    /// Whether both maps send every slot to the same primary.
    func sameAssignment(as other: ClusterSlotMap) -> Bool {
        (0..<HashSlot.count).allSatisfy { value in
            let slot = HashSlot(value)!
            return primary(for: slot) == other.primary(for: slot)
        }
    }

    /// Reads a `CLUSTER SHARDS` reply (Redis 7.0+): per shard its `slots` as start/end pairs and
    /// its `nodes`, of which the one with `role` "master" serves the slots.
    ///
    /// A node is reached at its `endpoint`, else its `ip`, else its `hostname`, else
    /// `fallbackHost` (the node that answered); at its `tls-port` when `tls` is set and it has
    /// one, else its `port`.
    static func parse(shards reply: RESPValue, tls: Bool, fallbackHost: String) throws(RedisError) -> ClusterSlotMap {
        guard let shards = reply.array else {
            throw RedisError(.protocolViolation, "CLUSTER SHARDS did not answer with a list of shards")
        }
        var map = ClusterSlotMap()
        for shard in shards {
            let fields = try Self.fields(of: shard, what: "a shard")
            guard let ranges = fields["slots"]?.array, ranges.count % 2 == 0, let nodes = fields["nodes"]?.array else {
                throw RedisError(.protocolViolation, "a shard in CLUSTER SHARDS lacks its slots or nodes")
            }
            var primary: (address: ClusterNodeAddress, healthy: Bool)?
            for node in nodes {
                let fields = try Self.fields(of: node, what: "a node")
                guard fields["role"]?.string == "master", let address = Self.address(of: fields, tls: tls, fallbackHost: fallbackHost) else { continue }
                let healthy = fields["health"]?.string == "online"
                // Two nodes claiming the shard happen briefly around a failover; prefer the live one.
                if primary == nil || (healthy && primary?.healthy == false) {
                    primary = (address, healthy)
                }
            }
            guard let primary else { continue }
            for pair in stride(from: 0, to: ranges.count, by: 2) {
                guard let start = ranges[pair].int, let end = ranges[pair + 1].int,
                      let first = HashSlot(start), let last = HashSlot(end), first <= last
                else {
                    throw RedisError(.protocolViolation, "a shard in CLUSTER SHARDS has a slot range outside 0...16383")
                }
                for value in first.value...last.value {
                    let slot = HashSlot(value)!
                    if map.primary(for: slot) == nil, primary.healthy { map.healthySlots += 1 }
                    map.setOwner(of: slot, to: primary.address)
                }
            }
        }
        map.updatePrimaries()
        return map
    }

    /// A RESP2 map: a flat array of names and values.
    private static func fields(of value: RESPValue, what: String) throws(RedisError) -> [String: RESPValue] {
        guard let items = value.array, items.count % 2 == 0 else {
            throw RedisError(.protocolViolation, "\(what) in CLUSTER SHARDS is not a list of fields and values")
        }
        var fields: [String: RESPValue] = [:]
        for index in stride(from: 0, to: items.count, by: 2) {
            if let name = items[index].string { fields[name] = items[index + 1] }
        }
        return fields
    }

    private static func address(of fields: [String: RESPValue], tls: Bool, fallbackHost: String) -> ClusterNodeAddress? {
        let port = (tls ? fields["tls-port"]?.int : nil) ?? fields["port"]?.int
        guard let port, (1...65535).contains(port) else { return nil }
        // "?" is how Redis writes an endpoint it does not know.
        let host = ["endpoint", "ip", "hostname"].lazy
            .compactMap { fields[$0]?.string }
            .first { !$0.isEmpty && $0 != "?" }
        return ClusterNodeAddress(host: host ?? fallbackHost, port: port)
    }
}
