import Foundation

/// What a client sends the gateway. Each case is one `type` of the API, with its `data`.
public enum ClientFrame: Sendable, Hashable {
    /// The device's own status.
    case status(PresenceStatus)
    /// Start watching users, or follow a conversation.
    case subscribe(Subject)
    /// Stop watching users, or stop following a conversation.
    case unsubscribe(Subject)
    /// The user started or stopped typing in a conversation.
    case typing(conversationID: String, isTyping: Bool)
    /// Asks for a `pong`.
    case ping
    /// Sends a message to a conversation.
    case send(MessageDraft)
    /// Asks for what each conversation has after a position.
    case sync([SyncPosition])
    /// Moves the user's `delivered` cursor in a conversation.
    case delivered(conversationID: String, seq: Int64)
    /// Moves the user's `read` cursor (and `delivered` with it) in a conversation.
    case read(conversationID: String, seq: Int64)

    /// The most positions one `sync` names.
    public static let maxSyncPositions = 100

    /// Whom a `subscribe` or `unsubscribe` is about: `{"user_ids": [...]}` or `{"conversation_id": "..."}`.
    public enum Subject: Sendable, Hashable {
        /// These users, each once, in the order given.
        case users([String])
        /// A conversation: its counts, its members' presence and its typing.
        case conversation(String)
    }

    /// The user and conversation ids the frame names.
    public var ids: [String] {
        switch self {
        case .subscribe(.users(let users)), .unsubscribe(.users(let users)): users
        case .subscribe(.conversation(let conversation)), .unsubscribe(.conversation(let conversation)): [conversation]
        case .typing(let conversation, _), .delivered(let conversation, _), .read(let conversation, _): [conversation]
        case .send(let draft): [draft.conversationID]
        case .sync(let positions): positions.map(\.conversationID)
        case .status, .ping: []
        }
    }

    /// The frame's `type`.
    public var type: String {
        switch self {
        case .status: "status"
        case .subscribe: "subscribe"
        case .unsubscribe: "unsubscribe"
        case .typing: "typing"
        case .ping: "ping"
        case .send: "send"
        case .sync: "sync"
        case .delivered: "delivered"
        case .read: "read"
        }
    }
}

/// A message as a `send` frame carries it: `{"conversation_id","client_message_id","text",
/// "type"?,"image_url"?,"client_created_at"?}`. Its bounds (id rule, text size, image URL) are
/// the engine's to check, with the words REST uses too.
public struct MessageDraft: Sendable, Hashable {
    public var conversationID: String
    public var clientMessageID: String
    public var text: String
    /// `text` or `image`.
    public var type: String
    public var imageURL: String?
    /// Milliseconds since 1970.
    public var clientCreatedAt: Int64?

    public init(conversationID: String, clientMessageID: String, text: String, type: String = "text", imageURL: String? = nil, clientCreatedAt: Int64? = nil) {
        self.conversationID = conversationID
        self.clientMessageID = clientMessageID
        self.text = text
        self.type = type
        self.imageURL = imageURL
        self.clientCreatedAt = clientCreatedAt
    }
}

/// The bounds of a seq or a cursor in a request: 0 to 2^53 − 1, the largest whole number every
/// JSON reader (a browser's among them) holds exactly (docs/API.md, "Messages").
public enum SeqBounds {
    public static let max: Int64 = 9_007_199_254_740_991
    public static let range: ClosedRange<Int64> = 0...max
    /// What a refusal says.
    public static let rule = "a whole number from 0 to 9007199254740991 (2^53 − 1)"
}

/// Where a client stands in one conversation: `{"conversation_id","after_seq","epoch"?}`.
public struct SyncPosition: Sendable, Hashable {
    public var conversationID: String
    /// The last seq the client has (0 for none).
    public var afterSeq: Int64
    /// The epoch that seq belongs to; `nil` when the client has none.
    public var epoch: String?

    public init(conversationID: String, afterSeq: Int64, epoch: String? = nil) {
        self.conversationID = conversationID
        self.afterSeq = afterSeq
        self.epoch = epoch
    }
}

/// A client frame with the `id` the gateway's answer will carry: `{"type", "data", "id"?}`.
public struct ClientMessage: Sendable, Hashable {
    /// The frame.
    public var frame: ClientFrame
    /// Carried by the answer (`ack`, a snapshot or `error`); at most 128 bytes.
    public var id: String?

    /// A frame with an id for its answer.
    public init(_ frame: ClientFrame, id: String? = nil) {
        self.frame = frame
        self.id = id
    }

    /// The most bytes an `id` has.
    public static let maxIDBytes = 128
}

/// A client frame the gateway cannot take, with words saying why and the frame's `id` if it
/// could be read, so that the `error` answering it carries that id.
public struct FrameError: Error, Sendable, Hashable, CustomStringConvertible {
    /// What is wrong, for the `error` frame.
    public var message: String
    /// The refused frame's `id`.
    public var id: String?

    /// An error about a frame.
    public init(_ message: String, id: String? = nil) {
        self.message = message
        self.id = id
    }

    public var description: String { message }
}

extension ClientMessage: Codable {
    enum CodingKeys: String, CodingKey { case type, data, id }
    enum DataKeys: String, CodingKey {
        case status, userIDs = "user_ids", conversationID = "conversation_id", isTyping = "is_typing"
        case clientMessageID = "client_message_id", text, type, imageURL = "image_url", clientCreatedAt = "client_created_at"
        case positions, afterSeq = "after_seq", epoch, seq
    }

    /// Reads a frame as the gateway takes it, throwing ``FrameError`` with the API's words for
    /// each thing that can be wrong. User and conversation ids must be ids in the
    /// ``PresenceIDFormat`` of the decoder's `userInfo`; they come out in their stored spelling.
    public init(from decoder: any Decoder) throws {
        guard let container = try? decoder.container(keyedBy: CodingKeys.self) else { throw FrameError(Self.notAnObject) }
        var id: String?
        if container.contains(.id) {
            guard let value = try? container.decode(String.self, forKey: .id), value.utf8.count <= Self.maxIDBytes else {
                throw FrameError("id must be a string of at most \(Self.maxIDBytes) bytes")
            }
            id = value
        }
        self.id = id
        guard let type = try? container.decode(String.self, forKey: .type) else { throw FrameError("the frame has no type", id: id) }
        var data: KeyedDecodingContainer<DataKeys>?
        if container.contains(.data) {
            guard let object = try? container.nestedContainer(keyedBy: DataKeys.self, forKey: .data) else {
                throw FrameError("data must be an object", id: id)
            }
            data = object
        }
        let fields = Fields(data: data, ids: PresenceIDFormat(userInfo: decoder.userInfo), frameID: id)
        switch type {
        case "ping": frame = .ping
        case "status": frame = .status(try fields.status())
        case "subscribe": frame = .subscribe(try fields.subject())
        case "unsubscribe": frame = .unsubscribe(try fields.subject())
        case "typing": frame = .typing(conversationID: try fields.conversationID(), isTyping: try fields.isTyping())
        case "send": frame = .send(try fields.draft())
        case "sync": frame = .sync(try fields.positions())
        case "delivered": frame = .delivered(conversationID: try fields.conversationID(), seq: try fields.seq())
        case "read": frame = .read(conversationID: try fields.conversationID(), seq: try fields.seq())
        default: throw FrameError("unknown frame type '\(type.prefix(64))'", id: id)
        }
    }

    static let notAnObject = #"a frame must be a JSON object {"type", "data", "id"?}"#

    /// The fields of a frame's `data`, each read with its own error.
    private struct Fields {
        let data: KeyedDecodingContainer<DataKeys>?
        let ids: PresenceIDFormat
        let frameID: String?

        func status() throws(FrameError) -> PresenceStatus {
            guard let raw = try? data?.decode(String.self, forKey: .status), let status = PresenceStatus(rawValue: raw) else {
                throw FrameError("status must be \(PresenceStatus.rule)", id: frameID)
            }
            return status
        }

        func subject() throws(FrameError) -> ClientFrame.Subject {
            if data?.contains(.conversationID) == true { return .conversation(try conversationID()) }
            guard var list = try? data?.nestedUnkeyedContainer(forKey: .userIDs) else {
                throw FrameError("user_ids must be an array of user ids", id: frameID)
            }
            var users: [String] = []
            var seen = Set<String>()
            while !list.isAtEnd {
                let user: String?
                if let text = try? list.decode(String.self) {
                    user = ids.canonical(text)
                } else if let number = try? list.decode(Int64.self) {
                    user = ids.canonical(number: number)
                } else {
                    user = nil
                }
                guard let user else { throw FrameError("user ids must be \(ids.rule)", id: frameID) }
                if seen.insert(user).inserted { users.append(user) }
            }
            return .users(users)
        }

        func conversationID() throws(FrameError) -> String {
            let conversation: String? =
                if let text = try? data?.decode(String.self, forKey: .conversationID) { ids.canonical(text) }
                else if let number = try? data?.decode(Int64.self, forKey: .conversationID) { ids.canonical(number: number) }
                else { nil }
            guard let conversation else { throw FrameError("conversation_id must be \(ids.rule)", id: frameID) }
            return conversation
        }

        func seq() throws(FrameError) -> Int64 {
            guard let seq = try? data?.decode(Int64.self, forKey: .seq), SeqBounds.range.contains(seq) else {
                throw FrameError("seq must be \(SeqBounds.rule)", id: frameID)
            }
            return seq
        }

        func draft() throws(FrameError) -> MessageDraft {
            let conversation = try conversationID()
            guard let clientID = try? data?.decode(String.self, forKey: .clientMessageID) else {
                throw FrameError("client_message_id must be a string", id: frameID)
            }
            guard let text = try? data?.decode(String.self, forKey: .text) else { throw FrameError("text must be a string", id: frameID) }
            var draft = MessageDraft(conversationID: conversation, clientMessageID: clientID, text: text)
            if let data, data.contains(.type), (try? data.decodeNil(forKey: .type)) != true {
                guard let type = try? data.decode(String.self, forKey: .type), type == "text" || type == "image" else {
                    throw FrameError("type must be text or image", id: frameID)
                }
                draft.type = type
            }
            if let data, data.contains(.imageURL), (try? data.decodeNil(forKey: .imageURL)) != true {
                guard let url = try? data.decode(String.self, forKey: .imageURL) else { throw FrameError("image_url must be a string", id: frameID) }
                draft.imageURL = url
            }
            if let data, data.contains(.clientCreatedAt), (try? data.decodeNil(forKey: .clientCreatedAt)) != true {
                guard let text = try? data.decode(String.self, forKey: .clientCreatedAt), let moment = PresenceTimestamp.milliseconds(text), moment >= 0 else {
                    throw FrameError("client_created_at must be an ISO 8601 UTC timestamp from 1970 on, such as 2026-11-21T12:00:00.123Z", id: frameID)
                }
                draft.clientCreatedAt = moment
            }
            return draft
        }

        func positions() throws(FrameError) -> [SyncPosition] {
            guard var list = try? data?.nestedUnkeyedContainer(forKey: .positions) else {
                throw FrameError(#"positions must be an array of {"conversation_id","after_seq","epoch"?}"#, id: frameID)
            }
            var positions: [SyncPosition] = []
            var seen = Set<String>()
            while !list.isAtEnd {
                guard positions.count < ClientFrame.maxSyncPositions else {
                    throw FrameError("a sync names at most \(ClientFrame.maxSyncPositions) conversations", id: frameID)
                }
                guard let entry = try? list.nestedContainer(keyedBy: DataKeys.self) else {
                    throw FrameError(#"each position must be an object {"conversation_id","after_seq","epoch"?}"#, id: frameID)
                }
                let fields = Fields(data: entry, ids: ids, frameID: frameID)
                let conversation = try fields.conversationID()
                guard let after = try? entry.decode(Int64.self, forKey: .afterSeq), SeqBounds.range.contains(after) else {
                    throw FrameError("after_seq must be \(SeqBounds.rule)", id: frameID)
                }
                var epoch: String?
                if entry.contains(.epoch), (try? entry.decodeNil(forKey: .epoch)) != true {
                    guard let text = try? entry.decode(String.self, forKey: .epoch), (1...64).contains(text.utf8.count) else {
                        throw FrameError("epoch must be a string of 1 to 64 bytes", id: frameID)
                    }
                    epoch = text
                }
                guard seen.insert(conversation).inserted else {
                    throw FrameError("a sync names each conversation once", id: frameID)
                }
                positions.append(SyncPosition(conversationID: conversation, afterSeq: after, epoch: epoch))
            }
            return positions
        }

        func isTyping() throws(FrameError) -> Bool {
            guard let isTyping = try? data?.decode(Bool.self, forKey: .isTyping) else {
                throw FrameError("is_typing must be true or false", id: frameID)
            }
            return isTyping
        }
    }

    public func encode(to encoder: any Encoder) throws {
        let ids = PresenceIDFormat(userInfo: encoder.userInfo)
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode(frame.type, forKey: .type)
        var data = container.nestedContainer(keyedBy: DataKeys.self, forKey: .data)
        switch frame {
        case .ping:
            break
        case .status(let status):
            try data.encode(status, forKey: .status)
        case .subscribe(let subject), .unsubscribe(let subject):
            switch subject {
            case .users(let users):
                var list = data.nestedUnkeyedContainer(forKey: .userIDs)
                for user in users {
                    if let number = ids.number(user) { try list.encode(number) } else { try list.encode(user) }
                }
            case .conversation(let conversation):
                try ids.encode(conversation, forKey: .conversationID, in: &data)
            }
        case .typing(let conversation, let isTyping):
            try ids.encode(conversation, forKey: .conversationID, in: &data)
            try data.encode(isTyping, forKey: .isTyping)
        case .send(let draft):
            try ids.encode(draft.conversationID, forKey: .conversationID, in: &data)
            try data.encode(draft.clientMessageID, forKey: .clientMessageID)
            try data.encode(draft.text, forKey: .text)
            try data.encode(draft.type, forKey: .type)
            try data.encodeIfPresent(draft.imageURL, forKey: .imageURL)
            if let moment = draft.clientCreatedAt { try data.encodeTimestamp(moment, forKey: .clientCreatedAt) }
        case .sync(let positions):
            var list = data.nestedUnkeyedContainer(forKey: .positions)
            for position in positions {
                var entry = list.nestedContainer(keyedBy: DataKeys.self)
                try ids.encode(position.conversationID, forKey: .conversationID, in: &entry)
                try entry.encode(position.afterSeq, forKey: .afterSeq)
                try entry.encodeIfPresent(position.epoch, forKey: .epoch)
            }
        case .delivered(let conversation, let seq), .read(let conversation, let seq):
            try ids.encode(conversation, forKey: .conversationID, in: &data)
            try data.encode(seq, forKey: .seq)
        }
        try container.encodeIfPresent(id, forKey: .id)
    }
}
