/// One argument of a Redis command, as the bytes sent on the wire.
public struct RedisArgument: Sendable, Hashable {
    /// The argument's bytes.
    public let bytes: [UInt8]

    /// An argument holding raw bytes.
    public init(bytes: [UInt8]) { self.bytes = bytes }
    /// An argument holding UTF-8 text.
    public init(_ text: String) { self.bytes = Array(text.utf8) }
    /// An argument holding a decimal integer.
    public init(_ value: Int) { self.bytes = Array(String(value).utf8) }
    /// An argument holding a decimal number, as Redis parses it.
    public init(_ value: Double) { self.bytes = Array(String(value).utf8) }
}

extension RedisArgument: ExpressibleByStringLiteral, ExpressibleByIntegerLiteral {
    public init(stringLiteral value: String) { self.init(value) }
    public init(integerLiteral value: Int) { self.init(value) }
}
