import Foundation
import JWTKit
import PresenceEngine
import RedisClient
import Testing

@testable import PresenceGateway

@Suite("Gateway configuration and authentication")
struct ConfigurationTests {
    static let secret = "test-secret-that-is-long-enough-for-hs256"

    /// A token for `user` signed with ``secret`` (HS256), valid for an hour.
    static func hs256(_ user: String) async throws -> String {
        let keys = JWTKeyCollection()
        await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
        return try await keys.sign(ClientClaims(sub: .string(user), exp: .init(value: Date(timeIntervalSinceNow: 3600)), nbf: nil))
    }

    @Test("environment values are read, and bad ones are refused with the variable's name")
    func environment() throws {
        let configuration = try GatewayConfiguration(environment: [
            "PRESENCE_PORT": "9000", "PRESENCE_LEASE_TTL": "20", "PRESENCE_VISIBILITY": "open",
            "PRESENCE_JWT_SECRET": String(repeating: "s", count: 32), "PRESENCE_LOG_LEVEL": "debug",
            "PRESENCE_MAX_SESSIONS": "5000", "PRESENCE_ID_FORMAT": "numeric",
            "PRESENCE_MESSAGE_HISTORY": "500", "PRESENCE_MESSAGE_TTL": "3600", "PRESENCE_MESSAGE_DEDUP_TTL": "600",
            "PRESENCE_MESSAGE_MAX_BYTES": "65536", "PRESENCE_MESSAGE_REPLICAS": "1",
        ])
        let engine = configuration.engineConfiguration
        #expect(engine.messageHistory == 500 && engine.messageTTL == .seconds(3600) && engine.messageDedupTTL == .seconds(600))
        #expect(engine.messageMaxBytes == 65536 && engine.messageReplicas == 1)
        #expect(configuration.maxBodySize == 65536 * 6 + 4096 && GatewayConfiguration().maxBodySize == 128 * 1024,
                "a body holds the largest text however JSON escapes it, and never less than 128 KiB")
        #expect(configuration.port == 9000 && configuration.leaseTTL == 20 && configuration.visibility == .open)
        #expect(configuration.idFormat == .numeric && GatewayConfiguration().idFormat == .string)
        #expect(configuration.maxSessions == 5000)
        try configuration.validate()
        for (name, value) in [("PRESENCE_PORT", "http"), ("PRESENCE_LEASE_TTL", "0"), ("PRESENCE_VISIBILITY", "all"), ("PRESENCE_LOG_LEVEL", "loud"), ("PRESENCE_MAX_SESSIONS", "0"), ("PRESENCE_ID_FORMAT", "integer"),
                              ("PRESENCE_MESSAGE_HISTORY", "0"), ("PRESENCE_MESSAGE_TTL", "0"), ("PRESENCE_MESSAGE_DEDUP_TTL", "-1"),
                              ("PRESENCE_MESSAGE_MAX_BYTES", "1048577"), ("PRESENCE_MESSAGE_REPLICAS", "17")] {
            do {
                _ = try GatewayConfiguration(environment: [name: value])
                Issue.record("\(name)=\(value) must be refused")
            } catch {
                #expect(error.description.contains(name))
            }
        }
    }

    @Test("every setting of the table: its flag follows its variable, its default reads back, a value outside its range or choices is refused with its name, and each choice is taken")
    func settingsTable() throws {
        let settings = GatewaySetting.all
        #expect(Set(settings.map(\.name)).count == settings.count && Set(settings.map(\.flag)).count == settings.count, "names and flags are unique")
        #expect(GatewaySetting.named("--lease-ttl")?.name == "PRESENCE_LEASE_TTL" && GatewaySetting.named("--redis-url")?.name == "PRESENCE_REDIS_URL")
        #expect(GatewaySetting.named("--max-devices-per-user") == nil, "a limit with no variable has no flag")
        for setting in settings {
            #expect(setting.name.hasPrefix("PRESENCE_") && setting.flag.hasPrefix("--") && !setting.help.isEmpty, "\(setting.name)")
            if let value = setting.defaultValue {
                let applied = try GatewayConfiguration(environment: [setting.name: value])
                #expect(setting.read(applied) == value && setting.read(GatewayConfiguration()) == value, "\(setting.name)'s default \(value) reads back")
            } else {
                #expect(setting.kind == .secret || setting.defaultText != nil, "\(setting.name) says its default in words, or is a secret")
            }
            var refused: [String] = []
            var taken: [(String, String)] = []
            switch setting.kind {
            case .text:
                taken = [("a-value", "a-value")]
            case .secret:
                taken = [("s3cret", "")]
                let empty = try GatewayConfiguration(environment: [setting.name: ""])
                #expect(setting.read(empty) == nil, "an empty \(setting.name) leaves it unset")
            case .integer(let range):
                refused = ["\(range.lowerBound - 1)", "\(range.upperBound + 1)", "ten", "1.5", ""]
                taken = [("\(range.lowerBound)", "\(range.lowerBound)"), ("\(range.upperBound)", "\(range.upperBound)")]
            case .choice(let names):
                refused = ["none-of-them", ""]
                taken = names.map { ($0, $0) } + names.map { ($0.uppercased(), $0) }
            }
            for value in refused {
                #expect(throws: GatewayConfigurationError.self, "\(setting.name)=\(value) is refused") { try GatewayConfiguration(environment: [setting.name: value]) }
                do {
                    _ = try GatewayConfiguration(environment: [setting.name: value])
                } catch {
                    #expect(error.description.contains("\(setting.name)="), "the refusal names the variable: \(error)")
                }
            }
            for (value, stored) in taken where setting.kind != .secret {
                #expect(setting.read(try GatewayConfiguration(environment: [setting.name: value])) == stored, "\(setting.name)=\(value) is taken as \(stored)")
            }
        }
        let schema = try #require(try JSONSerialization.jsonObject(with: Data(GatewaySetting.schema.utf8)) as? [String: [[String: Any]]])
        let entries = try #require(schema["settings"])
        #expect(entries.map { $0["name"] as? String } == settings.map(\.name))
        let lease = try #require(entries.first { $0["name"] as? String == "PRESENCE_LEASE_TTL" })
        #expect(lease["default"] as? Int == 10 && lease["minimum"] as? Int == 1 && lease["maximum"] as? Int == 3600 && lease["flag"] as? String == "--lease-ttl")
        let secret = try #require(entries.first { $0["name"] as? String == "PRESENCE_JWT_SECRET" })
        #expect(secret["type"] as? String == "secret" && secret["default"] is NSNull)
        let unknown = GatewaySetting.unknown(among: ["PRESENCE_LEASE_TLL", "PRESENCE_PORT", "PRESENCE_TEST_REDIS_URL", "HOME", "PRESENCE_WHATEVER"])
        #expect(unknown.map(\.name) == ["PRESENCE_LEASE_TLL", "PRESENCE_WHATEVER"] && unknown.map(\.meant) == ["PRESENCE_LEASE_TTL", nil],
                "a misspelt variable is named, with the setting it was likely meant to be: \(unknown)")
        #expect(GatewaySetting.distance("", "ab") == 2 && GatewaySetting.distance("kitten", "sitting") == 3 && GatewaySetting.distance("ab", "") == 2)
        let sessions = try #require(entries.first { $0["name"] as? String == "PRESENCE_MAX_SESSIONS" })
        #expect(sessions["default"] is NSNull && sessions["default_text"] as? String == "the open-file limit less 256")
    }

    /// The rows of each Markdown table in `file` (under the repository) whose first cell names
    /// `PRESENCE_*` variables: per variable, its default cell (backticks dropped) and its row.
    static func documentedSettings(_ file: String) throws -> [(name: String, default: String, row: String)] {
        var root = URL(fileURLWithPath: #filePath)
        for _ in 0..<3 { root.deleteLastPathComponent() }
        let text = try String(contentsOf: root.appendingPathComponent(file), encoding: .utf8)
        var found: [(name: String, default: String, row: String)] = []
        for row in text.split(separator: "\n") where row.hasPrefix("| `PRESENCE_") {
            let cells = row.split(separator: "|").map { $0.trimmingCharacters(in: .whitespaces) }
            let names = cells[0].split(separator: " / ").map { $0.replacingOccurrences(of: "`", with: "") }
            let defaults = cells[1].split(separator: " / ").map { $0.replacingOccurrences(of: "`", with: "") }
            for (index, name) in names.enumerated() {
                found.append((name, defaults.count == names.count ? defaults[index] : defaults.joined(separator: " / "), String(row)))
            }
        }
        return found
    }

    @Test("docs/configuration.md lists every setting once with its default and range, and docs/API.md names only settings there are, with their defaults")
    func documentedSettings() throws {
        let settings = Dictionary(uniqueKeysWithValues: GatewaySetting.all.map { ($0.name, $0) })
        let documented = try Self.documentedSettings("docs/configuration.md")
        #expect(documented.map(\.name).sorted() == settings.keys.sorted(), "docs/configuration.md's table has each setting once")
        for (name, written, row) in documented {
            guard let setting = settings[name] else { continue }
            let wanted = setting.defaultValue ?? setting.defaultText ?? "–"
            #expect(written == wanted, "docs/configuration.md gives \(name)'s default as \(written), the gateway \(wanted)")
            if case .integer(let range) = setting.kind {
                let spelled = { (value: Int) in [String(value), value.formatted(.number.grouping(.automatic).locale(Locale(identifier: "en_US")))] }
                let shown = spelled(range.lowerBound).contains { low in spelled(range.upperBound).contains { row.contains("\(low)–\($0)") } }
                #expect(shown, "docs/configuration.md gives \(name)'s range \(range.lowerBound)–\(range.upperBound)")
            }
        }
        for (name, written, _) in try Self.documentedSettings("docs/API.md") {
            let setting = settings[name]
            #expect(setting != nil, "docs/API.md names \(name), which the gateway does not read")
            if let value = setting?.defaultValue { #expect(written == value, "docs/API.md gives \(name)'s default as \(written), the gateway \(value)") }
        }
    }

    @Test("id formats: which strings and JSON values are ids, their stored spelling, and how they are written")
    func idFormats() throws {
        let numeric = PresenceIDFormat.numeric, string = PresenceIDFormat.string
        #expect(numeric.canonical("42") == "42" && numeric.canonical("007") == "7" && numeric.canonical("0") == "0")
        #expect(numeric.canonical(String(repeating: "9", count: 18)) == String(repeating: "9", count: 18))
        for bad in ["", "-1", "+1", "1.0", "1e3", "abc", " 1", String(repeating: "1", count: 19)] {
            #expect(numeric.canonical(bad) == nil, "\(bad.debugDescription) is not a numeric id")
        }
        #expect(string.canonical("alice@x") == "alice@x" && string.canonical("007") == "007" && string.canonical("a b") == nil)
        // JSON values as JSONSerialization gives them.
        let parsed = try JSONSerialization.jsonObject(with: Data(#"[1, "2", true, false, 1.5, -3, null, 0]"#.utf8)) as! [Any]
        #expect(parsed.map { numeric.canonical(json: $0) } == ["1", "2", nil, nil, nil, nil, nil, "0"])
        #expect(parsed.map { string.canonical(json: $0) } == [nil, "2", nil, nil, nil, nil, nil, nil], "numbers are ids only in the numeric format")
        #expect(numeric.json("42") as? Int64 == 42 && numeric.json("alice") as? String == "alice", "a stored id that is not a number stays a string")
        #expect(string.json("42") as? String == "42")
    }

    @Test("a missing or short secret and a bad Redis URL fail validation with a clear message")
    func validation() throws {
        #expect(throws: GatewayConfigurationError.self) { try GatewayConfiguration().validate() }
        var short = GatewayConfiguration()
        short.jwtSecret = "short"
        #expect(Self.refusal(short, "a short secret").contains("32 bytes"))
        var badURL = GatewayConfiguration()
        badURL.jwtSecret = String(repeating: "s", count: 32)
        badURL.redisURL = "http://redis"
        #expect(throws: GatewayConfigurationError.self) { try badURL.validate() }
        var sentinel = badURL
        sentinel.redisURL = "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/mymaster/0"
        try sentinel.validate()
        var cluster = badURL
        cluster.redisURL = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"
        try cluster.validate()
        cluster.redisURL = "redis+cluster://127.0.0.1:7000/1"
        #expect(Self.refusal(cluster, "a cluster database other than 0").contains("PRESENCE_REDIS_URL"))

        // Pub/sub: either kind on one server or through Sentinel, sharded only on a cluster.
        var sharded = try GatewayConfiguration(environment: ["PRESENCE_REDIS_PUBSUB": "sharded"])
        sharded.jwtSecret = String(repeating: "s", count: 32)
        #expect(try sharded.redisConfiguration().pubSub == .sharded)
        sharded.redisURL = sentinel.redisURL
        #expect(try sharded.redisConfiguration().pubSub == .sharded)
        var classic = sharded
        classic.redisPubSub = nil
        #expect(try classic.redisConfiguration().pubSub == .classic, "classic by default on one server")
        classic.redisURL = "redis+cluster://127.0.0.1:7000"
        #expect(try classic.redisConfiguration().pubSub == .sharded, "sharded by default on a cluster")
        classic.redisPubSub = "classic"
        let classicOnCluster = Self.refusal(classic, "classic pub/sub on a cluster")
        #expect(classicOnCluster.contains("PRESENCE_REDIS_PUBSUB=classic") && classicOnCluster.contains("sharded pub/sub only"), "\(classicOnCluster)")
        sharded.redisPubSub = "broadcast"
        let unknown = Self.refusal(sharded, "an unknown pub/sub")
        #expect(unknown.contains("PRESENCE_REDIS_PUBSUB=broadcast") && unknown.contains("'classic' or 'sharded'"), "\(unknown)")
    }

    /// The message `configuration` is refused with; an issue, and "", when it passes.
    private static func refusal(_ configuration: GatewayConfiguration, _ what: String) -> String {
        do {
            try configuration.validate()
            Issue.record("\(what) must be refused")
            return ""
        } catch {
            return error.description
        }
    }

    /// Both a secret and a public key: each token is checked with the key of its own algorithm.
    /// Fails with one key collection for both (the public key replaced the secret as its default
    /// signer, and every HS256 token was refused as "signature is not valid").
    @Test("with both a secret and a public key, HS256 and ES256 tokens both verify, each only with its own key")
    func secretAndPublicKey() async throws {
        let key = ES256PrivateKey()
        var configuration = GatewayConfiguration()
        configuration.jwtSecret = Self.secret
        configuration.jwtPublicKey = key.publicKey.pemRepresentation
        let authenticator = try await Authenticator(configuration: configuration)
        let hs = try await Self.hs256("alice")
        #expect(try await authenticator.authenticate(token: hs).userID == "alice")
        let signer = JWTKeyCollection()
        await signer.add(ecdsa: key)
        let es = try await signer.sign(ClientClaims(sub: .string("bob"), exp: .init(value: .distantFuture), nbf: nil))
        #expect(try await authenticator.authenticate(token: es).userID == "bob")
        // A token signed with another secret, or by another EC key, is still refused.
        let otherSecret = JWTKeyCollection()
        await otherSecret.add(hmac: HMACKey(from: String(repeating: "x", count: 40)), digestAlgorithm: .sha256)
        let forgedHS = try await otherSecret.sign(ClientClaims(sub: .string("alice"), exp: .init(value: .distantFuture), nbf: nil))
        await #expect(throws: APIError.self) { try await authenticator.authenticate(token: forgedHS) }
        let otherKey = JWTKeyCollection()
        await otherKey.add(ecdsa: ES256PrivateKey())
        let forgedES = try await otherKey.sign(ClientClaims(sub: .string("bob"), exp: .init(value: .distantFuture), nbf: nil))
        await #expect(throws: APIError.self) { try await authenticator.authenticate(token: forgedES) }
    }

    @Test("ES256 tokens verify against a configured public key; HS256 ones do not")
    func publicKey() async throws {
        let key = ES256PrivateKey()
        var configuration = GatewayConfiguration()
        configuration.jwtPublicKey = key.publicKey.pemRepresentation
        let authenticator = try await Authenticator(configuration: configuration)
        let signer = JWTKeyCollection()
        await signer.add(ecdsa: key)
        let good = try await signer.sign(ClientClaims(sub: .string("alice"), exp: .init(value: .distantFuture), nbf: nil))
        #expect(try await authenticator.authenticate(token: good).userID == "alice")
        let hs = try await Self.hs256("alice")
        await #expect(throws: APIError.self) { try await authenticator.authenticate(token: hs) }
        let notYet = try await signer.sign(ClientClaims(sub: .string("alice"), exp: .init(value: .distantFuture), nbf: .init(value: .distantFuture)))
        await #expect(throws: APIError.self) { try await authenticator.authenticate(token: notYet) }
    }
}
