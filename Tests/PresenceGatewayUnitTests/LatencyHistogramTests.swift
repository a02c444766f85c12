@testable import PresenceGateway
import Testing

@Suite("Delivery latency histogram")
struct LatencyHistogramTests {
    /// The value of the line that begins `name ` in `text`.
    private func value(_ name: String, in text: String) -> String? {
        text.split(separator: "\n").first { $0.hasPrefix(name + " ") }.map { String($0.dropFirst(name.count + 1)) }
    }

    @Test("samples recorded many at once land in every bucket at or above them, with the sum in seconds")
    func buckets() {
        let histogram = LatencyHistogram(name: "t")
        histogram.record(milliseconds: 3, count: 4_000)
        histogram.record(milliseconds: 5, count: 1)
        histogram.record(milliseconds: 40, count: 2)
        histogram.record(milliseconds: -20, count: 3)
        histogram.record(milliseconds: 60_000, count: 1)
        histogram.record(milliseconds: 7, count: 0)
        var buffer: [UInt8] = []
        histogram.emit(into: &buffer)
        let text = String(decoding: buffer, as: UTF8.self)
        #expect(text.hasPrefix("# TYPE t histogram\n"))
        #expect(value(#"t_bucket{le="0.005"}"#, in: text) == "4004", "3 ms and 5 ms, and the negative as 0")
        #expect(value(#"t_bucket{le="0.025"}"#, in: text) == "4004")
        #expect(value(#"t_bucket{le="0.05"}"#, in: text) == "4006")
        #expect(value(#"t_bucket{le="10.0"}"#, in: text) == "4006", "a minute is past every bound")
        #expect(value(#"t_bucket{le="+Inf"}"#, in: text) == "4007")
        #expect(value("t_count", in: text) == "4007")
        #expect(value("t_sum", in: text) == "72.085", "4,000 × 3 ms + 5 + 80 + 0 + 60,000 ms")
        let bounds = text.split(separator: "\n").filter { $0.hasPrefix("t_bucket") }.count
        #expect(bounds == LatencyHistogram.bounds.count + 1)
    }

    @Test("the node's metrics page carries the delivery latency once")
    func onTheMetricsPage() {
        GatewayMetrics.bootstrap()
        let page = GatewayMetrics.render()
        #expect(page.split(separator: "\n").filter { $0 == "# TYPE presence_delivery_latency_seconds histogram" }.count == 1)
        #expect(value("presence_delivery_latency_seconds_count", in: page) != nil)
    }
}
