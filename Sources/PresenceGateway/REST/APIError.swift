import Logging
import Foundation
import HTTPTypes
import Hummingbird
import PresenceEngine
import PresenceProtocol

/// An error answer of docs/API.md: `{"error": {"code", "message"}}` with its HTTP status.
public struct APIError: Error, HTTPResponseError, Sendable {
    /// What kind of error; it decides the HTTP status.
    public let code: ErrorCode
    /// Human readable text.
    public let message: String
    /// Seconds to wait, for `rate_limited`.
    public var retryAfter: Int?
    /// The methods the path takes, for `method_not_allowed`.
    public var allow: [String]?
    /// Whether a WebSocket frame that caused it counts towards the bad-frame limit.
    var isBadFrame = true

    /// The HTTP status for REST.
    public var status: HTTPResponse.Status { .init(code: code.httpStatus) }

    /// The body of an `error` frame, and the `error` of a REST error body.
    public var payload: ErrorPayload { ErrorPayload(code: code, message: message) }

    public static func unauthorized(_ message: String = "a valid bearer token is required") -> APIError { .init(.unauthorized, message) }
    public static func forbidden(_ message: String) -> APIError { .init(.forbidden, message) }
    public static func notFound(_ message: String) -> APIError { .init(.notFound, message) }
    public static func invalid(_ message: String) -> APIError { .init(.invalidRequest, message) }
    public static func rateLimited(_ message: String, retryAfter: Int) -> APIError {
        .init(.rateLimited, message, retryAfter: retryAfter)
    }
    public static func unavailable(_ message: String = "the presence store is unreachable; try again shortly") -> APIError {
        .init(.unavailable, message)
    }
    /// A path served under other methods only; `allow` lists them for the `Allow` header.
    public static func methodNotAllowed(allow: [String]) -> APIError {
        var error = APIError(.methodNotAllowed, "this path takes \(allow.joined(separator: ", ")) only")
        error.allow = allow
        return error
    }
    public static func `internal`(_ message: String = "internal error") -> APIError { .init(.internal, message) }

    init(_ code: ErrorCode, _ message: String, retryAfter: Int? = nil) {
        self.code = code
        self.message = message
        self.retryAfter = retryAfter
    }

    /// Maps any error to the answer a client gets; unknown errors become `internal`.
    public static func from(_ error: any Error) -> APIError {
        switch error {
        case let error as APIError:
            return error
        case let error as PresenceError:
            switch error.code {
            case .unavailable: return .unavailable()
            case .invalidRequest: return .invalid(error.message)
            case .limitReached: return .rateLimited(error.message, retryAfter: 60)
            case .forbidden: return .forbidden(error.message)
            case .notFound: return .notFound(error.message)
            case .payloadTooLarge: return .init(.payloadTooLarge, error.message)
            case .internal: return .internal()
            }
        case let error as HTTPError where error.status == .notFound:
            return .notFound("no such route")
        case let error as HTTPError where error.status == .unauthorized:
            return .unauthorized()
        case let error as HTTPError where error.status.code < 500:
            return .invalid(error.body ?? "the request is not valid")
        case let error as FrameError:
            return .invalid(error.message)
        case is DecodingError:
            return .invalid("the body is not the JSON this route expects")
        default:
            return .internal()
        }
    }

    /// The JSON body.
    struct Body: Encodable { var error: ErrorPayload }

    /// Writes error bodies (they carry no ids); made once, not per answer.
    private static let bodies = FrameCoder()

    public func response(from request: Request, context: some RequestContext) throws -> Response {
        var headers: HTTPFields = [.contentType: "application/json; charset=utf-8"]
        if let retryAfter { headers[.retryAfter] = String(retryAfter) }
        if let allow { headers[.allow] = allow.joined(separator: ", ") }
        let data = Self.bodies.data(Body(error: payload))
        return Response(status: status, headers: headers, body: .init(byteBuffer: ByteBuffer(bytes: data)))
    }
}

/// Turns every error a route throws into docs/API.md's error body, so no route can answer otherwise.
struct APIErrorMiddleware<Context: RequestContext>: RouterMiddleware {
    func handle(_ request: Request, context: Context, next: (Request, Context) async throws -> Response) async throws -> Response {
        do {
            return try await next(request, context)
        } catch {
            let apiError = APIError.from(error)
            if apiError.code == .internal {
                context.logger.error("request failed", metadata: ["error": "\(error)"])
            }
            GatewayMetrics.errors(apiError.code.rawValue)
            throw apiError
        }
    }
}

/// Answers 405 with `Allow` for a path that is served, but under other methods: a 404 there would
/// say the path does not exist. Added after every route, so it sees only what no route took.
struct MethodNotAllowedMiddleware<Context: RequestContext>: RouterMiddleware {
    /// The path of each route, and the methods it is served under.
    let routes: [(path: RouterPath, methods: [String])]

    /// From the router's routes.
    init(routes: [Router<Context>.RouteDescription]) {
        var methods: [String: (path: RouterPath, methods: [String])] = [:]
        for route in routes {
            methods[route.path.description, default: (route.path, [])].methods.append(route.method.rawValue)
        }
        self.routes = methods.values.map { ($0.path, $0.methods.sorted()) }
    }

    func handle(_ request: Request, context: Context, next: (Request, Context) async throws -> Response) async throws -> Response {
        do {
            return try await next(request, context)
        } catch let error as HTTPError where error.status == .notFound {
            let segments = request.uri.path.split(separator: "/")
            let allowed = routes.filter { route in
                route.path.components.count == segments.count && zip(route.path.components, segments).allSatisfy { $0 ~= $1 }
            }
            guard !allowed.isEmpty else { throw error }
            throw APIError.methodNotAllowed(allow: Array(Set(allowed.flatMap(\.methods))).sorted())
        }
    }
}
