import Foundation
import PresenceEngine

/// JSON shapes of API.md, built in one place. An instance writes user and conversation ids in
/// the node's ``PresenceIDFormat``; the static parts carry no ids.
struct Wire: Sendable {
    /// How ids are written.
    let ids: PresenceIDFormat

    /// The JSON value of a user or conversation id.
    func id(_ id: String) -> Any { ids.json(id) }

    /// `{"user_id","status","last_seen"}` plus `is_typing` when given.
    func presence(_ presence: Presence, isTyping: Bool? = nil) -> [String: Any] {
        var object: [String: Any] = ["user_id": id(presence.userID), "status": presence.status.rawValue, "last_seen": Self.timestamp(presence.lastSeen)]
        if let isTyping { object["is_typing"] = isTyping }
        return object
    }

    /// An `initial_state` frame.
    func initialState(_ presences: [Presence], id frameID: String? = nil) -> String {
        Self.frame("initial_state", ["presences": presences.map { presence($0) }], id: frameID)
    }

    /// A `presence_update` frame.
    func presenceUpdate(_ update: Presence) -> String {
        Self.frame("presence_update", presence(update))
    }

    /// A `typing_update` frame.
    func typingUpdate(user: String, conversation: String, isTyping: Bool) -> String {
        Self.frame("typing_update", ["user_id": id(user), "conversation_id": id(conversation), "is_typing": isTyping])
    }

    /// A `group_presence` frame.
    func groupPresence(_ conversation: String, total: Int, online: Int, away: Int, id frameID: String?) -> String {
        Self.frame("group_presence", ["conversation_id": id(conversation), "total": total, "online": online, "away": away], id: frameID)
    }

    /// `2026-11-21T12:00:00.123Z` for milliseconds since 1970.
    static func timestamp(_ milliseconds: Int64?) -> Any {
        milliseconds.map { PresenceTimestamp.iso8601($0) } ?? NSNull()
    }

    /// Serialized JSON text for a JSON-compatible value.
    static func json(_ value: Any) -> String {
        guard let data = try? JSONSerialization.data(withJSONObject: value, options: [.sortedKeys, .withoutEscapingSlashes]) else { return "{}" }
        return String(decoding: data, as: UTF8.self)
    }

    /// A WebSocket frame `{"type","data","id"?}`.
    static func frame(_ type: String, _ data: [String: Any], id: String? = nil) -> String {
        var object: [String: Any] = ["type": type, "data": data]
        if let id { object["id"] = id }
        return json(object)
    }

    /// An `error` frame.
    static func error(_ error: APIError, id: String?) -> String {
        frame("error", ["code": error.code, "message": error.message], id: id)
    }
}
