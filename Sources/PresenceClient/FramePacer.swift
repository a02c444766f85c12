import Foundation
import PresenceProtocol

/// A budget of `rate` frames a second with a burst of `burst`, as the gateway keeps one per
/// session (docs/API.md, "Many conversations"; docs/configuration.md, "Limits"). The client
/// spends from its own copy before it writes, so that the gateway's never has to refuse.
///
/// Moments are whole milliseconds, so that tokens add up exactly (200 ms at 5 a second is one
/// token, not 0.9999999) and a frame is never held a millisecond short of its token.
struct TokenBucket: Sendable, Hashable {
    /// Tokens a second.
    let rate: Double
    /// The most it holds; it starts full, as the gateway's does.
    let burst: Double
    private var tokens: Double
    private var updated: Int64

    /// A full bucket at `now`.
    init(rate: Double, burst: Double, now: Date) {
        precondition(rate > 0 && burst >= 1, "a bucket refills and holds at least one token")
        self.rate = rate
        self.burst = burst
        tokens = burst
        updated = Self.milliseconds(now)
    }

    static func milliseconds(_ moment: Date) -> Int64 {
        Int64((moment.timeIntervalSince1970 * 1000).rounded())
    }

    /// The tokens there at `moment` (milliseconds), without spending any.
    private func available(at moment: Int64) -> Double {
        // Milliseconds times the rate first: whole milliseconds then add whole tokens exactly.
        min(burst, tokens + Double(max(0, moment - updated)) * rate / 1000)
    }

    /// Whether a token is there at `now`.
    func isReady(at now: Date) -> Bool {
        available(at: Self.milliseconds(now)) >= 1 - 1e-9
    }

    /// Spends a token at `now`; call after ``isReady(at:)``.
    mutating func take(at now: Date) {
        let moment = Self.milliseconds(now)
        tokens = max(0, available(at: moment) - 1)
        updated = max(updated, moment)
    }

    /// When a token will be there: `now` if it is.
    func readyAt(_ now: Date) -> Date {
        let moment = Self.milliseconds(now)
        let held = available(at: moment)
        guard held < 1 - 1e-9 else { return now }
        let wait = Int64(((1 - held) * 1000 / rate).rounded(.up))
        return Date(timeIntervalSince1970: Double(moment + max(1, wait)) / 1000)
    }
}

/// What a session writes, paced within the gateway's budgets with a fifth to spare: `subscribe`
/// 4 a second with a burst of 8, `sync` the same, and every frame under 40 a second with a burst
/// of 80. The gateway allows 5 and 10, 5 and 10, and 50 and 100, but it counts frames as they
/// arrive, from buckets that start when its end of the session does, and the network may bunch
/// frames sent apart: paced at the gateway's own rates, a sync storm saw 12 subscribes refused.
/// A frame refused for the frame rate comes back without its id (so it is lost), and the 51st
/// refusal in a row closes the session with 4029.
///
/// Frames wait in lanes, each in the order it was made. A lane whose budget is spent does not
/// hold up the others: a `sync` never waits behind `subscribe`s, so the catch-up of messages at
/// the opening goes at once however many conversations are followed. `unsubscribe` shares the
/// `subscribe` lane without spending its budget, so it never overtakes the `subscribe` it undoes.
struct FramePacer: Sendable {
    enum Lane: Sendable, Hashable {
        case subscribe
        case sync
        case other
    }

    /// A frame written or waiting: its id, its text and what it asked for.
    struct Frame: Sendable {
        var id: String
        var text: String
        var lane: Lane
        /// Whether it spends its lane's budget besides the frame budget (`subscribe`, `sync`).
        var spendsLane: Bool
        var request: PresenceClient.Request
    }

    static let subscribeRate = 4.0
    static let subscribeBurst = 8.0
    static let syncRate = 4.0
    static let syncBurst = 8.0
    static let frameRate = 40.0
    static let frameBurst = 80.0

    private var frames: TokenBucket
    private var subscribes: TokenBucket
    private var syncs: TokenBucket
    /// Frames not written yet, oldest first.
    private(set) var waiting: [Frame] = []

    /// The budgets of a session that opens at `now`: full, as the gateway's are.
    init(now: Date) {
        frames = TokenBucket(rate: Self.frameRate, burst: Self.frameBurst, now: now)
        subscribes = TokenBucket(rate: Self.subscribeRate, burst: Self.subscribeBurst, now: now)
        syncs = TokenBucket(rate: Self.syncRate, burst: Self.syncBurst, now: now)
    }

    /// The lane of a frame, and whether it spends that lane's budget.
    static func lane(of frame: ClientFrame) -> (lane: Lane, spendsLane: Bool) {
        switch frame {
        case .subscribe: (lane: Lane.subscribe, spendsLane: true)
        case .unsubscribe: (lane: Lane.subscribe, spendsLane: false)
        case .sync: (lane: Lane.sync, spendsLane: true)
        case .status, .typing, .ping, .send, .delivered, .read: (lane: Lane.other, spendsLane: false)
        }
    }

    /// Puts a frame last in its lane.
    mutating func enqueue(_ frame: Frame) {
        waiting.append(frame)
    }

    /// The frames the budgets have room for at `now`, oldest first in each lane; they count as
    /// written.
    mutating func due(at now: Date) -> [Frame] {
        guard !waiting.isEmpty else { return [] }
        var held: Set<Lane> = []
        var written: [Frame] = []
        var kept: [Frame] = []
        for frame in waiting {
            guard !held.contains(frame.lane), frames.isReady(at: now), !frame.spendsLane || bucket(of: frame.lane).isReady(at: now) else {
                held.insert(frame.lane)
                kept.append(frame)
                continue
            }
            frames.take(at: now)
            if frame.spendsLane { spend(frame.lane, at: now) }
            written.append(frame)
        }
        waiting = kept
        return written
    }

    /// When the budgets have room for a waiting frame, or `nil` when none waits.
    func nextDeadline(after now: Date) -> Date? {
        var lanes: Set<Lane> = []
        var next: Date?
        for frame in waiting {
            // A lane's first frame goes first: the others of the lane wait behind it.
            guard lanes.insert(frame.lane).inserted else { continue }
            var at = frames.readyAt(now)
            if frame.spendsLane { at = max(at, bucket(of: frame.lane).readyAt(now)) }
            next = next.map { min($0, at) } ?? at
        }
        return next
    }

    /// Takes the waiting frames that `matches` out (they will not be written); returns them.
    mutating func remove(where matches: (Frame) -> Bool) -> [Frame] {
        let removed = waiting.filter(matches)
        if !removed.isEmpty { waiting.removeAll(where: matches) }
        return removed
    }

    private func bucket(of lane: Lane) -> TokenBucket {
        switch lane {
        case .subscribe: subscribes
        case .sync: syncs
        case .other: frames
        }
    }

    private mutating func spend(_ lane: Lane, at now: Date) {
        switch lane {
        case .subscribe: subscribes.take(at: now)
        case .sync: syncs.take(at: now)
        case .other: break
        }
    }
}
