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
        do {
            return try await send(script.command(.sha1, keys: keys, arguments: arguments))
        } catch where error.serverErrorPrefix == "NOSCRIPT" {
            return try await send(script.command(.source, keys: keys, arguments: arguments))
        }
    }

    /// Runs `script` once per call, all in one pipeline, each result in order. The calls Redis
    /// refused for not knowing the script, and only those, are sent again once it is loaded; a
    /// `SCRIPT FLUSH` may land inside a pipeline, after some calls ran, and again before the
    /// resend: what is refused then carries the source. Each call runs once.
    public func evaluate(_ script: RedisScript, calls: [(keys: [String], arguments: [RedisArgument])]) async throws(RedisError) -> [Result<RESPValue, RedisError>] {
        var results = try await pipeline(calls.map { script.command(.sha1, keys: $0.keys, arguments: $0.arguments) })
        var refused = results.indices.filter { results[$0].isNoScript }
        guard !refused.isEmpty else { return results }
        try await send("SCRIPT", "LOAD", RedisArgument(script.source))
        for naming in [RedisScript.Naming.sha1, .source] where !refused.isEmpty {
            let retried = try await pipeline(refused.map { script.command(naming, keys: calls[$0].keys, arguments: calls[$0].arguments) })
            for (index, result) in zip(refused, retried) { results[index] = result }
            refused = refused.filter { results[$0].isNoScript }
        }
        return results
    }
}

extension RedisScript {
    /// How a command names its script: by SHA1, or with its source (which Redis cannot refuse).
    package enum Naming { case sha1, source }

    /// `EVALSHA` or `EVAL` of this script on `keys` with `arguments`.
    package func command(_ naming: Naming, keys: [String], arguments: [RedisArgument]) -> [RedisArgument] {
        let head = naming == .sha1 ? [RedisArgument("EVALSHA"), RedisArgument(sha1)] : [RedisArgument("EVAL"), RedisArgument(source)]
        return head + [RedisArgument(keys.count)] + keys.map { RedisArgument($0) } + arguments
    }
}

extension Result<RESPValue, RedisError> {
    /// Refused with `NOSCRIPT`: the server did not know the script.
    package var isNoScript: Bool {
        if case .failure(let error) = self { return error.serverErrorPrefix == "NOSCRIPT" }
        return false
    }
}
