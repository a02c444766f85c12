import Foundation
import Logging
import NIOConcurrencyHelpers
import NIOCore
import PresenceEngine
import PresenceProtocol
import RedisClient
import ServiceLifecycle

/// This node's sessions and their fan-out: which session watches whom, the reference-counted
/// subscriptions to user channels, and the delivery of each event to exactly its local watchers.
final class SessionHub: Service, Sendable {
    let engine: PresenceEngine
    let subscriber: any RedisChannelSubscriber
    let frames: FrameCoder
    let logger: Logger
    /// Conversation messages to members' sessions (MessageRoutes.swift).
    let messages: MessageRoutes
    private let state = NIOLockedValueBox(HubState())
    /// This node's control channels, named once: every message's channel is compared with them.
    private let controlChannels: (node: String, broadcast: String)

    private struct HubState {
        var sessions: [String: Session] = [:]
        /// User → ids of that user's own sessions.
        var own: [String: Set<String>] = [:]
        /// User → the sessions watching them, by id: a delivery goes through them without
        /// looking each up again.
        var watchers: [String: [String: Session]] = [:]
        /// Conversation → the sessions subscribed to it, by id.
        var followers: [String: [String: Session]] = [:]
        /// Session id → the conversations it is subscribed to (the same pairs, by session).
        var following: [String: Set<String>] = [:]
        /// Set once the node is shutting down: no new sessions, not ready.
        var draining = false
        /// WebSocket connections admitted, from the upgrade to their end.
        var admitted = 0
    }
    /// The catch-up that runs after a pub/sub reconnect or a data loss (SessionHub+CatchUp.swift).
    let catchUps = NIOLockedValueBox(CatchUps())
    let catchUpWakeups = Wakeups()
    /// Membership changes heard and not yet applied (SessionHub+Membership.swift).
    let pendingMembership = NIOLockedValueBox(PendingMembership())
    let membershipWakeups = Wakeups()
    /// Runs before each batch of membership work, when set: tests hold the work here.
    let beforeMembershipWork = NIOLockedValueBox<(@Sendable () async -> Void)?>(nil)
    /// Runs between a catch-up's read and its end, when set: tests make events cross reads here.
    let afterCatchUpRead = NIOLockedValueBox<(@Sendable ([String]) async -> Void)?>(nil)
    /// Runs in a `sync` after the conversation's live messages are held and before it is read,
    /// when set: tests send messages here.
    let beforeSyncRead = NIOLockedValueBox<(@Sendable (String) async -> Void)?>(nil)
    /// Runs between a watch's references to channels and its adding of users, when set: tests
    /// end the session here.
    let afterWatchRetained = NIOLockedValueBox<(@Sendable (Session, [String]) async -> Void)?>(nil)

    init(engine: PresenceEngine, subscriber: any RedisChannelSubscriber, frames: FrameCoder, logger: Logger) {
        self.engine = engine
        self.subscriber = subscriber
        self.frames = frames
        self.logger = logger
        controlChannels = (engine.keys.nodeChannel(engine.configuration.nodeID), engine.keys.broadcastChannel)
        messages = MessageRoutes(engine: engine, subscriber: subscriber, frames: frames, logger: logger)
    }

    /// How long a new session's live messages wait for its first `sync` (see Session+Messages.swift),
    /// counted from its `initial_state`.
    static let messageOpeningHold = Duration.seconds(2)
    /// How much longer they wait at most while frames of the client wait to be handled when that
    /// time is up (one may be the `sync`).
    static let messageOpeningHoldExtension = Duration.seconds(10)

    var sessionCount: Int { state.withLockedValue { $0.sessions.count } }

    /// Counts one more WebSocket connection, unless `limit` are admitted already.
    func admit(limit: Int) -> Bool {
        state.withLockedValue { state in
            guard state.admitted < limit else { return false }
            state.admitted += 1
            return true
        }
    }

    /// A connection ``admit(limit:)`` counted has ended.
    func leave() { state.withLockedValue { $0.admitted -= 1 } }

    /// Whether the node is shutting down.
    var isDraining: Bool { state.withLockedValue { $0.draining } }

    /// The node is shutting down: `/readyz` answers 503 so load balancers stop sending clients,
    /// and upgrades are refused so that clients go to another node.
    func startDraining() { state.withLockedValue { $0.draining = true } }

    // MARK: Sessions and watching

    /// Adds a session; its own user's channel carries membership changes and its own presence.
    func register(_ session: Session) async {
        state.withLockedValue { state in
            state.sessions[session.id] = session
            state.own[session.userID, default: []].insert(session.id)
        }
        try? await subscriber.retain([engine.keys.userChannel(session.userID)])
    }

    /// Reads the conversations of the sessions' user (one user) again and has each session
    /// receive the messages of exactly those; a failed read changes nothing (a reconnect's
    /// catch-up reads again). A new session's first call runs once it is registered (its user's
    /// channel subscribed: a membership change from then on is heard and read again) and ends
    /// before the session handles its first frame.
    @discardableResult
    func refreshMessageRoutes(of sessions: [Session]) async -> Bool {
        guard let user = sessions.first?.userID, let conversations = try? await engine.conversations(of: user) else { return false }
        for session in sessions where !session.isClosing {
            let current = messages.conversations(of: session)
            await messages.leave(session, Array(current.subtracting(conversations)))
            await messages.join(session, conversations)
        }
        return true
    }

    /// A new session's first read of its user's conversations. When it fails (Redis slow or
    /// away for a moment), it is read again, with backoff up to 5 s, until it succeeds or the
    /// session closes: nothing else would (a membership change or a pub/sub reconnect need not
    /// come), and a session with no routes gets no live message for its whole life.
    func openMessageRoutes(of session: Session) async {
        guard await !refreshMessageRoutes(of: [session]) else { return }
        Task {
            var delay = Duration.milliseconds(100)
            while !session.isClosing {
                guard (try? await Task.sleep(for: delay)) != nil, !session.isClosing else { return }
                if await refreshMessageRoutes(of: [session]) { return }
                delay = min(delay * 2, .seconds(5))
            }
        }
    }

    /// Removes a session and everything it watched and followed, in one step with the hub's
    /// indexes: a watch or a follow racing it (a membership change, a catch-up) adds nothing
    /// after it, and gives back its own references to channels.
    func unregister(_ session: Session) async {
        let removed = state.withLockedValue { state -> (watched: [String], followed: Set<String>)? in
            guard state.sessions.removeValue(forKey: session.id) != nil else { return nil }
            state.own[session.userID]?.remove(session.id)
            if state.own[session.userID]?.isEmpty == true { state.own[session.userID] = nil }
            let watched = session.removeWatched(Array(session.watched))
            for user in watched { Self.drop(session.id, from: user, in: &state.watchers) }
            let followed = state.following.removeValue(forKey: session.id) ?? []
            for conversation in followed { Self.drop(session.id, from: conversation, in: &state.followers) }
            return (watched, followed)
        }
        await messages.end(session)
        guard let removed else { return }
        let channels = removed.watched.map { engine.keys.userChannel($0) }
            + removed.followed.map { engine.keys.conversationChannel($0) } + [engine.keys.userChannel(session.userID)]
        try? await subscriber.release(channels)
    }

    private func isRegistered(_ session: Session) -> Bool {
        state.withLockedValue { $0.sessions[session.id] != nil }
    }

    /// Starts delivering the presence of `users` to `session`; returns the users newly watched.
    ///
    /// Each watched user holds one reference to their channel, taken before the user is added
    /// (under the hub's lock, while the session is registered): an ``unregister(_:)`` gives back
    /// exactly the users it finds added, and this gives back the references it took for users it
    /// did not add (watched meanwhile, or the session gone).
    @discardableResult
    func watch(_ session: Session, _ users: [String]) async -> [String] {
        var seen = Set<String>()
        let candidates = users.filter { !session.isWatching($0) && seen.insert($0).inserted }
        // A session unregistered while its caller awaited Redis must not watch anything again.
        guard !candidates.isEmpty, isRegistered(session) else { return [] }
        do {
            try await subscriber.retain(candidates.map { engine.keys.userChannel($0) })
        } catch {
            // Wanted from now on: subscribed on reconnect, and the resync then catches up.
            logger.debug("subscription deferred until Redis is back", metadata: ["error": "\(error)"])
        }
        if let probe = afterWatchRetained.withLockedValue({ $0 }) { await probe(session, candidates) }
        let added = state.withLockedValue { state -> [String] in
            guard state.sessions[session.id] != nil else { return [] }
            let added = session.addWatched(candidates)
            for user in added { state.watchers[user, default: [:]][session.id] = session }
            return added
        }
        if added.count < candidates.count {
            let unneeded = Set(candidates).subtracting(added)
            try? await subscriber.release(unneeded.map { engine.keys.userChannel($0) })
        }
        return added
    }

    /// Stops delivering the presence of `users` to `session`.
    func unwatch(_ session: Session, _ users: [String]) async {
        let removed = state.withLockedValue { state -> [String] in
            let removed = session.removeWatched(users)
            for user in removed { Self.drop(session.id, from: user, in: &state.watchers) }
            return removed
        }
        guard !removed.isEmpty else { return }
        try? await subscriber.release(removed.map { engine.keys.userChannel($0) })
    }

    private static func drop(_ id: String, from key: String, in index: inout [String: [String: Session]]) {
        index[key]?[id] = nil
        if index[key]?.isEmpty == true { index[key] = nil }
    }

    /// Subscribes this node to a conversation's channel for `session`, before anything of the
    /// conversation is read: a membership change after the read then arrives as an event. The
    /// session's reference to the channel is taken first and given back if it was not kept (the
    /// session follows it already, or is gone), as ``watch(_:_:)`` does.
    func subscribeConversation(_ session: Session, _ conversation: String) async {
        let channel = engine.keys.conversationChannel(conversation)
        guard isRegistered(session) else { return }
        try? await subscriber.retain([channel])
        let kept = state.withLockedValue { state -> Bool in
            guard state.sessions[session.id] != nil, state.following[session.id, default: []].insert(conversation).inserted else { return false }
            state.followers[conversation, default: [:]][session.id] = session
            return true
        }
        if !kept { try? await subscriber.release([channel]) }
    }

    /// Starts following a conversation whose channel ``subscribeConversation(_:_:)`` subscribed:
    /// its counts, and its members' presence.
    func follow(_ session: Session, _ conversation: String, members: [String]) async {
        let added = await watch(session, members)
        session.follow(conversation, members: Set(members), large: members.count > engine.configuration.largeGroup, quiet: added)
    }

    /// Ends a conversation subscription (or one that failed on its way in).
    func unfollow(_ session: Session, _ conversation: String) async {
        if let unneeded = session.unfollow(conversation) { await unwatch(session, unneeded) }
        let subscribed = state.withLockedValue { state -> Bool in
            guard state.following[session.id]?.remove(conversation) != nil else { return false }
            if state.following[session.id]?.isEmpty == true { state.following[session.id] = nil }
            Self.drop(session.id, from: conversation, in: &state.followers)
            return true
        }
        if subscribed { try? await subscriber.release([engine.keys.conversationChannel(conversation)]) }
    }

    // MARK: Control

    /// Closes every session of `user` on this node.
    func disconnect(user: String, code: CloseCode, reason: String) -> Int {
        let sessions = state.withLockedValue { state in (state.own[user] ?? []).compactMap { state.sessions[$0] } }
        for session in sessions { session.close(code, reason: reason) }
        return sessions.count
    }

    /// The sessions of `user` on this node.
    func sessions(of user: String) -> [Session] {
        state.withLockedValue { state in (state.own[user] ?? []).compactMap { state.sessions[$0] } }
    }

    /// The sessions on this node watching `user`, other than the user's own.
    func watchers(of user: String) -> [Session] {
        state.withLockedValue { state in
            (state.watchers[user]?.values).map { $0.filter { $0.userID != user } } ?? []
        }
    }

    /// The sessions following `conversation` on this node.
    func followers(of conversation: String) -> [Session] {
        state.withLockedValue { state in (state.followers[conversation]?.values).map(Array.init) ?? [] }
    }

    /// Every session, for shutdown.
    var allSessions: [Session] { state.withLockedValue { Array($0.sessions.values) } }

    // MARK: Fan-out

    /// Consumes the subscriber's events until it stops.
    func run() async throws {
        // Sharded pub/sub has no channel for every node: node messages come on the node's own.
        let control = engine.redis.pubSub == .classic ? [controlChannels.broadcast] : []
        // Presence events, typing, messages and receipts are delivered on the subscriber
        // connection's loop as they arrive, not through `events` and this task: one hop between
        // threads fewer per event. A channel's messages all take the same way, in order.
        subscriber.handleMessages { [weak self] channel, payload in
            self?.deliverNow(channel: channel, payload: payload) ?? false
        }
        defer { subscriber.handleMessages(nil) }
        try? await subscriber.retain([controlChannels.node] + control)
        let upkeep = Task { await self.followUpkeep() }
        let catchUpRunner = Task { await self.runCatchUps() }
        let membershipRunner = Task { await self.runMembershipWork() }
        defer {
            upkeep.cancel()
            catchUpRunner.cancel()
            membershipRunner.cancel()
        }
        for await event in subscriber.events.cancelOnGracefulShutdown() {
            switch event {
            case .message(let channel, let payload):
                deliver(channel: channel, payload: payload)
            case .subscribed(reconnect: true):
                logger.info("pub/sub reconnected; re-reading the presence every session watches")
                engine.requestAudit()
                messages.readAgain()
                startResync(grace: engine.configuration.recoveryGrace)
            case .resubscribed(let channels):
                // On a cluster: a slot moved or its primary failed over (which may have lost its
                // last writes, the audit puts this node's back). What those channels carry is
                // read again, as after a reconnect: the users' presence and whom they may see,
                // the conversations' members. A user's keys share the slot of the user's channel,
                // and a conversation's that of its channel, so nothing else moved with them.
                let scope = ResyncScope(
                    users: Set(channels.compactMap(userOf(channel:))),
                    conversations: Set(channels.compactMap { engine.keys.conversation(fromChannel: $0) ?? engine.keys.conversation(fromMessageChannel: $0) })
                )
                messages.readAgain(Set(channels.compactMap(engine.keys.conversation(fromMessageChannel:))))
                logger.info("shard channels subscribed again at their new primary; re-reading what they carry", metadata: [
                    "redis.channels": "\(channels.count)", "presence.users": "\(scope.users?.count ?? 0)",
                    "presence.conversations": "\(scope.conversations?.count ?? 0)",
                ])
                engine.requestAudit()
                startResync(grace: engine.configuration.recoveryGrace, scope: scope)
            case .subscribed(reconnect: false), .disconnected:
                break
            }
        }
    }

    /// Acts on what the engine's upkeep finds: after a data loss every node's watchers are read
    /// again (this node's at once, the others' through the broadcast channel: a loss one node
    /// sees may have taken what any node told its watchers); a session whose device was taken
    /// over while Redis had lost it is closed, as after any takeover.
    private func followUpkeep() async {
        for await event in engine.upkeepEvents {
            switch event {
            case .dataLost:
                messages.readAgain()
                startResync(grace: Self.dataLossGrace(engine.configuration))
                _ = try? await engine.tell(.resync(node: engine.configuration.nodeID))
            case .deviceTakenOver(let id):
                state.withLockedValue { $0.sessions[id] }?.close(.replaced, reason: "this device connected again in another session")
            }
        }
    }

    private func deliver(channel: String, payload: [UInt8]) {
        if channel == controlChannels.node || channel == controlChannels.broadcast {
            handleControl(payload)
            return
        }
        if deliverNow(channel: channel, payload: payload) { return }
        if let conversation = engine.keys.conversation(fromChannel: channel) {
            if engine.decodeMembership(payload) != nil { queueMembership(conversation: conversation) }
            return
        }
        guard let user = userOf(channel: channel), let membership = engine.decodeMembership(payload) else { return }
        queueMembership(user: user)
        // A large group's change comes only on the added and removed users' channels: those
        // watching a removed user here may have seen them through that group alone.
        if membership.large, membership.removed.contains(user) { queueDeparture(user) }
    }

    /// Delivers a presence event, a typing indicator, a message or a receipt where it arrived
    /// (on the subscriber connection's event loop, see ``run()``), with no task in between;
    /// returns false for anything else, which comes through the subscriber's events to
    /// ``deliver(channel:payload:)``. Whatever it reaches takes a lock and returns: no wait holds
    /// the connection's loop (a message past a gap starts a read of the history in a task).
    private func deliverNow(channel: String, payload: [UInt8]) -> Bool {
        if let conversation = engine.keys.conversation(fromMessageChannel: channel) {
            messages.receive(conversation, payload: payload)
            return true
        }
        if let user = userOf(channel: channel) {
            guard let event = engine.decodeEvent(payload) else { return false }
            deliverPresence(event, about: user)
            return true
        }
        if let conversation = engine.keys.conversation(fromChannel: channel) {
            guard let typing = engine.decodeTyping(payload) else { return false }
            deliverTyping(typing, in: conversation)
            return true
        }
        return false
    }

    /// A presence event to the sessions here watching `user`: each is told what it may see of
    /// it, unless it knows already.
    private func deliverPresence(_ event: PresenceEvent, about user: String) {
        let watchers = state.withLockedValue { state in (state.watchers[user]?.values).map(Array.init) ?? [] }
        // Most watchers get the same view: encode it once into a frame's buffer, which every
        // such watcher's connection then writes, not once per watcher.
        var encoded: (update: Presence, frame: TextFrame)?
        var told = 0
        for session in watchers {
            guard let update = event.update(for: session.userID) else { continue }
            let remembered = session.rememberEvent(update) {
                if let encoded, encoded.update == update { return encoded.frame }
                let frame = TextFrame(frames.bytes(.presenceUpdate(PresencePayload(update))))
                encoded = (update, frame)
                return frame
            }
            if remembered.tell { told += 1 }
            if remembered.statusChanged { session.sendGroupCounts(involving: user) }
        }
        if told > 0 { GatewayMetrics.delivered(told, latencyMilliseconds: engine.estimatedStoreNow() - event.at) }
    }

    /// Typing goes to the conversation's subscribers (not the typer's own sessions, nor a
    /// session whose device said offline).
    private func deliverTyping(_ typing: TypingEvent, in conversation: String) {
        let frame = TextFrame(frames.bytes(.typingUpdate(TypingUpdate(userID: typing.userID, conversationID: conversation, isTyping: typing.isTyping))))
        var told = 0
        for session in followers(of: conversation) where session.userID != typing.userID && !session.deviceStatus.saidOffline {
            session.send(frame)
            told += 1
        }
        if told > 0 { GatewayMetrics.delivered(told, latencyMilliseconds: engine.estimatedStoreNow() - typing.at) }
    }

    private func userOf(channel: String) -> String? {
        engine.keys.user(fromKey: channel, suffix: "events")
    }

    private func handleControl(_ payload: [UInt8]) {
        guard let message = engine.decodeNodeMessage(payload) else { return }
        switch message {
        case .disconnectUser(let user):
            let count = disconnect(user: user, code: .disconnectedByAdmin, reason: "disconnected by an administrator")
            if count > 0 { logger.info("admin disconnect", metadata: ["presence.user_id": "\(user)", "presence.sessions": "\(count)"]) }
        case .resync(let node):
            if node != engine.configuration.nodeID {
                logger.info("another node found Redis had lost data; re-reading the presence every session watches")
                messages.readAgain()
                startResync(grace: Self.dataLossGrace(engine.configuration))
                // The loss may have taken this node's devices too, where its lease still stands
                // (another shard): checked on the upkeep's next tick, within the grace, rather
                // than at the scheduled audit.
                engine.requestAudit()
            }
        case .closeSession(let id):
            state.withLockedValue { $0.sessions[id] }?.close(.replaced, reason: "this device connected again in another session")
        }
    }

    /// Asks the node holding `session` to close it (a newer session took its device over).
    func closeRemote(node: String, session: String) async {
        _ = try? await engine.tell(.closeSession(sessionID: session), node: node)
    }
}
