/// The `code` of an error answer, in a REST body (`{"error": {"code", "message"}}`) or an `error`
/// frame, with the HTTP status REST answers it with.
public enum ErrorCode: String, Sendable, Hashable, Codable, CaseIterable {
    case unauthorized
    case forbidden
    case notFound = "not_found"
    case payloadTooLarge = "payload_too_large"
    case methodNotAllowed = "method_not_allowed"
    case invalidRequest = "invalid_request"
    case rateLimited = "rate_limited"
    case unavailable
    case `internal`

    /// The HTTP status of this error in REST.
    public var httpStatus: Int {
        switch self {
        case .unauthorized: 401
        case .forbidden: 403
        case .notFound: 404
        case .payloadTooLarge: 413
        case .methodNotAllowed: 405
        case .invalidRequest: 422
        case .rateLimited: 429
        case .unavailable: 503
        case .internal: 500
        }
    }

    /// A code from a newer peer that this version does not know reads as `internal`, so that a
    /// client still sees the error and its message.
    public init(from decoder: any Decoder) throws {
        let raw = try decoder.singleValueContainer().decode(String.self)
        self = ErrorCode(rawValue: raw) ?? .internal
    }
}
