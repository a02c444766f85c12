import Foundation
import Hummingbird
import PresenceEngine
import PresenceProtocol

/// The bodies of the admin reads behind the dashboard: a conversation's messages and cursors, a
/// user's devices, the overview, and the live feed's events.
extension RESTBody {
    /// `GET /api/admin/conversations/{conversation_id}`: the newest messages, each with how far
    /// it got (`sent`, `delivered` to every other member, `read` by every other member), and every
    /// member's cursors.
    struct ConversationDetail: ResponseEncodable {
        struct Member: Encodable {
            var userId: JSONID
            var deliveredSeq: Int64
            var readSeq: Int64
        }
        /// A message as `message` frames carry it, with its `status`.
        struct Reached: Encodable {
            var message: MessagePayload
            var status: String

            enum CodingKeys: CodingKey { case status }

            func encode(to encoder: any Encoder) throws {
                try message.encode(to: encoder)
                var container = encoder.container(keyedBy: CodingKeys.self)
                try container.encode(status, forKey: .status)
            }
        }
        enum CodingKeys: CodingKey { case conversationId, epoch, firstSeq, lastSeq, members, messages }

        var conversationId: JSONID
        var epoch: String?
        var firstSeq: Int64
        var lastSeq: Int64
        var members: [Member]
        var messages: [Reached]

        init(conversation: String, detail: ConversationSnapshot) {
            conversationId = JSONID(conversation)
            epoch = detail.page.epoch.isEmpty ? nil : detail.page.epoch
            firstSeq = detail.page.firstSeq
            lastSeq = detail.page.lastSeq
            members = detail.members.map { Member(userId: JSONID($0.user), deliveredSeq: $0.cursors.deliveredSeq, readSeq: $0.cursors.readSeq) }
            messages = detail.page.messages.map { Reached(message: MessagePayload($0), status: detail.reach(of: $0)) }
        }

        /// `epoch` is written as null, not left out, while there is no history.
        func encode(to encoder: any Encoder) throws {
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encode(conversationId, forKey: .conversationId)
            if let epoch { try container.encode(epoch, forKey: .epoch) } else { try container.encodeNil(forKey: .epoch) }
            try container.encode(firstSeq, forKey: .firstSeq)
            try container.encode(lastSeq, forKey: .lastSeq)
            try container.encode(members, forKey: .members)
            try container.encode(messages, forKey: .messages)
        }
    }

    /// `GET /api/admin/users/{user_id}`: what `presencectl user --json` prints.
    struct UserDetail: ResponseEncodable {
        struct Shown: Encodable {
            var status: PresenceStatus
            var lastSeen: Int64?

            enum CodingKeys: CodingKey { case status, lastSeen }

            func encode(to encoder: any Encoder) throws {
                var container = encoder.container(keyedBy: CodingKeys.self)
                try container.encode(status, forKey: .status)
                try container.encodeTimestamp(lastSeen, forKey: .lastSeen)
            }
        }
        struct Device: Encodable {
            var deviceId: String
            var status: PresenceStatus
            var node: String?
            var since: Int64
            var deadline: Int64?
            var lastAlive: Int64

            enum CodingKeys: CodingKey { case deviceId, status, node, since, deadline, lastAlive }

            func encode(to encoder: any Encoder) throws {
                var container = encoder.container(keyedBy: CodingKeys.self)
                try container.encode(deviceId, forKey: .deviceId)
                try container.encode(status, forKey: .status)
                if let node { try container.encode(node, forKey: .node) } else { try container.encodeNil(forKey: .node) }
                try container.encodeTimestamp(since, forKey: .since)
                try container.encodeTimestamp(deadline, forKey: .deadline)
                try container.encodeTimestamp(lastAlive, forKey: .lastAlive)
            }
        }
        /// One of the user's conversations with the user's cursors in it.
        struct Conversation: Encodable {
            var conversationId: JSONID
            var epoch: String?
            var lastSeq: Int64
            var deliveredSeq: Int64
            var readSeq: Int64
            var unread: Int64

            enum CodingKeys: CodingKey { case conversationId, epoch, lastSeq, deliveredSeq, readSeq, unread }

            /// `epoch` is written as null, not left out, while there is no history.
            func encode(to encoder: any Encoder) throws {
                var container = encoder.container(keyedBy: CodingKeys.self)
                try container.encode(conversationId, forKey: .conversationId)
                if let epoch { try container.encode(epoch, forKey: .epoch) } else { try container.encodeNil(forKey: .epoch) }
                try container.encode(lastSeq, forKey: .lastSeq)
                try container.encode(deliveredSeq, forKey: .deliveredSeq)
                try container.encode(readSeq, forKey: .readSeq)
                try container.encode(unread, forKey: .unread)
            }
        }
        enum CodingKeys: CodingKey { case userId, status, lastSeen, showOnlineStatus, shownToOthers, devices, conversations }

        var userId: JSONID
        var status: PresenceStatus
        var lastSeen: Int64?
        var showOnlineStatus: Bool
        var shownToOthers: Shown
        var devices: [Device]
        var conversations: [Conversation]

        func encode(to encoder: any Encoder) throws {
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encode(userId, forKey: .userId)
            try container.encode(status, forKey: .status)
            try container.encodeTimestamp(lastSeen, forKey: .lastSeen)
            try container.encode(showOnlineStatus, forKey: .showOnlineStatus)
            try container.encode(shownToOthers, forKey: .shownToOthers)
            try container.encode(devices, forKey: .devices)
            try container.encode(conversations, forKey: .conversations)
        }

        init(views: PresenceViews, devices: [DeviceRecord], conversations: [ConversationSummary]) {
            userId = JSONID(views.real.userID)
            status = views.real.status
            lastSeen = views.real.lastSeen
            showOnlineStatus = !views.hidden
            shownToOthers = Shown(status: views.shown.status, lastSeen: views.shown.lastSeen)
            self.devices = devices.map { device in
                Device(
                    deviceId: device.deviceID, status: device.status, node: device.node.isEmpty ? nil : device.node,
                    since: device.since, deadline: device.deadline, lastAlive: device.lastAlive
                )
            }
            self.conversations = conversations.map { summary in
                Conversation(conversationId: JSONID(summary.conversationID), epoch: summary.epoch.isEmpty ? nil : summary.epoch, lastSeq: summary.lastSeq,
                             deliveredSeq: summary.cursors.deliveredSeq, readSeq: summary.cursors.readSeq, unread: summary.unread)
            }
        }
    }

    /// The dashboard's overview (`GET /api/admin/overview`, and the feed's `overview` event).
    struct Overview: ResponseEncodable {
        struct Node: Encodable {
            var nodeId: String
            var sessions: Int
            var leaseExpiresAt: String
            /// Messages stored through the node since it started, as of its last lease renewal.
            var messagesStored: Int
        }
        struct Conversation: Encodable {
            var conversationId: JSONID
            var total: Int
            var online: Int
            var away: Int
        }
        var at: String
        var usersOnline: Int
        var usersAway: Int
        var users: [PresencePayload]
        var usersTruncated: Bool
        var nodes: [Node]
        var conversations: [Conversation]
        var conversationsTruncated: Bool
        /// The live nodes' `messages_stored`, summed: the dashboard's messages a second come from
        /// its change between overviews.
        var messagesStored: Int

        init(_ overview: PresenceOverview) {
            at = PresenceTimestamp.iso8601(overview.at)
            usersOnline = overview.usersOnline
            usersAway = overview.usersAway
            users = overview.present.map { PresencePayload($0) }
            usersTruncated = overview.presentTruncated
            nodes = overview.nodes.map {
                Node(nodeId: $0.nodeID, sessions: $0.sessions, leaseExpiresAt: PresenceTimestamp.iso8601($0.leaseExpiresAt), messagesStored: $0.messagesStored)
            }
            messagesStored = overview.nodes.reduce(0) { $0 + $1.messagesStored }
            conversations = overview.conversations.map {
                Conversation(conversationId: JSONID($0.conversationID), total: $0.total, online: $0.online, away: $0.away)
            }
            conversationsTruncated = overview.conversationsTruncated
        }
    }

    /// The feed's `unavailable` event: Redis could not be reached for the feed's subscriber or its
    /// overview; the feed goes on and tries again.
    struct FeedUnavailable: Encodable {
        var error = "unavailable"
        var message: String
    }

    /// The feed's `presence` event: a user's aggregate changed (`shown_status` is what others
    /// see, which differs while the user hides their status).
    struct FeedPresence: Encodable {
        var userId: JSONID
        var status: PresenceStatus
        var lastSeen: Int64?
        var shownStatus: PresenceStatus
        var at: Int64

        enum CodingKeys: CodingKey { case userId, status, lastSeen, shownStatus, at }

        func encode(to encoder: any Encoder) throws {
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encode(userId, forKey: .userId)
            try container.encode(status, forKey: .status)
            try container.encodeTimestamp(lastSeen, forKey: .lastSeen)
            try container.encode(shownStatus, forKey: .shownStatus)
            try container.encodeTimestamp(at, forKey: .at)
        }

        init(user: String, _ change: PresenceEvent) {
            userId = JSONID(user)
            status = change.views.real.status
            lastSeen = change.views.real.lastSeen
            shownStatus = change.views.shown.status
            at = change.at
        }
    }
}
