import Foundation
import PresenceProtocol

// The events published on a user's and a conversation's message channel, as their JSON objects.
// The scripts write them with `cjson.encode` (`publishPresence` in ``ScriptLua/clock``; the send
// and cursor scripts in MessageScripts.swift), and a send with `messageReplicas` writes its
// message event here once the replicas have it. Each type below is the one reading of its
// event on the Swift side: a field the Lua adds, renames or drops fails
// `PublishedEventTests`, which decodes what each script really published and compares its
// keys with these. (Typing and membership events are read by ``TypingEvent`` and
// ``MembershipEvent``, which callers see as they are.)

/// A presence change, as `publishPresence` writes it on the user's channel.
struct PublishedPresence: Codable, Equatable {
    var type = "presence"
    var userID: String
    var status: String
    /// 0: never seen.
    var lastSeen: Int64
    /// What users who may not see the truth see (offline while hidden).
    var publicStatus: String
    var publicLastSeen: Int64
    var changed: Bool
    var publicChanged: Bool
    var at: Int64

    enum CodingKeys: String, CodingKey, CaseIterable {
        case type, userID = "user_id", status, lastSeen = "last_seen", publicStatus = "public_status",
             publicLastSeen = "public_last_seen", changed, publicChanged = "public_changed", at
    }

    /// The event from its JSON without Foundation's decoder (it is read once per change, on
    /// every node watching); `nil` where the reading is not sure, for `JSONDecoder` to try.
    init?(direct payload: [UInt8]) {
        guard let json = JSONValue.parse(payload), json.isObject, let type = json["type"]?.string, let userID = json["user_id"]?.string,
              let status = json["status"]?.string, let lastSeen = json["last_seen"]?.integer, let publicStatus = json["public_status"]?.string,
              let publicLastSeen = json["public_last_seen"]?.integer, let changed = json["changed"]?.bool,
              let publicChanged = json["public_changed"]?.bool, let at = json["at"]?.integer else { return nil }
        (self.type, self.userID, self.status, self.lastSeen) = (type, userID, status, lastSeen)
        (self.publicStatus, self.publicLastSeen, self.changed, self.publicChanged, self.at) = (publicStatus, publicLastSeen, changed, publicChanged, at)
    }

    /// The event's two views; `nil` for a status this node does not know.
    var event: PresenceEvent? {
        guard type == "presence", let real = PresenceStatus(rawValue: status), let shownStatus = PresenceStatus(rawValue: publicStatus) else { return nil }
        let truth = Presence(userID: userID, status: real, lastSeen: lastSeen == 0 ? nil : lastSeen)
        let shown = Presence(userID: userID, status: shownStatus, lastSeen: publicLastSeen == 0 ? nil : publicLastSeen)
        return PresenceEvent(views: PresenceViews(real: truth, shown: shown, hidden: shown != truth), changed: changed, shownChanged: publicChanged, at: at)
    }
}

/// What a conversation's message channel carries: a stored message, or a member's cursors moved.
enum PublishedMessageEvent: Decodable, Equatable {
    case message(PublishedMessage)
    case receipt(PublishedReceipt)

    private enum Kind: String, CodingKey { case type }

    /// Reads `type` first, then the one kind's fields from the same parsed object.
    init(from decoder: any Decoder) throws {
        switch try decoder.container(keyedBy: Kind.self).decode(String.self, forKey: .type) {
        case "message": self = .message(try PublishedMessage(from: decoder))
        case "receipt": self = .receipt(try PublishedReceipt(from: decoder))
        case let other: throw DecodingError.dataCorrupted(.init(codingPath: [Kind.type], debugDescription: "not a message channel event: \(other)"))
        }
    }

    /// The event from its JSON without Foundation's decoder (a message is read once per send,
    /// on every node with a member's session); `nil` where the reading is not sure, for
    /// `JSONDecoder` to try.
    init?(direct payload: [UInt8]) {
        guard let json = JSONValue.parse(payload), json.isObject else { return nil }
        switch json["type"]?.string {
        case "message"?:
            guard let message = PublishedMessage(direct: json) else { return nil }
            self = .message(message)
        case "receipt"?:
            guard let conversation = json["conversation_id"]?.string, let epoch = json["epoch"]?.string, let user = json["user_id"]?.string,
                  let delivered = json["delivered_seq"]?.integer, let read = json["read_seq"]?.integer else { return nil }
            self = .receipt(PublishedReceipt(conversationID: conversation, epoch: epoch, userID: user, deliveredSeq: delivered, readSeq: read))
        default:
            return nil
        }
    }

    /// What the engine's callers get.
    var event: MessageEvent? {
        switch self {
        case .message(let published): published.stored.map(MessageEvent.message)
        case .receipt(let published):
            published.userID.isEmpty ? nil : .receipt(conversationID: published.conversationID, epoch: published.epoch, userID: published.userID,
                                                      cursors: Cursors(deliveredSeq: published.deliveredSeq, readSeq: published.readSeq))
        }
    }
}

/// A stored message, as the send script (or a replicated send) publishes it. Optional values
/// are written as empty strings: Lua's tables cannot hold a nil.
struct PublishedMessage: Codable, Equatable {
    var type = "message"
    var conversationID: String
    var epoch: String
    var seq: Int64
    var id: String
    var senderID: String
    var clientMessageID: String
    var messageType: String
    var text: String
    /// Empty: none.
    var imageURL: String
    var createdAt: Int64
    /// The client's own time in ms, as a decimal string; empty: none.
    var clientCreatedAt: String

    enum CodingKeys: String, CodingKey, CaseIterable {
        case type, conversationID = "conversation_id", epoch, seq, id, senderID = "sender_id", clientMessageID = "client_message_id",
             messageType = "message_type", text, imageURL = "image_url", createdAt = "created_at", clientCreatedAt = "client_created_at"
    }

    init(_ message: StoredMessage) {
        conversationID = message.conversationID
        epoch = message.epoch
        seq = message.seq
        id = message.id
        senderID = message.senderID
        clientMessageID = message.clientMessageID
        messageType = message.type.rawValue
        text = message.text
        imageURL = message.imageURL ?? ""
        createdAt = message.createdAt
        clientCreatedAt = message.clientCreatedAt.map { String($0) } ?? ""
    }

    /// ``PublishedMessageEvent/init(direct:)``'s reading of a message event's object.
    fileprivate init?(direct json: JSONValue) {
        guard let conversation = json["conversation_id"]?.string, let epoch = json["epoch"]?.string, let seq = json["seq"]?.integer,
              let id = json["id"]?.string, let sender = json["sender_id"]?.string, let clientID = json["client_message_id"]?.string,
              let messageType = json["message_type"]?.string, let text = json["text"]?.string, let imageURL = json["image_url"]?.string,
              let createdAt = json["created_at"]?.integer, let clientCreatedAt = json["client_created_at"]?.string else { return nil }
        (conversationID, self.epoch, self.seq, self.id, senderID, clientMessageID) = (conversation, epoch, seq, id, sender, clientID)
        (self.messageType, self.text, self.imageURL, self.createdAt, self.clientCreatedAt) = (messageType, text, imageURL, createdAt, clientCreatedAt)
    }

    /// The message; `nil` for a type this node does not know, or without its id, sender or
    /// client id (the script always writes them).
    var stored: StoredMessage? {
        guard let kind = MessageType(rawValue: messageType), !id.isEmpty, !senderID.isEmpty, !clientMessageID.isEmpty else { return nil }
        return StoredMessage(conversationID: conversationID, epoch: epoch, seq: seq, id: id, senderID: senderID, clientMessageID: clientMessageID,
                             type: kind, text: text, imageURL: imageURL.isEmpty ? nil : imageURL, createdAt: createdAt,
                             clientCreatedAt: Int64(clientCreatedAt))
    }
}

/// A member's delivered and read cursors after the cursor script moved them.
struct PublishedReceipt: Codable, Equatable {
    var type = "receipt"
    var conversationID: String
    var epoch: String
    var userID: String
    var deliveredSeq: Int64
    var readSeq: Int64

    enum CodingKeys: String, CodingKey, CaseIterable {
        case type, conversationID = "conversation_id", epoch, userID = "user_id", deliveredSeq = "delivered_seq", readSeq = "read_seq"
    }
}
