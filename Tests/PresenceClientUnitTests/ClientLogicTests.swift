import Foundation
import Testing

@testable import PresenceClient

/// A seeded generator, so jittered delays are the same on every run.
struct SeededGenerator: RandomNumberGenerator {
    var state: UInt64
    mutating func next() -> UInt64 {
        state = state &* 6_364_136_223_846_793_005 &+ 1_442_695_040_888_963_407
        return state
    }
}

@Suite("Reconnect backoff")
struct BackoffTests {
    @Test("1, 2, 4, 8, 16 s, then capped at 16 s, without jitter")
    func doubling() {
        var backoff = ReconnectBackoff(jitter: 0)
        var generator = SeededGenerator(state: 1)
        let delays = (0..<7).map { _ in backoff.nextDelay(using: &generator) }
        #expect(delays == [1, 2, 4, 8, 16, 16, 16])
    }

    @Test("each delay moves by at most ±20 % and the jitter actually varies")
    func jitter() {
        var generator = SeededGenerator(state: 42)
        var seen = Set<Double>()
        for _ in 0..<50 {
            var backoff = ReconnectBackoff()
            for base in [1.0, 2, 4, 8, 16, 16] {
                let delay = backoff.nextDelay(using: &generator)
                #expect(delay >= base * 0.8 && delay <= base * 1.2, "\(delay) for \(base)")
                if base == 1 { seen.insert(delay) }
            }
        }
        #expect(seen.count > 40, "first delays differ from run to run")
    }

    @Test("a success starts again from 1 s")
    func reset() {
        var backoff = ReconnectBackoff(jitter: 0)
        var generator = SeededGenerator(state: 7)
        for _ in 0..<4 { _ = backoff.nextDelay(using: &generator) }
        backoff.reset()
        #expect(backoff.nextDelay(using: &generator) == 1)
        #expect(backoff.attempts == 1)
    }
}

@Suite("Typing debouncer")
struct TypingDebouncerTests {
    let start = Date(timeIntervalSince1970: 1_800_000_000)

    @Test("true on the first keystroke, at most once per 2 s while typing goes on")
    func refresh() {
        var debouncer = TypingDebouncer()
        var sent: [TimeInterval] = []
        // A keystroke every 100 ms for 5 s.
        for step in 0..<50 {
            let offset = Double(step) * 0.1
            if let send = debouncer.keystroke(in: "room", at: start + offset, canSend: true) {
                #expect(send.isTyping)
                sent.append(offset)
            }
            #expect(debouncer.expire(at: start + offset).isEmpty)
        }
        #expect(sent.count == 3)
        #expect(zip(sent, sent.dropFirst()).allSatisfy { $1 - $0 >= 2 - 1e-9 })
    }

    @Test("false after 3 s without a keystroke, and not before")
    func idle() {
        var debouncer = TypingDebouncer()
        _ = debouncer.keystroke(in: "room", at: start, canSend: true)
        _ = debouncer.keystroke(in: "room", at: start + 1, canSend: true)
        #expect(debouncer.nextDeadline == start + 4)
        #expect(debouncer.expire(at: start + 3.9).isEmpty)
        #expect(debouncer.expire(at: start + 4) == [.init(conversationID: "room", isTyping: false)])
        #expect(debouncer.expire(at: start + 10).isEmpty, "one false only")
        #expect(debouncer.nextDeadline == nil)
    }

    @Test("false on send and on leaving, once; nothing for a conversation not typed in")
    func stop() {
        var debouncer = TypingDebouncer()
        _ = debouncer.keystroke(in: "a", at: start, canSend: true)
        _ = debouncer.keystroke(in: "b", at: start, canSend: true)
        #expect(debouncer.stop(in: "a") == .init(conversationID: "a", isTyping: false))
        #expect(debouncer.stop(in: "a") == nil)
        #expect(debouncer.stop(in: "c") == nil)
        #expect(debouncer.stopAll() == [.init(conversationID: "b", isTyping: false)])
        #expect(debouncer.conversations.isEmpty)
        // After a stop, the next keystroke starts again at once.
        #expect(debouncer.keystroke(in: "a", at: start + 0.5, canSend: true)?.isTyping == true)
    }

    @Test("nothing at all while the device cannot type, and nothing remembered")
    func offline() {
        var debouncer = TypingDebouncer()
        #expect(debouncer.keystroke(in: "room", at: start, canSend: false) == nil)
        #expect(debouncer.nextDeadline == nil)
        #expect(debouncer.expire(at: start + 10).isEmpty)
        #expect(debouncer.stop(in: "room") == nil)
        _ = debouncer.keystroke(in: "room", at: start, canSend: true)
        debouncer.forget()
        #expect(debouncer.expire(at: start + 10).isEmpty, "a dropped connection sends no stop; the gateway ends it")
    }
}

@Suite("Client lifecycle and the offline queue")
struct ClientLifecycleTests {
    let now = Date(timeIntervalSince1970: 1_800_000_000)

    @Test("foreground is the chosen status, background is away, terminate and sign-out are offline")
    func desiredStatus() {
        var lifecycle = ClientLifecycle()
        #expect(lifecycle.desiredStatus == .online && lifecycle.shouldConnect)
        lifecycle.didEnterBackground()
        #expect(lifecycle.desiredStatus == .away && lifecycle.shouldConnect)
        lifecycle.didBecomeActive()
        #expect(lifecycle.desiredStatus == .online)
        lifecycle.choose(.offline)
        lifecycle.didEnterBackground()
        #expect(lifecycle.desiredStatus == .offline, "appearing offline stays offline in the background")
        lifecycle.didBecomeActive()
        lifecycle.willTerminate()
        #expect(lifecycle.desiredStatus == .offline && !lifecycle.shouldConnect)
        lifecycle.didBecomeActive()
        #expect(lifecycle.phase == .terminated, "nothing revives a terminated client")
    }

    @Test("the background's offline policy: away at once, offline with no session after N seconds, online again when active")
    func backgroundOffline() {
        var lifecycle = ClientLifecycle(backgroundPolicy: .offline(after: 30))
        lifecycle.didEnterBackground(at: now)
        #expect(lifecycle.desiredStatus == .away && lifecycle.shouldConnect)
        #expect(lifecycle.backgroundDeadline == now + 30)
        let early = lifecycle.backgroundTimeUp(at: now + 29.9)
        let due = lifecycle.backgroundTimeUp(at: now + 30)
        let again = lifecycle.backgroundTimeUp(at: now + 31)
        #expect(!early && due)
        #expect(!again, "due once")
        #expect(lifecycle.desiredStatus == .offline && !lifecycle.shouldConnect)
        lifecycle.didBecomeActive()
        #expect(lifecycle.desiredStatus == .online && lifecycle.shouldConnect && lifecycle.backgroundDeadline == nil)

        lifecycle.didEnterBackground(at: now)
        lifecycle.didBecomeActive()
        let afterReturn = lifecycle.backgroundTimeUp(at: now + 60)
        #expect(!afterReturn, "back before the deadline: nothing is due")

        var atOnce = ClientLifecycle(backgroundPolicy: .offline(after: 0))
        atOnce.didEnterBackground(at: now)
        #expect(atOnce.desiredStatus == .offline && !atOnce.shouldConnect, "after: 0 is offline without away first")
    }

    @Test("network lost means no session; regained means one again")
    func network() {
        var lifecycle = ClientLifecycle()
        lifecycle.networkChanged(available: false)
        #expect(!lifecycle.shouldConnect)
        lifecycle.networkChanged(available: true)
        #expect(lifecycle.shouldConnect)
    }

    @Test("what each close code leads to")
    func closeCodes() {
        var lifecycle = ClientLifecycle()
        #expect(lifecycle.closed(code: 1001) == .reconnectNow(newToken: false))
        #expect(lifecycle.closed(code: 1001) == .reconnectAfterBackoff(newToken: false), "a second quick close in a row backs off")
        lifecycle.opened(with: .online)
        #expect(lifecycle.closed(code: 4001) == .reconnectNow(newToken: true))
        #expect(lifecycle.closed(code: 4001) == .reconnectAfterBackoff(newToken: true))
        #expect(lifecycle.closed(code: nil) == .reconnectAfterBackoff(newToken: false))
        #expect(lifecycle.closed(code: 1008) == .reconnectAfterBackoff(newToken: false))
        #expect(lifecycle.closed(code: 4029) == .reconnectAfterBackoff(newToken: false))
        #expect(lifecycle.closed(code: nil, upgradeRefused: true) == .reconnectAfterBackoff(newToken: true))
        #expect(lifecycle.closed(code: 4003) == .stop(.disconnectedByAdmin))
        #expect(!lifecycle.shouldConnect)
        #expect(lifecycle.closed(code: 1001) == .stop(.disconnectedByAdmin), "stopped for good")

        var replaced = ClientLifecycle()
        #expect(replaced.closed(code: 4009) == .stop(.replaced))
        var signedOut = ClientLifecycle()
        signedOut.signOut()
        #expect(signedOut.closed(code: 1000) == .stop(.signedOut))
    }

    @Test("a node that cannot serve (1011, 1013): each other URL at once, then the backoff; any other close starts the count again")
    func nodesThatCannotServe() {
        var lifecycle = ClientLifecycle()
        #expect(lifecycle.closed(code: 1011, gateways: 1) == .reconnectAfterBackoff(newToken: false), "one URL: nowhere else to go")
        #expect(lifecycle.closed(code: 1011, gateways: 3) == .reconnectNow(newToken: false))
        #expect(lifecycle.closed(code: 1013, gateways: 3) == .reconnectNow(newToken: false))
        #expect(lifecycle.closed(code: 1011, gateways: 3) == .reconnectAfterBackoff(newToken: false), "all three said so")
        #expect(lifecycle.closed(code: 1011, gateways: 3) == .reconnectNow(newToken: false), "after the backoff, a new round")
        #expect(lifecycle.closed(code: nil, gateways: 3) == .reconnectAfterBackoff(newToken: false))
        #expect(lifecycle.closed(code: 1011, gateways: 3) == .reconnectNow(newToken: false), "a dropped connection between restarts the count")
        #expect(lifecycle.closed(code: 1011, gateways: 3) == .reconnectNow(newToken: false))
        lifecycle.opened(with: .online)
        #expect(lifecycle.closed(code: 1011, gateways: 3) == .reconnectNow(newToken: false), "a session that opened restarts the count")
        #expect(lifecycle.closed(code: 1011, gateways: 3) == .reconnectNow(newToken: false))
        #expect(lifecycle.closed(code: 1013, gateways: 3) == .reconnectAfterBackoff(newToken: false))
    }

    @Test("a node not reached (down, or gone before the session opened): each other URL at once, then the backoff")
    func nodesNotReached() {
        var lifecycle = ClientLifecycle()
        lifecycle.opened(with: .online)
        #expect(lifecycle.closed(code: nil, gateways: 3) == .reconnectAfterBackoff(newToken: false), "a session's drop still waits: a dead node's clients spread out")
        #expect(lifecycle.closed(code: nil, unreachable: true, gateways: 3) == .reconnectNow(newToken: false), "the next node is down too: the one after at once")
        #expect(lifecycle.closed(code: 1011, gateways: 3) == .reconnectNow(newToken: false), "counted with 1011 and 1013")
        #expect(lifecycle.closed(code: nil, unreachable: true, gateways: 3) == .reconnectAfterBackoff(newToken: false), "every URL failed: back off")
        #expect(lifecycle.closed(code: nil, unreachable: true, gateways: 1) == .reconnectAfterBackoff(newToken: false), "one URL: nowhere else to go")
        #expect(lifecycle.closed(code: nil, upgradeRefused: true, unreachable: true, gateways: 3) == .reconnectAfterBackoff(newToken: true),
                "a refused upgrade answered: a fresh token after the backoff, as before")
    }

    @Test("changes made while disconnected: the latest wins, carried by the next session, never sent twice")
    func offlineQueue() {
        var lifecycle = ClientLifecycle()
        for status in [PresenceStatus.away, .offline, .online, .away] {
            lifecycle.choose(status)
            #expect(lifecycle.statusToSend(at: now) == nil, "nothing is sent without a session")
        }
        #expect(lifecycle.openingStatus == .away)
        lifecycle.opened(with: lifecycle.openingStatus)
        #expect(lifecycle.statusToSend(at: now) == nil, "the session opened with it: no duplicate")
        lifecycle.choose(.online)
        #expect(lifecycle.statusToSend(at: now) == .online)
        #expect(lifecycle.statusToSend(at: now) == nil, "sent once")
    }

    @Test("a change the session missed is sent after it opens; a refused one again after the delay")
    func owedAndRefused() {
        var lifecycle = ClientLifecycle()
        lifecycle.opened(with: .online)
        lifecycle.didEnterBackground()
        #expect(lifecycle.statusToSend(at: now) == .away)
        lifecycle.statusRefused(retryAt: now + 1)
        #expect(lifecycle.statusToSend(at: now + 0.5) == nil)
        #expect(lifecycle.statusToSend(at: now + 1) == .away)
        #expect(lifecycle.statusToSend(at: now + 2) == nil)
        _ = lifecycle.closed(code: nil)
        lifecycle.didBecomeActive()
        #expect(lifecycle.statusToSend(at: now + 3) == nil, "no session: kept for the next one")
        #expect(lifecycle.openingStatus == .online)
    }

    @Test("typing is allowed only in a session and not while appearing offline")
    func canType() {
        var lifecycle = ClientLifecycle()
        #expect(!lifecycle.canType)
        lifecycle.opened(with: .online)
        #expect(lifecycle.canType)
        lifecycle.choose(.offline)
        #expect(!lifecycle.canType)
    }
}

@Suite("Presence cache")
struct PresenceCacheTests {
    let now = Date(timeIntervalSince1970: 1_800_000_000)

    @Test("a change is announced once; the same snapshot again is not")
    func changes() {
        var cache = PresenceCache()
        let alice = PresenceSnapshot(userID: "alice", status: .online, lastSeen: now)
        #expect(cache.apply(alice) == [.presence(alice)])
        #expect(cache.apply(alice).isEmpty)
        let away = PresenceSnapshot(userID: "alice", status: .away, lastSeen: now + 1)
        #expect(cache.apply(away) == [.presence(away)])
    }

    @Test("going offline ends the user's typing; indicators run out by themselves")
    func typing() {
        var cache = PresenceCache()
        _ = cache.apply(PresenceSnapshot(userID: "bob", status: .online, lastSeen: now))
        #expect(cache.setTyping("bob", in: "room", true, expiresAt: now + 8) == [.typing(conversationID: "room", userID: "bob", isTyping: true)])
        #expect(cache.setTyping("bob", in: "room", true, expiresAt: now + 9).isEmpty, "a refresh is not a change")
        let offline = PresenceSnapshot(userID: "bob", status: .offline, lastSeen: now + 2)
        #expect(cache.apply(offline) == [.presence(offline), .typing(conversationID: "room", userID: "bob", isTyping: false)])
        _ = cache.setTyping("carol", in: "room", true, expiresAt: now + 5)
        #expect(cache.nextTypingExpiry == now + 5)
        #expect(cache.expireTyping(at: now + 4.9).isEmpty)
        #expect(cache.expireTyping(at: now + 5) == [.typing(conversationID: "room", userID: "carol", isTyping: false)])
        #expect(cache.typingUsers(in: "room").isEmpty)
    }

    @Test("a subscribe answer that leaves a user out means the user is not visible")
    func snapshotAnswer() {
        var cache = PresenceCache()
        _ = cache.apply(PresenceSnapshot(userID: "dave", status: .online, lastSeen: now))
        let alice = PresenceSnapshot(userID: "alice", status: .online, lastSeen: now)
        #expect(cache.applySnapshot([alice], requested: ["alice", "dave"]) == [.presence(alice), .removed(userID: "dave")])
        #expect(cache.presences.keys.sorted() == ["alice"])
    }

    @Test("after a reconnect, users the new session did not confirm are dropped")
    func catchUp() {
        var cache = PresenceCache()
        for user in ["alice", "bob", "carol"] { _ = cache.apply(PresenceSnapshot(userID: user, status: .online, lastSeen: now)) }
        cache.beginCatchUp()
        #expect(cache.apply(PresenceSnapshot(userID: "alice", status: .online, lastSeen: now)).isEmpty)
        let bob = PresenceSnapshot(userID: "bob", status: .away, lastSeen: now + 3)
        #expect(cache.apply(bob) == [.presence(bob)])
        #expect(cache.endCatchUp() == [.removed(userID: "carol")])
        #expect(cache.endCatchUp().isEmpty)
    }
}

@Suite("Presence text")
struct PresenceTextTests {
    let now = Date(timeIntervalSince1970: 1_800_000_000)

    @Test("status labels")
    func labels() {
        #expect(PresenceText.status(PresenceSnapshot(userID: "a", status: .online, lastSeen: now), now: now) == "Online")
        #expect(PresenceText.status(PresenceSnapshot(userID: "a", status: .away, lastSeen: now), now: now) == "Away")
        #expect(PresenceText.status(nil, now: now) == "Offline")
        #expect(PresenceText.status(PresenceSnapshot(userID: "a", status: .offline, lastSeen: nil), now: now) == "Offline")
        let cases: [(TimeInterval, String)] = [
            (0, "Last seen just now"), (59, "Last seen just now"), (60, "Last seen 1m ago"), (5 * 60 + 30, "Last seen 5m ago"),
            (3 * 3600 + 1, "Last seen 3h ago"), (2 * 86_400, "Last seen 2d ago"), (30 * 86_400, "Last seen on 2026-12-16"),
        ]
        for (ago, text) in cases {
            #expect(PresenceText.status(PresenceSnapshot(userID: "a", status: .offline, lastSeen: now - ago), now: now) == text, "\(ago) s ago")
        }
    }

    @Test("the label is refreshed exactly when its text changes")
    func nextChange() throws {
        let seen = now - 30
        let next = try #require(PresenceText.nextChange(of: seen, after: now))
        #expect(next == seen + 60)
        #expect(PresenceText.lastSeen(seen, now: next - 0.001) != PresenceText.lastSeen(seen, now: next))
        let later = try #require(PresenceText.nextChange(of: seen, after: seen + 125))
        #expect(later == seen + 180)
        #expect(PresenceText.nextChange(of: seen, after: seen + 3 * 3600 + 10) == seen + 4 * 3600)
        #expect(PresenceText.nextChange(of: nil, after: now) == nil)
    }

    @Test("an updating label follows the test clock")
    func updating() async throws {
        let clock = ManualClock(start: now)
        let presence = PresenceSnapshot(userID: "a", status: .offline, lastSeen: now - 50)
        var labels = PresenceText.updatingStatus(presence, clock: clock).makeAsyncIterator()
        #expect(await labels.next() == "Last seen just now")
        try await waitForSleepers(clock)
        clock.advance(by: 10)
        #expect(await labels.next() == "Last seen 1m ago")
        try await waitForSleepers(clock)
        clock.advance(by: 60)
        #expect(await labels.next() == "Last seen 2m ago")
    }

    @Test("groups and typing")
    func groupAndTyping() {
        #expect(PresenceText.group(GroupPresence(conversationID: "c", total: 5, online: 3, away: 1)) == "3 of 5 online")
        #expect(PresenceText.typing([]) == "")
        #expect(PresenceText.typing(["Alice"]) == "Alice is typing…")
        #expect(PresenceText.typing(["Alice", "Bob"]) == "Alice and Bob are typing…")
        #expect(PresenceText.typing(["Alice", "Bob", "Carol", "Dan", "Eve"]) == "Alice, Bob and 3 others are typing…")
    }
}

/// Waits until some task sleeps on `clock` (bounded).
func waitForSleepers(_ clock: ManualClock, count: Int = 1) async throws {
    for _ in 0..<2_000 {
        if clock.sleeperCount >= count { return }
        try await Task.sleep(for: .milliseconds(1))
    }
    Issue.record("nothing slept on the clock")
}
