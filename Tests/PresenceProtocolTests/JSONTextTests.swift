import Foundation
import Testing

@testable import PresenceProtocol

/// The frames read and written without Foundation's coders (DirectFrames.swift) against the
/// Codable path they stand in for, on seeded random frames and on mutations of them: written
/// byte for byte the same, and read the same wherever the direct reading answers at all.
@Suite("Frames read and written directly, against Foundation's coders")
struct JSONTextTests {
    static let seed: UInt64 = 0x5EED_0033
    static let rounds = 3_000

    /// SplitMix64: the same sequence for the same seed on every run.
    struct Seeded: RandomNumberGenerator {
        var state: UInt64
        mutating func next() -> UInt64 {
            state &+= 0x9E37_79B9_7F4A_7C15
            var z = state
            z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
            z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
            return z ^ (z >> 31)
        }
    }

    /// Text with what escaping has to get right: quotes, backslashes, slashes, every control
    /// character, multi-byte and astral characters, the line and paragraph separators.
    static func text(_ random: inout Seeded) -> String {
        let pieces = ["a", "Z", "9", " ", "\"", "\\", "/", "é", "日本", "😀", "\u{2028}", "\u{2029}", "\u{7F}", "\u{FEFF}", "e\u{301}", "{", "}", ",", ":"]
            + (0..<0x20).map { String(UnicodeScalar(UInt8($0))) }
        return (0..<Int.random(in: 0...12, using: &random)).map { _ in pieces.randomElement(using: &random)! }.joined()
    }

    static func id(_ random: inout Seeded) -> String {
        [String(Int64.random(in: 0...999_999_999_999_999_999, using: &random)), "007", "user-\(Int.random(in: 0...99, using: &random))", "a.b:c@d_e",
         String(repeating: "9", count: 19)].randomElement(using: &random)!
    }

    static func moment(_ random: inout Seeded) -> Int64 {
        Int64.random(in: 0...4_102_444_800_000, using: &random)
    }

    /// A frame of every kind the direct writer writes.
    static func frame(_ random: inout Seeded) -> ServerFrame {
        switch Int.random(in: 0..<9, using: &random) {
        case 0: return .ack
        case 1: return .pong
        case 2:
            return .presenceUpdate(PresencePayload(userID: id(&random), status: PresenceStatus.allCases.randomElement(using: &random)!,
                                                   lastSeen: Bool.random(using: &random) ? moment(&random) : nil,
                                                   isTyping: [nil, true, false].randomElement(using: &random)!))
        case 3: return .typingUpdate(TypingUpdate(userID: id(&random), conversationID: id(&random), isTyping: Bool.random(using: &random)))
        case 4:
            return .groupPresence(GroupPresence(conversationID: id(&random), total: Int.random(in: 0...Int.max, using: &random),
                                                online: Int.random(in: 0...500, using: &random), away: Int.random(in: 0...500, using: &random)))
        case 5:
            return .error(ErrorPayload(code: ErrorCode.allCases.randomElement(using: &random)!, message: text(&random),
                                       conversationID: Bool.random(using: &random) ? id(&random) : nil))
        case 6:
            return .receipt(ReceiptPayload(conversationID: Bool.random(using: &random) ? id(&random) : nil, userID: Bool.random(using: &random) ? id(&random) : nil,
                                           deliveredSeq: Int64.random(in: 0...Int64.max, using: &random), readSeq: Int64.random(in: 0...1000, using: &random)))
        case 7:
            return .message(MessagePayload(conversationID: id(&random), epoch: Bool.random(using: &random) ? text(&random) : nil, seq: Int64.random(in: 1...Int64.max, using: &random), id: text(&random),
                                           senderID: id(&random), clientMessageID: text(&random), type: ["text", "image"].randomElement(using: &random)!,
                                           text: text(&random), imageURL: Bool.random(using: &random) ? "https://x.test/\(text(&random))" : nil,
                                           createdAt: moment(&random), clientCreatedAt: Bool.random(using: &random) ? moment(&random) : nil,
                                           duplicate: [nil, true, false].randomElement(using: &random)!))
        default:
            return .messageAck(MessageAckPayload(conversationID: id(&random), clientMessageID: text(&random), epoch: Bool.random(using: &random) ? text(&random) : nil, seq: Int64.random(in: 1...99, using: &random),
                                                 id: text(&random), createdAt: moment(&random), duplicate: Bool.random(using: &random)))
        }
    }

    @Test("every frame the direct writer writes comes out byte for byte as JSONEncoder writes it, in both id formats")
    func writerMatchesEncoder() {
        print("JSONTextTests.writerMatchesEncoder: seed \(Self.seed), \(Self.rounds) frames")
        var random = Seeded(state: Self.seed)
        for format in PresenceIDFormat.allCases {
            let coder = FrameCoder(ids: format)
            for round in 0..<Self.rounds {
                let frame = Self.frame(&random)
                let id: String? = Bool.random(using: &random) ? Self.text(&random) : nil
                let message = ServerMessage(frame, id: id)
                guard let direct = message.directJSON(ids: format) else {
                    Issue.record("\(frame.type) was not written directly")
                    continue
                }
                let encoded = Array(coder.data(message))
                #expect(direct == encoded, "round \(round), \(format): \(String(decoding: direct, as: UTF8.self)) against \(String(decoding: encoded, as: UTF8.self))")
                if direct != encoded { return }
            }
        }
    }

    @Test("the snapshots are left to JSONEncoder, and FrameCoder writes both kinds")
    func snapshotsGoThroughTheEncoder() {
        let coder = FrameCoder()
        let snapshot = ServerMessage(.initialState([PresencePayload(userID: "u", status: .online, lastSeen: nil)]), id: "s")
        #expect(snapshot.directJSON(ids: .string) == nil)
        #expect(coder.bytes(.initialState([PresencePayload(userID: "u", status: .online, lastSeen: nil)]), id: "s") == Array(coder.data(snapshot)))
        #expect(coder.text(.pong, id: "p") == #"{"data":{},"id":"p","type":"pong"}"#)
    }

    /// Client frames as a client writes them, of every kind, with ids in `format`.
    static func clientFrame(_ random: inout Seeded, _ format: PresenceIDFormat) -> ClientMessage {
        let conversation = format == .numeric ? String(Int64.random(in: 0...99_999, using: &random)) : id(&random)
        let frame: ClientFrame = switch Int.random(in: 0..<8, using: &random) {
        case 0: .ping
        case 1: .status(PresenceStatus.allCases.randomElement(using: &random)!)
        case 2: .typing(conversationID: conversation, isTyping: Bool.random(using: &random))
        case 3: .delivered(conversationID: conversation, seq: Int64.random(in: SeqBounds.range, using: &random))
        case 4: .read(conversationID: conversation, seq: Int64.random(in: 0...9, using: &random))
        case 5: .subscribe(.users([conversation, id(&random)]))
        case 6:
            .send(MessageDraft(conversationID: conversation, clientMessageID: text(&random), text: text(&random),
                               type: Bool.random(using: &random) ? "text" : "image", imageURL: Bool.random(using: &random) ? text(&random) : nil,
                               clientCreatedAt: Bool.random(using: &random) ? moment(&random) : nil))
        default: .sync([SyncPosition(conversationID: conversation, afterSeq: 3)])
        }
        return ClientMessage(frame, id: Bool.random(using: &random) ? text(&random) : nil)
    }

    /// A frame's text changed the way a broken or hostile client might: a byte dropped, doubled
    /// or replaced, a token put in, or a value swapped for another kind.
    static func mutate(_ text: String, _ random: inout Seeded) -> [UInt8] {
        var bytes = Array(text.utf8)
        let tokens = ["\"", "\\", "\\u", "\\ud83d", "\\ude00", "\\u00e9", "-", "-0", "0", "01", "1.0", "1e3", "9223372036854775808", "-9223372036854775808",
                      "null", "true", "[]", "{}", ",", ":", " ", "\u{0}", "\u{FEFF}", "\"status\":\"away\"", "\"type\":\"ping\"", "\"data\":{}", "\"id\":1",
                      "\"type\":\"video\",", "\"image_url\":null,", "\"client_created_at\":\"2026-11-21T12:00:00.123Z\",", "1969-12-31T23:59:59Z"]
        for _ in 0..<Int.random(in: 1...3, using: &random) {
            let at = Int.random(in: 0...bytes.count, using: &random)
            switch Int.random(in: 0..<4, using: &random) {
            case 0 where at < bytes.count: bytes.remove(at: at)
            case 1 where at < bytes.count: bytes.insert(bytes[at], at: at)
            case 2 where at < bytes.count: bytes[at] = UInt8.random(in: 0...255, using: &random)
            default: bytes.insert(contentsOf: tokens.randomElement(using: &random)!.utf8, at: at)
            }
        }
        return bytes
    }

    @Test("the direct reading of a client frame, where it answers, is the Codable reading: on whole frames and on mutations of them")
    func readerMatchesDecoder() throws {
        print("JSONTextTests.readerMatchesDecoder: seed \(Self.seed), \(Self.rounds) frames and 4 mutations of each")
        var random = Seeded(state: Self.seed)
        let writer = JSONEncoder()
        writer.outputFormatting = .sortedKeys  // the same text, and so the same mutations, on every run
        var answered = 0, hot = 0
        for format in PresenceIDFormat.allCases {
            let decoder = JSONDecoder()
            decoder.userInfo[.presenceIDFormat] = format
            writer.userInfo[.presenceIDFormat] = format
            for round in 0..<Self.rounds {
                let message = Self.clientFrame(&random, format)
                let text = String(decoding: try writer.encode(message), as: UTF8.self)
                let direct = ClientMessage.direct(text.utf8, ids: format)
                switch message.frame {
                case .ping, .status, .typing, .send, .delivered, .read:
                    hot += 1
                    #expect(direct == message, "round \(round): a whole \(message.frame.type) frame is read directly: \(text)")
                default:
                    #expect(direct == nil, "round \(round): \(message.frame.type) is left to the decoder")
                }
                for _ in 0..<4 {
                    let bytes = Self.mutate(text, &random)
                    guard let read = ClientMessage.direct(bytes, ids: format) else { continue }
                    answered += 1
                    let decoded = try? decoder.decode(ClientMessage.self, from: Data(bytes))
                    #expect(decoded == read, "round \(round), \(format): \(String(decoding: bytes, as: UTF8.self)) read directly as \(read), by the decoder as \(String(describing: decoded))")
                }
            }
        }
        print("JSONTextTests.readerMatchesDecoder: \(hot) whole hot frames, \(answered) mutated frames read directly, all as the decoder reads them")
        #expect(answered > Self.rounds / 5, "the mutations exercise the direct reading, not only its refusals")
    }

    @Test("the reader takes RFC 8259's escapes and refuses what it is not sure of")
    func readerEdges() {
        #expect(JSONValue.parse(Array(#" {"a" : "\u00e9\ud83d\ude00\n\/\"" , "b":[1,-2,true,false,null,{}]} "#.utf8))
                == .object([("a", .string("é😀\n/\"")), ("b", .array([.integer(1), .integer(-2), .bool(true), .bool(false), .null, .object([])]))]))
        #expect(JSONValue.parse(Array(#"-9223372036854775808"#.utf8)) == .integer(.min))
        #expect(JSONValue.parse(Array(#"9223372036854775807"#.utf8)) == .integer(.max))
        for refused in [#"9223372036854775808"#, "-0", "01", "1.5", "1e3", #"{"a":1,"a":2}"#, #""\ud83d""#, #""\ude00x""#, "\"\u{1}\"", #"{"a":1"#,
                        "[1,]", "{,}", "\u{FEFF}{}", #""\x""#, "tru", "{} {}", String(repeating: "[", count: 40) + String(repeating: "]", count: 40)] {
            #expect(JSONValue.parse(Array(refused.utf8)) == nil, "\(refused)")
        }
        #expect(JSONValue.parse([0x22, 0xC3, 0x28, 0x22]) == nil, "invalid UTF-8 in a string")
    }
}
