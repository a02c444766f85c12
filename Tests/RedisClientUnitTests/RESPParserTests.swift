import NIOCore
import Testing

@testable import RedisClient

@Suite("RESP parsing through hiredis")
struct RESPParserTests {
    static let cases: [(String, RESPValue)] = [
        ("+OK\r\n", .simpleString("OK")),
        ("-ERR unknown command 'FOO'\r\n", .error("ERR unknown command 'FOO'")),
        (":42\r\n", .integer(42)),
        (":-7\r\n", .integer(-7)),
        ("$5\r\nhello\r\n", .bulkString(Array("hello".utf8))),
        ("$0\r\n\r\n", .bulkString([])),
        ("$-1\r\n", .null),
        ("*-1\r\n", .null),
        ("*0\r\n", .array([])),
        ("*3\r\n:1\r\n$1\r\na\r\n$-1\r\n", .array([.integer(1), .bulkString([97]), .null])),
        ("*2\r\n*2\r\n+a\r\n:2\r\n*1\r\n*1\r\n-E x\r\n", .array([.array([.simpleString("a"), .integer(2)]), .array([.array([.error("E x")])])])),
        ("$4\r\na\r\nb\r\n", .bulkString(Array("a\r\nb".utf8))),
    ]

    @Test("every reply type, in one piece and byte by byte", arguments: 0..<cases.count)
    func replyTypes(index: Int) throws {
        let (wire, expected) = Self.cases[index]
        let whole = RESPParser()
        try whole.feed(ByteBuffer(string: wire))
        #expect(try whole.next() == expected)
        #expect(try whole.next() == nil)

        let bytewise = RESPParser()
        var result: RESPValue?
        for (offset, byte) in wire.utf8.enumerated() {
            #expect(result == nil, "a reply completed early, at byte \(offset)")
            try bytewise.feed(ByteBuffer(bytes: [byte]))
            result = try bytewise.next()
        }
        #expect(result == expected)
    }

    @Test("several replies in one read come out in order")
    func manyInOneRead() throws {
        let parser = RESPParser()
        try parser.feed(ByteBuffer(string: Self.cases.map(\.0).joined()))
        for (_, expected) in Self.cases {
            #expect(try parser.next() == expected)
        }
        #expect(try parser.next() == nil)
    }

    @Test("a malformed reply is an error, not a crash")
    func malformed() throws {
        let parser = RESPParser()
        try parser.feed(ByteBuffer(string: "?what\r\n"))
        #expect(throws: RedisError.self) { try parser.next() }
    }

    @Test("arrays nest at most 8 deep (the top one and 7 inside it); a deeper reply is an error")
    func nestingLimit() throws {
        // Eight arrays around an error reply: what the `resp` fuzzer sent when its own check
        // wrongly counted the innermost element as a level (Fuzz/regressions/resp/).
        let eight = RESPParser()
        try eight.feed(ByteBuffer(string: String(repeating: "*1\r\n", count: 8) + "-*1\r\n"))
        var expected = RESPValue.error("*1")
        for _ in 0..<8 { expected = .array([expected]) }
        #expect(try eight.next() == expected)
        #expect(RESPParser.maxArrayDepth == 8)

        for depth in [9, 12] {
            let parser = RESPParser()
            try parser.feed(ByteBuffer(string: String(repeating: "*1\r\n", count: depth) + ":1\r\n"))
            #expect(throws: RedisError.self, "\(depth) levels") { try parser.next() }
        }
    }

    @Test("an incomplete reply larger than the limit is rejected")
    func sizeLimit() throws {
        let parser = RESPParser(maxPendingBytes: 1024)
        try parser.feed(ByteBuffer(string: "$100000\r\n"))
        #expect(try parser.next() == nil)
        #expect(throws: RedisError.self) {
            try parser.feed(ByteBuffer(repeating: UInt8(ascii: "x"), count: 2048))
        }
    }

    @Test("an array header declaring more than a million elements is rejected before hiredis allocates for it")
    func arrayLimit() throws {
        // Found by the fuzzer: hiredis would calloc 3.2 GB for these 13 bytes.
        let huge = RESPParser()
        #expect(throws: RedisError.self) { try huge.feed(ByteBuffer(string: "*399999999\r\n")) }
        let nineteenDigits = RESPParser()
        #expect(throws: RedisError.self) { try nineteenDigits.feed(ByteBuffer(string: "*1000000000000000000\r\n")) }
        let nullBulk = RESPParser()
        try nullBulk.feed(ByteBuffer(string: "$-1\r\n*1\r\n:7\r\n"))
        #expect(try nullBulk.next() == .null)
        #expect(try nullBulk.next() == .array([.integer(7)]), "a null bulk string skips nothing")
        let padded = RESPParser()
        #expect(throws: RedisError.self) { try padded.feed(ByteBuffer(string: "*00000000000000000399999999\r\n")) }
        // Split anywhere, nested, or after bulk strings that contain the same bytes as data.
        let split = RESPParser()
        try split.feed(ByteBuffer(string: "*2\r\n$12\r\n*399999999\r\n\r\n*2\r\n:1\r\n*3999"))
        #expect(throws: RedisError.self) { try split.feed(ByteBuffer(string: "99999\r\n")) }
        let fine = RESPParser()
        try fine.feed(ByteBuffer(string: "*2\r\n$12\r\n*399999999\r\n\r\n*1048576\r\n"))
        #expect(try fine.next() == nil, "a bulk string's bytes are data, and a million elements are allowed")
    }

    @Test("commands are encoded binary safe, with lengths and counts of any number of digits")
    func encoding() {
        var buffer = ByteBuffer()
        RESPEncoder.encode(["SET", "k", RedisArgument(bytes: [0, 13, 10, 255]), ""], into: &buffer)
        let expected: [UInt8] = Array("*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\n".utf8) + [0, 13, 10, 255] + Array("\r\n$0\r\n\r\n".utf8)
        #expect(buffer.readableBytesView.elementsEqual(expected))

        // Lengths of several digits, an argument count of two, a command appended to another.
        let long = RedisArgument(bytes: Array(repeating: 7, count: 12_345))
        let many = (0..<11).map { RedisArgument($0) }
        RESPEncoder.encode([long], into: &buffer)
        RESPEncoder.encode(many, into: &buffer)
        let more: [UInt8] = Array("*1\r\n$12345\r\n".utf8) + Array(repeating: 7, count: 12_345) + Array("\r\n*11\r\n".utf8)
            + (0..<11).flatMap { Array("$\(String($0).count)\r\n\($0)\r\n".utf8) }
        #expect(buffer.readableBytesView.elementsEqual(expected + more))
    }
}
