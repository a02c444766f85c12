import ArgumentParser
import Foundation

/// Benchmarks of the presence engine and the gateway; each prints a table of numbers.
@main
struct PresenceBench: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "presence-bench",
        abstract: "Measures the presence engine and the gateway against a running Redis.",
        discussion: "Example: presence-bench engine --devices 10000 --idle-seconds 60",
        subcommands: [EngineBench.self, LatencyBench.self, GroupBench.self]
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
