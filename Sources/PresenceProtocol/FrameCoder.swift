import Foundation

/// Turns frames into the JSON text of a WebSocket message and back, with ids in one
/// ``PresenceIDFormat``. Keys are sorted, so equal frames are equal text.
public struct FrameCoder: Sendable {
    /// How user and conversation ids are written.
    public let ids: PresenceIDFormat
    /// Whether keys are written and read in the API's snake case by the coders' strategy (REST
    /// bodies); frames name their keys so themselves.
    private let snakeCaseKeys: Bool
    private let encoder: JSONEncoder
    private let decoder: JSONDecoder

    /// A coder writing ids in `ids`. With `snakeCaseKeys`, keys are written and read in the
    /// API's style (`leaseExpiresAt` as `lease_expires_at`).
    public init(ids: PresenceIDFormat = .string, snakeCaseKeys: Bool = false) {
        self.ids = ids
        self.snakeCaseKeys = snakeCaseKeys
        encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
        if snakeCaseKeys { encoder.keyEncodingStrategy = .convertToSnakeCase }
        encoder.userInfo[.presenceIDFormat] = ids
        decoder = JSONDecoder()
        if snakeCaseKeys { decoder.keyDecodingStrategy = .convertFromSnakeCase }
        decoder.userInfo[.presenceIDFormat] = ids
    }

    /// The JSON text of any frame or body.
    public func text(_ value: some Encodable) -> String {
        String(decoding: data(value), as: UTF8.self)
    }

    /// The JSON bytes of any frame or body.
    public func data(_ value: some Encodable) -> Data {
        // Every value here encodes: strings, numbers, booleans and null.
        (try? encoder.encode(value)) ?? Data("{}".utf8)
    }

    /// Any body from its JSON bytes.
    public func decode<Value: Decodable>(_ type: Value.Type, from data: Data) throws -> Value {
        try decoder.decode(type, from: data)
    }

    /// The text of a server frame.
    public func text(_ frame: ServerFrame, id: String? = nil) -> String {
        String(decoding: bytes(frame, id: id), as: UTF8.self)
    }

    /// The JSON bytes of a server frame: the frames of the hot paths written directly, the
    /// same bytes as `JSONEncoder`'s (see DirectFrames.swift), the rest through it.
    public func bytes(_ frame: ServerFrame, id: String? = nil) -> [UInt8] {
        let message = ServerMessage(frame, id: id)
        if !snakeCaseKeys, let direct = message.directJSON(ids: ids) { return direct }
        return Array(data(message))
    }

    /// A server frame from its text.
    public func serverMessage(_ text: String) throws -> ServerMessage {
        try decoder.decode(ServerMessage.self, from: Data(text.utf8))
    }

    /// A client frame as the gateway takes it (see ``ClientMessage/init(from:)``); anything
    /// that is not JSON is ``FrameError`` too.
    public func clientMessage(_ text: String) throws(FrameError) -> ClientMessage {
        if !snakeCaseKeys, let message = ClientMessage.direct(text.utf8, ids: ids) { return message }
        do {
            return try decoder.decode(ClientMessage.self, from: Data(text.utf8))
        } catch let error as FrameError {
            throw error
        } catch {
            throw FrameError(ClientMessage.notAnObject)
        }
    }
}
