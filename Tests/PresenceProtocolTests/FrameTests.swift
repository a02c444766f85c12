import Foundation
import PresenceProtocol
import Testing

@Suite("Frames of the WebSocket protocol")
struct FrameTests {
    let strings = FrameCoder(ids: .string)
    let numbers = FrameCoder(ids: .numeric)

    /// The JSON value of a text, for comparing what was written with what the API says.
    func json(_ text: String) -> NSDictionary? {
        (try? JSONSerialization.jsonObject(with: Data(text.utf8))) as? NSDictionary
    }

    @Test("server frames are written as the API spells them, ids as strings or numbers by the format")
    func serverFrames() throws {
        let presence = PresencePayload(userID: "42", status: .away, lastSeen: 1_795_262_400_123)
        #expect(json(strings.text(.presenceUpdate(presence))) == json(#"{"type":"presence_update","data":{"user_id":"42","status":"away","last_seen":"2026-11-21T12:00:00.123Z"}}"#))
        #expect(json(numbers.text(.presenceUpdate(presence))) == json(#"{"type":"presence_update","data":{"user_id":42,"status":"away","last_seen":"2026-11-21T12:00:00.123Z"}}"#))
        let never = PresencePayload(userID: "bob", status: .offline, lastSeen: nil)
        #expect(json(numbers.text(.initialState([never]), id: "s1")) == json(#"{"type":"initial_state","data":{"presences":[{"user_id":"bob","status":"offline","last_seen":null}]},"id":"s1"}"#),
                "an id that is not a number stays a string, and last_seen is null, not left out")
        #expect(json(numbers.text(.typingUpdate(TypingUpdate(userID: "7", conversationID: "123", isTyping: true)))) == json(#"{"type":"typing_update","data":{"user_id":7,"conversation_id":123,"is_typing":true}}"#))
        #expect(json(strings.text(.groupPresence(GroupPresence(conversationID: "room", total: 5, online: 3, away: 1)), id: "g")) == json(#"{"type":"group_presence","data":{"conversation_id":"room","total":5,"online":3,"away":1},"id":"g"}"#))
        #expect(json(strings.text(.ack, id: "a")) == json(#"{"type":"ack","data":{},"id":"a"}"#))
        #expect(json(strings.text(.pong)) == json(#"{"type":"pong","data":{}}"#))
        #expect(json(strings.text(.error(ErrorPayload(code: .rateLimited, message: "slow down")), id: "x")) == json(#"{"type":"error","data":{"code":"rate_limited","message":"slow down"},"id":"x"}"#))
    }

    @Test("every server frame reads back as written, in both formats")
    func serverRoundTrip() throws {
        let frames: [ServerFrame] = [
            .initialState([PresencePayload(userID: "1", status: .online, lastSeen: 5), PresencePayload(userID: "2", status: .offline, lastSeen: nil)]),
            .presenceUpdate(PresencePayload(userID: "3", status: .away, lastSeen: 1_795_262_405_007)),
            .typingUpdate(TypingUpdate(userID: "4", conversationID: "5", isTyping: false)),
            .groupPresence(GroupPresence(conversationID: "6", total: 3, online: 1, away: 1)),
            .ack, .pong, .error(ErrorPayload(code: .forbidden, message: "no")),
            .error(ErrorPayload(code: .forbidden, message: "not a member", conversationID: "77")),
            .message(MessagePayload(conversationID: "7", epoch: "e1", seq: 3, id: "e1-3", senderID: "8", clientMessageID: "local-1", type: "image", text: "a cat",
                                    imageURL: "https://img.test/c.png", createdAt: 1_795_262_400_123, clientCreatedAt: nil)),
            .messageAck(MessageAckPayload(conversationID: "7", clientMessageID: "local-1", epoch: "e1", seq: 3, id: "e1-3", createdAt: 1_795_262_400_123, duplicate: true)),
            .synced(SyncedPayload(conversationID: "7", epoch: "e2", lastSeq: 9, complete: false, more: true, missing: [
                MissingRange(epoch: "e1", fromSeq: 4, toSeq: nil), MissingRange(epoch: "e2", fromSeq: 1, toSeq: 2),
            ])),
            .synced(SyncedPayload(conversationID: "7", epoch: "e3", lastSeq: 9, complete: true, more: false, missing: [],
                                  truncated: [MissingRange(epoch: "e2", fromSeq: 6, toSeq: 8)])),
            .receipt(ReceiptPayload(conversationID: "7", userID: "8", deliveredSeq: 5, readSeq: 4)),
        ]
        for coder in [strings, numbers] {
            for frame in frames {
                for id in [nil, "r1"] {
                    #expect(try coder.serverMessage(coder.text(frame, id: id)) == ServerMessage(frame, id: id), "\(frame) with ids as \(coder.ids)")
                }
            }
        }
    }

    @Test("a frame type this version does not know is its own error; an error code it does not know reads as internal")
    func newerPeers() throws {
        #expect(throws: ProtocolError.unknownType("presence_v2")) { try strings.serverMessage(#"{"type":"presence_v2","data":{}}"#) }
        let error = try strings.serverMessage(#"{"type":"error","data":{"code":"teapot","message":"short and stout"}}"#)
        #expect(error.frame == .error(ErrorPayload(code: .internal, message: "short and stout")))
    }

    @Test("client frames: what the gateway takes, with ids in their stored spelling")
    func clientFrames() throws {
        #expect(try strings.clientMessage(#"{"type":"ping"}"#) == ClientMessage(.ping))
        #expect(try strings.clientMessage(#"{"type":"status","data":{"status":"away"},"id":"1"}"#) == ClientMessage(.status(.away), id: "1"))
        #expect(try strings.clientMessage(#"{"type":"subscribe","data":{"user_ids":["a","b","a"]}}"#) == ClientMessage(.subscribe(.users(["a", "b"]))), "each user once, in order")
        #expect(try numbers.clientMessage(#"{"type":"subscribe","data":{"user_ids":[7,"007","8"]}}"#) == ClientMessage(.subscribe(.users(["7", "8"]))))
        #expect(try numbers.clientMessage(#"{"type":"unsubscribe","data":{"conversation_id":123}}"#) == ClientMessage(.unsubscribe(.conversation("123"))))
        #expect(try strings.clientMessage(#"{"type":"typing","data":{"conversation_id":"room","is_typing":true}}"#) == ClientMessage(.typing(conversationID: "room", isTyping: true)))
        #expect(try numbers.clientMessage(#"{"type":"send","data":{"conversation_id":12,"client_message_id":"l-1","text":"hi","type":null,"client_created_at":"2026-11-21T12:00:00.123Z"},"id":"s"}"#)
                == ClientMessage(.send(MessageDraft(conversationID: "12", clientMessageID: "l-1", text: "hi", clientCreatedAt: 1_795_262_400_123)), id: "s"))
        #expect(try strings.clientMessage(#"{"type":"sync","data":{"positions":[{"conversation_id":"a","after_seq":3,"epoch":"e1"},{"conversation_id":"b","after_seq":0}]}}"#)
                == ClientMessage(.sync([SyncPosition(conversationID: "a", afterSeq: 3, epoch: "e1"), SyncPosition(conversationID: "b", afterSeq: 0)])))
        #expect(try strings.clientMessage(#"{"type":"read","data":{"conversation_id":"a","seq":4}}"#) == ClientMessage(.read(conversationID: "a", seq: 4)))
        #expect(try strings.clientMessage(#"{"type":"delivered","data":{"conversation_id":"a","seq":0}}"#) == ClientMessage(.delivered(conversationID: "a", seq: 0)))
    }

    @Test("each way a client frame can be wrong has its own words, and keeps the frame's id once read")
    func clientFrameErrors() {
        let cases: [(text: String, coder: FrameCoder, message: String, id: String?)] = [
            ("not json", strings, #"a frame must be a JSON object {"type", "data", "id"?}"#, nil),
            ("[]", strings, #"a frame must be a JSON object {"type", "data", "id"?}"#, nil),
            (#"{"type":"ping","id":5}"#, strings, "id must be a string of at most 128 bytes", nil),
            (#"{"type":"ping","id":"\#(String(repeating: "x", count: 129))"}"#, strings, "id must be a string of at most 128 bytes", nil),
            (#"{"data":{},"id":"k"}"#, strings, "the frame has no type", "k"),
            (#"{"type":"status","data":[],"id":"k"}"#, strings, "data must be an object", "k"),
            (#"{"type":"dance","id":"k"}"#, strings, "unknown frame type 'dance'", "k"),
            (#"{"type":"status","data":{"status":"busy"},"id":"k"}"#, strings, "status must be one of online, away, offline", "k"),
            (#"{"type":"subscribe","data":{},"id":"k"}"#, strings, "user_ids must be an array of user ids", "k"),
            (#"{"type":"subscribe","data":{"user_ids":["a b"]}}"#, strings, "user ids must be 1-128 characters of A-Z a-z 0-9 . _ : @ -", nil),
            (#"{"type":"subscribe","data":{"user_ids":[7]}}"#, strings, "user ids must be 1-128 characters of A-Z a-z 0-9 . _ : @ -", nil),
            (#"{"type":"subscribe","data":{"user_ids":[true]}}"#, numbers, "user ids must be a decimal integer of 1-18 digits", nil),
            (#"{"type":"subscribe","data":{"user_ids":[-1]}}"#, numbers, "user ids must be a decimal integer of 1-18 digits", nil),
            (#"{"type":"subscribe","data":{"conversation_id":null}}"#, strings, "conversation_id must be 1-128 characters of A-Z a-z 0-9 . _ : @ -", nil),
            (#"{"type":"typing","data":{"is_typing":true}}"#, strings, "conversation_id must be 1-128 characters of A-Z a-z 0-9 . _ : @ -", nil),
            (#"{"type":"typing","data":{"conversation_id":"room","is_typing":"yes"}}"#, strings, "is_typing must be true or false", nil),
            (#"{"type":"send","data":{"conversation_id":"a","text":"hi"}}"#, strings, "client_message_id must be a string", nil),
            (#"{"type":"send","data":{"conversation_id":"a","client_message_id":"x","text":5}}"#, strings, "text must be a string", nil),
            (#"{"type":"send","data":{"conversation_id":"a","client_message_id":"x","text":"t","type":"video"}}"#, strings, "type must be text or image", nil),
            (#"{"type":"send","data":{"conversation_id":"a","client_message_id":"x","text":"t","image_url":3}}"#, strings, "image_url must be a string", nil),
            (#"{"type":"send","data":{"conversation_id":"a","client_message_id":"x","text":"t","client_created_at":"yesterday"}}"#, strings,
             "client_created_at must be an ISO 8601 UTC timestamp from 1970 on, such as 2026-11-21T12:00:00.123Z", nil),
            (#"{"type":"sync","data":{}}"#, strings, #"positions must be an array of {"conversation_id","after_seq","epoch"?}"#, nil),
            (#"{"type":"sync","data":{"positions":[5]}}"#, strings, #"each position must be an object {"conversation_id","after_seq","epoch"?}"#, nil),
            (#"{"type":"sync","data":{"positions":[{"conversation_id":"a"}]}}"#, strings, "after_seq must be a whole number from 0 to 9007199254740991 (2^53 − 1)", nil),
            (#"{"type":"sync","data":{"positions":[{"conversation_id":"a","after_seq":9007199254740992}]}}"#, strings,
             "after_seq must be a whole number from 0 to 9007199254740991 (2^53 − 1)", nil),
            (#"{"type":"sync","data":{"positions":[{"conversation_id":"a","after_seq":1,"epoch":""}]}}"#, strings, "epoch must be a string of 1 to 64 bytes", nil),
            (#"{"type":"sync","data":{"positions":[{"conversation_id":"a","after_seq":1},{"conversation_id":"a","after_seq":2}]}}"#, strings, "a sync names each conversation once", nil),
            (#"{"type":"sync","data":{"positions":["# + (0...100).map { #"{"conversation_id":"c\#($0)","after_seq":0}"# }.joined(separator: ",") + "]}}", strings,
             "a sync names at most 100 conversations", nil),
            (#"{"type":"read","data":{"conversation_id":"a","seq":-1}}"#, strings, "seq must be a whole number from 0 to 9007199254740991 (2^53 − 1)", nil),
            (#"{"type":"delivered","data":{"conversation_id":"a"}}"#, strings, "seq must be a whole number from 0 to 9007199254740991 (2^53 − 1)", nil),
            (#"{"type":"delivered","data":{"conversation_id":"a","seq":9007199254740992}}"#, strings,
             "seq must be a whole number from 0 to 9007199254740991 (2^53 − 1)", nil),
        ]
        for item in cases {
            #expect(throws: FrameError(item.message, id: item.id), "\(item.text.prefix(80))") { try item.coder.clientMessage(item.text) }
        }
    }

    @Test("every client frame reads back as written, in both formats")
    func clientRoundTrip() throws {
        let frames: [ClientFrame] = [
            .ping, .status(.offline), .subscribe(.users(["1", "22"])), .subscribe(.conversation("9")),
            .unsubscribe(.users(["3"])), .unsubscribe(.conversation("4")), .typing(conversationID: "5", isTyping: true),
            .send(MessageDraft(conversationID: "6", clientMessageID: "l-1", text: "hi \"you\"", type: "image", imageURL: "https://i.test/x.png", clientCreatedAt: 1_795_262_400_123)),
            .send(MessageDraft(conversationID: "6", clientMessageID: "l-2", text: "plain")),
            .sync([SyncPosition(conversationID: "7", afterSeq: 0), SyncPosition(conversationID: "8", afterSeq: 12, epoch: "abc")]),
            .delivered(conversationID: "9", seq: 1), .read(conversationID: "9", seq: 2),
        ]
        for coder in [strings, numbers] {
            for frame in frames {
                let message = ClientMessage(frame, id: "c")
                #expect(try coder.clientMessage(coder.text(message)) == message)
            }
        }
    }

    @Test("node messages read back as written; a user id is escaped, not pasted into the JSON")
    func nodeMessages() throws {
        for message: NodeMessage in [.disconnectUser(userID: "a\"b"), .resync(node: "n1"), .closeSession(sessionID: "s-1")] {
            #expect(try JSONDecoder().decode(NodeMessage.self, from: strings.data(message)) == message)
        }
        #expect(json(strings.text(NodeMessage.disconnectUser(userID: "7"))) == json(#"{"type":"disconnect_user","user_id":"7"}"#))
    }

    @Test("close codes and error codes have the API's numbers and statuses")
    func codes() {
        #expect(CloseCode.allCases.map(\.rawValue) == [1000, 1001, 1008, 1009, 1011, 1013, 4001, 4003, 4009, 4029])
        #expect(ErrorCode.allCases.map(\.httpStatus) == [401, 403, 404, 413, 405, 422, 429, 503, 500])
        #expect(PresenceStatus.rule == "one of online, away, offline")
    }

    @Test("timestamps: milliseconds to the API's text and back; anything else is refused")
    func timestamps() {
        for milliseconds: Int64 in [0, 1_795_262_400_123, 1_795_262_405_007, 253_402_300_799_999] {
            #expect(PresenceTimestamp.milliseconds(PresenceTimestamp.iso8601(milliseconds)) == milliseconds)
        }
        #expect(PresenceTimestamp.iso8601(1_795_262_405_007) == "2026-11-21T12:00:05.007Z")
        #expect(PresenceTimestamp.iso8601(0) == "1970-01-01T00:00:00.000Z")
        #expect(PresenceTimestamp.milliseconds("2026-11-21T12:00:00Z") == 1_795_262_400_000)
        #expect(PresenceTimestamp.milliseconds("2026-11-21T12:00:00.5Z") == 1_795_262_400_500)
        #expect(PresenceTimestamp.milliseconds("2026-11-21T12:00:00.123456Z") == 1_795_262_400_123)
        for bad in ["", "2026-11-21", "2026-11-21T12:00:00.123", "2026-13-21T12:00:00Z", "2026-11-21 12:00:00Z", "2026-11-21T12:00:00.Z", "2026-11-21T12:00:00.12a4Z"] {
            #expect(PresenceTimestamp.milliseconds(bad) == nil, "\(bad)")
        }
    }
}
