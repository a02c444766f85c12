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
    /// refused for not knowing the script (a fresh primary, a `SCRIPT FLUSH`), and only those,
    /// are sent again once the script is loaded on the nodes that refused; a flush that lands
    /// again before the resend refuses some again: those carry the source. Each call runs once.
    public func evaluate(_ script: RedisScript, calls: [(keys: [String], arguments: [RedisArgument])]) async throws(RedisError) -> [Result<RESPValue, RedisError>] {
        var outcomes = try await pipelineWithNodes(calls.map { script.command(.sha1, keys: $0.keys, arguments: $0.arguments) })
        var refused = outcomes.indices.filter { outcomes[$0].result.isNoScript }
        guard !refused.isEmpty else { return outcomes.map(\.result) }
        try await load(script, on: Set(refused.compactMap { outcomes[$0].node }))
        for naming in [RedisScript.Naming.sha1, .source] where !refused.isEmpty {
            let retried = try await pipelineWithNodes(refused.map { script.command(naming, keys: calls[$0].keys, arguments: calls[$0].arguments) })
            for (index, outcome) in zip(refused, retried) { outcomes[index] = outcome }
            refused = refused.filter { outcomes[$0].result.isNoScript }
        }
        return outcomes.map(\.result)
    }

    /// `SCRIPT LOAD` of `script` on each of `nodes`, at once.
    private func load(_ script: RedisScript, on nodes: Set<ClusterNodeAddress>) async throws(RedisError) {
        let deadline = commandDeadline()
        let loads = await withTaskGroup(of: Result<RESPValue, RedisError>.self) { group in
            for node in nodes {
                group.addTask {
                    await self.execute(["SCRIPT", "LOAD", RedisArgument(script.source)], slot: nil, deadline: deadline, target: .pinned(node)).result
                }
            }
            return await group.reduce(into: []) { $0.append($1) }
        }
        for load in loads { _ = try load.get() }
    }
}
