import PresenceEngine

/// A user or conversation id as JSON carries it: a string, or (with `PRESENCE_ID_FORMAT=numeric`)
/// a whole number. Request bodies and the JWT `sub` take either.
enum JSONID: Codable, Sendable {
    case string(String)
    case number(Int64)

    init(from decoder: any Decoder) throws {
        let container = try decoder.singleValueContainer()
        if let number = try? container.decode(Int64.self) {
            self = .number(number)
        } else {
            self = .string(try container.decode(String.self))
        }
    }

    func encode(to encoder: any Encoder) throws {
        var container = encoder.singleValueContainer()
        switch self {
        case .string(let text): try container.encode(text)
        case .number(let number): try container.encode(number)
        }
    }

    /// The stored spelling of this id, or `nil` if it is not an id in `format`.
    func canonical(_ format: PresenceIDFormat) -> String? {
        switch self {
        case .string(let text): format.canonical(text)
        case .number(let number): format.canonical(number: number)
        }
    }
}
