import Foundation

/// Where a client keeps the messages written on the device that the gateway has not stored yet
/// (`sending`, and `failed` ones kept for a retry), so that they survive the process.
///
/// The client reads it once when it starts running and writes the whole outbox after every
/// change, one write after another. An iOS app may back it with Core Data or SQLite.
public protocol MessageOutboxStore: Sendable {
    /// The outbox as last saved, oldest first; empty when nothing was saved.
    func load() async throws -> [ChatMessage]
    /// Replaces what is saved with `messages`.
    func save(_ messages: [ChatMessage]) async throws
}

/// An outbox in a JSON file, replaced atomically on every save.
public actor FileMessageOutboxStore: MessageOutboxStore {
    /// The file.
    public let url: URL

    /// A store in `url`; its folder is made when first saved.
    public init(url: URL) {
        self.url = url
    }

    /// The default file for a device: `PresenceClient/outbox-<deviceID>.json` in the user's
    /// Application Support folder (on Linux, `~/.local/share`).
    public static func defaultURL(deviceID: String) -> URL {
        let base = FileManager.default.urls(for: .applicationSupportDirectory, in: .userDomainMask).first
            ?? FileManager.default.temporaryDirectory
        return base.appendingPathComponent("PresenceClient", isDirectory: true).appendingPathComponent("outbox-\(deviceID).json")
    }

    public func load() async throws -> [ChatMessage] {
        guard FileManager.default.fileExists(atPath: url.path) else { return [] }
        let data = try Data(contentsOf: url)
        return try JSONDecoder().decode([ChatMessage].self, from: data)
    }

    public func save(_ messages: [ChatMessage]) async throws {
        try FileManager.default.createDirectory(at: url.deletingLastPathComponent(), withIntermediateDirectories: true)
        try JSONEncoder().encode(messages).write(to: url, options: .atomic)
    }
}

/// An outbox in memory: it lasts as long as the store object (tests, or an app that keeps its
/// own).
public actor MemoryMessageOutboxStore: MessageOutboxStore {
    private var saved: [ChatMessage] = []

    public init() {}

    public func load() async throws -> [ChatMessage] { saved }

    public func save(_ messages: [ChatMessage]) async throws { saved = messages }
}
