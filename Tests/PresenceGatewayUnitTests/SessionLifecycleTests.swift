import RedisTestSupport
import Testing

@testable import PresenceGateway

/// A session's lifecycle without sockets, tasks or Redis: events in, actions out.
@Suite("Session lifecycle")
struct SessionLifecycleTests {
    typealias Lifecycle = SessionLifecycle<String>
    static let limits = Lifecycle.Limits(messages: 4, bytes: 100)
    static let clientClose = SessionChannelHandler.Ending(clientCode: 1000, serverCode: nil)

    /// The action's case, for comparing.
    static func name(_ action: Lifecycle.Action) -> String {
        switch action {
        case .none: "none"
        case .startHandling: "start"
        case .handle(let message, let opened): "handle \(Self.name(message)) on \(opened)"
        case .handleAgain: "again"
        case .overflow: "overflow"
        case .finish(let opened, let ending): "finish \(opened ?? "nil") \(ending.clientCode ?? 0)/\(ending.serverCode ?? 0)"
        }
    }

    /// A message as the tests name it: its text, without the moment it arrived.
    static func name(_ message: SessionMessage) -> String {
        switch message {
        case .text(let text, _): "text(\"\(text)\")"
        case .binary: "binary"
        case .refused(let wait): "refused(retryAfter: \(wait))"
        }
    }

    @Test("messages that came while opening wait, then are handled in order by one task, a turn each")
    func queuedWhileOpening() {
        var life = Lifecycle(limits: Self.limits)
        #expect(Self.name(life.received(.text("a"))) == "none")
        #expect(Self.name(life.received(.text("b"))) == "none")
        #expect(Self.name(life.openingEnded("s")) == "start")
        #expect(Self.name(life.received(.text("c"))) == "none", "a task already handles them")
        #expect(Self.name(life.nextMessage()) == "handle text(\"a\") on s")
        #expect(Self.name(life.handled(goesOn: true)) == "again")
        #expect(Self.name(life.nextMessage()) == "handle text(\"b\") on s")
        #expect(Self.name(life.handled(goesOn: true)) == "again")
        #expect(Self.name(life.nextMessage()) == "handle text(\"c\") on s")
        #expect(Self.name(life.handled(goesOn: true)) == "none", "nothing left: the task ends")
        #expect(Self.name(life.received(.binary)) == "start", "the next message starts a task again")
    }

    @Test("the connection ends while opening: nothing is handled, and the end is settled only once the opening is over, with what it opened")
    func endedWhileOpening() {
        var life = Lifecycle(limits: Self.limits)
        _ = life.received(.text("a"))
        #expect(Self.name(life.connectionEnded(Self.clientClose)) == "none", "the opening still runs")
        #expect(life.clientGone)
        #expect(Self.name(life.openingEnded("s")) == "finish s 1000/0")
        #expect(Self.name(life.nextMessage()) == "none")
        #expect(Self.name(life.connectionEnded(Self.clientClose)) == "none", "settled once")
    }

    @Test("the connection ends while a message is handled: settled after that turn, once")
    func endedWhileHandling() {
        var life = Lifecycle(limits: Self.limits)
        _ = life.openingEnded("s")
        #expect(Self.name(life.received(.text("a"))) == "start")
        _ = life.received(.text("b"))
        #expect(Self.name(life.nextMessage()) == "handle text(\"a\") on s")
        #expect(Self.name(life.connectionEnded(.init(clientCode: nil, serverCode: 1001))) == "none", "a message is under way")
        #expect(Self.name(life.handled(goesOn: true)) == "finish s 0/1001", "b is dropped with the connection")
        #expect(Self.name(life.handled(goesOn: true)) == "none")
    }

    @Test("past the inbox's limit (messages or bytes), one overflow; what follows is dropped, and the end is settled")
    func overflow() {
        var opening = Lifecycle(limits: Self.limits)
        for _ in 0..<4 { #expect(Self.name(opening.received(.binary)) == "none") }
        #expect(Self.name(opening.received(.binary)) == "overflow", "the fifth message")
        #expect(Self.name(opening.received(.binary)) == "none")
        #expect(Self.name(opening.openingEnded("s")) == "none", "nothing is handled")
        #expect(Self.name(opening.connectionEnded(Self.clientClose)) == "finish s 1000/0")

        var open = Lifecycle(limits: Self.limits)
        _ = open.openingEnded("s")
        #expect(Self.name(open.received(.text(String(repeating: "x", count: 60)))) == "start")
        #expect(Self.name(open.received(.text(String(repeating: "x", count: 60)))) == "overflow", "120 bytes")
        #expect(Self.name(open.nextMessage()) == "none", "the inbox is gone")
        #expect(Self.name(open.connectionEnded(Self.clientClose)) == "finish s 1000/0")
    }

    @Test("refused messages wait in order, apart from the limits: at most refusedKept of them, later ones dropped until the handling catches up; never an overflow")
    func refusals() {
        var life = Lifecycle(limits: .init(messages: 4, bytes: 100, refusedKept: 3))
        _ = life.openingEnded("s")
        #expect(Self.name(life.received(.text("a"))) == "start")
        for _ in 0..<5 { #expect(Self.name(life.received(.refused(retryAfter: 1))) == "none", "not an overflow") }
        #expect(Self.name(life.received(.text("b"))) == "none")
        #expect(Self.name(life.received(.refused(retryAfter: 2))) == "none", "dropped: three wait already")
        // One handled: a refusal may wait again.
        #expect(Self.name(life.nextMessage()) == "handle text(\"a\") on s")
        #expect(Self.name(life.handled(goesOn: true)) == "again")
        #expect(Self.name(life.nextMessage()) == "handle refused(retryAfter: 1) on s")
        #expect(Self.name(life.handled(goesOn: true)) == "again")
        #expect(Self.name(life.received(.refused(retryAfter: 3))) == "none")
        var handled: [String] = []
        var next = life.nextMessage()
        while case .handle(let message, _) = next {
            handled.append(Self.name(message))
            next = life.handled(goesOn: true)
            if case .handleAgain = next { next = life.nextMessage() }
        }
        #expect(handled == ["refused(retryAfter: 1)", "refused(retryAfter: 1)", "text(\"b\")", "refused(retryAfter: 3)"],
                "three of the first five refusals kept, the one after b dropped, one kept once a place was free: \(handled)")

        // Many refusals between admitted messages never overflow; five admitted ones do.
        var interleaved = Lifecycle(limits: .init(messages: 4, bytes: 100, refusedKept: 2))
        for _ in 0..<4 {
            #expect(Self.name(interleaved.received(.binary)) == "none")
            for _ in 0..<10 { #expect(Self.name(interleaved.received(.refused(retryAfter: 1))) == "none") }
        }
        #expect(Self.name(interleaved.received(.binary)) == "overflow", "the fifth admitted message")
    }

    @Test("a message that ends the session drops what waits; a failed opening is settled with nothing opened")
    func stops() {
        var life = Lifecycle(limits: Self.limits)
        _ = life.openingEnded("s")
        _ = life.received(.text("sign out"))
        _ = life.received(.text("late"))
        #expect(Self.name(life.nextMessage()) == "handle text(\"sign out\") on s")
        #expect(Self.name(life.handled(goesOn: false)) == "none")
        #expect(Self.name(life.received(.text("later"))) == "none")
        #expect(Self.name(life.connectionEnded(Self.clientClose)) == "finish s 1000/0")

        var failed = Lifecycle(limits: Self.limits)
        _ = failed.received(.text("a"))
        #expect(Self.name(failed.openingEnded(nil)) == "none")
        #expect(failed.clientGone, "the opening failed: the client is being refused")
        #expect(Self.name(failed.connectionEnded(.init(clientCode: nil, serverCode: 4001))) == "finish nil 0/4001")
    }

    @Test("random event orders (seeded): one task at a time, messages handled in order and never twice, nothing started after the end, and the end settled exactly once")
    func randomOrders() {
        let seed: UInt64 = 20_261_126
        print("session lifecycle: seed \(seed), 2,000 runs")
        var random = SeededRandom(seed: seed)
        for run in 0..<2_000 {
            var life = Lifecycle(limits: Self.limits)
            var received: [String] = [], handled: [String] = []
            var openingOver = false, connectionOver = false
            // A task started and not yet over; with the message it handles, once it took one.
            var task: (started: Bool, message: String?)?
            var finishes = 0
            var trace: [String] = []
            func apply(_ action: Lifecycle.Action) {
                trace.append(Self.name(action))
                switch action {
                case .startHandling:
                    #expect(task == nil, "run \(run): a second task: \(trace)")
                    task = (true, nil)
                case .handleAgain:
                    // The task that just handled a message takes another turn.
                    task = (true, nil)
                case .handle(.text(let text, _), _):
                    #expect(!connectionOver, "run \(run): a message handled after the end: \(trace)")
                    handled.append(text)
                    task = (true, text)
                case .finish:
                    finishes += 1
                    #expect(openingOver && connectionOver, "run \(run): settled early: \(trace)")
                    #expect(task?.message == nil, "run \(run): settled while a message is handled: \(trace)")
                case .handle(.binary, _), .handle(.refused, _), .none, .overflow:
                    break
                }
            }
            var steps = 0
            while finishes == 0 || task != nil {
                steps += 1
                #expect(steps < 500, "run \(run): no way out: \(trace)")
                if steps >= 500 { break }
                switch random.below(6) {
                case 0, 1:
                    let text = "m\(received.count)"
                    received.append(text)
                    apply(life.received(.text(text)))
                case 2 where !openingOver:
                    openingOver = true
                    apply(life.openingEnded(random.below(5) == 0 ? nil : "s"))
                case 3 where !connectionOver && random.below(3) == 0:
                    connectionOver = true
                    apply(life.connectionEnded(Self.clientClose))
                case 4, 5:
                    guard let current = task else { continue }
                    if current.message == nil {
                        let action = life.nextMessage()
                        if case .handle = action {} else { task = nil }
                        apply(action)
                    } else {
                        task = nil
                        apply(life.handled(goesOn: random.below(10) != 0))
                    }
                default:
                    // Eventually everything ends.
                    if !openingOver { openingOver = true; apply(life.openingEnded("s")) }
                    else if !connectionOver { connectionOver = true; apply(life.connectionEnded(Self.clientClose)) }
                }
            }
            #expect(finishes == 1, "run \(run): settled \(finishes) times: \(trace)")
            #expect(handled == Array(received.prefix(handled.count)) || isOrderedSubsequence(handled, of: received),
                    "run \(run): handled \(handled) of \(received)")
            #expect(Set(handled).count == handled.count, "run \(run): a message handled twice")
            guard case .finished = life.phase else {
                Issue.record("run \(run): not finished: \(life.phase)")
                continue
            }
        }
    }

    func isOrderedSubsequence(_ part: [String], of whole: [String]) -> Bool {
        var rest = whole[...]
        for item in part {
            guard let index = rest.firstIndex(of: item) else { return false }
            rest = rest[(index + 1)...]
        }
        return true
    }
}
