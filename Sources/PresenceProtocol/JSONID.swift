/// A user or conversation id as JSON carries it: a string, or (with `PRESENCE_ID_FORMAT=numeric`)
/// a whole number. Request bodies and the JWT `sub` take either; a stored id is written as the
/// encoder's ``PresenceIDFormat`` says.
public enum JSONID: Codable, Sendable, Hashable {
    case string(String)
    case number(Int64)

    /// A stored id, to be written in the encoder's format.
    public init(_ stored: String) {
        self = .string(stored)
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.singleValueContainer()
        if let number = try? container.decode(Int64.self) {
            self = .number(number)
        } else {
            self = .string(try container.decode(String.self))
        }
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.singleValueContainer()
        switch self {
        case .string(let text):
            if let number = PresenceIDFormat(userInfo: encoder.userInfo).number(text) {
                try container.encode(number)
            } else {
                try container.encode(text)
            }
        case .number(let number):
            try container.encode(number)
        }
    }

    /// The stored spelling of this id, or `nil` if it is not an id in `format`.
    public func canonical(_ format: PresenceIDFormat) -> String? {
        switch self {
        case .string(let text): format.canonical(text)
        case .number(let number): format.canonical(number: number)
        }
    }
}
