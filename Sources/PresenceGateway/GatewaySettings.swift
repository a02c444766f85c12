import Foundation
import Logging
import PresenceEngine

/// One `PRESENCE_*` setting: its variable, what it takes, what it does. ``GatewaySetting/all``
/// is the only place a setting is spelled: ``GatewayConfiguration/apply(_:)`` reads values
/// through it, `presence-gateway` takes a flag for each, and `--print-config-schema` prints it
/// (``GatewaySetting/schema``) for the deployment checks and the configuration docs.
public struct GatewaySetting: Sendable {
    /// What a setting's value may be.
    public enum Kind: Sendable, Equatable {
        /// Any text.
        case text
        /// Text never printed (a secret or token); an empty value counts as unset.
        case secret
        /// A whole number in the range.
        case integer(ClosedRange<Int>)
        /// One of the names.
        case choice([String])
    }

    /// The environment variable, `PRESENCE_…`.
    public let name: String
    /// What the value may be.
    public let kind: Kind
    /// One line on what it does.
    public let help: String
    /// The default where it is not one value (worked out at start), in words.
    public let defaultText: String?
    /// The value `configuration` holds, as it would be written; nil when unset.
    let read: @Sendable (GatewayConfiguration) -> String?
    /// Sets the value from its text, which ``kind`` has allowed.
    let write: @Sendable (inout GatewayConfiguration, String) -> Void

    /// The command-line flag: `PRESENCE_LEASE_TTL` is `--lease-ttl`.
    public var flag: String {
        "--" + name.dropFirst("PRESENCE_".count).lowercased().replacingOccurrences(of: "_", with: "-")
    }

    /// The default, as the value would be written; nil for a secret, or where ``defaultText`` says it.
    public var defaultValue: String? {
        defaultText == nil ? read(GatewayConfiguration()) : nil
    }

    /// Checks `text` against ``kind`` and sets it; an empty secret leaves the setting unset.
    func apply(_ text: String, to configuration: inout GatewayConfiguration) throws(GatewayConfigurationError) {
        switch kind {
        case .text:
            break
        case .secret:
            guard !text.isEmpty else { return }
        case .integer(let range):
            guard let value = Int(text), range.contains(value) else {
                throw GatewayConfigurationError("\(name)=\(text) must be a whole number between \(range.lowerBound) and \(range.upperBound)")
            }
        case .choice(let names):
            guard names.contains(text.lowercased()) else {
                throw GatewayConfigurationError("\(name)=\(text) must be one of \(names.joined(separator: ", "))")
            }
        }
        write(&configuration, text)
    }
}

extension GatewaySetting {
    static func text(_ name: String, _ path: any WritableKeyPath<GatewayConfiguration, String> & Sendable, help: String, defaultText: String? = nil) -> GatewaySetting {
        GatewaySetting(name: name, kind: .text, help: help, defaultText: defaultText,
                       read: { $0[keyPath: path] }, write: { $0[keyPath: path] = $1 })
    }

    static func optional(_ name: String, _ path: any WritableKeyPath<GatewayConfiguration, String?> & Sendable, secret: Bool = false, help: String,
                         defaultText: String? = nil) -> GatewaySetting {
        GatewaySetting(name: name, kind: secret ? .secret : .text, help: help, defaultText: defaultText,
                       read: { secret ? nil : $0[keyPath: path] }, write: { $0[keyPath: path] = $1 })
    }

    static func integer(_ name: String, _ range: ClosedRange<Int>, _ path: any WritableKeyPath<GatewayConfiguration, Int> & Sendable, help: String,
                        defaultText: String? = nil) -> GatewaySetting {
        GatewaySetting(name: name, kind: .integer(range), help: help, defaultText: defaultText,
                       read: { String($0[keyPath: path]) }, write: { $0[keyPath: path] = Int($1)! })
    }

    static func choice<Value: RawRepresentable & CaseIterable & Sendable>(
        _ name: String, _ path: any WritableKeyPath<GatewayConfiguration, Value> & Sendable, help: String
    ) -> GatewaySetting where Value.RawValue == String {
        GatewaySetting(name: name, kind: .choice(Value.allCases.map(\.rawValue)), help: help, defaultText: nil,
                       read: { $0[keyPath: path].rawValue }, write: { $0[keyPath: path] = Value(rawValue: $1.lowercased())! })
    }

    /// Every setting, in the order docs/configuration.md lists them.
    public static let all: [GatewaySetting] = [
        .text("PRESENCE_HOST", \.host, help: "Listen address."),
        .integer("PRESENCE_PORT", 0...65535, \.port, help: "Listen port (0 picks a free one)."),
        .text("PRESENCE_REDIS_URL", \.redisURL,
              help: "redis://[user:password@]host:port/db, rediss:// for TLS, redis+sentinel://host:port[,...]/primary-name[/db] or redis+cluster://host:port[,...]; rediss+sentinel:// and rediss+cluster:// over TLS."),
        .optional("PRESENCE_REDIS_PUBSUB", \.redisPubSub,
                  help: "classic or sharded pub/sub on one server or through Sentinel; a cluster takes sharded only.",
                  defaultText: "classic (a cluster: sharded)"),
        .text("PRESENCE_KEY_PREFIX", \.keyPrefix, help: "Prefix of every Redis key and channel."),
        .text("PRESENCE_NODE_ID", \.nodeID, help: "This node's id; up to 10 characters keep each online user's devices hash compact in Redis (a listpack).", defaultText: "host name + random suffix"),
        .optional("PRESENCE_JWT_SECRET", \.jwtSecret, secret: true, help: "HS256 secret, at least 32 bytes."),
        .optional("PRESENCE_JWT_PUBLIC_KEY", \.jwtPublicKey, secret: true, help: "RS256/ES256 public key, PEM text."),
        .optional("PRESENCE_ADMIN_TOKEN", \.adminToken, secret: true, help: "Admin bearer token; admin routes are off without it."),
        .choice("PRESENCE_VISIBILITY", \.visibility, help: "Who may see whom: members of a shared conversation, or everyone."),
        .choice("PRESENCE_ID_FORMAT", \.idFormat, help: "User and conversation ids as JSON strings or numbers."),
        .integer("PRESENCE_LEASE_TTL", 1...3600, \.leaseTTL, help: "Seconds a node's lease lives without renewal."),
        .integer("PRESENCE_LINGER", 0...3600, \.linger, help: "Seconds a device that dropped its connection stays live."),
        .integer("PRESENCE_HEARTBEAT_TTL", 1...86400, \.heartbeatTTL, help: "Seconds a REST-only device stays live after its last post."),
        .integer("PRESENCE_TYPING_TTL", 1...3600, \.typingTTL, help: "Seconds a typing state lives without refresh."),
        .integer("PRESENCE_LARGE_GROUP", 2...100_000, \.largeGroup,
                 help: "Above this many members a conversation gives counts, not member lists or automatic contacts."),
        .choice("PRESENCE_LOG_LEVEL", \.logLevel, help: "The least severe level logged."),
        .integer("PRESENCE_MESSAGE_HISTORY", 1...1_000_000, \.messageHistory, help: "Messages kept per conversation."),
        .integer("PRESENCE_MESSAGE_TTL", 1...(10 * 366 * 86_400), \.messageTTL, help: "Seconds a conversation's history lives after its last message."),
        .integer("PRESENCE_MESSAGE_DEDUP_TTL", 1...(10 * 366 * 86_400), \.messageDedupTTL, help: "Seconds a sender's client_message_id is remembered."),
        .integer("PRESENCE_MESSAGE_MAX_BYTES", 1...1_048_576, \.messageMaxBytes, help: "Largest message text, in UTF-8 bytes."),
        .integer("PRESENCE_MESSAGE_REPLICAS", 0...16, \.messageReplicas, help: "Replicas a message must have reached before it is acknowledged."),
        .integer("PRESENCE_MAX_SESSIONS", 1...10_000_000, \.maxSessions,
                 help: "Most WebSocket sessions this node holds at once.", defaultText: "the open-file limit less 256"),
    ]

    /// The setting named `name`, by variable or flag.
    public static func named(_ name: String) -> GatewaySetting? {
        all.first { $0.name == name || $0.flag == name }
    }

    /// The `PRESENCE_*` names among `names` that are no setting, each with the setting it was
    /// likely meant to be (at most two letters off), if any: a misspelt variable is otherwise
    /// ignored without a word. Names of the test tools (`PRESENCE_TEST_*`) are left out.
    public static func unknown(among names: some Sequence<String>) -> [(name: String, meant: String?)] {
        names.filter { $0.hasPrefix("PRESENCE_") && !$0.hasPrefix("PRESENCE_TEST_") && named($0) == nil }.sorted().map { name in
            (name, all.map(\.name).first { distance(name, $0) <= 2 })
        }
    }

    /// The edit distance of `a` and `b` (insertions, deletions, substitutions).
    static func distance(_ a: String, _ b: String) -> Int {
        let b = Array(b.utf8)
        // One row of the table at a time: row[j] is the distance of a's first i letters to b's first j.
        var row = Array(0...b.count)
        for (i, letter) in a.utf8.enumerated() {
            var diagonal = row[0]
            row[0] = i + 1
            for (j, other) in b.enumerated() {
                let replaced = diagonal + (letter == other ? 0 : 1)
                diagonal = row[j + 1]
                row[j + 1] = min(replaced, row[j + 1] + 1, row[j] + 1)
            }
        }
        return row[b.count]
    }

    /// Every setting as JSON (`presence-gateway --print-config-schema`): per setting its
    /// `name`, `flag`, `type` (`text`, `secret`, `integer` with `minimum` and `maximum`,
    /// `choice` with `choices`), `default` (a number, a string, or null with `default_text`
    /// saying it in words) and `help`.
    public static var schema: String {
        let settings = all.map(SchemaEntry.init)
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
        let data = try! encoder.encode(["settings": settings])
        return String(decoding: data, as: UTF8.self)
    }

    /// One setting in ``schema``.
    struct SchemaEntry: Encodable {
        let name: String, flag: String, type: String, help: String
        let minimum: Int?, maximum: Int?, choices: [String]?
        /// Always present: null says "worked out at start" (see `default_text`) or "unset".
        let defaultValue: SchemaDefault, defaultText: String?

        init(_ setting: GatewaySetting) {
            (name, flag, help, defaultText) = (setting.name, setting.flag, setting.help, setting.defaultText)
            switch setting.kind {
            case .text: (type, minimum, maximum, choices) = ("text", nil, nil, nil)
            case .secret: (type, minimum, maximum, choices) = ("secret", nil, nil, nil)
            case .integer(let range): (type, minimum, maximum, choices) = ("integer", range.lowerBound, range.upperBound, nil)
            case .choice(let names): (type, minimum, maximum, choices) = ("choice", nil, nil, names)
            }
            switch (setting.kind, setting.defaultValue) {
            case (_, nil): defaultValue = .unset
            case (.integer, let value?): defaultValue = Int(value).map(SchemaDefault.number) ?? .text(value)
            case (_, let value?): defaultValue = .text(value)
            }
        }

        enum CodingKeys: String, CodingKey {
            case name, flag, type, help, minimum, maximum, choices
            case defaultValue = "default", defaultText = "default_text"
        }
    }

    /// A default in ``schema``: a number for an integer setting, text, or null.
    enum SchemaDefault: Encodable {
        case number(Int)
        case text(String)
        case unset

        func encode(to encoder: any Encoder) throws {
            var container = encoder.singleValueContainer()
            switch self {
            case .number(let value): try container.encode(value)
            case .text(let value): try container.encode(value)
            case .unset: try container.encodeNil()
            }
        }
    }
}
