extension RedisClusterClient {
    /// Runs `script` by SHA on the primary of its keys' slot; if that node does not know it
    /// (restart, `SCRIPT FLUSH`, a fresh primary), sends the source with `EVAL` to that same node.
    @discardableResult
    public func evaluate(_ script: RedisScript, keys: [String], arguments: [RedisArgument] = []) async throws(RedisError) -> RESPValue {
        let command = script.command(.sha1, keys: keys, arguments: arguments)
        let slot = try Self.route(command)
        let (result, node) = await execute(command, slot: slot, deadline: commandDeadline())
        guard result.isNoScript, let node else { return try result.get() }
        let source = script.command(.source, keys: keys, arguments: arguments)
        return try await execute(source, slot: slot, deadline: commandDeadline(), target: .node(node)).result.get()
    }

    /// Runs `script` once per call, pipelined per node, each result in order. The calls a node
    /// refused for not knowing the script (a fresh primary, a `SCRIPT FLUSH` inside the pipeline)
    /// are sent again with the source, and only those: each call runs once.
    public func evaluate(_ script: RedisScript, calls: [(keys: [String], arguments: [RedisArgument])]) async throws(RedisError) -> [Result<RESPValue, RedisError>] {
        var outcomes = try await pipelineWithNodes(calls.map { script.command(.sha1, keys: $0.keys, arguments: $0.arguments) })
        let refused = outcomes.indices.filter { outcomes[$0].result.isNoScript }
        guard !refused.isEmpty else { return outcomes.map(\.result) }
        let retried = try await pipelineWithNodes(refused.map { script.command(.source, keys: calls[$0].keys, arguments: calls[$0].arguments) })
        for (index, outcome) in zip(refused, retried) { outcomes[index] = outcome }
        return outcomes.map(\.result)
    }
}
