import CoreMetrics
import Foundation
import Metrics
import NIOConcurrencyHelpers
import Prometheus

/// The gateway's metrics, exported in Prometheus text format at `/metrics`.
enum GatewayMetrics {
    /// The registry behind `/metrics`; bootstrapped into swift-metrics once per process.
    static let registry: PrometheusCollectorRegistry = {
        let registry = PrometheusCollectorRegistry()
        MetricsSystem.bootstrap(PrometheusMetricsFactory(registry: registry))
        return registry
    }()

    static func bootstrap() { _ = registry }

    private static let sessionGauge = Gauge(label: "presence_sessions")
    private static let framesSent = Counter(label: "presence_frames_sent_total")
    /// Recorded once per event for all the watchers it reached here, not through swift-metrics.
    private static let deliveries = LatencyHistogram(name: "presence_delivery_latency_seconds")
    private static let transitions = Counter(label: "presence_transitions_total")

    private static let connectionGauge = Gauge(label: "presence_connections")
    private static let openConnections = NIOLockedValueBox(0)
    /// A TCP connection of the node's port opened (`+1`) or ended (`-1`): HTTP and WebSocket
    /// alike, from the accept to the close, so that connections held by nothing show.
    static func connections(_ change: Int) {
        openConnections.withLockedValue { $0 += change }
    }
    private static let channelGauge = Gauge(label: "presence_subscribed_channels")
    private static let workRunning = Gauge(label: "presence_session_work", dimensions: [("state", "running")])
    private static let workWaiting = Gauge(label: "presence_session_work", dimensions: [("state", "waiting")])

    /// What is read at each scrape rather than recorded as it changes: the open sessions and
    /// connections, the pub/sub channels the node's subscriber wants, and the session work
    /// (openings, frames, ends) running and waiting. All go back to their idle values once
    /// sessions end: a leak shows as a floor that rises.
    ///
    /// Read, not recorded: a count recorded after each change can be overtaken, when two changes
    /// on two threads record in the other order, and the gauge then keeps a stale value until
    /// the next change (300 sessions ending at once could leave `presence_sessions` at 10 until
    /// another session came or went).
    static func sample(sessions: Int, channels: Int, work: (running: Int, waiting: Int)) {
        sessionGauge.record(sessions)
        connectionGauge.record(openConnections.withLockedValue { $0 })
        channelGauge.record(channels)
        workRunning.record(work.running)
        workWaiting.record(work.waiting)
    }

    static func frameSent() { framesSent.increment() }
    static func transition() { transitions.increment() }
    /// `count` sessions were handed one event, `latencyMilliseconds` after Redis stored it.
    static func delivered(_ count: Int, latencyMilliseconds: Int64) {
        deliveries.record(milliseconds: latencyMilliseconds, count: count)
    }
    private static let messagesSent = Counter(label: "presence_messages_sent_total")
    private static let messagesDelivered = Counter(label: "presence_messages_delivered_total")
    private static let messageLatency = Metrics.Timer(label: "presence_message_delivery_latency_seconds")
    /// A message stored by a send through this node (not a retry's duplicate).
    static func messageSent() { messagesSent.increment() }
    /// A message this node handed to `sessions` sessions, `latencyMilliseconds` after Redis stored it.
    static func messageDelivered(sessions: Int, latencyMilliseconds: Int64) {
        messagesDelivered.increment(by: sessions)
        messageLatency.recordNanoseconds(max(0, latencyMilliseconds) * 1_000_000)
    }
    static func refused(_ reason: String) { Counter(label: "presence_sessions_refused_total", dimensions: [("reason", reason)]).increment() }
    static func errors(_ code: String) { Counter(label: "presence_errors_total", dimensions: [("code", code)]).increment() }
    static func redisLatency(_ command: String, nanoseconds: Int64) {
        Metrics.Timer(label: "presence_redis_latency_seconds", dimensions: [("operation", command)]).recordNanoseconds(nanoseconds)
    }

    /// The text format for `/metrics`.
    static func render() -> String {
        var buffer: [UInt8] = []
        registry.emit(into: &buffer)
        deliveries.emit(into: &buffer)
        return String(decoding: buffer, as: UTF8.self)
    }
}
