import Foundation
import PresenceEngine
import PresenceProtocol

/// The message stretches of ``InstructionScenario``: a message's instructions (its `send`, the
/// script's reply, the message heard back) and a delivered message's (one more member's session)
/// come apart as a change's and a delivery's do, by the difference of two series.
extension InstructionScenario {
    struct MessageWindows {
        /// Conversations of two members: the sender's own session and one reader get each message.
        var pair: InstructionCounter.Window
        /// Conversations of the sender and `watchers` readers.
        var room: InstructionCounter.Window
    }

    /// `users` conversations of each kind, members set through the engine before their sessions
    /// open; each sender sends `changes` messages, the kind's senders at once, each round waited
    /// for at every member's session.
    func messageSeries(fleet: Fleet, nodes: NodeProcesses, counter: InstructionCounter) async throws -> MessageWindows {
        let kinds = [("pair", 1), ("room", watchers)]
        let conversations = kinds.map { kind, readers in
            (0..<users).map { index in (id: "\(kind)-\(index)", members: ["\(kind)-\(index)-sender"] + (0..<readers).map { "\(kind)-\(index)-reader-\($0)" }) }
        }
        let setup = try await BenchEngine.make(redisURL: options.common.redisURL, prefix: nodes.prefix)
        try await setup.use { engine in
            for conversation in conversations.joined() { _ = try await engine.setMembers(of: conversation.id, to: conversation.members) }
        }
        let opened = FrameCounter()
        let heard = ["pair": FrameCounter(), "room": FrameCounter()]
        let members = conversations.joined().flatMap { conversation in conversation.members.map { ($0, "m", 0) } }
        let sockets = try await fleet.connect(members, concurrency: 16, label: "instructions: members") { index, text in
            switch serverFrame(text) {
            case .initialState: opened.add(index)
            case .message(let message): heard[String(message.conversationID.prefix { $0 != "-" })]?.add(index)
            default: break
            }
        }
        guard await opened.wait(for: sockets.count, timeout: .seconds(300), label: "instructions: members") else {
            throw BenchError("instructions: only \(opened.count) of \(sockets.count) members' sessions opened")
        }
        // Nothing to catch up: live messages flow from now on, with no opening hold. The pause
        // lets what the opening burst left run before counting: the opening holds' timers
        // (2 s) and the node's heap trim, which looks every 5 s.
        for socket in sockets { socket.send(clientText(.sync([]))) }
        try await Task.sleep(for: .seconds(12))

        var first = 0
        var windows: [InstructionCounter.Window] = []
        for (kind, rooms) in zip(kinds, conversations) {
            let senders = rooms.indices.map { sockets[first + $0 * (kind.1 + 1)] }
            first += rooms.count * (kind.1 + 1)
            let delivered = heard[kind.0]!
            let perRound = rooms.count * (kind.1 + 1)
            windows.append(try await counter.measure(kind.0) {
                for round in 1...changes {
                    for (socket, room) in zip(senders, rooms) {
                        let draft = MessageDraft(conversationID: room.id, clientMessageID: "\(room.id)-\(round)", text: "instructions \(round)")
                        socket.send(clientText(.send(draft), id: "m\(round)"))
                    }
                    guard await delivered.wait(for: round * perRound, timeout: .seconds(120)) else {
                        throw BenchError("instructions: round \(round) of the \(kind.0) messages reached \(delivered.count - (round - 1) * perRound) of \(perRound) sessions")
                    }
                    try await Task.sleep(for: .milliseconds(300))
                }
            })
        }
        return MessageWindows(pair: windows[0], room: windows[1])
    }
}
