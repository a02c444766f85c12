import Foundation
import PresenceProtocol
import RedisClient

extension PresenceEngine {
    /// Publishes `message` on the channel every node listens to; returns how many nodes heard it.
    @discardableResult
    public func tell(_ message: NodeMessage) async throws(PresenceError) -> Int {
        try await publish(message, on: keys.broadcastChannel)
    }

    /// Publishes `message` on the channel of the node `node` alone.
    @discardableResult
    public func tell(_ message: NodeMessage, node: String) async throws(PresenceError) -> Int {
        try await publish(message, on: keys.nodeChannel(node))
    }

    /// A message from another node, or `nil` for a payload that is none.
    public func decodeNodeMessage(_ payload: [UInt8]) -> NodeMessage? {
        try? JSONDecoder().decode(NodeMessage.self, from: Data(payload))
    }

    private func publish(_ message: NodeMessage, on channel: String) async throws(PresenceError) -> Int {
        let text = nodeMessageCoder.data(message)
        return try await run { try await self.redis.publish(Array(text), on: channel) }
    }
}

/// Writes node messages; made once, not per message.
private let nodeMessageCoder = FrameCoder()
