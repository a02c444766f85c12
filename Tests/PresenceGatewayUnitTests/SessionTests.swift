import NIOCore
import NIOEmbedded
import PresenceEngine
import PresenceProtocol
import Testing

@testable import PresenceEngine
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

    static func stored(_ epoch: String, _ seq: Int64) -> StoredMessage {
        StoredMessage(conversationID: "room", epoch: epoch, seq: seq, id: "\(epoch)-\(seq)", senderID: "ann", clientMessageID: "c\(seq)",
                      type: .text, text: "hi", imageURL: nil, createdAt: 0, clientCreatedAt: nil)
    }

    @Test("a late live message of an epoch the session has moved past is dropped, after a message or a synced of the new epoch")
    func pastEpochs() {
        var conversation = Session.ConversationState()
        var taken: [Bool] = []
        for (epoch, seq) in [("old", 25), ("new", 26), ("old", 26), ("new", 27)] { taken.append(conversation.take(Self.stored(epoch, Int64(seq)))) }
        // The history forked at 25; old 26, published before the rollback and late, names
        // another message now.
        #expect(taken == [true, true, false, true])

        var answered = Session.ConversationState()
        let first = answered.take(Self.stored("old", 25))
        answered.answered(in: "new", clientEpoch: "old")
        // Told the new epoch, then a late one of the old.
        let late = answered.live(Self.stored("old", 26), frame: TextFrame(Array("old 26".utf8)), openingHold: false)
        let next = answered.live(Self.stored("new", 26), frame: TextFrame(Array("new 26".utf8)), openingHold: false)
        #expect(first && !late && next)
    }

    @Test("a sync position is raised to the end of the unbroken run the session was sent of its epoch, and only then")
    func syncHolding() {
        let position = SyncPosition(conversationID: "room", afterSeq: 2, epoch: "e")
        #expect(FrameHandler.holding(position, sent: Session.SentRun(epoch: "e", seq: 4, runStart: 1)).afterSeq == 4)
        #expect(FrameHandler.holding(position, sent: Session.SentRun(epoch: "e", seq: 4, runStart: 3)).afterSeq == 4)
        #expect(FrameHandler.holding(position, sent: Session.SentRun(epoch: "e", seq: 4, runStart: 4)).afterSeq == 2, "a gap between: named missing as before")
        #expect(FrameHandler.holding(position, sent: Session.SentRun(epoch: "f", seq: 4, runStart: 1)).afterSeq == 2, "another epoch")
        #expect(FrameHandler.holding(position, sent: Session.SentRun(epoch: "e", seq: 1, runStart: 1)).afterSeq == 2)
        #expect(FrameHandler.holding(SyncPosition(conversationID: "room", afterSeq: 2), sent: Session.SentRun(epoch: "e", seq: 4, runStart: 1)).afterSeq == 2)
    }

    @Test("a refused sync leaves its conversation behind: no live message past the gap until a sync of it is answered")
    func refusedSync() throws {
        let session = try Self.session()
        func frame(_ seq: Int64) -> TextFrame { TextFrame(Array("message \(seq)".utf8)) }
        session.endOpeningHold()
        session.beginSync(["room"])
        session.endSync("room", answer: nil)
        session.deliverLive(Self.stored("e", 3), frame: frame(3))
        #expect(session.sentPosition("room") == nil, "seq 3 went out after the refusal, past whatever the client lacks")
        session.beginSync(["room"])
        session.endSync("room", answer: Session.SyncAnswer(messages: [(Self.stored("e", 2), frame(2)), (Self.stored("e", 3), frame(3))],
                                                          synced: "synced", more: false, epoch: "e", clientEpoch: "e"))
        session.deliverLive(Self.stored("e", 4), frame: frame(4))
        #expect(session.sentPosition("room") == Session.SentRun(epoch: "e", seq: 4, runStart: 2))
    }
}
