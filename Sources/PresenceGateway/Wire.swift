import Foundation
import PresenceEngine

/// JSON shapes of API.md, built in one place.
enum Wire {
    /// `2026-11-21T12:00:00.123Z` for milliseconds since 1970.
    static func timestamp(_ milliseconds: Int64?) -> Any {
        milliseconds.map { PresenceTimestamp.iso8601($0) } ?? NSNull()
    }

    /// `{"user_id","status","last_seen"}` plus `is_typing` when given.
    static func presence(_ presence: Presence, isTyping: Bool? = nil) -> [String: Any] {
        var object: [String: Any] = ["user_id": presence.userID, "status": presence.status.rawValue, "last_seen": timestamp(presence.lastSeen)]
        if let isTyping { object["is_typing"] = isTyping }
        return object
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
