import Foundation

/// Turns keystrokes into the few typing frames the gateway needs: `true` on the first keystroke
/// and at most once per `refreshInterval` while typing goes on; `false` after `idleTimeout`
/// without a keystroke, when the message is sent, or when the conversation is left. Nothing is
/// sent while the device cannot type (disconnected or appearing offline).
public struct TypingDebouncer: Sendable {
    /// A typing frame to send.
    public struct Send: Sendable, Hashable {
        /// The conversation.
        public var conversationID: String
        /// Started or stopped.
        public var isTyping: Bool
    }

    private struct Typing: Sendable {
        var lastKeystroke: Date
        var lastSent: Date
    }

    /// Least time between two `true` frames of one conversation, seconds.
    public var refreshInterval: TimeInterval
    /// Time without a keystroke after which typing stops, seconds.
    public var idleTimeout: TimeInterval
    private var typing: [String: Typing] = [:]

    /// A debouncer: `true` at most every 2 s, `false` after 3 s idle.
    public init(refreshInterval: TimeInterval = 2, idleTimeout: TimeInterval = 3) {
        self.refreshInterval = refreshInterval
        self.idleTimeout = idleTimeout
    }

    /// Conversations this device is typing in now.
    public var conversations: Set<String> { Set(typing.keys) }

    /// A keystroke in `conversation` at `now`. `canSend` is false while disconnected or offline:
    /// then nothing is sent and nothing is remembered.
    public mutating func keystroke(in conversation: String, at now: Date, canSend: Bool) -> Send? {
        guard canSend else { return nil }
        if var state = typing[conversation] {
            state.lastKeystroke = now
            let refresh = now.timeIntervalSince(state.lastSent) >= refreshInterval
            if refresh { state.lastSent = now }
            typing[conversation] = state
            return refresh ? Send(conversationID: conversation, isTyping: true) : nil
        }
        typing[conversation] = Typing(lastKeystroke: now, lastSent: now)
        return Send(conversationID: conversation, isTyping: true)
    }

    /// The message was sent, or the conversation left: typing there stops now.
    public mutating func stop(in conversation: String) -> Send? {
        typing.removeValue(forKey: conversation) == nil ? nil : Send(conversationID: conversation, isTyping: false)
    }

    /// Stops typing everywhere (the device goes offline): one `false` per conversation.
    public mutating func stopAll() -> [Send] {
        defer { typing = [:] }
        return typing.keys.sorted().map { Send(conversationID: $0, isTyping: false) }
    }

    /// The connection dropped: the gateway ends this device's typing by itself, so forget it
    /// without sending anything.
    public mutating func forget() { typing = [:] }

    /// Typing that went idle by `now`: one `false` each.
    public mutating func expire(at now: Date) -> [Send] {
        let idle = typing.filter { now.timeIntervalSince($0.value.lastKeystroke) >= idleTimeout }.map(\.key).sorted()
        for conversation in idle { typing[conversation] = nil }
        return idle.map { Send(conversationID: $0, isTyping: false) }
    }

    /// When the next `expire(at:)` has something to do.
    public var nextDeadline: Date? {
        typing.values.map { $0.lastKeystroke.addingTimeInterval(idleTimeout) }.min()
    }
}
