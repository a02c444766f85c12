import NIOConcurrencyHelpers

/// A latency histogram in Prometheus's text format that takes many samples of one latency at
/// once: an event that reached 4,000 watchers on a node is one record of 4,000 under one lock,
/// where a swift-metrics timer takes 4,000 records (some 650 instructions a delivery, 5 % of
/// it, in a `presence-bench instructions --profile` of the fan-out).
final class LatencyHistogram: Sendable {
    /// The buckets' upper bounds in milliseconds: those of the timers beside it (swift-prometheus's
    /// defaults, 5 ms to 10 s).
    static let bounds: [Int64] = [5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000]

    let name: String
    private let counts = NIOLockedValueBox(Counts())

    private struct Counts {
        /// Per bound, the samples at or under it (Prometheus's buckets are cumulative).
        var buckets = [Int](repeating: 0, count: LatencyHistogram.bounds.count)
        var sumMilliseconds: Int64 = 0
        var count = 0
    }

    init(name: String) {
        self.name = name
    }

    /// Records `count` samples of `milliseconds` (a negative latency, from clocks apart, as 0).
    func record(milliseconds: Int64, count: Int) {
        guard count > 0 else { return }
        let value = max(0, milliseconds)
        counts.withLockedValue { counts in
            for (index, bound) in Self.bounds.enumerated() where value <= bound {
                counts.buckets[index] += count
            }
            counts.sumMilliseconds += value * Int64(count)
            counts.count += count
        }
    }

    /// Appends the histogram as Prometheus text: its type, each bucket's count, `+Inf`, the sum
    /// in seconds and the count.
    func emit(into buffer: inout [UInt8]) {
        let counts = self.counts.withLockedValue { $0 }
        var text = "# TYPE \(name) histogram\n"
        for (bound, count) in zip(Self.bounds, counts.buckets) {
            text += "\(name)_bucket{le=\"\(Self.seconds(bound))\"} \(count)\n"
        }
        text += "\(name)_bucket{le=\"+Inf\"} \(counts.count)\n"
        text += "\(name)_sum \(Self.seconds(counts.sumMilliseconds))\n"
        text += "\(name)_count \(counts.count)\n"
        buffer.append(contentsOf: text.utf8)
    }

    /// Milliseconds as seconds, in Prometheus's decimal form: 5 is "0.005", 2,500 is "2.5".
    static func seconds(_ milliseconds: Int64) -> String {
        "\(Double(milliseconds) / 1_000)"
    }
}
