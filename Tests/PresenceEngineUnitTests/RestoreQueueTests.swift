@testable import PresenceEngine
import Testing

/// The devices a node owes Redis after a loss, as runs of ``PresenceEngine/restorePending()``
/// claim and write them (no server: the queue alone).
@Suite("Devices owed after a loss, claimed by restore runs")
struct RestoreQueueTests {
    @Test("two restore runs at once claim batches apart; a failed batch is owed again, a written one no more")
    func restoreRunsClaimApart() {
        var queue = PresenceEngine.RestoreQueue()
        queue.owed = Set((0..<5).map { "u\($0)|phone" })
        let first = queue.claim(3)
        let second = queue.claim(3)
        #expect(first.count == 3 && second.count == 2, "the second run takes what the first left: \(first), \(second)")
        #expect(Set(first).isDisjoint(with: second), "no device is in both runs' batches")
        #expect(queue.claim(3).isEmpty, "a third run finds everything claimed")
        #expect(queue.owed.count == 5, "claimed devices are owed until written: reads are not current yet")

        queue.written(first)
        queue.unclaim(second)
        #expect(queue.owed == Set(second), "the failed batch is owed still, the written one no more")
        #expect(Set(queue.claim(10)) == Set(second), "the next run takes the failed batch")
    }

    @Test("a device found lost again while a run writes it stays owed until that run is done")
    func lostAgainWhileWritten() {
        var queue = PresenceEngine.RestoreQueue()
        queue.owed = ["alice|phone"]
        let batch = queue.claim(10)
        queue.owed.insert("alice|phone")
        #expect(queue.claim(10).isEmpty, "not claimed twice")
        queue.written(batch)
        #expect(queue.owed.isEmpty)
    }
}
