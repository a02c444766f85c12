import Logging
import NIOConcurrencyHelpers
import NIOCore

/// Commands: routed to the slot's primary, redirected and retried as the type's documentation says.
extension RedisClusterClient {
    /// Where the next attempt of a command goes.
    enum Target: Sendable {
        /// The primary of the command's slot, or any primary for a command without a key.
        case slotOwner
        /// The node a `MOVED` or `NOSCRIPT` named; the slot's primary again after a retry.
        case node(ClusterNodeAddress)
        /// The node an `ASK` named, with `ASKING` written just before the command; once.
        case asking(ClusterNodeAddress)
        /// This node only, whatever it answers (`SCRIPT LOAD`, per-node commands).
        case pinned(ClusterNodeAddress)
    }

    /// What to do after a failed attempt.
    private enum NextStep {
        case moved(HashSlot, ClusterNodeAddress)
        case ask(ClusterNodeAddress)
        case retry
        case fail

        var isFail: Bool {
            if case .fail = self { return true }
            return false
        }
    }

    /// Commands that change the state of their connection, which the router shares between all
    /// callers: they cannot mean anything through it.
    private static let connectionStateCommands: Set<String> = [
        "MULTI", "EXEC", "DISCARD", "WATCH", "UNWATCH", "SELECT", "AUTH", "HELLO", "QUIT", "RESET",
        "SUBSCRIBE", "PSUBSCRIBE", "SSUBSCRIBE", "UNSUBSCRIBE", "PUNSUBSCRIBE", "SUNSUBSCRIBE",
        "MONITOR", "ASKING", "READONLY", "READWRITE",
    ]

    /// The slot `command` is routed by (nil: any primary), or the error that keeps it from being sent.
    static func route(_ command: [RedisArgument]) throws(RedisError) -> HashSlot? {
        guard let name = command.first else {
            throw RedisError(.server, "ERR an empty command cannot be sent")
        }
        let upper = HashSlot.uppercased(name.bytes)
        guard !connectionStateCommands.contains(upper) else {
            throw RedisError(.server, "ERR \(upper) changes the state of one connection, and the cluster client shares its connections; use a RedisClient or a RedisSubscriber on one node")
        }
        return try HashSlot.slot(of: command)
    }

    /// When a command sent now must have succeeded or failed: the task's
    /// ``RedisCommandDeadline/current`` when it comes sooner.
    func commandDeadline() -> ContinuousClock.Instant {
        let own = ContinuousClock.now + configuration.waitForConnection + configuration.commandTimeout
        return RedisCommandDeadline.current.map { min($0, own) } ?? own
    }

    /// Sends one command to the primary of its keys' slot (any primary when it has none) and
    /// returns its reply, following redirections and retrying as the type's documentation says.
    ///
    /// Throws `CROSSSLOT` without sending when the keys map to several slots.
    @discardableResult
    public func send(_ arguments: [RedisArgument]) async throws(RedisError) -> RESPValue {
        let slot = try Self.route(arguments)
        return try await execute(arguments, slot: slot, deadline: commandDeadline()).result.get()
    }

    /// Sends one command given as words.
    @discardableResult
    public func send(_ arguments: RedisArgument...) async throws(RedisError) -> RESPValue {
        try await send(arguments)
    }

    /// Sends `arguments` to every primary at once (`SCAN`, `INFO`, `DBSIZE`, `SCRIPT FLUSH` over
    /// the whole cluster); each primary's outcome, in the order of ``primaries``.
    ///
    /// A node that cannot be reached is retried like any command; redirections are not followed.
    public func sendToEachPrimary(_ arguments: [RedisArgument]) async throws(RedisError) -> [(node: ClusterNodeAddress, result: Result<RESPValue, RedisError>)] {
        let slot = try Self.route(arguments)
        let deadline = commandDeadline()
        try await waitForMap(until: deadline)
        let primaries = self.primaries
        return await withTaskGroup(of: (Int, Result<RESPValue, RedisError>).self) { group in
            for (index, node) in primaries.enumerated() {
                group.addTask { (index, await self.execute(arguments, slot: slot, deadline: deadline, target: .pinned(node)).result) }
            }
            var results = [Result<RESPValue, RedisError>?](repeating: nil, count: primaries.count)
            for await (index, result) in group { results[index] = result }
            return primaries.indices.map { (primaries[$0], results[$0]!) }
        }
    }

    /// Sends several commands, one pipeline per node, and returns each command's outcome in the
    /// order given.
    ///
    /// Commands answered with a redirection or a retryable error are sent again one by one, as
    /// `send` would; commands on different nodes run in no set order. Throws only when no slot
    /// map is known in time.
    public func pipeline(_ commands: [[RedisArgument]]) async throws(RedisError) -> [Result<RESPValue, RedisError>] {
        try await pipelineWithNodes(commands).map(\.result)
    }

    /// A pipeline's outcomes, each with the node that gave it.
    func pipelineWithNodes(_ commands: [[RedisArgument]]) async throws(RedisError) -> [(result: Result<RESPValue, RedisError>, node: ClusterNodeAddress?)] {
        guard !commands.isEmpty else { return [] }
        let deadline = commandDeadline()
        try await waitForMap(until: deadline)
        typealias Outcome = (result: Result<RESPValue, RedisError>, node: ClusterNodeAddress?)
        var outcomes = [Outcome?](repeating: nil, count: commands.count)
        var slots = [HashSlot?](repeating: nil, count: commands.count)
        for (index, command) in commands.enumerated() {
            do {
                slots[index] = try Self.route(command)
            } catch {
                outcomes[index] = (.failure(error), nil)
            }
        }
        // Group by primary; commands without a key all go to one primary chosen at random.
        var groups: [ClusterNodeAddress: [Int]] = [:]
        var unrouted: [Int] = []
        state.withLockedValue { state in
            let anyPrimary = state.map?.primaries.randomElement()
            for index in commands.indices where outcomes[index] == nil {
                if let owner = slots[index].map({ state.map?.primary(for: $0) }) ?? anyPrimary {
                    groups[owner, default: []].append(index)
                } else {
                    unrouted.append(index)
                }
            }
        }
        let unownedError = RedisError(.unavailable, "no primary serves the command's hash slot in the current slot map")
        // One pipeline per node. What failed in a way worth another attempt comes back with
        // its error, and goes on one by one from there.
        let firstRound = await withTaskGroup(of: [(Int, Outcome)].self) { group in
            for (node, indices) in groups {
                group.addTask {
                    let results = await self.sendPipeline(indices.map { commands[$0] }, to: node, until: deadline)
                    return zip(indices, results).map { ($0, ($1, node)) }
                }
            }
            var all: [(Int, Outcome)] = unrouted.map { ($0, (.failure(unownedError), nil)) }
            for await part in group { all += part }
            return all
        }
        var again: [(Int, RedisError, ClusterNodeAddress?)] = []
        for (index, outcome) in firstRound {
            if case .failure(let error) = outcome.result, !Self.nextStep(after: error, from: outcome.node).isFail {
                again.append((index, error, outcome.node))
            } else {
                outcomes[index] = outcome
            }
        }
        let routedSlots = slots
        let secondRound = await withTaskGroup(of: (Int, Outcome).self) { group in
            for (index, error, node) in again {
                group.addTask {
                    (index, await self.execute(commands[index], slot: routedSlots[index], deadline: deadline, after: (error, node)))
                }
            }
            var all: [(Int, Outcome)] = []
            for await part in group { all.append(part) }
            return all
        }
        for (index, outcome) in secondRound { outcomes[index] = outcome }
        return outcomes.map { $0! }
    }

    /// Sends `commands` as one pipeline on `node`'s connection. When there is no open
    /// connection in time, every command fails with ``RedisError/Code/unavailable`` (unsent).
    private func sendPipeline(_ commands: [[RedisArgument]], to node: ClusterNodeAddress, until deadline: ContinuousClock.Instant) async -> [Result<RESPValue, RedisError>] {
        do throws(RedisError) {
            let connection = try await connection(to: node, until: deadline)
            guard connection.isActive else {
                throw RedisError(.unavailable, "the connection to Redis cluster node \(node) closed before the commands were sent")
            }
            return try await connection.pipeline(commands)
        } catch {
            return commands.map { _ in .failure(error) }
        }
    }

    /// Sends one command and follows its redirections and retries until it succeeds, fails for
    /// good, or `deadline` leaves no time for another attempt. With `earlier`, the first attempt
    /// was already made (in a pipeline) and gave that error.
    func execute(
        _ command: [RedisArgument],
        slot: HashSlot?,
        deadline: ContinuousClock.Instant,
        target start: Target = .slotOwner,
        after earlier: (error: RedisError, node: ClusterNodeAddress?)? = nil
    ) async -> (result: Result<RESPValue, RedisError>, node: ClusterNodeAddress?) {
        var target = start
        var earlier = earlier
        var redirections = 0
        var attempt = 0
        while true {
            let failure: RedisError
            var node: ClusterNodeAddress?
            // Whether the attempt found no open connection to its node: only such a command's
            // pause ends when one opens. One that failed on an open connection (`READONLY` from
            // a demoted primary) waits its backoff out, for the slot map to move.
            var unconnected = false
            if let first = earlier {
                earlier = nil
                (failure, node) = first
            } else {
                do throws(RedisError) {
                    let address = try await self.address(for: target, slot: slot, until: deadline)
                    node = address
                    unconnected = true
                    let connection = try await connection(to: address, until: deadline)
                    unconnected = !connection.isActive
                    if case .asking = target {
                        return (.success(try await Self.sendAsking(command, on: connection, node: address)), address)
                    }
                    guard !unconnected else {
                        throw RedisError(.unavailable, "the connection to Redis cluster node \(address) closed before the command was sent")
                    }
                    return (.success(try await connection.send(command)), address)
                } catch {
                    failure = error
                }
            }
            let pinned = if case .pinned = target { true } else { false }
            switch Self.nextStep(after: failure, from: node) {
            case .fail:
                return (.failure(failure), node)
            case .moved(let movedSlot, let address):
                redirections += 1
                guard !pinned else { return (.failure(failure), node) }
                guard redirections <= Self.maximumRedirections else { return (.failure(tooManyRedirections(command, failure)), node) }
                state.withLockedValue { $0.map?.assign(movedSlot, to: address) }
                logger.trace("MOVED", metadata: ["redis.command": "\(HashSlot.commandName(command))", "redis.slot": "\(movedSlot)", "redis.node": "\(address)"])
                requestRefresh()
                target = .node(address)
            case .ask(let address):
                redirections += 1
                guard !pinned else { return (.failure(failure), node) }
                guard redirections <= Self.maximumRedirections else { return (.failure(tooManyRedirections(command, failure)), node) }
                logger.trace("ASK", metadata: ["redis.command": "\(HashSlot.commandName(command))", "redis.node": "\(address)"])
                target = .asking(address)
            case .retry:
                guard !isShutdown else { return (.failure(failure), node) }
                if failure.code == .unavailable || failure.serverErrorPrefix == "CLUSTERDOWN" { requestRefresh() }
                if failure.serverErrorPrefix == "CLUSTERDOWN" || failure.serverErrorPrefix == "LOADING" { notify(.refused) }
                let delay = Self.retryBackoff.delay(attempt: attempt)
                attempt += 1
                guard ContinuousClock.now + delay < deadline else { return (.failure(Self.unserved(failure)), node) }
                await pause(delay, orUntilConnected: unconnected ? node : nil)
                guard !Task.isCancelled else { return (.failure(failure), node) }
                if !pinned { target = .slotOwner }
            }
        }
    }

    private func tooManyRedirections(_ command: [RedisArgument], _ last: RedisError) -> RedisError {
        RedisError(
            .unavailable,
            "\(HashSlot.commandName(command)) was redirected \(Self.maximumRedirections) times without reaching its slot's primary; the cluster's slots keep moving",
            underlying: last
        )
    }

    /// The node the next attempt goes to.
    private func address(for target: Target, slot: HashSlot?, until deadline: ContinuousClock.Instant) async throws(RedisError) -> ClusterNodeAddress {
        switch target {
        case .node(let address), .asking(let address), .pinned(let address):
            return address
        case .slotOwner:
            break
        }
        try await waitForMap(until: deadline)
        let owner: ClusterNodeAddress? = state.withLockedValue { state in
            guard let map = state.map else { return nil }
            if let slot { return map.primary(for: slot) }
            // Any primary will do: one with an open connection spares a connect.
            let primaries = map.primaries
            return primaries.filter { state.nodes[$0]?.connection?.isActive ?? false }.randomElement() ?? primaries.randomElement()
        }
        guard let owner else {
            throw RedisError(.unavailable, "no primary serves hash slot \(slot.map(String.init(describing:)) ?? "?") in the current slot map")
        }
        return owner
    }

    /// Classifies an error: a redirection to follow, a condition worth another attempt (the
    /// command did not run), or a failure to report.
    private static func nextStep(after error: RedisError, from node: ClusterNodeAddress?) -> NextStep {
        switch error.code {
        case .unavailable:
            return .retry
        case .server:
            break
        default:
            return .fail
        }
        switch error.serverErrorPrefix {
        case "MOVED", "ASK":
            let parts = error.message.split(separator: " ")
            guard parts.count >= 3, let number = Int(parts[1]), let slot = HashSlot(number),
                  let address = ClusterNodeAddress(redirection: parts[2], defaultHost: node?.host ?? "127.0.0.1")
            else { return .fail }
            return parts[0] == "MOVED" ? .moved(slot, address) : .ask(address)
        case "TRYAGAIN", "CLUSTERDOWN", "LOADING":
            return .retry
        default:
            return .fail
        }
    }

    /// What a command the cluster kept refusing (`CLUSTERDOWN`, `TRYAGAIN`, `LOADING`) past its
    /// time budget fails with: ``RedisError/Code/unavailable``, as the command never ran, like
    /// one whose node cannot be reached; its caller then treats it as an outage, not as a
    /// failed command.
    static func unserved(_ failure: RedisError) -> RedisError {
        guard failure.code == .server else { return failure }
        return RedisError(.unavailable, "the Redis cluster did not serve the command within its time budget", underlying: failure)
    }

    /// Writes `ASKING` and `command` as one request, so that no other caller's command comes
    /// between them on the shared connection, and returns the command's reply.
    private static func sendAsking(_ command: [RedisArgument], on connection: RedisConnection, node: ClusterNodeAddress) async throws(RedisError) -> RESPValue {
        let channel = connection.channel
        var buffer = channel.allocator.buffer(capacity: 64)
        RESPEncoder.encode(["ASKING"], into: &buffer)
        RESPEncoder.encode(command, into: &buffer)
        let reply = channel.eventLoop.makePromise(of: RESPValue.self)
        let written = channel.eventLoop.makePromise(of: Void.self)
        // A write that fails never reaches the reply handler, which would fail `reply` itself.
        written.futureResult.whenFailure { error in
            reply.fail(RedisError(.connectionClosed, "the connection to Redis cluster node \(node) failed", underlying: error))
        }
        let request = RedisRequest(encoded: buffer, expectedReplies: 2, promise: reply)
        channel.eventLoop.execute {
            // Checked on the channel's loop, where it cannot change under us: not sent, so safe to retry.
            guard channel.isActive else {
                reply.fail(RedisError(.unavailable, "the connection to Redis cluster node \(node) closed before the command was sent"))
                return
            }
            channel.writeAndFlush(request, promise: written)
        }
        let replies: RESPValue
        do {
            replies = try await reply.futureResult.get()
        } catch let error as RedisError {
            throw error
        } catch {
            throw RedisError(.connectionClosed, "the connection to Redis cluster node \(node) failed", underlying: error)
        }
        guard case .array(let both) = replies, both.count == 2 else {
            throw RedisError(.protocolViolation, "Redis cluster node \(node) did not answer ASKING and the command with two replies")
        }
        for part in both {
            if case .error(let message) = part { throw RedisError(.server, message) }
        }
        return both[1]
    }
}
