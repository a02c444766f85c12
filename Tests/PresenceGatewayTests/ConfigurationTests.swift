import Foundation
import JWTKit
import PresenceEngine
import Testing

@testable import PresenceGateway

@Suite("Gateway configuration and authentication")
struct ConfigurationTests {
    @Test("environment values are read, and bad ones are refused with the variable's name")
    func environment() throws {
        let configuration = try GatewayConfiguration(environment: [
            "PRESENCE_PORT": "9000", "PRESENCE_LEASE_TTL": "20", "PRESENCE_VISIBILITY": "open",
            "PRESENCE_JWT_SECRET": String(repeating: "s", count: 32), "PRESENCE_LOG_LEVEL": "debug",
            "PRESENCE_MAX_SESSIONS": "5000",
        ])
        #expect(configuration.port == 9000 && configuration.leaseTTL == 20 && configuration.visibility == .open)
        #expect(configuration.maxSessions == 5000)
        try configuration.validate()
        for (name, value) in [("PRESENCE_PORT", "http"), ("PRESENCE_LEASE_TTL", "0"), ("PRESENCE_VISIBILITY", "all"), ("PRESENCE_LOG_LEVEL", "loud"), ("PRESENCE_MAX_SESSIONS", "0")] {
            do {
                _ = try GatewayConfiguration(environment: [name: value])
                Issue.record("\(name)=\(value) must be refused")
            } catch {
                #expect(error.description.contains(name))
            }
        }
    }

    @Test("a missing or short secret and a bad Redis URL fail validation with a clear message")
    func validation() throws {
        #expect(throws: GatewayConfigurationError.self) { try GatewayConfiguration().validate() }
        var short = GatewayConfiguration()
        short.jwtSecret = "short"
        do {
            try short.validate()
            Issue.record("a short secret must be refused")
        } catch {
            #expect(error.description.contains("32 bytes"))
        }
        var badURL = GatewayConfiguration()
        badURL.jwtSecret = String(repeating: "s", count: 32)
        badURL.redisURL = "http://redis"
        #expect(throws: GatewayConfigurationError.self) { try badURL.validate() }
    }

    @Test("ES256 tokens verify against a configured public key; HS256 ones do not")
    func publicKey() async throws {
        let key = ES256PrivateKey()
        var configuration = GatewayConfiguration()
        configuration.jwtPublicKey = key.publicKey.pemRepresentation
        let authenticator = try await Authenticator(configuration: configuration)
        let signer = JWTKeyCollection()
        await signer.add(ecdsa: key)
        let good = try await signer.sign(ClientClaims(sub: .init(value: "alice"), exp: .init(value: .distantFuture), nbf: nil))
        #expect(try await authenticator.authenticate(token: good).userID == "alice")
        let hs = try await token("alice")
        await #expect(throws: APIError.self) { try await authenticator.authenticate(token: hs) }
        let notYet = try await signer.sign(ClientClaims(sub: .init(value: "alice"), exp: .init(value: .distantFuture), nbf: .init(value: .distantFuture)))
        await #expect(throws: APIError.self) { try await authenticator.authenticate(token: notYet) }
    }
}
