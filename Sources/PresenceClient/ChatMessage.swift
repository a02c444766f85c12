import Foundation

/// Where a message stands, as this device knows it.
public enum MessageStatus: String, Sendable, Hashable, Codable {
    /// Written on this device, in its outbox: not in the gateway yet ("Not delivered" while
    /// offline). It goes out by itself when a session is open.
    case sending
    /// Stored by the gateway (it has its `seq`).
    case sent
    /// Received by every other member's device (for others' messages: by this device).
    case delivered
    /// Read by every other member (for others' messages: read here, `markRead`).
    case read
    /// Refused (not a member, an invalid message) or unanswered three times on a live session.
    /// Kept in the outbox, never dropped: ``PresenceClient/retry(_:)`` sends it again.
    case failed
}

/// A conversation's message on this device: one it wrote (in the outbox until the gateway
/// stores it) or one the gateway delivered.
public struct ChatMessage: Sendable, Hashable, Codable {
    /// The conversation.
    public var conversationID: String
    /// The id this device gave the message (the same on every attempt, so a retry whose answer
    /// was lost is not stored twice).
    public var clientMessageID: String
    /// The message's place in its conversation; `nil` until the gateway stored it.
    public var seq: Int64?
    /// The gateway's id (`epoch-seq`); `nil` until stored.
    public var id: String?
    /// The history's epoch the seq belongs to; `nil` until stored.
    public var epoch: String?
    /// The sender; `nil` for this device's messages until the gateway's copy says it.
    public var senderID: String?
    /// `text` or `image`.
    public var type: String
    /// The text (an image's caption).
    public var text: String
    /// An image's URL.
    public var imageURL: String?
    /// When it was written (on this device for its own, else when the gateway stored it).
    public var createdAt: Date
    /// Where it stands.
    public var status: MessageStatus
    /// Why it failed, when it did.
    public var failure: String?

    /// A message.
    public init(conversationID: String, clientMessageID: String, seq: Int64? = nil, id: String? = nil, epoch: String? = nil, senderID: String? = nil,
                type: String = "text", text: String, imageURL: String? = nil, createdAt: Date, status: MessageStatus, failure: String? = nil) {
        self.conversationID = conversationID
        self.clientMessageID = clientMessageID
        self.seq = seq
        self.id = id
        self.epoch = epoch
        self.senderID = senderID
        self.type = type
        self.text = text
        self.imageURL = imageURL
        self.createdAt = createdAt
        self.status = status
        self.failure = failure
    }

    /// The message a `message` frame carries.
    init(_ payload: MessagePayload, epoch: String?, status: MessageStatus) {
        self.init(conversationID: payload.conversationID, clientMessageID: payload.clientMessageID, seq: payload.seq, id: payload.id,
                  epoch: epoch, senderID: payload.senderID, type: payload.type, text: payload.text, imageURL: payload.imageURL,
                  createdAt: Date(timeIntervalSince1970: Double(payload.createdAt) / 1000), status: status)
    }
}

/// A message's status changed.
public struct MessageStatusChange: Sendable, Hashable {
    public var conversationID: String
    public var clientMessageID: String
    public var status: MessageStatus
    /// Why, for `failed`.
    public var failure: String?
}

/// One member's cursors in a conversation.
public struct MemberReceipt: Sendable, Hashable {
    public var userID: String
    /// Messages up to this seq reached one of the member's devices.
    public var deliveredSeq: Int64
    /// Messages up to this seq were read.
    public var readSeq: Int64
}

/// A range of a conversation's messages. In ``PresenceClientEvent/messageGap(_:)``, messages a
/// `sync` could not give (trimmed from the history, or a history Redis lost): the app may page
/// them over REST (`GET /api/conversations/{id}/messages`) or show that they are gone. In
/// ``PresenceClientEvent/messageTruncated(_:)``, messages this device held that Redis lost.
public struct MessageGap: Sendable, Hashable {
    public var conversationID: String
    /// The epoch of the range (`nil`: the device had none).
    public var epoch: String?
    public var fromSeq: Int64
    /// `nil`: the rest of a lost epoch.
    public var toSeq: Int64?
}
