import NIOCore
import NIOEmbedded
import PresenceEngine
import PresenceProtocol
import Testing

@testable import PresenceGateway

@Suite("A session's view of what it watches")
struct SessionTests {
    /// Bob's session on an embedded channel, whose loop nobody runs: what it sends stays queued.
    static func session() throws -> Session {
        let channel = EmbeddedChannel()
        let handler = SessionChannelHandler(limits: SessionChannelHandlerTests.limits, events: .init(text: { _ in }, binary: {}, ended: { _ in }))
        try channel.pipeline.syncOperations.addHandler(handler)
        let connection = SessionConnection(handler, mailbox: LoopMailbox(eventLoop: channel.embeddedEventLoop))
        return Session(userID: "bob", deviceID: "phone", frames: FrameCoder(ids: .string), connection: connection)
    }

    @Test("overlapping reads of one user: events wait for the last one, and each read an event crossed is done again")
    func overlappingReads() throws {
        let session = try Self.session()
        _ = session.addWatched(["ann"])
        func presence(_ status: PresenceStatus) -> Presence { Presence(userID: "ann", status: status, lastSeen: nil) }
        let first = session.beginRead(["ann"])
        let second = session.beginRead(["ann"])
        // An event while both are under way, then the first read ends with what it read.
        #expect(!session.rememberEvent(presence(.online)) { TextFrame("online") }.tell, "held back while reads are under way")
        #expect(session.endRead(["ann"], first, snapshot: [presence(.online)]) == ["ann"], "the event crossed the first read")
        // The second read is still under way: a newer event must not be applied under it...
        #expect(!session.rememberEvent(presence(.away)) { TextFrame("away") }.tell, "still held back: the second read has not ended")
        // ...and the second read, older than that event, is marked to be done again.
        #expect(session.endRead(["ann"], second, snapshot: [presence(.online)]) == ["ann"])
        // With no read under way, events go straight through.
        #expect(session.rememberEvent(presence(.away)) { TextFrame("away") }.tell)
        #expect(session.lastTold("ann") == .away)
        let third = session.beginRead(["ann"])
        #expect(session.endRead(["ann"], third, snapshot: [presence(.away)]).isEmpty, "no event crossed it")
    }

    /// A dictionary emptied keeps its storage: every idle session held room for the users its
    /// opening had read (some 600 bytes for ten).
    @Test("once no read is under way, the session keeps no storage for reads")
    func readsGiveBackStorage() throws {
        let session = try Self.session()
        let users = (0..<50).map { "user-\($0)" }
        _ = session.addWatched(users)
        let all = session.beginRead(users)
        let some = session.beginRead(Array(users.prefix(5)))
        #expect(session.readingCapacity >= 50)
        _ = session.endRead(users, all, snapshot: [])
        #expect(session.readingCapacity > 0, "five users are still being read")
        _ = session.endRead(Array(users.prefix(5)), some, snapshot: [])
        #expect(session.readingCapacity == 0, "room for \(session.readingCapacity) users kept")
    }
}
