import Hummingbird
import PresenceProtocol

/// The request context of every route: Hummingbird's, plus the node's REST body coder and, behind
/// the authentication middleware, the user.
public struct GatewayRequestContext: RequestContext {
    public var coreContext: CoreRequestContextStorage
    /// How bodies are read and written: set for every request by ``RESTCodingMiddleware``.
    var bodies = FrameCoder(snakeCaseKeys: true)

    /// The limit on a request body: set for every request by ``RESTCodingMiddleware``, from
    /// the largest message (see ``GatewayConfiguration/maxBodySize``).
    var maxBody = 128 * 1024
    public var maxUploadSize: Int { maxBody }
    public var requestDecoder: RESTRequestDecoder { RESTRequestDecoder(coder: bodies) }
    public var responseEncoder: RESTResponseEncoder { RESTResponseEncoder(coder: bodies) }

    /// The user the bearer token stands for: set by ``UserAuthenticationMiddleware`` for the
    /// routes behind it, read through ``user``.
    var identity: AuthenticatedUser?

    public init(source: ApplicationRequestContextSource) {
        self.coreContext = .init(source: source)
    }
}
