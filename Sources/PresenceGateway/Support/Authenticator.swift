import Foundation
import JWTKit
import PresenceEngine
import PresenceProtocol

/// The claims a client token must carry: `sub` (the user id) and `exp`; `nbf` is honoured.
struct ClientClaims: JWTPayload {
    /// A string, or a whole number (issuers of integer user ids write it so).
    var sub: JSONID
    var exp: ExpirationClaim
    var nbf: NotBeforeClaim?

    func verify(using algorithm: some JWTAlgorithm) async throws {
        try exp.verifyNotExpired()
        try nbf?.verifyNotBefore()
    }
}

/// A verified client identity.
public struct AuthenticatedUser: Sendable {
    /// The user id from `sub`.
    public var userID: String
    /// When the token expires.
    public var expiresAt: Date
}

/// Verifies client JWTs (HS256 secret, or an RS256/ES256 public key) and the admin token.
public struct Authenticator: Sendable {
    /// One key collection per `alg` a token's header may name (those of the configured keys). A
    /// collection has one default signer, which a token without a `kid` is checked with: with a
    /// secret and a public key in one collection, the second replaced the first, and every token
    /// of the other algorithm was refused.
    private let keysByAlgorithm: [String: JWTKeyCollection]
    private var algorithms: Set<String> { Set(keysByAlgorithm.keys) }
    private let adminToken: String?
    /// Which `sub` values are user ids.
    private let idFormat: PresenceIDFormat
    /// Tokens longer than this are refused before parsing.
    static let maxTokenLength = 8 * 1024

    /// Makes an authenticator from the configuration's secret or public key.
    public init(configuration: GatewayConfiguration) async throws(GatewayConfigurationError) {
        var keysByAlgorithm: [String: JWTKeyCollection] = [:]
        if let secret = configuration.jwtSecret {
            keysByAlgorithm["HS256"] = await JWTKeyCollection().add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
        }
        if let pem = configuration.jwtPublicKey {
            if let rsa = try? Insecure.RSA.PublicKey(pem: pem) {
                keysByAlgorithm["RS256"] = await JWTKeyCollection().add(rsa: rsa, digestAlgorithm: .sha256)
            } else if let ecdsa = try? ES256PublicKey(pem: pem) {
                keysByAlgorithm["ES256"] = await JWTKeyCollection().add(ecdsa: ecdsa)
            } else {
                throw GatewayConfigurationError("PRESENCE_JWT_PUBLIC_KEY is neither an RSA (2048 bits or more) nor a P-256 public key in PEM form")
            }
        }
        self.keysByAlgorithm = keysByAlgorithm
        self.adminToken = configuration.adminToken
        self.idFormat = configuration.idFormat
    }

    /// The user a bearer token stands for; throws ``APIError`` `unauthorized` for anything else.
    public func authenticate(token: String?) async throws(APIError) -> AuthenticatedUser {
        guard let token, !token.isEmpty else { throw .unauthorized("a bearer token is required") }
        guard token.utf8.count <= Self.maxTokenLength else { throw .unauthorized("the token is too long") }
        // The key decides how a signature is checked; a header that names another algorithm
        // (`none`, or HS256 against an RSA key) is refused before that, whatever it carries.
        guard let algorithm = Self.headerAlgorithm(token) else { throw .unauthorized("the token is malformed or its signature is not valid") }
        guard let keys = keysByAlgorithm[algorithm] else {
            throw .unauthorized("the token's algorithm '\(algorithm.prefix(16))' is not accepted; this node takes \(algorithms.sorted().joined(separator: ", "))")
        }
        let claims: ClientClaims
        do {
            claims = try await keys.verify(token, as: ClientClaims.self)
        } catch let error as JWTError where error.errorType == .claimVerificationFailure {
            throw .unauthorized("the token has expired or is not valid yet")
        } catch {
            throw .unauthorized("the token is malformed or its signature is not valid")
        }
        guard let userID = claims.sub.canonical(idFormat) else {
            throw .unauthorized("the token's sub is not a valid user id: it must be \(idFormat.rule)")
        }
        return AuthenticatedUser(userID: userID, expiresAt: claims.exp.value)
    }

    /// The part of a token's header read before its signature is checked.
    private struct Header: Decodable {
        var alg: String
    }

    /// The `alg` of a compact JWT's header, or nil when the header cannot be read.
    static func headerAlgorithm(_ token: String) -> String? {
        guard let header = token.split(separator: ".", omittingEmptySubsequences: false).first else { return nil }
        var base64 = header.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        base64 += String(repeating: "=", count: (4 - base64.count % 4) % 4)
        guard let data = Data(base64Encoded: base64) else { return nil }
        return (try? JSONDecoder().decode(Header.self, from: data))?.alg
    }

    /// Whether admin routes are on.
    public var adminEnabled: Bool { adminToken != nil }

    /// Checks the admin bearer token in constant time.
    public func isAdmin(token: String?) -> Bool {
        guard let expected = adminToken, let token else { return false }
        let a = Array(expected.utf8), b = Array(token.utf8)
        guard a.count == b.count else { return false }
        return zip(a, b).reduce(UInt8(0)) { $0 | ($1.0 ^ $1.1) } == 0
    }

    /// The token of an `Authorization: Bearer` header value.
    static func bearer(_ header: String?) -> String? {
        guard let header, header.count > 7, header.prefix(7).lowercased() == "bearer " else { return nil }
        return String(header.dropFirst(7)).trimmingCharacters(in: .whitespaces)
    }
}
