/// A presence status, exactly as the API spells it: a user's aggregate over their devices, or
/// one device's own.
public enum PresenceStatus: String, Sendable, Hashable, Codable, CaseIterable {
    case online, away, offline

    /// What a valid status is, for error messages: "one of online, away, offline".
    public static let rule = "one of " + allCases.map(\.rawValue).joined(separator: ", ")
}
