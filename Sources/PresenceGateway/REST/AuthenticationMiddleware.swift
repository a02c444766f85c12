import Hummingbird

/// Lets a request through to the routes of its group only with a valid client token in
/// `Authorization: Bearer …`, and puts the user it stands for on the context
/// (``GatewayRequestContext/user``); 401 otherwise. Runs only for a route of its group that
/// matched, so an unknown path is still a 404 to anyone.
struct UserAuthenticationMiddleware: RouterMiddleware {
    let authenticator: Authenticator

    func handle(_ request: Request, context: GatewayRequestContext, next: (Request, GatewayRequestContext) async throws -> Response) async throws -> Response {
        var context = context
        context.identity = try await authenticator.authenticate(token: Authenticator.bearer(request.headers[.authorization]))
        return try await next(request, context)
    }
}

/// Lets a request through to the admin routes only with the admin token in
/// `Authorization: Bearer …`; 401 otherwise. (With no admin token configured the admin routes are
/// not added at all, so their paths are 404 under any method.)
struct AdminAuthenticationMiddleware: RouterMiddleware {
    let authenticator: Authenticator

    func handle(_ request: Request, context: GatewayRequestContext, next: (Request, GatewayRequestContext) async throws -> Response) async throws -> Response {
        guard authenticator.isAdmin(token: Authenticator.bearer(request.headers[.authorization])) else {
            throw APIError.unauthorized("the admin token is missing or wrong")
        }
        return try await next(request, context)
    }
}

extension GatewayRequestContext {
    /// The user the request's token stands for, in a route behind ``UserAuthenticationMiddleware``.
    var user: AuthenticatedUser {
        get throws(APIError) {
            guard let identity else { throw .unauthorized("a bearer token is required") }
            return identity
        }
    }
}
