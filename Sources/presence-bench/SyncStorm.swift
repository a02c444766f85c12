import ArgumentParser
import Foundation
import Logging
import NIOConcurrencyHelpers
import PresenceClient
import PresenceEngine

/// A device that was away catches up (docs/API.md, "Many conversations"): messages written into
/// each of its conversations while it was offline, more groups followed beside them, and the
/// Swift SDK's own opening (its pacing of subscribes and syncs, its retries) against a node of
/// this process with the gateway's default budgets.
struct SyncStormScenario: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "sync-storm",
        abstract: "A device in N conversations with M messages each written while it was away, and K more groups: the SDK's catch-up time, refusals and error frames."
    )

    @OptionGroup var common: CommonOptions
    @Option(help: "Conversations with messages written while the device was away.") var conversations = 300
    @Option(help: "More groups the device follows, with nothing to catch up.") var groups = 300
    @Option(help: "Messages written into each conversation while the device was away.") var messages = 20
    @Option(help: "Bytes of text per message.") var size = 200
    @Option(help: "Seconds the catch-up may take before the run gives up.") var timeout = 60
    @Option(help: "Write the figures as JSON to this file.") var json: String?

    func run() async throws {
        let nodes = try await TwoNodes.start(redisURL: common.redisURL, statusRate: 5, maxIDs: 500)
        let setup = try await BenchEngine.make(redisURL: common.redisURL, prefix: nodes.prefix)
        let talks = (0..<conversations).map { "storm-talk-\($0)" }
        let followed = (0..<groups).map { "storm-group-\($0)" }
        let text = String(repeating: "s", count: max(1, size))
        let written = ContinuousClock.now
        try await setup.use { engine in
            for talk in talks { _ = try await engine.setMembers(of: talk, to: ["storm-reader", "storm-writer"]) }
            for group in followed { _ = try await engine.setMembers(of: group, to: ["storm-reader", "storm-writer", "storm-other"]) }
            // Written while the reader is away, conversation after conversation, as a busy day would.
            for number in 1...messages {
                for talk in talks {
                    _ = try await engine.send(OutgoingMessage(clientMessageID: "\(talk)-\(number)", text: text), to: talk, from: "storm-writer")
                }
                progress("written \(number * talks.count) of \(messages * talks.count) messages")
            }
        }
        progress("")
        print("wrote \(messages * talks.count) messages in \(talks.count) conversations in \(String(format: "%.1f", seconds(.now - written))) s")
        let errorsBefore = try errorFrames(port: nodes.ports[0])

        var logger = Logger(label: "storm-reader")
        logger.logLevel = ProcessInfo.processInfo.environment["SYNC_STORM_LOG"] == nil ? .warning : .info
        let configuration = try PresenceClientConfiguration(gatewayURLs: [URL(string: "ws://127.0.0.1:\(nodes.ports[0])")!], deviceID: "storm-phone")
        let token = try await nodes.token("storm-reader")
        let client = PresenceClient(configuration: configuration, tokenProvider: { _ in token }, outboxStore: MemoryMessageOutboxStore(),
                                    logger: logger)
        for conversation in talks + followed { try await client.join(conversation: conversation) }
        let events = await client.events()
        let heard = NIOLockedValueBox((errors: [String](), connected: ContinuousClock.Instant?.none))
        let listening = Task {
            for await event in events {
                switch event {
                case .error(let code, let message): heard.withLockedValue { $0.errors.append("\(code.rawValue): \(message)") }
                case .connection(.connected): heard.withLockedValue { $0.connected = $0.connected ?? .now }
                default: break
                }
            }
        }
        let started = ContinuousClock.now
        let running = Task { await client.run() }
        let expected = messages * talks.count
        var caughtUp: ContinuousClock.Instant?
        var held = 0
        while ContinuousClock.now - started < .seconds(timeout) {
            held = 0
            for talk in talks { held += await client.messages(in: talk).count }
            if held >= expected {
                caughtUp = .now
                break
            }
            progress("caught up on \(held) of \(expected) messages")
            try await Task.sleep(for: .milliseconds(20))
        }
        progress("")
        let catchUp = caughtUp.map { seconds($0 - started) }
        // Every conversation in order, once: seqs 1…M.
        var outOfOrder = 0
        for talk in talks {
            if await client.messages(in: talk).compactMap(\.seq) != Array(1...Int64(messages)) { outOfOrder += 1 }
        }
        let connected = heard.withLockedValue { $0.connected }.map { seconds($0 - started) }
        let errorsAfter = try errorFrames(port: nodes.ports[0])
        let refused = errorsAfter.subtracting(errorsBefore)
        // Signed off before the nodes stop: the session ends with 1000.
        await client.signOut()
        running.cancel()
        listening.cancel()
        let sdkErrors = heard.withLockedValue { $0.errors }

        try report("sync-storm: \(talks.count) conversations × \(messages) messages of \(size) bytes written while away, \(followed.count) more groups; the Swift SDK on one node", [
            ("caught up (every message held)", catchUp.map { String(format: "%.2f s after the client started (goal ≤ 3 s)", $0) } ?? "not within \(timeout) s: \(held) of \(expected)"),
            ("\"connected\" (every subscribe answered)", connected.map { String(format: "%.2f s", $0) } ?? "not within the run"),
            ("conversations not exactly seqs 1…\(messages)", "\(outOfOrder)"),
            ("error frames the node sent", refused.total == 0 ? "0" : refused.description),
            ("error events the SDK raised", sdkErrors.isEmpty ? "0" : "\(sdkErrors.count): \(sdkErrors.prefix(3))"),
        ], json: ["scenario": "sync-storm", "conversations": talks.count, "groups": followed.count, "messages": expected, "size": size,
                  "catch_up_seconds": catchUp ?? -1, "connected_seconds": connected ?? -1, "out_of_order": outOfOrder,
                  "error_frames": refused.total, "sdk_errors": sdkErrors.count], to: json)
        try await setup.use { engine in
            for conversation in talks + followed { _ = try await engine.deleteConversation(conversation) }
        }
        await nodes.stop()
        guard catchUp != nil, outOfOrder == 0, refused.total == 0, sdkErrors.isEmpty else {
            throw BenchError("the device did not catch up cleanly (see above)")
        }
    }

    /// The node's `presence_errors_total` by code, from its `/metrics` (both nodes of this process
    /// share the counters).
    private func errorFrames(port: Int) throws -> ErrorCounts {
        let text = try String(contentsOf: URL(string: "http://127.0.0.1:\(port)/metrics")!, encoding: .utf8)
        var counts: [String: Int] = [:]
        for line in text.split(separator: "\n") where line.hasPrefix("presence_errors_total{") {
            guard let code = line.split(separator: "\"").dropFirst().first, let value = line.split(separator: " ").last.flatMap({ Double($0) }) else { continue }
            counts[String(code), default: 0] += Int(value)
        }
        return ErrorCounts(byCode: counts)
    }
}

/// Error frames by code, as the node counted them.
struct ErrorCounts: CustomStringConvertible {
    var byCode: [String: Int]

    var total: Int { byCode.values.reduce(0, +) }

    /// What was counted after `earlier`.
    func subtracting(_ earlier: ErrorCounts) -> ErrorCounts {
        ErrorCounts(byCode: byCode.mapValues { $0 }.filter { $0.value > (earlier.byCode[$0.key] ?? 0) }
            .reduce(into: [:]) { counts, entry in counts[entry.key] = entry.value - (earlier.byCode[entry.key] ?? 0) })
    }

    var description: String { byCode.sorted { $0.key < $1.key }.map { "\($0.key) \($0.value)" }.joined(separator: ", ") }
}
