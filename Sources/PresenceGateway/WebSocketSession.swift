import Foundation
import Hummingbird
import HummingbirdWebSocket
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOWebSocket
import PresenceEngine

/// Remembers the close code a client sent, which the WebSocket handler does not surface:
/// code 1000 takes the device offline at once, anything else lets it linger.
final class CloseCodeRecorder: ChannelInboundHandler, RemovableChannelHandler, Sendable {
    typealias InboundIn = WebSocketFrame
    private let code = NIOLockedValueBox<UInt16?>(nil)

    var receivedCode: UInt16? { code.withLockedValue { $0 } }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let frame = unwrapInboundIn(data)
        if frame.opcode == .connectionClose {
            var payload = frame.unmaskedData
            let received = payload.readInteger(as: UInt16.self) ?? 1005
            code.withLockedValue { $0 = received }
        }
        context.fireChannelRead(data)
    }

    /// Puts a recorder right after the frame decoder of a WebSocket channel.
    static func install(on channel: any Channel) async -> CloseCodeRecorder? {
        let recorder = CloseCodeRecorder()
        do {
            try await channel.eventLoop.submit {
                let pipeline = channel.pipeline.syncOperations
                let decoder = try pipeline.handler(type: ByteToMessageHandler<WebSocketFrameDecoder>.self)
                try pipeline.addHandler(recorder, position: .after(decoder))
            }.get()
            return recorder
        } catch {
            return nil
        }
    }
}

/// The envelope of a client frame: `{"type": "...", "data": {...}, "id"?: "..."}`.
package struct ClientFrame {
    package var type: String
    package var data: [String: Any]
    package var id: String?

    /// Parses a text frame. `id` is set as soon as it is read, so that an error about the rest
    /// of the frame can carry it.
    package static func parse(_ text: String, id: inout String?) throws(APIError) -> ClientFrame {
        guard let object = try? JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any] else {
            throw .invalid("a frame must be a JSON object {\"type\", \"data\", \"id\"?}")
        }
        if let raw = object["id"] {
            guard let value = raw as? String, value.utf8.count <= 128 else { throw .invalid("id must be a string of at most 128 bytes") }
            id = value
        }
        guard let type = object["type"] as? String else { throw .invalid("the frame has no type") }
        if object["data"] != nil, !(object["data"] is [String: Any]) { throw .invalid("data must be an object") }
        return ClientFrame(type: type, data: object["data"] as? [String: Any] ?? [:], id: id)
    }
}

/// The WebSocket protocol of API.md for one session.
struct WebSocketSession {
    let gateway: Gateway
    let session: Session
    let user: AuthenticatedUser
    let logger: Logger
    private var badFrames = 0
    private var rateLimitedFrames = 0
    private var frameBucket: TokenBucket
    private var statusBucket: TokenBucket
    private var subscribeBucket: TokenBucket
    private var typingBucket: TokenBucket

    init(gateway: Gateway, session: Session, user: AuthenticatedUser, logger: Logger) {
        self.gateway = gateway
        self.session = session
        self.user = user
        self.logger = logger
        let configuration = gateway.configuration
        statusBucket = TokenBucket(rate: configuration.statusRate, burst: configuration.statusRate * 2)
        subscribeBucket = TokenBucket(rate: configuration.subscribeRate, burst: configuration.subscribeRate * 2)
        typingBucket = TokenBucket(rate: configuration.typingRate, burst: configuration.typingRate * 2)
        frameBucket = TokenBucket(rate: configuration.frameRate, burst: configuration.frameRate * 2)
    }

    /// Handles one text message; returns `false` once the session must close.
    mutating func handle(_ text: String) async -> Bool {
        var id: String?
        do {
            // Checked before parsing: a flood costs the node as little as possible.
            if let wait = frameBucket.take() { throw APIError.rateLimited("too many frames", retryAfter: wait) }
            let frame = try ClientFrame.parse(text, id: &id)
            try await dispatch(type: frame.type, data: frame.data, id: frame.id)
            badFrames = 0
            rateLimitedFrames = 0
        } catch {
            return refuse(APIError.from(error), id: id)
        }
        return !session.isClosing
    }

    /// Answers a binary frame (the protocol is JSON text); it counts against the frame rate but
    /// not as a bad frame.
    mutating func handleBinary() -> Bool {
        if let wait = frameBucket.take() { return refuse(.rateLimited("too many frames", retryAfter: wait), id: nil) }
        session.send(Wire.error(.invalid("frames must be JSON text, not binary"), id: nil))
        return !session.isClosing
    }

    /// Answers a refused frame with `error`; past the limits of bad or rate-limited frames in a
    /// row, closes the session (1008 or 4029). Returns whether the session goes on.
    private mutating func refuse(_ apiError: APIError, id: String?) -> Bool {
        session.send(Wire.error(apiError, id: id))
        GatewayMetrics.errors(apiError.code)
        if apiError.code == "invalid_request", apiError.isBadFrame {
            badFrames += 1
            if badFrames > gateway.configuration.maxBadFrames {
                session.close(code: 1008, reason: "too many bad frames in a row")
            }
        } else if apiError.code == "rate_limited" {
            rateLimitedFrames += 1
            if rateLimitedFrames > gateway.configuration.maxRateLimitedFrames {
                session.close(code: 4029, reason: "rate limited past a limit")
            }
        }
        return !session.isClosing
    }

    private mutating func dispatch(type: String, data: [String: Any], id: String?) async throws {
        switch type {
        case "ping":
            session.send(Wire.frame("pong", [:], id: id))
        case "status":
            guard let raw = data["status"] as? String, let status = PresenceStatus(rawValue: raw) else {
                throw APIError.invalid("status must be one of online, away, offline")
            }
            if let wait = statusBucket.take() { throw APIError.rateLimited("too many status changes", retryAfter: wait) }
            session.setDeviceStatus(status)
            _ = try await gateway.engine.setStatus(user: user.userID, device: session.deviceID, session: session.id, status: status)
            session.send(Wire.frame("ack", [:], id: id))
        case "subscribe", "unsubscribe":
            if let raw = data["conversation_id"] {
                let conversation = try conversationID(raw)
                if type == "unsubscribe" {
                    await gateway.hub.unfollow(session, conversation)
                    session.send(Wire.frame("ack", [:], id: id))
                } else {
                    if let wait = subscribeBucket.take() { throw APIError.rateLimited("too many subscribes", retryAfter: wait) }
                    try await followConversation(conversation, id: id)
                }
                return
            }
            let users = try userIDs(data)
            if type == "unsubscribe" {
                // Members of a followed conversation stay watched for its counts, without updates.
                let members = users.filter { session.isMemberOfFollowed($0) }
                session.markQuiet(members)
                await gateway.hub.unwatch(session, users.filter { !members.contains($0) })
                session.send(Wire.frame("ack", [:], id: id))
                return
            }
            if let wait = subscribeBucket.take() { throw APIError.rateLimited("too many subscribes", retryAfter: wait) }
            guard session.watchedCount + users.count <= gateway.configuration.maxWatchedUsers else {
                throw APIError.invalid("a session may watch at most \(gateway.configuration.maxWatchedUsers) users")
            }
            var visible: [String] = []
            for target in users where try await gateway.engine.canSee(viewer: user.userID, target: target) {
                visible.append(target)
            }
            // Users watched so far only for a large group's counts become fully watched.
            let promoted = visible.filter { session.isQuiet($0) }
            session.unquiet(promoted)
            try await gateway.hub.watchAndRead(session, visible) { presences in
                [gateway.wire.initialState(presences, id: id)]
            }
        case "typing":
            let conversation = try conversationID(data["conversation_id"] as Any)
            guard let isTyping = data["is_typing"] as? Bool else { throw APIError.invalid("is_typing must be true or false") }
            if let wait = typingBucket.take() { throw APIError.rateLimited("too many typing frames", retryAfter: wait) }
            // A device that said offline sends no typing.
            if !session.deviceStatus.saidOffline {
                try await gateway.engine.setTyping(user: user.userID, conversation: conversation, isTyping: isTyping)
            }
            session.send(Wire.frame("ack", [:], id: id))
        default:
            throw APIError.invalid("unknown frame type '\(type.prefix(64))'")
        }
    }

    /// `subscribe {conversation_id}`: `group_presence` (answering the frame), then an
    /// `initial_state` of the members, who are watched from then on.
    private func followConversation(_ conversation: String, id: String?) async throws {
        // Subscribed before the members are read: a change after the read arrives as an event,
        // and one before it is in what is read.
        await gateway.hub.subscribeConversation(session, conversation)
        do {
            try await followSubscribed(conversation, id: id)
        } catch {
            await gateway.hub.unfollow(session, conversation)
            throw error
        }
        // A membership change between the read below and the session's view of the group being
        // set up found no view to change: read the members once more.
        await gateway.hub.refreshMembers(session, conversation)
    }

    private func followSubscribed(_ conversation: String, id: String?) async throws {
        guard let members = try await gateway.engine.members(of: conversation), members.contains(user.userID) else {
            throw APIError.forbidden("you are not a member of this conversation")
        }
        // A large group's members are watched for its counts only; they do not count towards the
        // session's watch limit, but a group has a size limit of its own.
        if members.count > Session.largeGroup {
            guard members.count <= gateway.configuration.maxGroupMembers else {
                throw APIError.invalid("conversations over \(gateway.configuration.maxGroupMembers) members cannot be followed")
            }
        } else if session.watchedCount + members.count > gateway.configuration.maxWatchedUsers {
            throw APIError.invalid("a session may watch at most \(gateway.configuration.maxWatchedUsers) users")
        }
        // Events about members are held back while they are read, so the read cannot undo them.
        let memberList = Array(members)
        let mark = session.beginRead(memberList)
        await gateway.hub.follow(session, conversation, members: memberList)
        // One pipelined read of every member, here only; later changes adjust the counts.
        let presences: [Presence]
        do {
            presences = try await gateway.engine.views(of: memberList).map { $0.seen(by: user.userID) }
        } catch {
            _ = session.endRead(memberList, mark, snapshot: [])
            throw error
        }
        // A large group gets counts and typing only, not every member's presence.
        let shown = members.count > Session.largeGroup ? [] : presences
        let dirty = session.endRead(memberList, mark, snapshot: presences, answering: (conversation, id)) { _ in
            [gateway.wire.initialState(shown, id: id)]
        }
        if !dirty.isEmpty { await gateway.hub.catchUp(session, dirty) }
    }

    /// A frame's `conversation_id`, in its stored spelling.
    private func conversationID(_ raw: Any) throws(APIError) -> String {
        let format = gateway.configuration.idFormat
        guard let conversation = format.canonical(json: raw) else { throw .invalid("conversation_id must be \(format.rule)") }
        return conversation
    }

    private func userIDs(_ data: [String: Any]) throws(APIError) -> [String] {
        guard let raw = data["user_ids"] as? [Any] else { throw .invalid("user_ids must be an array of user ids") }
        guard raw.count <= gateway.configuration.maxIDsPerRequest else {
            throw .invalid("at most \(gateway.configuration.maxIDsPerRequest) user ids per frame")
        }
        let format = gateway.configuration.idFormat
        var ids: [String] = []
        var seen = Set<String>()
        for item in raw {
            guard let id = format.canonical(json: item) else { throw .invalid("user ids must be \(format.rule)") }
            if seen.insert(id).inserted { ids.append(id) }
        }
        return ids
    }
}
