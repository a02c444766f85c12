import PresenceEngine
import PresenceProtocol

extension PresencePayload {
    /// What a viewer may know of a user, as frames and REST bodies carry it.
    init(_ presence: Presence, isTyping: Bool? = nil) {
        self.init(userID: presence.userID, status: presence.status, lastSeen: presence.lastSeen, isTyping: isTyping)
    }
}
