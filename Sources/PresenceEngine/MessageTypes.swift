import RedisClient

// The values of a conversation's messages that the engine's callers see (the scripts that make
// them are in Scripts/MessageScripts.swift).

/// A message as the history keeps it.
public struct StoredMessage: Sendable, Equatable {
    public var conversationID: String
    public var epoch: String
    public var seq: Int64
    public var id: String
    public var senderID: String
    public var clientMessageID: String
    public var type: MessageType
    public var text: String
    public var imageURL: String?
    /// When Redis stored it, ms since 1970.
    public var createdAt: Int64
    /// As the client said it made it, ms since 1970.
    public var clientCreatedAt: Int64?

    init(conversationID: String, epoch: String, seq: Int64, id: String, senderID: String, clientMessageID: String, type: MessageType,
         text: String, imageURL: String?, createdAt: Int64, clientCreatedAt: Int64?) {
        self.conversationID = conversationID
        self.epoch = epoch
        self.seq = seq
        self.id = id
        self.senderID = senderID
        self.clientMessageID = clientMessageID
        self.type = type
        self.text = text
        self.imageURL = imageURL
        self.createdAt = createdAt
        self.clientCreatedAt = clientCreatedAt
    }

    /// Reads the flat field list of a stream entry or a retry record (`seq` given apart for an
    /// entry, whose id holds it).
    init?(conversation: String, epoch: String, seq: Int64?, fields: [String]) {
        var values: [String: String] = [:]
        for index in stride(from: 0, to: fields.count - 1, by: 2) { values[fields[index]] = fields[index + 1] }
        guard let seq = seq ?? values["s"].flatMap({ Int64($0) }), let id = values["i"], let sender = values["u"],
              let clientID = values["c"], let type = values["t"].flatMap(MessageType.init(rawValue:)), let text = values["x"],
              let created = values["a"].flatMap({ Int64($0) }) else { return nil }
        self.init(conversationID: conversation, epoch: values["e"] ?? epoch, seq: seq, id: id, senderID: sender, clientMessageID: clientID,
                  type: type, text: text, imageURL: values["g"], createdAt: created, clientCreatedAt: values["k"].flatMap { Int64($0) })
    }

    /// Reads a stream entry, `[id, [field, value, ...]]`.
    init?(conversation: String, epoch: String, entry: RESPValue) {
        guard let parts = entry.array, parts.count == 2, let entryID = parts[0].string,
              let seq = entryID.split(separator: "-").first.flatMap({ Int64($0) }) else { return nil }
        self.init(conversation: conversation, epoch: epoch, seq: seq, fields: parts[1].strings)
    }
}

/// `text` or `image`.
public enum MessageType: String, Sendable, CaseIterable {
    case text, image
}

/// Which part of a history to read.
public enum HistoryRange: Sendable, Equatable {
    /// The oldest kept after this seq.
    case after(Int64)
    /// The newest before this seq.
    case before(Int64)
    /// The newest.
    case latest
}

/// A page of a conversation's history, in seq order.
public struct HistoryPage: Sendable, Equatable {
    public var epoch: String
    public var lastSeq: Int64
    /// The oldest seq kept; `lastSeq + 1` when none is.
    public var firstSeq: Int64
    public var messages: [StoredMessage]
    /// For a read after a seq of an epoch the current one forked from: where that epoch joins
    /// this one (the read began at the lower of the two). `nil` otherwise.
    public var forkPoint: Int64? = nil
    /// The epochs the current one forked from, newest first.
    public var forks: [Fork] = []

    /// An epoch the current one forked from, and the last seq it had in this server's life.
    public struct Fork: Sendable, Equatable {
        public var epoch: String
        public var point: Int64

        /// Reads the script's `'epoch:point epoch:point'`.
        static func list(_ text: String) -> [Fork] {
            text.split(separator: " ").compactMap { entry in
                guard let colon = entry.lastIndex(of: ":"), let point = Int64(entry[entry.index(after: colon)...]) else { return nil }
                return Fork(epoch: String(entry[..<colon]), point: point)
            }
        }
    }

    /// Where a seq of `epoch`, one the current epoch forked from, joins it: the lowest fork point
    /// on the way; `nil` for an epoch not among its ancestors.
    public func joinPoint(of epoch: String) -> Int64? {
        var lowest: Int64?
        for fork in forks {
            lowest = min(lowest ?? fork.point, fork.point)
            if fork.epoch == epoch { return lowest }
        }
        return nil
    }
}

/// What a send carries besides its conversation and sender.
public struct OutgoingMessage: Sendable {
    public var clientMessageID: String
    public var type: MessageType
    public var text: String
    public var imageURL: String?
    public var clientCreatedAt: Int64?

    public init(clientMessageID: String, type: MessageType = .text, text: String, imageURL: String? = nil, clientCreatedAt: Int64? = nil) {
        self.clientMessageID = clientMessageID
        self.type = type
        self.text = text
        self.imageURL = imageURL
        self.clientCreatedAt = clientCreatedAt
    }
}

/// A member's cursors in one conversation, within its history's epoch.
public struct Cursors: Sendable, Equatable {
    public var deliveredSeq: Int64
    public var readSeq: Int64

    public init(deliveredSeq: Int64, readSeq: Int64) {
        self.deliveredSeq = deliveredSeq
        self.readSeq = readSeq
    }
}

/// Which of a member's cursors a client moves.
public enum CursorKind: String, Sendable {
    case delivered, read
}

/// One of a user's conversations as their list shows it: the history's epoch and last seq,
/// their cursors and the last message kept.
public struct ConversationSummary: Sendable, Equatable {
    public var conversationID: String
    /// Empty while the conversation has no history.
    public var epoch: String
    public var lastSeq: Int64
    public var cursors: Cursors
    public var lastMessage: StoredMessage?
    public var unread: Int64 { max(0, lastSeq - cursors.readSeq) }
}

/// A conversation as an administrator sees it: its newest messages and every member's cursors.
public struct ConversationSnapshot: Sendable {
    public var page: HistoryPage
    public var members: [(user: String, cursors: Cursors)]

    public init(page: HistoryPage, members: [(user: String, cursors: Cursors)]) {
        self.page = page
        self.members = members
    }

    /// How far `message` got: `read` once every member but its sender has read it, `delivered`
    /// once every such member's device has it, else `sent` (also with no other member).
    public func reach(of message: StoredMessage) -> String {
        let others = members.filter { $0.user != message.senderID }.map(\.cursors)
        guard !others.isEmpty else { return "sent" }
        if others.allSatisfy({ $0.readSeq >= message.seq }) { return "read" }
        if others.allSatisfy({ $0.deliveredSeq >= message.seq }) { return "delivered" }
        return "sent"
    }
}
