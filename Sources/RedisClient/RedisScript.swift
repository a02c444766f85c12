import Crypto

/// A Lua script with its SHA1, run with EVALSHA and loaded again on `NOSCRIPT`.
public struct RedisScript: Sendable, Hashable {
    /// The Lua source.
    public let source: String
    /// The lowercase hex SHA1 of `source`, as Redis names the script.
    public let sha1: String

    /// Makes a script value; the SHA1 is computed once, here.
    public init(_ source: String) {
        self.source = source
        self.sha1 = Insecure.SHA1.hash(data: Array(source.utf8)).map { byte in
            let hex = String(byte, radix: 16)
            return byte < 16 ? "0" + hex : hex
        }.joined()
    }
}

extension RedisClient {
    /// Runs `script` by SHA; if Redis does not know it (restart, `SCRIPT FLUSH`), sends the source.
    @discardableResult
    public func evaluate(_ script: RedisScript, keys: [String], arguments: [RedisArgument] = []) async throws(RedisError) -> RESPValue {
        let tail = [RedisArgument(keys.count)] + keys.map { RedisArgument($0) } + arguments
        do {
            return try await send([RedisArgument("EVALSHA"), RedisArgument(script.sha1)] + tail)
        } catch where error.serverErrorPrefix == "NOSCRIPT" {
            return try await send([RedisArgument("EVAL"), RedisArgument(script.source)] + tail)
        }
    }

    /// Runs `script` once per call, all in one pipeline, each result in order. If Redis does not
    /// know the script, it is loaded once and the pipeline sent again.
    public func evaluate(_ script: RedisScript, calls: [(keys: [String], arguments: [RedisArgument])]) async throws(RedisError) -> [Result<RESPValue, RedisError>] {
        let commands: [[RedisArgument]] = calls.map { call in
            [RedisArgument("EVALSHA"), RedisArgument(script.sha1), RedisArgument(call.keys.count)] + call.keys.map { RedisArgument($0) } + call.arguments
        }
        let results = try await pipeline(commands)
        let missing = results.contains { result in
            if case .failure(let error) = result { return error.serverErrorPrefix == "NOSCRIPT" }
            return false
        }
        guard missing else { return results }
        try await send("SCRIPT", "LOAD", RedisArgument(script.source))
        return try await pipeline(commands)
    }
}
