import Hummingbird
import RedisClient

/// Gives every request's Redis commands one deadline, so that REST answers 503 within a second
/// while Redis cannot be reached. On one server the client already fails fast (a short wait for
/// a connection, a stalled one dropped after 750 ms); on a Redis Cluster a command whose node
/// cannot be reached is retried for seconds, to ride out a failover, and the request would wait
/// that long without it.
struct StoreDeadlineMiddleware<Context: RequestContext>: RouterMiddleware {
    /// How long a request's commands may be retried in all.
    static var deadline: Duration { .milliseconds(800) }

    func handle(_ request: Request, context: Context, next: (Request, Context) async throws -> Response) async throws -> Response {
        try await RedisCommandDeadline.$current.withValue(.now + Self.deadline) {
            try await next(request, context)
        }
    }
}
