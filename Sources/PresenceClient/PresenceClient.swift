import Foundation
import Logging

/// A device's link to the presence gateway: it keeps a session open (reconnecting with backoff,
/// catching up after each reconnect), tells the gateway the status the app's lifecycle calls
/// for, debounces typing, and keeps a cache of what it hears with a stream of changes.
///
/// Call `run()` once (for example in a `Task` owned by the app's session) and feed it the app's
/// lifecycle: `didBecomeActive()`, `didEnterBackground()`, `willTerminate()`, `signOut()`,
/// `networkChanged(available:)`.
public actor PresenceClient {
    /// Returns a token for the gateway; `refresh` is true when the last one was refused or has
    /// expired, so a cached token must not be returned again.
    public typealias TokenProvider = @Sendable (_ refresh: Bool) async throws -> String

    /// What the client sends or asked for, by frame id, until the gateway answers.
    enum Request: Sendable {
        case status
        case users([String])
        case conversation(String)
        case typing
        /// A `send` of the outbox message with this client message id.
        case message(String)
        /// A `sync` of these conversations: those whose `synced` (or refusal) has not come yet.
        case sync(Set<String>)
        case other
    }

    let configuration: PresenceClientConfiguration
    let tokenProvider: TokenProvider
    let clock: any PresenceClientClock
    let transport: any PresenceTransport
    let outboxStore: any MessageOutboxStore
    let logger: Logger

    var lifecycle = ClientLifecycle()
    var backoff: ReconnectBackoff
    var debouncer: TypingDebouncer
    var chat = ChatState()
    /// The last save of the outbox under way.
    var saving: Task<Void, Never>?
    /// Everything known of others.
    public internal(set) var cache = PresenceCache()
    /// The link to the gateway.
    public internal(set) var connectionState = ConnectionState.idle
    /// The close code the gateway sent when the last session ended (`nil`: none yet, or the
    /// connection dropped without one), for diagnostics. Attempts that did not open a session
    /// (an upgrade refused with an HTTP status, a gateway unreachable) do not change it.
    public internal(set) var lastCloseCode: UInt16?
    /// Users watched explicitly (besides those the gateway watches for the session).
    public internal(set) var watchedUsers: Set<String> = []
    /// Conversations followed.
    public internal(set) var joinedConversations: Set<String> = []

    var outbox: AsyncStream<OutgoingFrame>.Continuation?
    /// The open session's frames not written yet, and its budgets.
    var pacer = FramePacer(now: .distantPast)
    var serial = 0
    var nextFrameID = 0
    var pending: [String: Request] = [:]
    var catchUp: Set<String> = []
    var awaitingInitialState = false
    /// The attempt under way, and when it is given up unless its `initial_state` has come.
    var attempt: (task: Task<UInt16?, any Error>, deadline: Date)?
    var openedWith = PresenceStatus.online
    var retries: [(due: Date, frame: ClientFrame, request: Request, catchingUp: Bool)] = []
    var needsNewToken = false
    var urlIndex = 0
    var running = false
    var observers: [UInt64: AsyncStream<PresenceClientEvent>.Continuation] = [:]
    var nextObserver: UInt64 = 0
    /// Lifecycle changes that may start or end a session.
    let wake = AsyncSignal()
    /// Deadlines of the timer loop moved.
    let timers = AsyncSignal()
    /// A session ended.
    let sessionEnded = AsyncSignal()

    /// A client. `transport` defaults to SwiftNIO WebSockets on Linux and to
    /// ``URLSessionTransport`` on Apple platforms; `clock` to the system clock;
    /// `outboxStore` to a file of the device's (``FileMessageOutboxStore/defaultURL(deviceID:)``).
    public init(
        configuration: PresenceClientConfiguration,
        tokenProvider: @escaping TokenProvider,
        clock: any PresenceClientClock = SystemPresenceClock(),
        transport: (any PresenceTransport)? = nil,
        outboxStore: (any MessageOutboxStore)? = nil,
        logger: Logger
    ) {
        self.configuration = configuration
        self.tokenProvider = tokenProvider
        self.clock = clock
        self.transport = transport ?? defaultPresenceTransport(logger: logger)
        self.outboxStore = outboxStore ?? FileMessageOutboxStore(url: FileMessageOutboxStore.defaultURL(deviceID: configuration.deviceID))
        self.logger = logger
        self.backoff = configuration.backoff
        self.debouncer = TypingDebouncer(refreshInterval: configuration.typingRefreshInterval, idleTimeout: configuration.typingIdleTimeout)
        self.lifecycle.backgroundPolicy = configuration.backgroundPolicy
    }

    // MARK: - Observing

    /// A stream of every change from now on. Each call makes a new stream; it ends when the
    /// consumer stops iterating or the client stops.
    public func events() -> AsyncStream<PresenceClientEvent> {
        let (stream, continuation) = AsyncStream.makeStream(of: PresenceClientEvent.self, bufferingPolicy: .bufferingNewest(10_000))
        nextObserver += 1
        let id = nextObserver
        observers[id] = continuation
        continuation.onTermination = { _ in Task { await self.removeObserver(id) } }
        return stream
    }

    private func removeObserver(_ id: UInt64) { observers[id] = nil }

    func emit(_ events: [PresenceClientEvent]) {
        for event in events {
            for observer in observers.values { observer.yield(event) }
        }
    }

    func setState(_ state: ConnectionState) {
        guard state != connectionState else { return }
        connectionState = state
        logger.debug("connection state", metadata: ["presence.state": "\(state)"])
        emit([.connection(state)])
    }

    // MARK: - Reading the cache

    /// The presence of `user`, if known.
    public func presence(of user: String) -> PresenceSnapshot? { cache.presences[user] }

    /// Every known presence.
    public var presences: [PresenceSnapshot] { cache.presences.values.sorted { $0.userID < $1.userID } }

    /// The counts of a followed conversation.
    public func group(_ conversation: String) -> GroupPresence? { cache.groups[conversation] }

    /// Who is typing in `conversation`; nobody while this device is disconnected or offline.
    public func typingUsers(in conversation: String) -> [String] {
        lifecycle.canType ? cache.typingUsers(in: conversation) : []
    }

    /// The status this device is meant to have now.
    public var status: PresenceStatus { lifecycle.desiredStatus }

    // MARK: - App lifecycle

    /// The app came to the foreground: the chosen status (online unless chosen otherwise), and a
    /// reconnect now if the session was down.
    public func didBecomeActive() {
        lifecycle.didBecomeActive()
        backoff.reset()
        statusChanged()
    }

    /// The app went to the background: away (the session stays while the system lets it); with
    /// `backgroundPolicy` `.offline(after:)`, after that long the session closes cleanly
    /// (offline at once) and opens again when the app is active.
    public func didEnterBackground() {
        lifecycle.didEnterBackground(at: clock.now)
        // The timer loop learns of the background's deadline now, not at its next other timer.
        timers.signal()
        if lifecycle.offlineInBackground {
            endSessionForBackground()
        } else {
            statusChanged()
        }
    }

    /// Closes the session cleanly for the background's offline policy; `run()` waits for the app
    /// to be active again.
    func endSessionForBackground() {
        stopTyping()
        outbox?.yield(.close(.normal))
        wake.signal()
    }

    /// The network path went away or came back. Going away ends the session (the device
    /// lingers on the gateway, so a quick return shows no offline); coming back reconnects now.
    public func networkChanged(available: Bool) {
        lifecycle.networkChanged(available: available)
        if available {
            backoff.reset()
        } else {
            outbox?.yield(.close(.goingAway))
        }
        wake.signal()
    }

    /// The app is terminating: offline at once, with a clean close; `run()` returns.
    public func willTerminate() async {
        lifecycle.willTerminate()
        await closeCleanly()
    }

    /// The person signed out: offline at once, with a clean close; `run()` returns and the client
    /// does not connect again.
    public func signOut() async {
        lifecycle.signOut()
        await closeCleanly()
    }

    /// Chooses the status shown while the app is active: `away`, or `offline` to appear offline
    /// while still hearing others. Changes made while disconnected are sent on reconnect (the
    /// latest wins).
    public func setStatus(_ status: PresenceStatus) {
        lifecycle.choose(status)
        statusChanged()
    }

    private func statusChanged() {
        if lifecycle.desiredStatus == .offline { stopTyping() }
        sendOwedStatus()
        wake.signal()
    }

    /// Going offline: our typing stops, and others' typing is no longer shown.
    private func stopTyping() {
        for send in debouncer.stopAll() { sendTyping(send) }
        emit(cache.clearTyping())
    }

    private func closeCleanly() async {
        for send in debouncer.stopAll() { sendTyping(send) }
        let seen = sessionEnded.generation
        if let outbox {
            outbox.yield(.close(.normal))
            await sessionEnded.wait(after: seen, until: clock.now.addingTimeInterval(configuration.closeTimeout), clock: clock)
        }
        wake.signal()
    }

    // MARK: - Watching

    /// Watches users besides those the gateway watches for the session (with
    /// `PRESENCE_VISIBILITY=open`, the only way to hear of anyone). Users the caller may not
    /// see are left out silently, as the gateway does.
    public func watch(_ users: [String]) throws(PresenceClientError) {
        try ClientID.check(users, "user id")
        let new = users.filter { watchedUsers.insert($0).inserted }
        if outbox != nil, !awaitingInitialState { subscribe(users: new, catchingUp: false) }
    }

    /// Stops watching users.
    public func unwatch(_ users: [String]) throws(PresenceClientError) {
        try ClientID.check(users, "user id")
        let removed = users.filter { watchedUsers.remove($0) != nil }
        guard !removed.isEmpty else { return }
        for chunk in removed.chunks(of: 500) { send(.unsubscribe(.users(chunk)), request: .other) }
        emit(cache.remove(removed))
    }

    /// Follows a conversation: its counts, its typing, and its members' presence.
    public func join(conversation: String) throws(PresenceClientError) {
        try ClientID.check([conversation], "conversation id")
        guard joinedConversations.insert(conversation).inserted else { return }
        if outbox != nil, !awaitingInitialState { subscribe(conversation: conversation, catchingUp: false) }
    }

    /// Stops following a conversation, and stops typing in it.
    public func leave(conversation: String) throws(PresenceClientError) {
        try ClientID.check([conversation], "conversation id")
        if let send = debouncer.stop(in: conversation) { sendTyping(send) }
        guard joinedConversations.remove(conversation) != nil else { return }
        // A `subscribe` the gateway never got needs no `unsubscribe`.
        if !unqueueSubscribe(conversation) { send(.unsubscribe(.conversation(conversation)), request: .other) }
        emit(cache.removeConversation(conversation))
    }

    // MARK: - Typing

    /// A keystroke in `conversation`'s composer. Nothing is sent while disconnected or offline.
    public func userTyped(in conversation: String) throws(PresenceClientError) {
        try ClientID.check([conversation], "conversation id")
        let wasIdle = debouncer.nextDeadline == nil
        if let send = debouncer.keystroke(in: conversation, at: clock.now, canSend: lifecycle.canType) { sendTyping(send) }
        if wasIdle { timers.signal() }
    }

    /// The message was sent (or the draft cleared): typing stops now.
    public func messageSent(in conversation: String) throws(PresenceClientError) {
        try ClientID.check([conversation], "conversation id")
        if let send = debouncer.stop(in: conversation) { sendTyping(send) }
    }

    func sendTyping(_ typing: TypingDebouncer.Send) {
        send(.typing(conversationID: typing.conversationID, isTyping: typing.isTyping), request: .typing)
    }

    // MARK: - Sending

    /// Frames as the gateway reads them; ids are written as strings, which a gateway in either
    /// id format takes.
    static let frames = FrameCoder(ids: .string)

    /// Sends a frame with a fresh id if a session is open; returns the id. It is written now if
    /// the session's budgets have room, else as soon as they do (``FramePacer``).
    @discardableResult
    func send(_ frame: ClientFrame, request: Request) -> String? {
        guard outbox != nil else { return nil }
        nextFrameID += 1
        let id = "\(serial).\(nextFrameID)"
        pending[id] = request
        let (lane, spendsLane) = FramePacer.lane(of: frame)
        pacer.enqueue(FramePacer.Frame(id: id, text: Self.frames.text(ClientMessage(frame, id: id)), lane: lane, spendsLane: spendsLane, request: request))
        writePaced()
        return id
    }

    /// Writes the waiting frames the budgets have room for, oldest first in each lane; the timer
    /// loop comes back for the others when the budgets have room.
    func writePaced() {
        guard let outbox else { return }
        for frame in pacer.due(at: clock.now) {
            outbox.yield(.text(frame.text))
            frameWritten(frame)
        }
        if !pacer.waiting.isEmpty { timers.signal() }
    }

    /// A message's wait for its `message_ack` starts when its `send` is written, not while it
    /// waits for the budget.
    private func frameWritten(_ frame: FramePacer.Frame) {
        guard case .message = frame.request, let index = chat.outbox.firstIndex(where: { $0.frameID == frame.id }) else { return }
        chat.outbox[index].deadline = clock.now.addingTimeInterval(Self.ackTimeout)
    }

    /// Drops a conversation's `subscribe` not written yet (waiting for the budget, or to be sent
    /// again after a refusal); returns whether there was one.
    func unqueueSubscribe(_ conversation: String) -> Bool {
        func isIt(_ request: Request) -> Bool {
            if case .conversation(let subscribed) = request { subscribed == conversation } else { false }
        }
        let queued = pacer.remove { isIt($0.request) }
        let refused = retries.filter { isIt($0.request) }
        guard !queued.isEmpty || !refused.isEmpty else { return false }
        retries.removeAll { isIt($0.request) }
        for frame in queued {
            pending[frame.id] = nil
            catchUp.remove(frame.id)
        }
        answered(nil)
        return true
    }

    func sendOwedStatus() {
        guard outbox != nil, !awaitingInitialState, let status = lifecycle.statusToSend(at: clock.now) else { return }
        send(.status(status), request: .status)
    }

    func subscribe(users: [String], catchingUp: Bool) {
        for chunk in users.sorted().chunks(of: 500) {
            if let id = send(.subscribe(.users(chunk)), request: .users(chunk)), catchingUp { catchUp.insert(id) }
        }
    }

    func subscribe(conversation: String, catchingUp: Bool) {
        if let id = send(.subscribe(.conversation(conversation)), request: .conversation(conversation)), catchingUp {
            catchUp.insert(id)
        }
    }
}

extension Array {
    func chunks(of size: Int) -> [[Element]] {
        stride(from: 0, to: count, by: size).map { Array(self[$0..<Swift.min($0 + size, count)]) }
    }
}
