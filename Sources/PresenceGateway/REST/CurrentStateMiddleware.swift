import Hummingbird
import PresenceEngine

/// Answers reads of presence with 503 while this node knows Redis may hold a stale view of its
/// own users: its lease lapsed (a partition longer than the lease, reapers took its devices
/// offline) and it has not yet written its sessions again. Without it, a node answered "offline"
/// for a user connected to it for the moment between Redis coming back and its re-registration.
struct CurrentStateMiddleware<Context: RequestContext>: RouterMiddleware {
    let engine: PresenceEngine

    /// The paths whose GETs read presence.
    static var reads: [String] { ["/api/presence/users", "/api/conversations/", "/api/admin/users/", "/api/admin/overview"] }

    func handle(_ request: Request, context: Context, next: (Request, Context) async throws -> Response) async throws -> Response {
        if request.method == .get, !engine.holdsCurrentState, Self.reads.contains(where: { request.uri.path.hasPrefix($0) }) {
            throw APIError.unavailable("this node is catching up with the presence store; try again shortly")
        }
        return try await next(request, context)
    }
}
