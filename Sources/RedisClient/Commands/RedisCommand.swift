/// One Redis command with the type of its reply: its words, and how the reply is read. The
/// commands of `Commands/` are structs named as Redis names them (`HMGET`, `SADD`, ...), each
/// with its inputs by name, so a caller neither spells words nor counts the reply's positions.
public protocol RedisCommand<Response>: Sendable {
    /// What the reply is read into.
    associatedtype Response: Sendable
    /// The command's words, its name first.
    var arguments: [RedisArgument] { get }
    /// Reads the reply; a reply of another shape throws ``RedisError/Code/protocolViolation``.
    func decode(_ reply: RESPValue) throws(RedisError) -> Response
}

extension RedisCommand {
    /// The command's name, for messages.
    var name: String { arguments.first.map { String(decoding: $0.bytes, as: UTF8.self) } ?? "?" }

    /// The error for a reply of the wrong shape.
    func unexpected(_ reply: RESPValue) -> RedisError {
        RedisError(.protocolViolation, "\(name): unexpected reply \(reply.description.prefix(80))")
    }

    /// The reply's elements, or an error if it is not an array.
    func elements(of reply: RESPValue) throws(RedisError) -> [RESPValue] {
        guard let elements = reply.array else { throw unexpected(reply) }
        return elements
    }

    /// The reply as an integer, or an error.
    func integer(_ reply: RESPValue) throws(RedisError) -> Int {
        guard case .integer(let value) = reply else { throw unexpected(reply) }
        return Int(value)
    }

    /// The reply as a string, nil for a null.
    func optionalString(_ reply: RESPValue) throws(RedisError) -> String? {
        if reply.isNull { return nil }
        guard let value = reply.string else { throw unexpected(reply) }
        return value
    }

    /// The reply's elements as strings (a null element is an error).
    func strings(_ reply: RESPValue) throws(RedisError) -> [String] {
        var strings: [String] = []
        for element in try elements(of: reply) {
            guard let string = element.string else { throw unexpected(reply) }
            strings.append(string)
        }
        return strings
    }

    /// The reply as a result with the command's decoding applied.
    func result(_ reply: Result<RESPValue, RedisError>) -> Result<Response, RedisError> {
        reply.flatMap { value in
            do throws(RedisError) { return .success(try decode(value)) } catch { return .failure(error) }
        }
    }
}

extension RedisCommands {
    /// Sends `command` and reads its reply.
    @discardableResult
    public func execute<Command: RedisCommand>(_ command: Command) async throws(RedisError) -> Command.Response {
        try command.decode(try await send(command.arguments))
    }

    /// Sends `commands` in one pipeline (on a cluster, each to its slot's primary); each result
    /// in order.
    public func pipeline<Command: RedisCommand>(_ commands: [Command]) async throws(RedisError) -> [Result<Command.Response, RedisError>] {
        let replies = try await pipeline(commands.map(\.arguments))
        return zip(commands, replies).map { $0.result($1) }
    }

    /// Sends commands of different types but one reply type in one pipeline; each result in order.
    public func pipeline<Response>(_ commands: [any RedisCommand<Response>]) async throws(RedisError) -> [Result<Response, RedisError>] {
        let replies = try await pipeline(commands.map(\.arguments))
        return zip(commands, replies).map { $0.result($1) }
    }

    /// Sends a fixed set of commands of any types in one pipeline: a tuple of their results.
    public func pipeline<each Command: RedisCommand>(
        _ commands: repeat each Command
    ) async throws(RedisError) -> (repeat Result<(each Command).Response, RedisError>) {
        var arguments: [[RedisArgument]] = []
        for command in repeat each commands { arguments.append(command.arguments) }
        let replies = try await pipeline(arguments)
        var index = 0
        func next<One: RedisCommand>(_ command: One) -> Result<One.Response, RedisError> {
            defer { index += 1 }
            return command.result(replies[index])
        }
        return (repeat next(each commands))
    }
}
