import Foundation
import Hummingbird
import NIOCore
import PresenceProtocol

/// REST bodies go through Hummingbird's Codable path: a route reads its body with
/// `request.decode(as:context:)` and returns a ``ResponseEncodable`` value. These are the two
/// ends of that path, configured as docs/API.md wants: keys in snake case both ways, ids in the node's
/// format, request bodies of at most 64 KiB, and a 422 that says what was wrong.
public struct RESTRequestDecoder: RequestDecoder {
    let coder: FrameCoder

    public func decode<Value: Decodable>(_ type: Value.Type, from request: Request, context: some RequestContext) async throws -> Value {
        let buffer: ByteBuffer
        do {
            buffer = try await request.body.collect(upTo: context.maxUploadSize)
        } catch {
            throw APIError(.payloadTooLarge, "the body must be JSON of at most \(context.maxUploadSize / 1024) KiB")
        }
        do {
            return try coder.decode(type, from: Data(buffer.readableBytesView))
        } catch {
            throw APIError.invalid("the body is not the JSON this route expects: \(Self.describe(error))")
        }
    }

    private static func describe(_ error: any Error) -> String {
        switch error {
        case DecodingError.keyNotFound(let key, _): return "missing field '\(snakeCase(key.stringValue))'"
        case DecodingError.typeMismatch(_, let context): return "wrong type for '\(path(context))'"
        case DecodingError.valueNotFound(_, let context): return "null for '\(path(context))'"
        default: return "not valid JSON"
        }
    }

    private static func path(_ context: DecodingError.Context) -> String {
        context.codingPath.map { snakeCase($0.stringValue) }.joined(separator: ".")
    }

    /// A key as the client wrote it: the decoder names keys by their Swift spelling
    /// (`deviceId`), the client knows `device_id`. Array indexes (`Index 3`) stay as they are.
    private static func snakeCase(_ key: String) -> String {
        guard !key.contains(" ") else { return key }
        return key.reduce(into: "") { name, character in
            if character.isUppercase { name += "_" + character.lowercased() } else { name.append(character) }
        }
    }
}

/// Writes a route's value as a 200 JSON answer.
public struct RESTResponseEncoder: ResponseEncoder {
    let coder: FrameCoder

    public func encode(_ value: some Encodable, from request: Request, context: some RequestContext) throws -> Response {
        Response(
            status: .ok,
            headers: [.contentType: "application/json; charset=utf-8"],
            body: .init(byteBuffer: ByteBuffer(bytes: coder.data(value)))
        )
    }
}

/// Gives every request the node's body coder (its id format lives in the node's configuration,
/// which a request context cannot reach when Hummingbird creates it).
struct RESTCodingMiddleware: RouterMiddleware {
    let coder: FrameCoder
    let maxBody: Int

    func handle(_ request: Request, context: GatewayRequestContext, next: (Request, GatewayRequestContext) async throws -> Response) async throws -> Response {
        var context = context
        context.bodies = coder
        context.maxBody = maxBody
        return try await next(request, context)
    }
}

/// A presence, or a list of them, is the answer of most user routes.
extension PresencePayload: ResponseEncodable {}
extension MessagePayload: ResponseEncodable {}
extension HistoryPayload: ResponseEncodable {}
extension ReceiptPayload: ResponseEncodable {}
extension ConversationEntryPayload: ResponseEncodable {}
