import ArgumentParser
import Foundation

/// Benchmarks of the presence engine and the gateway; each prints a table of numbers.
@main
struct PresenceBench: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "presence-bench",
        abstract: "Measures the presence engine and the gateway against a running Redis.",
        discussion: """
        The scenarios idle, churn, storm, fanout, death, cost, group-messages, reconnect-storm and
        instructions start presence-gateway processes (from beside this executable, or
        --gateway-binary) on the Redis of --redis-url and load them over loopback WebSockets;
        engine, latency, group, messages
        and sync-storm run nodes in this process (sync-storm drives them through the Swift SDK).
        Example: presence-bench churn --rate 1000 --duration 10 --json churn.json
        """,
        subcommands: [IdleScenario.self, ChurnScenario.self, StormScenario.self, FanoutScenario.self, DeathScenario.self,
                      CostScenario.self, SoakScenario.self, EngineBench.self, LatencyBench.self, GroupBench.self,
                      MembershipBench.self, MessageBench.self, SyncStormScenario.self, GroupMessagesScenario.self, ReconnectStormScenario.self, DeliveryFloor.self, InstructionScenario.self]
    )
}

/// Options every benchmark takes.
struct CommonOptions: ParsableArguments {
    @Option(help: "The Redis server to use.")
    var redisURL = ProcessInfo.processInfo.environment["PRESENCE_REDIS_URL"] ?? "redis://127.0.0.1:6379/0"
}

/// Seconds as a Double.
func seconds(_ duration: Duration) -> Double {
    Double(duration.components.seconds) + Double(duration.components.attoseconds) / 1e18
}

/// The value at quantile `q` of sorted values.
func percentile(_ sorted: [Double], _ q: Double) -> Double {
    guard !sorted.isEmpty else { return .nan }
    return sorted[min(sorted.count - 1, Int((Double(sorted.count) * q).rounded(.down)))]
}

/// Progress on stderr, rewritten in place.
func progress(_ text: String) {
    FileHandle.standardError.write(Data("\r\u{1B}[K\(text)".utf8))
}

func endProgress() {
    FileHandle.standardError.write(Data("\r\u{1B}[K".utf8))
}
