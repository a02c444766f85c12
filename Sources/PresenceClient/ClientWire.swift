import Foundation

/// A frame from the gateway, decoded.
enum ServerFrame: Sendable, Equatable {
    case initialState([PresenceSnapshot], id: String?)
    case presenceUpdate(PresenceSnapshot)
    case typingUpdate(userID: String, conversationID: String, isTyping: Bool)
    case groupPresence(GroupPresence, id: String?)
    case ack(id: String?)
    case pong(id: String?)
    case error(code: String, message: String, id: String?)
    /// A type this version does not know; newer gateways may send more.
    case unknown(type: String)
}

/// The JSON of the gateway's WebSocket protocol, client side.
enum ClientWire {
    /// A client frame: `{"type", "data", "id"?}`.
    static func frame(_ type: String, _ data: [String: any Sendable], id: String?) -> String {
        var object: [String: Any] = ["type": type, "data": data]
        if let id { object["id"] = id }
        let bytes = (try? JSONSerialization.data(withJSONObject: object, options: [.sortedKeys])) ?? Data("{}".utf8)
        return String(decoding: bytes, as: UTF8.self)
    }

    /// Decodes a server frame; `nil` for text that is not a frame at all.
    static func decode(_ text: String) -> ServerFrame? {
        guard let object = try? JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any],
              let type = object["type"] as? String else { return nil }
        let data = object["data"] as? [String: Any] ?? [:]
        let id = object["id"] as? String
        switch type {
        case "initial_state":
            guard let list = data["presences"] as? [[String: Any]] else { return nil }
            return .initialState(list.compactMap(snapshot), id: id)
        case "presence_update":
            return snapshot(data).map { .presenceUpdate($0) }
        case "typing_update":
            guard let user = identifier(data["user_id"]), let conversation = identifier(data["conversation_id"]),
                  let isTyping = data["is_typing"] as? Bool else { return nil }
            return .typingUpdate(userID: user, conversationID: conversation, isTyping: isTyping)
        case "group_presence":
            guard let conversation = identifier(data["conversation_id"]), let total = data["total"] as? Int,
                  let online = data["online"] as? Int, let away = data["away"] as? Int else { return nil }
            return .groupPresence(GroupPresence(conversationID: conversation, total: total, online: online, away: away), id: id)
        case "ack":
            return .ack(id: id)
        case "pong":
            return .pong(id: id)
        case "error":
            return .error(code: data["code"] as? String ?? "internal", message: data["message"] as? String ?? "", id: id)
        default:
            return .unknown(type: type)
        }
    }

    static func snapshot(_ object: [String: Any]) -> PresenceSnapshot? {
        guard let user = identifier(object["user_id"]), let raw = object["status"] as? String,
              let status = PresenceStatus(rawValue: raw) else { return nil }
        return PresenceSnapshot(userID: user, status: status, lastSeen: (object["last_seen"] as? String).flatMap(date))
    }

    /// A user or conversation id: a string, or a number from a gateway that runs with
    /// `PRESENCE_ID_FORMAT=numeric` (the SDK keeps ids as strings either way).
    static func identifier(_ value: Any?) -> String? {
        if let text = value as? String { return text }
        guard let number = value as? NSNumber, String(cString: number.objCType) != "c", let whole = value as? Int64 else { return nil }
        return String(whole)
    }

    /// Parses `2026-11-21T12:00:00.123Z` (milliseconds optional).
    static func date(_ text: String) -> Date? {
        if let date = try? Date.ISO8601FormatStyle(includingFractionalSeconds: true).parse(text) { return date }
        return try? Date.ISO8601FormatStyle().parse(text)
    }
}
