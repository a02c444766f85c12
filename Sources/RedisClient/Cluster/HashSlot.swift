/// One of Redis Cluster's 16384 hash slots: the unit in which the key space is split between
/// primaries.
///
/// A key's slot is CRC16 (XMODEM) of the key modulo 16384, or of its hash tag: the bytes between
/// the first `{` and the first `}` after it, when there are any. Keys sharing a tag share a slot,
/// which is how multi-key commands are made possible in a cluster.
public struct HashSlot: Hashable, Sendable, Comparable, CustomStringConvertible {
    /// How many slots a cluster has.
    public static let count = 16384

    /// The slot number, `0..<16384`.
    public let value: Int

    /// The slot numbered `value`, or nil when it is out of range.
    public init?(_ value: Int) {
        guard (0..<Self.count).contains(value) else { return nil }
        self.value = value
    }

    /// The slot of a key given as bytes.
    public init(of key: some Collection<UInt8>) {
        self.value = Int(Self.crc16(Self.hashedPart(of: key)) % UInt16(Self.count))
    }

    /// The slot of a key given as text (its UTF-8 bytes).
    public init(of key: String) {
        self.init(of: Array(key.utf8))
    }

    public static func < (lhs: HashSlot, rhs: HashSlot) -> Bool { lhs.value < rhs.value }

    public var description: String { String(value) }

    /// The part of `key` that is hashed: its `{tag}` when it has a non-empty one, else all of it.
    static func hashedPart<Key: Collection<UInt8>>(of key: Key) -> Key.SubSequence {
        guard let open = key.firstIndex(of: UInt8(ascii: "{")) else { return key[...] }
        let afterOpen = key.index(after: open)
        guard let close = key[afterOpen...].firstIndex(of: UInt8(ascii: "}")), close != afterOpen else { return key[...] }
        return key[afterOpen..<close]
    }

    /// CRC16-CCITT in its XMODEM form (polynomial 0x1021, initial value 0, no reflection), the
    /// checksum Redis Cluster's specification hashes keys with.
    public static func crc16(_ bytes: some Sequence<UInt8>) -> UInt16 {
        var crc: UInt16 = 0
        for byte in bytes {
            crc = (crc << 8) ^ crc16Table[Int(UInt8(truncatingIfNeeded: crc >> 8) ^ byte)]
        }
        return crc
    }

    /// The CRC of every byte value, so that hashing costs one lookup per byte.
    private static let crc16Table: [UInt16] = (0..<256).map { index in
        var crc = UInt16(index) << 8
        for _ in 0..<8 {
            crc = crc & 0x8000 != 0 ? (crc << 1) ^ 0x1021 : crc << 1
        }
        return crc
    }
}
