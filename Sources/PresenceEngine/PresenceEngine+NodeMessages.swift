import Foundation
import Logging
import PresenceProtocol
import RedisClient

extension PresenceEngine {
    /// Publishes `message` to every node; returns how many nodes heard it. With classic pub/sub
    /// that is one message on the channel every node listens to. Sharded pub/sub has no such
    /// channel (a cluster would pass it to every shard): one message goes to each registered
    /// node's own channel, on that channel's shard alone.
    @discardableResult
    public func tell(_ message: NodeMessage) async throws(PresenceError) -> Int {
        guard redis.pubSub == .sharded else { return try await publish(message, on: keys.broadcastChannel) }
        let registered = try await run { try await self.redis.execute(ZRANGE(key: keys.nodes)) }
        let payload = Array(nodeMessageCoder.data(message))
        let mode = redis.pubSub
        let results = try await run {
            try await self.redis.pipeline(registered.map { Publish(payload, on: self.keys.nodeChannel($0), mode: mode) })
        }
        // A node whose channel's primary is failing over misses the message; the others still
        // have it, so it fails only when no node could be told.
        var heard = 0
        var failures: [RedisError] = []
        for result in results {
            switch result {
            case .success(let count): heard += count
            case .failure(let error): failures.append(error)
            }
        }
        if let failure = failures.first {
            guard failures.count < results.count else { throw Self.presenceError(failure) }
            logger.warning("a node message reached some nodes only", metadata: [
                "presence.message": "\(message)", "presence.missed": "\(failures.count)", "error": "\(failure)",
            ])
        }
        return heard
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
