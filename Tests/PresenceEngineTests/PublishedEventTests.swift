import Foundation
import NIOConcurrencyHelpers
import RedisClient
import RedisTestSupport
import Testing

@testable import PresenceEngine

/// The events the Lua scripts publish against the types that read them in Swift: what each
/// script really published, decoded, and its keys compared with the reading type's, so that a
/// field added, renamed or dropped on one side alone fails here.
@Suite("Published events: the scripts' JSON and its Swift readers")
struct PublishedEventTests {
    /// The keys of a published JSON object.
    static func keys(_ payload: [UInt8]) -> Set<String> {
        Set(((try? JSONSerialization.jsonObject(with: Data(payload))) as? [String: Any])?.keys.map { $0 } ?? [])
    }

    static func keys<Key: CodingKey & CaseIterable>(_: Key.Type) -> Set<String> {
        Set(Key.allCases.map(\.stringValue))
    }

    @Test("presence, typing, message and receipt events as the scripts publish them: each decodes, with the keys its Swift type reads")
    func scriptsAndReaders() async throws {
        try await EngineCluster.with { cluster in
            let engine = cluster.engine(node: "n1")
            let keys = engine.keys
            try await engine.setMembers(of: "chat", to: ["ann", "bo"])
            try await withRedisSubscriber(for: engine.redis, logger: TestRedis.logger()) { subscriber in
                let channels = [keys.userChannel("ann"), keys.conversationChannel("chat"), keys.messageChannel("chat")]
                try await subscriber.subscribe(channels)
                let received = NIOLockedValueBox<[(channel: String, payload: [UInt8])]>([])
                let listener = Task {
                    for await event in subscriber.events {
                        if case .message(let channel, let payload) = event { received.withLockedValue { $0.append((channel, payload)) } }
                    }
                }
                defer { listener.cancel() }
                func next(on channel: String) async -> [UInt8]? {
                    guard await eventually(timeout: .seconds(3), { received.withLockedValue { $0.contains { $0.channel == channel } } }) else { return nil }
                    return received.withLockedValue { list in
                        let index = list.firstIndex { $0.channel == channel }!
                        return list.remove(at: index).payload
                    }
                }

                _ = try await engine.connect(user: "ann", device: "phone", session: "s1")
                let presence = try #require(await next(on: keys.userChannel("ann")))
                #expect(Self.keys(presence) == Self.keys(PublishedPresence.CodingKeys.self), "presence: \(String(decoding: presence, as: UTF8.self))")
                let event = try #require(engine.decodeEvent(presence))
                let direct = try #require(PublishedPresence(direct: presence), "the script's presence event is read without JSONDecoder")
                #expect(direct == (try JSONDecoder().decode(PublishedPresence.self, from: Data(presence))))
                #expect(event.views.real.userID == "ann" && event.views.real.status == .online && event.changed)

                #expect(try await engine.setTyping(user: "ann", conversation: "chat", isTyping: true))
                let typing = try #require(await next(on: keys.conversationChannel("chat")))
                #expect(Self.keys(typing) == Self.keys(TypingEvent.CodingKeys.self), "typing: \(String(decoding: typing, as: UTF8.self))")
                #expect(engine.decodeTyping(typing).map { [$0.userID, $0.conversationID, "\($0.isTyping)"] } == ["ann", "chat", "true"])

                let outgoing = OutgoingMessage(clientMessageID: "c-1", type: .image, text: "a cat", imageURL: "https://img.test/cat.png",
                                               clientCreatedAt: 1_700_000_000_123)
                let sent = try await engine.send(outgoing, to: "chat", from: "ann").message
                let message = try #require(await next(on: keys.messageChannel("chat")))
                #expect(Self.keys(message) == Self.keys(PublishedMessage.CodingKeys.self), "message: \(String(decoding: message, as: UTF8.self))")
                #expect(engine.decodeMessageEvent(message) == .message(sent), "the script's event reads as the stored message")
                let directMessage = try #require(PublishedMessageEvent(direct: message), "the script's message event is read without JSONDecoder")
                #expect(directMessage == (try JSONDecoder().decode(PublishedMessageEvent.self, from: Data(message))))
                // A send with replicas publishes from Swift: the same keys, the same message.
                let replicated = PresenceEngine.messageEvent(sent)
                #expect(Self.keys(replicated) == Self.keys(message))
                #expect(engine.decodeMessageEvent(replicated) == .message(sent))
                // The send moved the sender's cursors to it, and said so.
                let own = try #require(await next(on: keys.messageChannel("chat")))
                #expect(Self.keys(own) == Self.keys(PublishedReceipt.CodingKeys.self), "receipt: \(String(decoding: own, as: UTF8.self))")
                #expect(engine.decodeMessageEvent(own) == .receipt(conversationID: "chat", epoch: sent.epoch, userID: "ann",
                                                                  cursors: Cursors(deliveredSeq: sent.seq, readSeq: sent.seq)))

                _ = try await engine.moveCursor(.read, of: "bo", in: "chat", to: sent.seq)
                let receipt = try #require(await next(on: keys.messageChannel("chat")))
                #expect(Self.keys(receipt) == Self.keys(PublishedReceipt.CodingKeys.self), "receipt: \(String(decoding: receipt, as: UTF8.self))")
                let directReceipt = try #require(PublishedMessageEvent(direct: receipt), "the script's receipt is read without JSONDecoder")
                #expect(directReceipt == (try JSONDecoder().decode(PublishedMessageEvent.self, from: Data(receipt))))
                #expect(engine.decodeMessageEvent(receipt) == .receipt(conversationID: "chat", epoch: sent.epoch, userID: "bo",
                                                                      cursors: Cursors(deliveredSeq: sent.seq, readSeq: sent.seq)))
            }
        }
    }

    @Test("what is not an event of its channel reads as nothing: another type, a missing field, an empty id, a status or message type this node does not know, not JSON")
    func notEvents() async throws {
        try await EngineCluster.with { cluster in
            let engine = cluster.engine(node: "n1")
            let presence = #"{"type":"presence","user_id":"u","status":"online","last_seen":0,"public_status":"online","public_last_seen":0,"changed":true,"public_changed":true,"at":1}"#
            #expect(engine.decodeEvent(Array(presence.utf8)) != nil, "the control: a whole presence event")
            for bad in [
                presence.replacingOccurrences(of: #""type":"presence""#, with: #""type":"typing""#),
                presence.replacingOccurrences(of: #""status":"online","#, with: ""),
                presence.replacingOccurrences(of: #""status":"online""#, with: #""status":"busy""#),
                "not json",
            ] {
                #expect(engine.decodeEvent(Array(bad.utf8)) == nil, "\(bad)")
            }
            let receipt = #"{"type":"receipt","conversation_id":"c","epoch":"e","user_id":"u","delivered_seq":2,"read_seq":1}"#
            #expect(engine.decodeMessageEvent(Array(receipt.utf8)) != nil, "the control: a whole receipt")
            let message = #"{"type":"message","conversation_id":"c","epoch":"e","seq":1,"id":"i","sender_id":"u","client_message_id":"k","message_type":"text","text":"t","image_url":"","created_at":1,"client_created_at":""}"#
            #expect(engine.decodeMessageEvent(Array(message.utf8)) != nil, "the control: a whole message")
            for bad in [
                receipt.replacingOccurrences(of: #""type":"receipt""#, with: #""type":"typing""#),
                receipt.replacingOccurrences(of: #","read_seq":1"#, with: ""),
                receipt.replacingOccurrences(of: #""user_id":"u""#, with: #""user_id":"""#),
                message.replacingOccurrences(of: #""message_type":"text""#, with: #""message_type":"video""#),
                message.replacingOccurrences(of: #""id":"i""#, with: #""id":"""#),
                message.replacingOccurrences(of: #""sender_id":"u""#, with: #""sender_id":"""#),
                message.replacingOccurrences(of: #""client_message_id":"k""#, with: #""client_message_id":"""#),
            ] {
                #expect(engine.decodeMessageEvent(Array(bad.utf8)) == nil, "\(bad)")
            }
        }
    }

    /// Seeded mutations of `whole` (a byte dropped or replaced, a token put in), each read by
    /// `direct`; returns how many it read, after checking each against `decoder`.
    static func mutations<Value: Equatable>(of whole: String, seed: UInt64, direct: ([UInt8]) -> Value?, decoder: ([UInt8]) -> Value?) -> Int {
        var state = seed
        func next(_ bound: Int) -> Int {
            state &+= 0x9E37_79B9_7F4A_7C15
            var z = state
            z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
            z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
            return Int((z ^ (z >> 31)) % UInt64(bound))
        }
        let tokens = ["\"", "\\", "\\u00e9", "-", "0", "1.5", "1e3", "null", "true", "false", "[]", "{}", ",", ":", " ", "\"at\":1,", "\"x\":{\"y\":[1]},",
                      "\"type\":\"receipt\",", "\"seq\":2,", "\\/"]
        var read = 0
        for _ in 0..<4_000 {
            var bytes = Array(whole.utf8)
            for _ in 0..<(1 + next(2)) {
                let at = next(bytes.count + 1)
                switch next(3) {
                case 0 where at < bytes.count: bytes.remove(at: at)
                case 1 where at < bytes.count: bytes[at] = UInt8(next(256))
                default: bytes.insert(contentsOf: tokens[next(tokens.count)].utf8, at: at)
                }
            }
            guard let value = direct(bytes) else { continue }
            read += 1
            #expect(value == decoder(bytes), "\(String(decoding: bytes, as: UTF8.self))")
        }
        return read
    }

    @Test("a presence event read directly is what JSONDecoder reads, on seeded mutations of one")
    func directPresenceMatchesDecoder() throws {
        let seed: UInt64 = 0x5EED_0034
        print("PublishedEventTests.directPresenceMatchesDecoder: seed \(seed), 4,000 mutations")
        let whole = #"{"type":"presence","user_id":"u-1","status":"away","last_seen":1764345600123,"public_status":"offline","public_last_seen":0,"changed":true,"public_changed":false,"at":1764345600124}"#
        #expect(PublishedPresence(direct: Array(whole.utf8)) == (try JSONDecoder().decode(PublishedPresence.self, from: Data(whole.utf8))))
        let read = Self.mutations(of: whole, seed: seed, direct: { PublishedPresence(direct: $0) },
                                  decoder: { try? JSONDecoder().decode(PublishedPresence.self, from: Data($0)) })
        print("PublishedEventTests.directPresenceMatchesDecoder: \(read) mutated events read directly, each as JSONDecoder reads it")
        #expect(read > 300, "the mutations reach the direct reading, not only its refusals")
    }

    @Test("a message or a receipt read directly is what JSONDecoder reads, on seeded mutations of each")
    func directMessageEventsMatchDecoder() throws {
        let seed: UInt64 = 0x5EED_0035
        print("PublishedEventTests.directMessageEventsMatchDecoder: seed \(seed), 4,000 mutations of each")
        let message = #"{"type":"message","conversation_id":"c-1","epoch":"e7","seq":12,"id":"m-9","sender_id":"u-1","client_message_id":"k\/1","message_type":"text","text":"h\u00e9llo \"you\"\n","image_url":"","created_at":1764345600123,"client_created_at":"1764345600000"}"#
        let receipt = #"{"type":"receipt","conversation_id":"c-1","epoch":"e7","user_id":"u-2","delivered_seq":12,"read_seq":11}"#
        for (kind, whole) in [("message", message), ("receipt", receipt)] {
            let direct = try #require(PublishedMessageEvent(direct: Array(whole.utf8)))
            #expect(direct == (try JSONDecoder().decode(PublishedMessageEvent.self, from: Data(whole.utf8))))
            let read = Self.mutations(of: whole, seed: seed, direct: { PublishedMessageEvent(direct: $0) },
                                      decoder: { try? JSONDecoder().decode(PublishedMessageEvent.self, from: Data($0)) })
            print("PublishedEventTests.directMessageEventsMatchDecoder: \(read) mutated \(kind)s read directly, each as JSONDecoder reads it")
            #expect(read > 100, "the mutations reach the direct reading, not only its refusals")
        }
    }
}
