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
    private let keys: JWTKeyCollection
    /// The `alg` values a token's header may name: those of the configured keys.
    private let algorithms: Set<String>
    private let adminToken: String?
    /// Which `sub` values are user ids.
    private let idFormat: PresenceIDFormat
    /// Tokens longer than this are refused before parsing.
    static let maxTokenLength = 8 * 1024

    /// Makes an authenticator from the configuration's secret or public key.
    public init(configuration: GatewayConfiguration) async throws(GatewayConfigurationError) {
        let keys = JWTKeyCollection()
        var algorithms: Set<String> = []
        if let secret = configuration.jwtSecret {
            await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
            algorithms.insert("HS256")
        }
        if let pem = configuration.jwtPublicKey {
            if let rsa = try? Insecure.RSA.PublicKey(pem: pem) {
                await keys.add(rsa: rsa, digestAlgorithm: .sha256)
                algorithms.insert("RS256")
            } else if let ecdsa = try? ES256PublicKey(pem: pem) {
                await keys.add(ecdsa: ecdsa)
                algorithms.insert("ES256")
            } else {
                throw GatewayConfigurationError("PRESENCE_JWT_PUBLIC_KEY is neither an RSA (2048 bits or more) nor a P-256 public key in PEM form")
            }
        }
        self.keys = keys
        self.algorithms = algorithms
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
        guard algorithms.contains(algorithm) else {
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

    /// The `alg` of a compact JWT's header, or nil when the header cannot be read.
    static func headerAlgorithm(_ token: String) -> String? {
        guard let header = token.split(separator: ".", omittingEmptySubsequences: false).first else { return nil }
        var base64 = header.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        base64 += String(repeating: "=", count: (4 - base64.count % 4) % 4)
        guard let data = Data(base64Encoded: base64),
              let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any] else { return nil }
        return object["alg"] as? String
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
