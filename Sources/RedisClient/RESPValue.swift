/// One reply from Redis (RESP2), copied out of hiredis's reply tree.
public enum RESPValue: Sendable, Hashable {
    /// A status reply such as `+OK`.
    case simpleString(String)
    /// An error reply such as `-ERR unknown command`.
    case error(String)
    /// An integer reply.
    case integer(Int64)
    /// A bulk string; binary safe.
    case bulkString([UInt8])
    /// A nil bulk string or a nil array (RESP2 does not tell them apart once parsed).
    case null
    /// An array reply; elements may be nested arrays.
    indirect case array([RESPValue])
}

extension RESPValue {
    /// The value as text: status and bulk strings decode as UTF-8, integers print in decimal.
    public var string: String? {
        switch self {
        case .simpleString(let text): text
        case .bulkString(let bytes): String(decoding: bytes, as: UTF8.self)
        case .integer(let value): String(value)
        case .error, .null, .array: nil
        }
    }

    /// The value as an integer: integer replies, and strings holding a decimal number.
    public var int: Int? {
        switch self {
        case .integer(let value): Int(value)
        case .bulkString, .simpleString: string.flatMap { Int($0) }
        case .error, .null, .array: nil
        }
    }

    /// The value as a floating point number (for sorted set scores).
    public var double: Double? {
        switch self {
        case .integer(let value): Double(value)
        case .bulkString, .simpleString: string.flatMap { Double($0) }
        case .error, .null, .array: nil
        }
    }

    /// The elements of an array reply; `nil` for anything else.
    public var array: [RESPValue]? {
        if case .array(let elements) = self { return elements }
        return nil
    }

    /// Whether this is the nil reply.
    public var isNull: Bool {
        if case .null = self { return true }
        return false
    }

    /// The elements of an array reply as strings, skipping nils.
    public var strings: [String] {
        array?.compactMap(\.string) ?? []
    }
}

extension RESPValue: CustomStringConvertible {
    public var description: String {
        switch self {
        case .simpleString(let text): return text
        case .error(let message): return "(error) \(message)"
        case .integer(let value): return "(integer) \(value)"
        case .bulkString: return "\"\(string ?? "")\""
        case .null: return "(nil)"
        case .array(let elements): return "[" + elements.map(\.description).joined(separator: ", ") + "]"
        }
    }
}
