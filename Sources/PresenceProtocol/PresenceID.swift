import Foundation

/// Validation of ids (docs/API.md: 1–128 characters of `[A-Za-z0-9._:@-]`).
public enum PresenceID {
    /// What a valid id is, for error messages.
    public static let rule = "1-128 characters of A-Z a-z 0-9 . _ : @ -"

    /// Whether `id` is a valid user, device or conversation id.
    public static func isValid(_ id: some StringProtocol) -> Bool {
        guard (1...128).contains(id.utf8.count) else { return false }
        return id.utf8.allSatisfy { byte in
            switch byte {
            case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "0")...UInt8(ascii: "9"):
                return true
            case UInt8(ascii: "."), UInt8(ascii: "_"), UInt8(ascii: ":"), UInt8(ascii: "@"), UInt8(ascii: "-"):
                return true
            default:
                return false
            }
        }
    }

}

/// How user and conversation ids look on the wire (`PRESENCE_ID_FORMAT`).
///
/// Inside the service an id is always a string: Redis keys, channels and the engine's API do not
/// change with the format. The format decides which strings are ids, and how the gateway writes
/// them in JSON. Device and node ids are strings in both formats.
public enum PresenceIDFormat: String, Sendable, CaseIterable {
    /// Any id of docs/API.md (1–128 characters of `[A-Za-z0-9._:@-]`), written as a JSON string.
    case string
    /// Decimal integers of 1–18 digits, written as JSON numbers, for clients written against an
    /// API with integer ids. Requests may give them as numbers or as strings.
    case numeric

    /// The most digits a numeric id has: every such id fits an `Int64` (and a JavaScript
    /// number up to 2^53 for ids below 9,007,199,254,740,992).
    public static let maxDigits = 18

    /// What a valid user or conversation id is in this format, for error messages.
    public var rule: String {
        switch self {
        case .string: PresenceID.rule
        case .numeric: "a decimal integer of 1-\(Self.maxDigits) digits"
        }
    }

    /// The id `text` names, in the one spelling the service stores, or `nil` if it is not an id
    /// in this format. A numeric id loses its leading zeros (`007` is user 7).
    public func canonical(_ text: some StringProtocol) -> String? {
        switch self {
        case .string:
            return PresenceID.isValid(text) ? String(text) : nil
        case .numeric:
            guard (1...Self.maxDigits).contains(text.utf8.count),
                  text.utf8.allSatisfy({ $0 >= UInt8(ascii: "0") && $0 <= UInt8(ascii: "9") }),
                  let value = Int64(text) else { return nil }
            return String(value)
        }
    }

    /// The id a JSON value names: a string in either format, or a whole number in the numeric
    /// one; `nil` for anything else (a fraction, a negative number, a boolean, `null`).
    public func canonical(json value: Any) -> String? {
        if let text = value as? String { return canonical(text) }
        // JSONSerialization gives booleans as NSNumbers that also read as 0 and 1; their type
        // code is `c` (a C char), which no JSON number gets.
        guard let number = value as? NSNumber, String(cString: number.objCType) != "c",
              let whole = value as? Int64 else { return nil }
        return canonical(number: whole)
    }

    /// The id a JSON number names: only in the numeric format, and only a whole number of at
    /// most ``maxDigits`` digits.
    public func canonical(number: Int64) -> String? {
        guard self == .numeric, number >= 0 else { return nil }
        return canonical(String(number))
    }

    /// The JSON value for a stored id: a number in the numeric format (an id that is not one,
    /// stored before the format was chosen, stays a string), the string otherwise.
    public func json(_ id: String) -> Any {
        number(id) ?? id
    }

    /// The number a stored id is written as, or `nil` if it is written as a string.
    public func number(_ id: String) -> Int64? {
        guard self == .numeric, let number = Int64(id), canonical(id) == id else { return nil }
        return number
    }
}

extension PresenceIDFormat {
    /// The format a frame or body is written or read in: `string` unless the encoder's or
    /// decoder's `userInfo` names one under ``Foundation/CodingUserInfoKey/presenceIDFormat``.
    public init(userInfo: [CodingUserInfoKey: Any]) {
        self = userInfo[.presenceIDFormat] as? PresenceIDFormat ?? .string
    }

    /// Writes a stored id under `key` as this format writes it (see ``json(_:)``).
    public func encode<Key: CodingKey>(_ id: String, forKey key: Key, in container: inout KeyedEncodingContainer<Key>) throws {
        if let number = number(id) {
            try container.encode(number, forKey: key)
        } else {
            try container.encode(id, forKey: key)
        }
    }
}

extension CodingUserInfoKey {
    /// The ``PresenceIDFormat`` that frames and bodies write and read ids in.
    public static let presenceIDFormat = CodingUserInfoKey(rawValue: "presence.id_format")!
}
