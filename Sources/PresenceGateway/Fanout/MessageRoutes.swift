import Logging
import NIOConcurrencyHelpers
import NIOCore
import PresenceEngine
import PresenceProtocol
import RedisClient

/// This node's delivery of conversation messages (docs/API.md, "Messages"): every live session of a
/// member gets its conversations' messages without subscribing to anything.
///
/// A conversation's message channel is subscribed while a member's session is here (one
/// reference per session and conversation, as the hub's watches hold theirs), and its history's
/// position is read after the subscription: a message stored before the read is history, one
/// stored after it arrives on the channel. Per conversation the node delivers seqs one after
/// another: a message past a gap (one lost to a pub/sub reconnect, a failover, a slot moving)
/// makes it read the missing range from the history and deliver that first; messages arriving
/// meanwhile wait, so that sessions never see a gap or a repeat from the node. A message's
/// frame is encoded once, for every session.
final class MessageRoutes: Sendable {
    let engine: PresenceEngine
    let subscriber: any RedisChannelSubscriber
    let frames: FrameCoder
    let logger: Logger
    private let state = NIOLockedValueBox(RoutesState())
    /// Runs between a delivery read of the history and its use, when set: tests make messages
    /// arrive during a read here.
    let afterDeliveryRead = NIOLockedValueBox<(@Sendable (String) async -> Void)?>(nil)

    struct RoutesState {
        var routes: [String: Route] = [:]
        /// Session id → the conversations it receives messages of.
        var bySession: [String: Set<String>] = [:]
    }

    /// One conversation as this node delivers it.
    struct Route {
        var sessions: [String: Session] = [:]
        /// The epoch of the last seq delivered; empty before any history.
        var epoch = ""
        var lastSeq: Int64 = 0
        /// Whether the history's position has been read (after the subscription).
        var settled = false
        /// A read of the history is under way (the position, or a gap's range).
        var reading = false
        /// Another read was asked for while one ran (a gap found meanwhile, a reconnect).
        var readAgain = false
        /// Messages that arrived while the position was unknown or a read ran, in arrival order.
        var waiting: [StoredMessage] = []
        /// The life of the history a read found replaced (it expired, or Redis lost it): a
        /// message of it that arrives late is older than anything delivered since, and dropped.
        var leftEpoch: String?
    }

    init(engine: PresenceEngine, subscriber: any RedisChannelSubscriber, frames: FrameCoder, logger: Logger) {
        self.engine = engine
        self.subscriber = subscriber
        self.frames = frames
        self.logger = logger
    }

    /// How many messages of `conversation` wait for a read of its history to end.
    func waitingCount(_ conversation: String) -> Int {
        state.withLockedValue { $0.routes[conversation]?.waiting.count ?? 0 }
    }

    /// The conversations `session` receives messages of.
    func conversations(of session: Session) -> Set<String> {
        state.withLockedValue { $0.bySession[session.id] ?? [] }
    }

    // MARK: Who receives what

    /// `session` receives the messages of `conversations` from now on.
    func join(_ session: Session, _ conversations: [String]) async {
        let candidates = Array(Set(conversations).subtracting(self.conversations(of: session))).sorted()
        guard !candidates.isEmpty else { return }
        // Subscribed before anything is read: what is stored after the read arrives here.
        try? await subscriber.retain(candidates.map { engine.keys.messageChannel($0) })
        let (added, fresh) = state.withLockedValue { state -> ([String], [String]) in
            // A session that ended while this awaited Redis joins nothing.
            guard !session.messageState.withLockedValue({ $0.ended }) else { return ([], []) }
            var added: [String] = []
            var fresh: [String] = []
            for conversation in candidates where state.bySession[session.id, default: []].insert(conversation).inserted {
                if state.routes[conversation] == nil {
                    state.routes[conversation] = Route()
                    fresh.append(conversation)
                }
                state.routes[conversation]?.sessions[session.id] = session
                added.append(conversation)
            }
            return (added, fresh)
        }
        let unneeded = Set(candidates).subtracting(added)
        if !unneeded.isEmpty { try? await subscriber.release(unneeded.map { engine.keys.messageChannel($0) }) }
        if !fresh.isEmpty { await settle(fresh) }
    }

    /// `session` no longer receives the messages of `conversations` (its user left them).
    func leave(_ session: Session, _ conversations: [String]) async {
        let removed = state.withLockedValue { state -> [String] in
            conversations.filter { conversation in
                guard state.bySession[session.id]?.remove(conversation) != nil else { return false }
                Self.drop(session, from: conversation, in: &state)
                return true
            }
        }
        for conversation in removed { session.forgetConversation(conversation) }
        if !removed.isEmpty { try? await subscriber.release(removed.map { engine.keys.messageChannel($0) }) }
    }

    /// `session` ended: it receives nothing more, and gives back its channels.
    func end(_ session: Session) async {
        let removed = state.withLockedValue { state -> Set<String> in
            session.messageState.withLockedValue { $0.ended = true }
            let conversations = state.bySession.removeValue(forKey: session.id) ?? []
            for conversation in conversations { Self.drop(session, from: conversation, in: &state) }
            return conversations
        }
        if !removed.isEmpty { try? await subscriber.release(removed.map { engine.keys.messageChannel($0) }) }
    }

    private static func drop(_ session: Session, from conversation: String, in state: inout RoutesState) {
        state.routes[conversation]?.sessions[session.id] = nil
        if state.routes[conversation]?.sessions.isEmpty == true { state.routes[conversation] = nil }
        if state.bySession[session.id]?.isEmpty == true { state.bySession[session.id] = nil }
    }

    // MARK: Delivery

    /// A message or a receipt heard on a conversation's message channel.
    func receive(_ conversation: String, payload: [UInt8]) {
        guard let event = engine.decodeMessageEvent(payload) else { return }
        switch event {
        case .message(let message):
            let gap = state.withLockedValue { state -> Bool in
                guard state.routes[conversation] != nil else { return false }
                return accept(message, route: &state.routes[conversation]!)
            }
            if gap { startReading(conversation) }
        case .receipt(_, _, let user, let cursors):
            let sessions = state.withLockedValue { state in state.routes[conversation].map { Array($0.sessions.values) } ?? [] }
            guard !sessions.isEmpty else { return }
            let frame = TextFrame(frames.bytes(.receipt(ReceiptPayload(
                conversationID: conversation, userID: user, deliveredSeq: cursors.deliveredSeq, readSeq: cursors.readSeq
            ))))
            for session in sessions { session.send(frame) }
        }
    }

    /// Delivers `message` if it is the next seq; queues it while the route reads; returns
    /// whether it is past a gap (a read of the history must begin).
    private func accept(_ message: StoredMessage, route: inout Route) -> Bool {
        guard route.settled, !route.reading else {
            route.waiting.append(message)
            return false
        }
        if message.epoch == route.leftEpoch { return false }
        if message.epoch != route.epoch {
            // Another life of the history: the first one (nothing was there when the position
            // was read), or one that began since: lost (seqs from 1 again) or forked (seqs go on
            // from its fork point). Only the history can say which: read it.
            guard route.epoch.isEmpty else {
                route.waiting.append(message)
                return true
            }
            route.epoch = message.epoch
            route.lastSeq = 0
        }
        if message.seq <= route.lastSeq { return false }
        guard message.seq == route.lastSeq + 1 else {
            route.waiting.append(message)
            return true
        }
        deliver(message, in: route)
        route.lastSeq = message.seq
        return false
    }

    private func deliver(_ message: StoredMessage, in route: Route) {
        let frame = TextFrame(frames.bytes(.message(MessagePayload(message))))
        for session in route.sessions.values { session.deliverLive(message, frame: frame) }
        GatewayMetrics.messageDelivered(sessions: route.sessions.count, latencyMilliseconds: engine.estimatedStoreNow() - message.createdAt)
    }

    /// Reads the position of new routes (one pipeline), then delivers what waited meanwhile.
    private func settle(_ conversations: [String]) async {
        let wanted = state.withLockedValue { state in
            conversations.filter { conversation in
                guard state.routes[conversation]?.reading == false else { return false }
                state.routes[conversation]?.reading = true
                return true
            }
        }
        guard !wanted.isEmpty else { return }
        let positions = (try? await engine.historyPositions(wanted)) ?? [:]
        var unsettled: [String] = []
        for conversation in wanted {
            let again = state.withLockedValue { state -> Bool in
                guard var route = state.routes[conversation] else { return false }
                if let position = positions[conversation] { Self.place(&route, epoch: position.epoch, lastSeq: position.lastSeq) }
                route.reading = false
                let again = drainWaiting(&route) || route.readAgain
                state.routes[conversation] = route
                return again
            }
            if positions[conversation] == nil || again { unsettled.append(conversation) }
        }
        for conversation in unsettled { startReading(conversation) }
    }

    /// Reads a route's history from its last seq (its position first, if unknown) in the
    /// background; at most one read per route runs, and one asked for meanwhile follows it.
    func startReading(_ conversation: String) {
        let start = state.withLockedValue { state -> Bool in
            guard state.routes[conversation] != nil else { return false }
            if state.routes[conversation]!.reading {
                state.routes[conversation]!.readAgain = true
                return false
            }
            state.routes[conversation]!.reading = true
            state.routes[conversation]!.readAgain = false
            return true
        }
        guard start else { return }
        Task { await self.read(conversation) }
    }

    /// After a pub/sub reconnect or a failover: every route (or those named) reads what it may
    /// have missed.
    func readAgain(_ conversations: Set<String>? = nil) {
        let names = state.withLockedValue { state in Array(state.routes.keys).filter { conversations?.contains($0) ?? true } }
        for conversation in names { startReading(conversation) }
    }

    private func read(_ conversation: String) async {
        var failures = 0
        while true {
            let position = state.withLockedValue { state -> (epoch: String, lastSeq: Int64, settled: Bool)? in
                state.routes[conversation].map { ($0.epoch, $0.lastSeq, $0.settled) }
            }
            guard let position else { return }
            do {
                // Unknown position: where the history stands is enough (nothing before it is owed).
                // A known one names its epoch, so that a fork reads on from its fork point.
                let page = try await engine.deliveryPage(of: conversation, position.settled ? .after(position.lastSeq) : .latest,
                                                         limit: position.settled ? PresenceEngine.maxHistoryPage : 1,
                                                         epoch: position.epoch.isEmpty ? nil : position.epoch)
                failures = 0
                if let probe = afterDeliveryRead.withLockedValue({ $0 }) { await probe(conversation) }
                let done = state.withLockedValue { state -> Bool in
                    guard var route = state.routes[conversation] else { return true }
                    defer { state.routes[conversation] = route }
                    if page.epoch != route.epoch, route.settled, let point = page.forkPoint {
                        // The history forked from the route's epoch: what was delivered up to the
                        // fork point is the same message in the new epoch; the page was read from
                        // the lower of the two (sessions that were sent more are told by `sync`).
                        route.leftEpoch = route.epoch
                        route.epoch = page.epoch
                        route.lastSeq = min(route.lastSeq, point)
                    }
                    // Waiting messages of another life than the history's (older ones that came
                    // late) are not of what is delivered from now on.
                    if !page.epoch.isEmpty { route.waiting.removeAll { $0.epoch != page.epoch } }
                    if !route.settled {
                        Self.place(&route, epoch: page.epoch, lastSeq: page.lastSeq)
                    } else if page.epoch != route.epoch {
                        // The history started again: read it from its start.
                        if !route.epoch.isEmpty { route.leftEpoch = route.epoch }
                        route.epoch = page.epoch
                        route.lastSeq = 0
                        return false
                    } else {
                        for message in page.messages where message.seq > route.lastSeq {
                            // A trimmed stretch cannot be delivered; sessions sync past it.
                            deliver(message, in: route)
                            route.lastSeq = message.seq
                        }
                        if page.messages.count >= PresenceEngine.maxHistoryPage { return false }
                    }
                    let gap = drainWaiting(&route)
                    if gap || route.readAgain {
                        route.readAgain = false
                        return false
                    }
                    route.reading = false
                    return true
                }
                if done { return }
            } catch {
                failures += 1
                logger.debug("reading a conversation's history for delivery failed; trying again", metadata: [
                    "presence.conversation_id": "\(conversation)", "error": "\(error)",
                ])
                // Redis is away: the reconnect's read will come; until then, try now and then.
                try? await Task.sleep(for: .milliseconds(min(5_000, 100 * (1 << min(failures, 6)))))
            }
        }
    }

    /// Gives a route its position: the history's, or just before the first message that came
    /// on the channel since the subscription, when that one is already in the history (it was
    /// stored after the subscription, so this node's sessions are owed it).
    private static func place(_ route: inout Route, epoch: String, lastSeq: Int64) {
        route.settled = true
        route.epoch = epoch
        route.lastSeq = lastSeq
        if let first = route.waiting.first, first.epoch == epoch, first.seq <= lastSeq { route.lastSeq = first.seq - 1 }
    }

    /// Delivers what waited, in order, now that the route knows its position; returns whether a
    /// gap remains (another read is needed). A message of another epoch than the route's starts
    /// a new life (it was stored after the read: an empty history has no epoch yet), unless it
    /// is of the life a read found replaced.
    private func drainWaiting(_ route: inout Route) -> Bool {
        let waiting = route.waiting
        route.waiting = []
        guard route.settled else {
            route.waiting = waiting
            return false
        }
        var gap = false
        for message in waiting {
            if gap {
                route.waiting.append(message)
                continue
            }
            if message.epoch == route.leftEpoch { continue }
            if message.epoch != route.epoch {
                // Lost or forked: only the history says which (see ``accept(_:route:)``).
                guard route.epoch.isEmpty else {
                    route.waiting.append(message)
                    gap = true
                    continue
                }
                route.epoch = message.epoch
                route.lastSeq = 0
            }
            if message.seq <= route.lastSeq { continue }
            if message.seq == route.lastSeq + 1 {
                deliver(message, in: route)
                route.lastSeq = message.seq
            } else {
                route.waiting.append(message)
                gap = true
            }
        }
        return gap
    }
}
