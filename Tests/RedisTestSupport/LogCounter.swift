import Logging
import NIOConcurrencyHelpers

/// Counts a logger's messages by their text: for tests that bound how often something happens.
public final class LogCounter: Sendable {
    private let counts = NIOLockedValueBox<[String: Int]>([:])

    public init() {}

    /// How many messages with this text were logged.
    public func count(_ message: String) -> Int { counts.withLockedValue { $0[message] ?? 0 } }

    /// A handler that counts every message, at every level, into `counter`.
    public struct Handler: LogHandler {
        let counter: LogCounter
        public var logLevel: Logger.Level = .trace
        public var metadata: Logger.Metadata = [:]

        public init(counter: LogCounter) { self.counter = counter }

        public subscript(metadataKey key: String) -> Logger.Metadata.Value? {
            get { metadata[key] }
            set { metadata[key] = newValue }
        }

        public func log(event: LogEvent) {
            counter.counts.withLockedValue { $0[event.message.description, default: 0] += 1 }
        }
    }
}
