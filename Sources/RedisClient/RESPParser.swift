private import CHiredis
import NIOCore

/// Incremental RESP2 parser over hiredis's reader: feed bytes as they arrive, take complete replies.
///
/// hiredis keeps partial frames in its own buffer and bounds nesting: arrays at most
/// ``maxArrayDepth`` deep (the top array and 7 inside it); a deeper reply is a protocol error
/// (``next()`` throws, and the connection is dropped). On top of that
/// this type bounds the bytes buffered for one incomplete reply, and the length an array header
/// may declare: hiredis allocates a pointer for every declared element at once, so 13 bytes
/// (`*399999999\r\n`) would cost 3.2 GB. Either way a peer cannot make us hold an arbitrary
/// amount of memory.
///
/// - Important: Not thread safe; owned by one channel handler on one event loop.
package final class RESPParser {
    private let reader: UnsafeMutablePointer<redisReader>
    /// The most bytes an incomplete reply may hold in the buffer before the stream is rejected.
    let maxPendingBytes: Int
    /// The most elements an array header may declare (found by the fuzzer: see above).
    static let maxArrayElements = 1 << 20
    /// The most arrays a reply may nest, the outermost included: hiredis 0.14's own bound
    /// ("nested multi bulk replies with depth > 7" counts the levels inside the top one).
    package static let maxArrayDepth = 8
    private var scanner = HeaderScanner()

    package init(maxPendingBytes: Int = 512 * 1024 * 1024) {
        guard let reader = redisReaderCreate() else {
            fatalError("hiredis could not allocate a reader (out of memory)")
        }
        self.reader = reader
        self.maxPendingBytes = maxPendingBytes
    }

    deinit {
        redisReaderFree(reader)
    }

    /// Appends bytes received from the socket.
    package func feed(_ buffer: ByteBuffer) throws(RedisError) {
        try buffer.withUnsafeReadableBytes { bytes throws(RedisError) in try scanner.scan(bytes) }
        let status = buffer.withUnsafeReadableBytes { bytes -> Int32 in
            guard let base = bytes.baseAddress, bytes.count > 0 else { return REDIS_OK }
            return redisReaderFeed(reader, base.assumingMemoryBound(to: CChar.self), bytes.count)
        }
        if status != REDIS_OK {
            throw RedisError(.protocolViolation, "could not buffer the reply: \(readerError)")
        }
        if reader.pointee.len - reader.pointee.pos > maxPendingBytes {
            throw RedisError(.protocolViolation, "a reply exceeds the limit of \(maxPendingBytes) bytes")
        }
    }

    /// The next complete reply, or `nil` when more bytes are needed.
    package func next() throws(RedisError) -> RESPValue? {
        var raw: UnsafeMutableRawPointer?
        guard redisReaderGetReply(reader, &raw) == REDIS_OK else {
            throw RedisError(.protocolViolation, "malformed reply: \(readerError)")
        }
        guard let raw else { return nil }
        let reply = raw.assumingMemoryBound(to: redisReply.self)
        defer { freeReplyObject(raw) }
        return Self.convert(reply)
    }

    private var readerError: String {
        withUnsafeBytes(of: reader.pointee.errstr) { bytes in
            let chars = bytes.prefix { $0 != 0 }
            return String(decoding: chars, as: UTF8.self)
        }
    }

    private static func convert(_ reply: UnsafeMutablePointer<redisReply>) -> RESPValue {
        let node = reply.pointee
        switch node.type {
        case REDIS_REPLY_STRING:
            return .bulkString(bytes(node.str, node.len))
        case REDIS_REPLY_STATUS:
            return .simpleString(String(decoding: bytes(node.str, node.len), as: UTF8.self))
        case REDIS_REPLY_ERROR:
            return .error(String(decoding: bytes(node.str, node.len), as: UTF8.self))
        case REDIS_REPLY_INTEGER:
            return .integer(node.integer)
        case REDIS_REPLY_ARRAY:
            var elements: [RESPValue] = []
            elements.reserveCapacity(node.elements)
            for index in 0..<node.elements {
                if let child = node.element[index] { elements.append(convert(child)) } else { elements.append(.null) }
            }
            return .array(elements)
        default:
            return .null
        }
    }

    private static func bytes(_ pointer: UnsafeMutablePointer<CChar>?, _ count: Int) -> [UInt8] {
        guard let pointer, count > 0 else { return [] }
        return pointer.withMemoryRebound(to: UInt8.self, capacity: count) { Array(UnsafeBufferPointer(start: $0, count: count)) }
    }
}

/// Follows a RESP2 stream as hiredis will, only far enough to see every array header before
/// hiredis does: header lines are read, bulk payloads skipped by their declared length.
struct HeaderScanner {
    /// Payload bytes (with their CRLF) still to pass over.
    private var skip = 0
    /// The header line read so far: its type byte and up to 24 bytes of its value.
    private var line: [UInt8] = []
    private var lineLength = 0

    mutating func scan(_ bytes: UnsafeRawBufferPointer) throws(RedisError) {
        var index = 0
        while index < bytes.count {
            if skip > 0 {
                let passed = min(skip, bytes.count - index)
                skip -= passed
                index += passed
                continue
            }
            let byte = bytes[index]
            index += 1
            lineLength += 1
            if line.count < 24 { line.append(byte) }
            guard byte == UInt8(ascii: "\n") else { continue }
            try endOfLine()
            line.removeAll(keepingCapacity: true)
            lineLength = 0
        }
    }

    private mutating func endOfLine() throws(RedisError) {
        guard let type = line.first, type == UInt8(ascii: "*") || type == UInt8(ascii: "$") else { return }
        // Redis never pads a length; a longer one could hide a huge count behind leading zeros.
        guard lineLength <= 24 else {
            throw RedisError(.protocolViolation, "a length header of \(lineLength) bytes")
        }
        // Anything else that is not a number, hiredis refuses itself.
        guard let length = Self.number(line.dropFirst().prefix { $0 != UInt8(ascii: "\r") }) else { return }
        if type == UInt8(ascii: "$") {
            if length >= 0 { skip = length + 2 }
        } else if length > RESPParser.maxArrayElements {
            throw RedisError(.protocolViolation, "an array of \(length) elements exceeds the limit of \(RESPParser.maxArrayElements)")
        }
    }

    /// An optional `-` and decimal digits, as `Int(_:)` reads them (`nil` past `Int`'s range),
    /// without making a String: this runs for every bulk reply.
    private static func number(_ text: ArraySlice<UInt8>) -> Int? {
        let negative = text.first == UInt8(ascii: "-")
        let digits = negative ? text.dropFirst() : text
        guard !digits.isEmpty else { return nil }
        var value = 0
        for byte in digits {
            guard byte >= UInt8(ascii: "0"), byte <= UInt8(ascii: "9") else { return nil }
            let (shifted, overflowA) = value.multipliedReportingOverflow(by: 10)
            let (next, overflowB) = shifted.addingReportingOverflow(Int(byte - UInt8(ascii: "0")))
            guard !overflowA, !overflowB else { return nil }
            value = next
        }
        return negative ? -value : value
    }
}

/// Encodes commands as RESP arrays of bulk strings, binary safe: each argument's length, then its
/// bytes as they are. Made in one array and written to the buffer at once: hiredis's formatter,
/// used before, cost three arrays, a `malloc` and an `sprintf` per argument, and ByteBuffer's
/// writes of a few bytes each cost some 250 instructions apiece (callgrind, BENCHMARKS.md).
enum RESPEncoder {
    /// Writes `arguments` as one RESP command into `buffer`.
    static func encode(_ arguments: [RedisArgument], into buffer: inout ByteBuffer) {
        var bytes: [UInt8] = []
        // A length takes at most 20 digits; with its marker and two CRLFs, 24 bytes.
        bytes.reserveCapacity(arguments.reduce(24) { $0 + $1.bytes.count + 24 })
        appendHeader(UInt8(ascii: "*"), arguments.count, to: &bytes)
        for argument in arguments {
            appendHeader(UInt8(ascii: "$"), argument.bytes.count, to: &bytes)
            bytes.append(contentsOf: argument.bytes)
            bytes.append(UInt8(ascii: "\r"))
            bytes.append(UInt8(ascii: "\n"))
        }
        buffer.writeBytes(bytes)
    }

    /// `marker`, `count` in decimal, CRLF.
    private static func appendHeader(_ marker: UInt8, _ count: Int, to bytes: inout [UInt8]) {
        bytes.append(marker)
        // Most significant digit first: no slice to reverse.
        var divisor = 1
        while divisor <= count / 10 { divisor *= 10 }
        var rest = count
        repeat {
            bytes.append(UInt8(ascii: "0") + UInt8(rest / divisor))
            rest %= divisor
            divisor /= 10
        } while divisor > 0
        bytes.append(UInt8(ascii: "\r"))
        bytes.append(UInt8(ascii: "\n"))
    }
}
