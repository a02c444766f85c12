import Foundation
import Hummingbird
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOWebSocket
import PresenceEngine
import PresenceProtocol

/// The WebSocket protocol of docs/API.md for one session: each client frame decoded, checked
/// against the session's rate limits, and done. The frame rate itself is taken as frames arrive
/// (``SessionRun/received(_:)``); the frames it refused come here to be answered in order.
struct FrameHandler {
    let gateway: Gateway
    let session: Session
    let user: AuthenticatedUser
    private var badFrames = 0
    private var rateLimitedFrames = 0
    private var statusBucket: TokenBucket
    private var subscribeBucket: TokenBucket
    private var typingBucket: TokenBucket
    private var syncBucket: TokenBucket

    init(gateway: Gateway, session: Session, user: AuthenticatedUser) {
        self.gateway = gateway
        self.session = session
        self.user = user
        let configuration = gateway.configuration
        statusBucket = TokenBucket(rate: configuration.statusRate, burst: configuration.statusRate * 2)
        subscribeBucket = TokenBucket(rate: configuration.subscribeRate, burst: configuration.subscribeRate * 2)
        typingBucket = TokenBucket(rate: configuration.typingRate, burst: configuration.typingRate * 2)
        syncBucket = TokenBucket(rate: configuration.syncRate, burst: configuration.syncRate * 2)
    }

    /// Handles one text message that arrived at `arrived` (each kind's budget counts it then:
    /// a client that keeps to the budgets is not refused because the node was busy with an
    /// earlier frame, a long `sync` answer say); returns `false` once the session must close.
    mutating func handle(_ text: String, arrived: ContinuousClock.Instant = .now) async -> Bool {
        let message: ClientMessage
        do {
            message = try gateway.frames.clientMessage(text)
        } catch {
            return refuse(.invalid(error.message), id: error.id)
        }
        do {
            try await dispatch(message.frame, id: message.id, arrived: arrived)
            badFrames = 0
            rateLimitedFrames = 0
        } catch {
            return refuse(APIError.from(error), id: message.id)
        }
        return !session.isClosing
    }

    /// Answers a frame the frame rate refused on arrival (its content was not kept).
    mutating func handleRefused(retryAfter wait: Int) -> Bool {
        refuse(.rateLimited("too many frames", retryAfter: wait), id: nil)
    }

    /// Answers a binary frame (the protocol is JSON text); it counts against the frame rate but
    /// not as a bad frame.
    mutating func handleBinary() -> Bool {
        session.send(gateway.frames.text(.error(APIError.invalid("frames must be JSON text, not binary").payload)))
        return !session.isClosing
    }

    /// Answers a refused frame with `error`; past the limits of bad or rate-limited frames in a
    /// row, closes the session (1008 or 4029). Returns whether the session goes on.
    private mutating func refuse(_ apiError: APIError, id: String?) -> Bool {
        session.send(gateway.frames.text(.error(apiError.payload), id: id))
        GatewayMetrics.errors(apiError.code.rawValue)
        switch apiError.code {
        case .invalidRequest where apiError.isBadFrame:
            badFrames += 1
            if badFrames > gateway.configuration.maxBadFrames {
                session.close(.policyViolation, reason: "too many bad frames in a row")
            }
        case .rateLimited:
            rateLimitedFrames += 1
            if rateLimitedFrames > gateway.configuration.maxRateLimitedFrames {
                session.close(.rateLimited, reason: "rate limited past a limit")
            }
        default:
            break
        }
        return !session.isClosing
    }

    private mutating func dispatch(_ frame: ClientFrame, id: String?, arrived: ContinuousClock.Instant) async throws {
        switch frame {
        case .ping:
            session.send(.pong, id: id)
        case .status(let status):
            if let wait = statusBucket.take(now: arrived) { throw APIError.rateLimited("too many status changes", retryAfter: wait) }
            session.setDeviceStatus(status)
            _ = try await gateway.engine.setStatus(user: user.userID, device: session.deviceID, session: session.id, status: status)
            session.send(.ack, id: id)
        case .subscribe(.conversation(let conversation)):
            if let wait = subscribeBucket.take(now: arrived) { throw APIError.rateLimited("too many subscribes", retryAfter: wait) }
            try await followConversation(conversation, id: id)
        case .unsubscribe(.conversation(let conversation)):
            await gateway.hub.unfollow(session, conversation)
            session.send(.ack, id: id)
        case .subscribe(.users(let users)):
            try checkCount(users)
            if let wait = subscribeBucket.take(now: arrived) { throw APIError.rateLimited("too many subscribes", retryAfter: wait) }
            guard session.watchedCount + users.count <= gateway.configuration.maxWatchedUsers else {
                throw APIError.invalid("a session may watch at most \(gateway.configuration.maxWatchedUsers) users")
            }
            let checks = session.visibilityChecks.begun
            let visible = try await gateway.engine.visible(to: user.userID, among: users)
            // Users watched so far only for a large group's counts become fully watched.
            let promoted = visible.filter { session.isQuiet($0) }
            session.unquiet(promoted)
            let frames = gateway.frames
            try await gateway.hub.watchAndRead(session, visible, visibleAsOf: checks) { presences in
                [frames.text(.initialState(presences.map { PresencePayload($0) }), id: id)]
            }
        case .unsubscribe(.users(let users)):
            try checkCount(users)
            // Members of a followed conversation stay watched for its counts, without updates.
            let members = users.filter { session.isMemberOfFollowed($0) }
            session.markQuiet(members)
            await gateway.hub.unwatch(session, users.filter { !members.contains($0) })
            session.send(.ack, id: id)
        case .typing(let conversation, let isTyping):
            if let wait = typingBucket.take(now: arrived) { throw APIError.rateLimited("too many typing frames", retryAfter: wait) }
            // A device that said offline sends no typing.
            if !session.deviceStatus.saidOffline {
                try await gateway.engine.setTyping(user: user.userID, conversation: conversation, isTyping: isTyping)
            }
            session.send(.ack, id: id)
        case .send(let draft):
            let message = try Self.outgoing(draft)
            if let wait = gateway.messageLimiter.take(user.userID) { throw APIError.rateLimited("too many messages", retryAfter: wait) }
            let sent = try await gateway.engine.send(message, to: draft.conversationID, from: user.userID)
            if !sent.duplicate { GatewayMetrics.messageSent() }
            let stored = sent.message
            session.send(gateway.frames.text(.messageAck(MessageAckPayload(
                conversationID: stored.conversationID, clientMessageID: stored.clientMessageID, epoch: stored.epoch, seq: stored.seq, id: stored.id,
                createdAt: stored.createdAt, duplicate: sent.duplicate
            )), id: id))
        case .sync(let positions):
            if let wait = syncBucket.take(now: arrived) { throw APIError.rateLimited("too many syncs", retryAfter: wait) }
            await sync(positions, id: id)
        case .delivered(let conversation, let seq):
            try await gateway.engine.markDelivered(seq, of: user.userID, in: conversation)
            session.send(.ack, id: id)
        case .read(let conversation, let seq):
            _ = try await gateway.engine.moveCursor(.read, of: user.userID, in: conversation, to: seq)
            session.send(.ack, id: id)
        }
    }

    /// A `send` frame's message for the engine, which checks its bounds.
    private static func outgoing(_ draft: MessageDraft) throws(APIError) -> OutgoingMessage {
        guard let type = MessageType(rawValue: draft.type) else { throw APIError.invalid("type must be text or image") }
        return OutgoingMessage(clientMessageID: draft.clientMessageID, type: type, text: draft.text, imageURL: draft.imageURL,
                               clientCreatedAt: draft.clientCreatedAt)
    }

    /// `sync`: for each position, the messages after it this session was not sent yet (up to
    /// 1,000, and 128 KiB of frames), then `synced` with what cannot be given; the conversation's
    /// live messages wait meanwhile (see Session+Messages.swift). A position refused (not a
    /// member, no such conversation, Redis away) is answered by an `error` naming its
    /// conversation; the others go on.
    private func sync(_ positions: [SyncPosition], id: String?) async {
        let frames = gateway.frames
        // Each conversation's part is queued once what came before it has gone to the socket,
        // and stays well inside what a session may have waiting to be written, counted as the
        // bytes it writes: the answer goes out as the socket drains, and a client reading as fast
        // as it can is never closed for syncing. A part cut at the budget says `more`.
        let limit = gateway.configuration.outboundBufferLimit / 2
        session.beginSync(positions.map(\.conversationID))
        for position in positions {
            let conversation = position.conversationID
            if let probe = gateway.hub.beforeSyncRead.withLockedValue({ $0 }) { await probe(conversation) }
            await session.connection.drained()
            var budget = limit
            do {
                let answer = try await gateway.engine.sync(Self.holding(position, sent: session.sentPosition(conversation)), for: user.userID)
                let (encoded, cut) = Self.encode(answer.messages, within: &budget, frames: frames)
                let more = answer.more || cut
                var missing = answer.missing
                // This session was sent seqs after the position before the sync (live, after or
                // past its opening hold; a sync crossing them on the wire), so it sends none at or
                // below them: those of the unbroken run it was sent the client has; any before
                // that run cannot be given here, and the client reads them over REST.
                let lost = missing.contains { $0.toSeq == nil }
                let from = missing.last { $0.toSeq != nil && $0.epoch == answer.epoch }?.toSeq ?? (lost ? 0 : answer.after)
                if let sent = session.sentPosition(conversation), sent.epoch == answer.epoch, sent.seq > from {
                    let before = min(sent.runStart - 1, answer.lastSeq)
                    if before > from { missing.append(MissingRange(epoch: answer.epoch, fromSeq: from + 1, toSeq: before)) }
                }
                let synced = frames.text(.synced(SyncedPayload(
                    conversationID: conversation, epoch: answer.epoch, lastSeq: answer.lastSeq, complete: missing.isEmpty,
                    more: more, missing: missing, truncated: answer.truncated, receipts: try await receipts(of: conversation)
                )), id: id)
                session.endSync(conversation, answer: Session.SyncAnswer(
                    messages: encoded, synced: synced, more: more, epoch: answer.epoch, clientEpoch: position.epoch))
            } catch {
                session.endSync(conversation, answer: nil)
                let apiError = APIError.from(error)
                GatewayMetrics.errors(apiError.code.rawValue)
                session.send(frames.text(.error(ErrorPayload(code: apiError.code, message: apiError.message, conversationID: conversation)), id: id))
            }
        }
    }

    /// The position a `sync` is answered from: the client's, or, when this session was sent an
    /// unbroken run of the same epoch from just after it on (live messages the `sync` crossed on
    /// the wire), the end of that run. The client holds those too, so a fork below them names
    /// them in `truncated`; without a fork the answer is the same, as a session is never sent a
    /// seq twice.
    static func holding(_ position: SyncPosition, sent: Session.SentRun?) -> SyncPosition {
        guard let sent, let epoch = position.epoch, sent.epoch == epoch, sent.seq > position.afterSeq,
              sent.runStart <= position.afterSeq + 1 else { return position }
        return SyncPosition(conversationID: position.conversationID, afterSeq: sent.seq, epoch: epoch)
    }

    /// The `message` frames of `messages` that fit in `budget` bytes as written (at least one
    /// while any budget is left), and whether some were cut; takes what they use from `budget`.
    static func encode(_ messages: [StoredMessage], within budget: inout Int, frames: FrameCoder)
        -> (encoded: [(message: StoredMessage, frame: TextFrame)], cut: Bool) {
        var encoded: [(message: StoredMessage, frame: TextFrame)] = []
        for message in messages {
            let frame = TextFrame(frames.bytes(.message(MessagePayload(message))))
            let size = frame.bytes.readableBytes
            guard size <= budget || (encoded.isEmpty && budget > 0) else { return (encoded, true) }
            budget = max(0, budget - size)
            encoded.append((message, frame))
        }
        return (encoded, false)
    }

    /// Every member's cursors for a `synced`, read after its messages (a client sets its sent
    /// messages' status from them); `nil` past ``SyncedPayload/receiptsLimit`` members.
    private func receipts(of conversation: String) async throws -> [ReceiptPayload]? {
        guard let rows = try await gateway.engine.receipts(of: conversation, for: user.userID, atMost: SyncedPayload.receiptsLimit) else { return nil }
        return rows.map { ReceiptPayload(userID: $0.user, deliveredSeq: $0.cursors.deliveredSeq, readSeq: $0.cursors.readSeq) }
    }

    /// A frame names at most `maxIDsPerRequest` users.
    private func checkCount(_ users: [String]) throws(APIError) {
        guard users.count <= gateway.configuration.maxIDsPerRequest else {
            throw .invalid("at most \(gateway.configuration.maxIDsPerRequest) user ids per frame")
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
        if members.count > gateway.configuration.largeGroup {
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
        let shown = members.count > gateway.configuration.largeGroup ? [] : presences
        let dirty = session.endRead(memberList, mark, snapshot: presences, answering: (conversation, id)) { _ in
            [gateway.frames.text(.initialState(shown.map { PresencePayload($0) }), id: id)]
        }
        if !dirty.isEmpty { await gateway.hub.catchUp(session, dirty) }
    }
}
