/// A message from a session's client, as its connection assembled it.
enum SessionMessage: Sendable, Equatable {
    /// A text message and when it arrived: every budget of the session (the frame rate, and
    /// those of each kind of frame) counts it then, not when a busy session gets to it.
    case text(String, arrived: ContinuousClock.Instant)
    case binary
    /// A message the session's frame rate refused on arrival: its content is dropped there, and
    /// it waits in order with the others to be answered with `rate_limited`.
    case refused(retryAfter: Int)

    /// A text message that arrives now.
    static func text(_ text: String) -> SessionMessage { .text(text, arrived: .now) }
}

/// The life of one session, apart from its socket, its tasks and Redis: what it holds in each
/// phase, and what its owner (``SessionRun``) must do after each event. Each method changes the
/// phase and returns an action; the owner runs the action and nothing else decides.
///
/// Every phase has a way out. The connection always ends: the client's close, a dropped socket,
/// or one of the connection's own timers (the close handshake's and the ping's, in
/// ``SessionChannelHandler``). After its end the session is settled once the opening is over
/// (bounded by the Redis command timeouts) and the message under way, if any, is handled; the
/// settling (``Action/finish(_:_:)``) is returned exactly once.
///
/// `Opened` is what a successful opening yields (the session, its user and its frame handler).
struct SessionLifecycle<Opened> {
    typealias Message = SessionMessage

    /// At most this many messages, or this many bytes of them, wait to be handled (while the
    /// session opens, or behind a slow Redis call). Refused messages do not count: at most
    /// `refusedKept` of them wait, and later ones are dropped unanswered until the handling
    /// catches up (a run of that many answered refusals closes the session anyway).
    struct Limits: Sendable {
        var messages: Int
        var bytes: Int
        var refusedKept = Int.max
    }

    /// Messages not handled yet, with the bytes of their text.
    struct Inbox: Sendable {
        private(set) var messages: [Message] = []
        private(set) var bytes = 0
        /// Refused messages waiting.
        private var refused = 0

        var isEmpty: Bool { messages.isEmpty }

        /// Queues `message`; `false` when it is dropped instead: a refusal while `refusedKept`
        /// wait already.
        mutating func append(_ message: Message, limits: Limits) -> Bool {
            switch message {
            case .refused:
                guard refused < limits.refusedKept else { return false }
                refused += 1
            case .text(let text, _):
                bytes += text.utf8.count
            case .binary:
                break
            }
            messages.append(message)
            return true
        }

        mutating func removeFirst() -> Message {
            let message = messages.removeFirst()
            switch message {
            case .text(let text, _): bytes -= text.utf8.count
            case .refused: refused -= 1
            case .binary: break
            }
            return message
        }

        /// Past the limits, counting the messages the frame rate let in.
        func exceeds(_ limits: Limits) -> Bool { messages.count - refused > limits.messages || bytes > limits.bytes }
    }

    enum Phase {
        /// The token, the device and the engine's record are being checked and written; messages
        /// wait in the inbox.
        case opening(Inbox)
        /// Open: messages are handled in order, one turn of the work gate each, by one task at a
        /// time (`handling`).
        case open(Opened, Inbox, handling: Bool)
        /// Nothing more is handled (a message ended the session, the inbox overflowed, or the
        /// opening failed); the connection is being closed.
        case stopped(Opened?, openingOver: Bool, handling: Bool)
        /// The connection ended; what still runs (the opening, the message under way) is waited
        /// for before the session is settled.
        case ended(Opened?, SessionChannelHandler.Ending, openingOver: Bool, handling: Bool)
        /// Settled, or being settled: the lifecycle holds nothing any more.
        case finished
    }

    /// What the owner does next.
    enum Action {
        /// Nothing.
        case none
        /// Start a task (a turn of the work gate) to handle messages: the only one, until a turn
        /// returns ``idle`` or ``finish(_:_:)``.
        case startHandling
        /// Handle this message now, in the task that asked.
        case handle(Message, Opened)
        /// The task's turn is over and more messages wait: take another turn of the gate.
        case handleAgain
        /// The inbox overflowed: close the connection with 4029; what follows is dropped.
        case overflow
        /// Settle the session's end: leave the hub and close its device (`nil`: it never opened).
        case finish(Opened?, SessionChannelHandler.Ending)
    }

    let limits: Limits
    private(set) var phase: Phase = .opening(Inbox())

    init(limits: Limits) {
        self.limits = limits
    }

    /// Whether the client has gone, or will be closed: an opening under way writes nothing more.
    var clientGone: Bool {
        switch phase {
        case .opening, .open: false
        case .stopped, .ended, .finished: true
        }
    }

    /// Whether messages of the client wait to be handled, or one is being handled.
    var hasWaitingMessages: Bool {
        switch phase {
        case .opening(let inbox): !inbox.isEmpty
        case .open(_, _, let handling): handling
        case .stopped, .ended, .finished: false
        }
    }

    /// A message from the client: queued; handled at once when the session is open and no task
    /// handles its messages; dropped after the session stopped or ended, and when it is a
    /// refusal while `limits.refusedKept` wait already.
    mutating func received(_ message: Message) -> Action {
        switch phase {
        case .opening(var inbox):
            guard inbox.append(message, limits: limits) else { return .none }
            guard !inbox.exceeds(limits) else {
                phase = .stopped(nil, openingOver: false, handling: false)
                return .overflow
            }
            phase = .opening(inbox)
            return .none
        case .open(let opened, var inbox, let handling):
            guard inbox.append(message, limits: limits) else { return .none }
            guard !inbox.exceeds(limits) else {
                phase = .stopped(opened, openingOver: true, handling: handling)
                return .overflow
            }
            phase = .open(opened, inbox, handling: true)
            return handling ? .none : .startHandling
        case .stopped, .ended, .finished:
            return .none
        }
    }

    /// The opening is over: `opened` when it succeeded, `nil` when it failed (the owner refuses
    /// the connection). Messages that waited are handled now.
    mutating func openingEnded(_ opened: Opened?) -> Action {
        switch phase {
        case .opening(let inbox):
            guard let opened else {
                phase = .stopped(nil, openingOver: true, handling: false)
                return .none
            }
            phase = .open(opened, inbox, handling: !inbox.isEmpty)
            return inbox.isEmpty ? .none : .startHandling
        case .stopped(nil, openingOver: false, let handling):
            phase = .stopped(opened, openingOver: true, handling: handling)
            return .none
        case .ended(nil, let ending, openingOver: false, let handling):
            phase = .ended(opened, ending, openingOver: true, handling: handling)
            return settleIfIdle()
        case .open, .stopped, .ended, .finished:
            // An opening ends once.
            return .none
        }
    }

    /// The connection ended (on its loop): once.
    mutating func connectionEnded(_ ending: SessionChannelHandler.Ending) -> Action {
        switch phase {
        case .opening:
            phase = .ended(nil, ending, openingOver: false, handling: false)
            return .none
        case .open(let opened, _, let handling):
            phase = .ended(opened, ending, openingOver: true, handling: handling)
            return settleIfIdle()
        case .stopped(let opened, let openingOver, let handling):
            phase = .ended(opened, ending, openingOver: openingOver, handling: handling)
            return settleIfIdle()
        case .ended, .finished:
            return .none
        }
    }

    /// The handling task's turn begins: the next message, or the end of the turns (``idle`` as
    /// ``none``, or ``finish(_:_:)`` when the connection ended meanwhile).
    mutating func nextMessage() -> Action {
        if case .open(let opened, var inbox, handling: true) = phase, !inbox.isEmpty {
            let message = inbox.removeFirst()
            phase = .open(opened, inbox, handling: true)
            return .handle(message, opened)
        }
        return turnsOver()
    }

    /// The message of this turn is handled; `goesOn` false when it ended the session (the owner
    /// closes it). Another turn when more messages wait.
    mutating func handled(goesOn: Bool) -> Action {
        if !goesOn, case .open(let opened, _, let handling) = phase {
            phase = .stopped(opened, openingOver: true, handling: handling)
        }
        if case .open(_, let inbox, handling: true) = phase, !inbox.isEmpty { return .handleAgain }
        return turnsOver()
    }

    /// No task handles messages any more; the session is settled if the connection ended.
    private mutating func turnsOver() -> Action {
        switch phase {
        case .open(let opened, let inbox, _):
            phase = .open(opened, inbox, handling: false)
            return .none
        case .stopped(let opened, let openingOver, _):
            phase = .stopped(opened, openingOver: openingOver, handling: false)
            return .none
        case .ended(let opened, let ending, let openingOver, _):
            phase = .ended(opened, ending, openingOver: openingOver, handling: false)
            return settleIfIdle()
        case .opening, .finished:
            return .none
        }
    }

    /// After the connection ended: settled once the opening is over and no message is under way.
    private mutating func settleIfIdle() -> Action {
        guard case .ended(let opened, let ending, openingOver: true, handling: false) = phase else { return .none }
        phase = .finished
        return .finish(opened, ending)
    }
}

extension SessionLifecycle: Sendable where Opened: Sendable {}
extension SessionLifecycle.Phase: Sendable where Opened: Sendable {}
extension SessionLifecycle.Action: Sendable where Opened: Sendable {}
