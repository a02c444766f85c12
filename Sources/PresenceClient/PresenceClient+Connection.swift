import Foundation
import Logging

extension PresenceClient {
    /// Keeps a session open while the app wants one, until `signOut()`, `willTerminate()`, a
    /// close that says not to come back (4003, 4009), or cancellation. Call it once.
    public func run() async {
        guard !running else {
            logger.warning("PresenceClient.run() called while already running")
            return
        }
        running = true
        defer { running = false }
        await loadOutbox()
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await self.connectionLoop() }
            group.addTask { await self.timerLoop() }
            await group.next()
            group.cancelAll()
        }
        for observer in observers.values { observer.finish() }
        observers = [:]
    }

    private func connectionLoop() async {
        while !Task.isCancelled {
            if let reason = lifecycle.stopReason {
                setState(.stopped(reason))
                return
            }
            if lifecycle.phase == .terminated {
                setState(.idle)
                return
            }
            let seen = wake.generation
            guard lifecycle.shouldConnect else {
                setState(.idle)
                await wake.wait(after: seen)
                continue
            }
            setState(.connecting)
            let token: String
            do {
                token = try await tokenProvider(needsNewToken)
                needsNewToken = false
            } catch {
                logger.warning("the token provider failed", metadata: ["error": "\(error)"])
                emit([.error(code: .unauthorized, message: "the token provider failed: \(error)")])
                await pause(backoff.nextDelay())
                continue
            }
            // The app may have changed its mind while the token was fetched.
            guard lifecycle.shouldConnect else { continue }
            await runSession(token: token)
            guard lifecycle.shouldConnect || lifecycle.stopReason != nil else { continue }
        }
    }

    /// One session, from the upgrade to the close, then the decision of what comes next.
    private func runSession(token: String) async {
        let base = configuration.gatewayURLs[urlIndex % configuration.gatewayURLs.count]
        openedWith = lifecycle.openingStatus
        let url = configuration.sessionURL(base: base, token: token, status: openedWith)
        let (stream, continuation) = AsyncStream.makeStream(of: OutgoingFrame.self)
        serial += 1
        let current = serial
        outbox = continuation
        pacer = FramePacer(now: clock.now)
        pending = [:]
        catchUp = []
        retries = []
        awaitingInitialState = true
        cache.beginCatchUp()
        var code: UInt16?
        var refused = false
        let transport = self.transport
        let task = Task {
            try await transport.session(url: url, outgoing: stream) { text in
                await self.receive(text, serial: current)
            }
        }
        attempt = (task, clock.now.addingTimeInterval(configuration.openTimeout))
        timers.signal()
        do {
            code = try await withTaskCancellationHandler { try await task.value } onCancel: { task.cancel() }
        } catch PresenceTransportError.upgradeRefused {
            refused = true
        } catch PresenceTransportError.unsupported(let reason) {
            logger.error("the transport cannot open WebSockets here; pass another transport", metadata: ["error": "\(reason)"])
            emit([.error(code: .internal, message: reason)])
        } catch {
            logger.debug("session failed", metadata: ["error": "\(error)", "presence.gateway": "\(base.absoluteString)"])
        }
        attempt = nil
        continuation.finish()
        outbox = nil
        // Frames not written yet were this session's: the next one asks afresh.
        pacer = FramePacer(now: clock.now)
        // An attempt that never became a session (refused, unreachable, given up) leaves the
        // code of the last session as it was.
        if code != nil || !awaitingInitialState { lastCloseCode = code }
        // Nothing answered: no close code, no refusal, no session (a node down or gone while
        // the attempt opened).
        let unreachable = code == nil && !refused && awaitingInitialState
        let opened = !awaitingInitialState
        awaitingInitialState = false
        pending = [:]
        retries = []
        outboxSessionEnded()
        debouncer.forget()
        emit(cache.clearTyping())
        sessionEnded.signal()
        logger.info("session ended", metadata: ["presence.close_code": "\(code.map(String.init) ?? "none")", "presence.refused": "\(refused)"])
        guard lifecycle.shouldConnect else {
            _ = lifecycle.closed(code: code, upgradeRefused: refused)
            emit([.sessionEnded(SessionEnd(closeCode: code, upgradeRefused: refused, unreachable: unreachable, opened: opened, next: nil))])
            return
        }
        let next = lifecycle.closed(code: code, upgradeRefused: refused, unreachable: unreachable, gateways: configuration.gatewayURLs.count)
        // Why, before the state that says what comes next (an app, or the terminal client, shows it).
        emit([.sessionEnded(SessionEnd(closeCode: code, upgradeRefused: refused, unreachable: unreachable, opened: opened, next: next))])
        switch next {
        case .stop(let reason):
            setState(.stopped(reason))
        case .reconnectNow(let newToken):
            needsNewToken = newToken
            urlIndex += 1
        case .reconnectAfterBackoff(let newToken):
            needsNewToken = newToken
            urlIndex += 1
            await pause(backoff.nextDelay())
        }
    }

    /// Waits `seconds`, or less if the app asks for a session now (foreground, network back).
    private func pause(_ seconds: TimeInterval) async {
        let retryAt = clock.now.addingTimeInterval(seconds)
        setState(.waiting(retryAt: retryAt))
        let seen = wake.generation
        let attempts = backoff.attempts
        while clock.now < retryAt, !Task.isCancelled {
            await wake.wait(after: seen, until: retryAt, clock: clock)
            // Only a reset backoff (didBecomeActive, network back) or a stop cuts the wait short.
            if backoff.attempts < attempts || !lifecycle.shouldConnect { return }
            if wake.generation != seen { return await pause(retryAt.timeIntervalSince(clock.now)) }
        }
    }

    /// Runs the timed work: typing that went idle, typing indicators that ran out, refused
    /// requests due again, frames waiting for the budgets.
    private func timerLoop() async {
        while !Task.isCancelled {
            let seen = timers.generation
            let openDeadline = awaitingInitialState ? attempt?.deadline : nil
            let now = clock.now
            let deadlines = [
                debouncer.nextDeadline, cache.nextTypingExpiry, retries.map(\.due).min(), lifecycle.statusRetryAt, openDeadline,
                lifecycle.backgroundDeadline, chat.nextDeadline(after: now), chat.syncRetries.values.min(), pacer.nextDeadline(after: now),
            ].compactMap { $0 }
            await timers.wait(after: seen, until: deadlines.min(), clock: clock)
            fireTimers()
        }
    }

    private func fireTimers() {
        let now = clock.now
        if lifecycle.backgroundTimeUp(at: now) { endSessionForBackground() }
        if awaitingInitialState, let attempt, attempt.deadline <= now {
            logger.info("the session did not open in time; trying again", metadata: ["presence.open_timeout": "\(configuration.openTimeout)"])
            attempt.task.cancel()
            self.attempt = nil
        }
        // What waited for the budgets goes before what is made now.
        writePaced()
        for send in debouncer.expire(at: now) {
            self.send(.typing(conversationID: send.conversationID, isTyping: false), request: .typing)
        }
        emit(cache.expireTyping(at: now))
        let due = retries.filter { $0.due <= now }
        retries.removeAll { $0.due <= now }
        for retry in due {
            if let id = send(retry.frame, request: retry.request), retry.catchingUp { catchUp.insert(id) }
        }
        syncRetriesDue(at: now)
        sendOwedStatus()
        outboxTimers(at: now)
    }

    // MARK: - Frames from the gateway

    func receive(_ text: String, serial current: Int) {
        guard current == serial else { return }
        let message: ServerMessage
        do {
            message = try Self.frames.serverMessage(text)
        } catch let error as ProtocolError {
            logger.debug("a frame this client does not know", metadata: ["presence.frame": "\(error)"])
            return
        } catch {
            logger.warning("an unreadable frame from the gateway", metadata: ["presence.frame": "\(text.prefix(200))"])
            return
        }
        let id = message.id
        switch message.frame {
        case .initialState(let payloads):
            let presences = payloads.map(PresenceSnapshot.init)
            if awaitingInitialState, id == nil {
                awaitingInitialState = false
                emit(presences.flatMap { cache.apply($0) })
                sessionOpened()
            } else if let id, let request = pending.removeValue(forKey: id) {
                if case .users(let requested) = request {
                    emit(cache.applySnapshot(presences, requested: requested))
                } else {
                    emit(presences.flatMap { cache.apply($0) })
                }
                answered(id)
            } else {
                emit(presences.flatMap { cache.apply($0) })
            }
        case .presenceUpdate(let presence):
            emit(cache.apply(PresenceSnapshot(presence)))
        case .typingUpdate(let typing):
            // Others' typing is not shown while this device appears offline.
            guard lifecycle.canType || !typing.isTyping else { return }
            emit(cache.setTyping(typing.userID, in: typing.conversationID, typing.isTyping,
                                 expiresAt: clock.now.addingTimeInterval(configuration.typingDisplayTimeout)))
            timers.signal()
        case .groupPresence(let group):
            emit(cache.apply(group))
        case .ack:
            if let id, pending.removeValue(forKey: id) != nil { answered(id) }
        case .pong:
            break
        case .message(let payload):
            received(message: payload)
        case .messageAck(let ack):
            if let id { pending[id] = nil }
            received(ack: ack)
        case .synced(let synced):
            received(synced: synced, id: id)
        case .receipt(let receipt):
            received(receipt: receipt)
        case .error(let error):
            refused(id: id, code: error.code, message: error.message, conversation: error.conversationID)
        }
    }

    private func refused(id: String?, code: ErrorCode, message: String, conversation: String?) {
        logger.info("the gateway refused a request", metadata: ["presence.code": "\(code)", "presence.message": "\(message)"])
        guard let id, let request = pending[id] else {
            emit([.error(code: code, message: message)])
            return
        }
        switch request {
        case .message(let clientMessageID):
            pending[id] = nil
            messageRefused(clientMessageID, code: code, message: message)
            return
        case .sync(let waiting):
            // One `sync` names several conversations: the refusal is of one, or of the whole frame.
            syncFailed(id: id, waiting: waiting, code: code, message: message, conversation: conversation)
            return
        default:
            pending[id] = nil
        }
        let retryAt = clock.now.addingTimeInterval(configuration.retryDelay)
        switch request {
        case .status:
            lifecycle.statusRefused(retryAt: retryAt)
            timers.signal()
        case .users(let users) where code == .rateLimited:
            retries.append((retryAt, .subscribe(.users(users)), request, catchUp.remove(id) != nil))
            timers.signal()
            return
        case .conversation(let conversation) where code == .rateLimited:
            retries.append((retryAt, .subscribe(.conversation(conversation)), request, catchUp.remove(id) != nil))
            timers.signal()
            return
        case .conversation(let conversation):
            // Not a member (any more), or too large: following it cannot succeed.
            joinedConversations.remove(conversation)
            emit(cache.removeConversation(conversation))
        default:
            break
        }
        answered(id)
        emit([.error(code: code, message: message)])
    }

    /// The session's first `initial_state` arrived: the device is live. Sync the conversations,
    /// ask again for what the app follows, and send a status owed since the session opened.
    private func sessionOpened() {
        lifecycle.opened(with: openedWith)
        backoff.reset()
        // The syncs first: the gateway holds live messages until the first one (at most 2 s),
        // and they have a budget of their own, so they never wait behind the subscribes (which,
        // for hundreds of conversations, take a minute of the subscribe budget).
        messagesSessionOpened()
        subscribe(users: Array(watchedUsers), catchingUp: true)
        for conversation in joinedConversations.sorted() { subscribe(conversation: conversation, catchingUp: true) }
        sendOwedStatus()
        answered(nil)
    }

    /// A request of the catch-up was answered; when the last one is, the cache is current.
    func answered(_ id: String?) {
        if let id { catchUp.remove(id) }
        guard catchUp.isEmpty, !retries.contains(where: \.catchingUp), !awaitingInitialState, connectionState != .connected else { return }
        emit(cache.endCatchUp())
        setState(.connected)
    }
}
