import Foundation
import NIOConcurrencyHelpers

/// A token bucket: `rate` tokens a second, holding at most `burst`.
struct TokenBucket: Sendable {
    let rate: Double
    let burst: Double
    private var tokens: Double
    private var updated: ContinuousClock.Instant

    init(rate: Double, burst: Double) {
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.updated = .now
    }

    /// Takes a token at `now` (a frame's arrival); on refusal, the seconds until one is
    /// available. A moment before the last one (a frame that arrived before the bucket was made,
    /// while its session opened) adds nothing and takes nothing back.
    mutating func take(now: ContinuousClock.Instant = .now) -> Int? {
        let elapsed = max(.zero, now - updated)
        let seconds = Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18
        tokens = min(burst, tokens + seconds * rate)
        updated = max(updated, now)
        guard tokens >= 1 else { return max(1, Int(((1 - tokens) / rate).rounded(.up))) }
        tokens -= 1
        return nil
    }
}

/// Token buckets by key (a user id), for REST routes; old entries are dropped as it grows.
final class RateLimiter: Sendable {
    private let buckets = NIOLockedValueBox([String: TokenBucket]())
    let rate: Double

    init(rate: Double) { self.rate = rate }

    /// Takes a token for `key`; on refusal, the seconds to wait.
    func take(_ key: String) -> Int? {
        buckets.withLockedValue { buckets in
            if buckets.count > 100_000 { buckets.removeAll(keepingCapacity: true) }
            var bucket = buckets[key] ?? TokenBucket(rate: rate, burst: rate * 2)
            let wait = bucket.take()
            buckets[key] = bucket
            return wait
        }
    }
}
