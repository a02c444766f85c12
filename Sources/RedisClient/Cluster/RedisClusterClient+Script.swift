extension RedisClusterClient {
    /// Runs `script` by SHA on the primary of its keys' slot; if that node does not know it
    /// (restart, `SCRIPT FLUSH`, a fresh primary), sends the source with `EVAL` to that same node.
    @discardableResult
    public func evaluate(_ script: RedisScript, keys: [String], arguments: [RedisArgument] = []) async throws(RedisError) -> RESPValue {
        let tail = [RedisArgument(keys.count)] + keys.map { RedisArgument($0) } + arguments
        let command = [RedisArgument("EVALSHA"), RedisArgument(script.sha1)] + tail
        let slot = try Self.route(command)
        let (result, node) = await execute(command, slot: slot, deadline: commandDeadline())
        guard case .failure(let error) = result, error.serverErrorPrefix == "NOSCRIPT", let node else {
            return try result.get()
        }
        let source = [RedisArgument("EVAL"), RedisArgument(script.source)] + tail
        return try await execute(source, slot: slot, deadline: commandDeadline(), target: .node(node)).result.get()
    }

    /// Runs `script` once per call, pipelined per node, each result in order. Nodes that do not
    /// know the script get it with `SCRIPT LOAD`, and the calls they refused are sent again.
    public func evaluate(_ script: RedisScript, calls: [(keys: [String], arguments: [RedisArgument])]) async throws(RedisError) -> [Result<RESPValue, RedisError>] {
        let commands: [[RedisArgument]] = calls.map { call in
            [RedisArgument("EVALSHA"), RedisArgument(script.sha1), RedisArgument(call.keys.count)] + call.keys.map { RedisArgument($0) } + call.arguments
        }
        var outcomes = try await pipelineWithNodes(commands)
        var missing: [Int] = []
        var nodes = Set<ClusterNodeAddress>()
        for (index, outcome) in outcomes.enumerated() {
            guard case .failure(let error) = outcome.result, error.serverErrorPrefix == "NOSCRIPT", let node = outcome.node else { continue }
            missing.append(index)
            nodes.insert(node)
        }
        guard !missing.isEmpty else { return outcomes.map(\.result) }
        let deadline = commandDeadline()
        let loads = await withTaskGroup(of: Result<RESPValue, RedisError>.self) { group in
            for node in nodes {
                group.addTask {
                    await self.execute(["SCRIPT", "LOAD", RedisArgument(script.source)], slot: nil, deadline: deadline, target: .pinned(node)).result
                }
            }
            var loads: [Result<RESPValue, RedisError>] = []
            for await load in group { loads.append(load) }
            return loads
        }
        for load in loads { _ = try load.get() }
        let retried = try await pipelineWithNodes(missing.map { commands[$0] })
        for (index, outcome) in zip(missing, retried) { outcomes[index] = outcome }
        return outcomes.map(\.result)
    }
}
