import Testing

@testable import PresenceGateway

/// When the heap trimmer reads the heap in use. Reading it (glibc's `mallinfo2`) walks every
/// free chunk of every arena, each under its arena's lock: 4.4 to 6.9 ms on a node holding
/// 10,000 sessions. The process's resident memory and the node's session count are read at every
/// look; the heap only when one of them moved, when the last walk left a trim pending, or once
/// in `walkEvery` looks. The readings here are a test's; `HeapTrimTests` trims a real heap.
@Suite("Heap trim: when the heap is walked")
struct MemoryTrimmerTests {
    /// Memory readings set by the test, counting the walks of the heap and the trims.
    final class Heap {
        var resident = 300 << 20
        var inUse = 200 << 20
        var walks = 0
        var trims = 0

        var memory: MemoryTrimmer.Memory {
            MemoryTrimmer.Memory(
                resident: { self.resident },
                inUse: {
                    self.walks += 1
                    return self.inUse
                },
                trim: {
                    self.trims += 1
                    self.resident = self.inUse + (100 << 20)
                }
            )
        }
    }

    /// A trimmer over `heap` that has had its first look with 10,000 sessions open (a walk: the
    /// sessions came since it started), the count of walks set back to 0.
    private static func trimmer(_ heap: Heap) -> MemoryTrimmer {
        var trimmer = MemoryTrimmer(memory: heap.memory)
        #expect(trimmer.check(sessions: 10_000) == nil)
        heap.walks = 0
        return trimmer
    }

    @Test("a heap that nothing changed is walked once in 12 looks (a minute), not at every look")
    func steady() {
        let heap = Heap()
        var trimmer = Self.trimmer(heap)
        for _ in 0..<24 { #expect(trimmer.check(sessions: 10_000) == nil) }
        #expect(heap.walks == 2)
        #expect(heap.trims == 0)
    }

    @Test("resident memory that moved by the quiet step, or sessions by 500, call for a walk")
    func movedReadings() {
        let heap = Heap()
        var trimmer = Self.trimmer(heap)
        heap.resident += 3 << 20
        _ = trimmer.check(sessions: 10_000)
        #expect(heap.walks == 0, "3 MiB more resident: under the quiet step")
        heap.resident += 1 << 20
        _ = trimmer.check(sessions: 10_000)
        #expect(heap.walks == 1, "4 MiB more resident since the last walk")
        _ = trimmer.check(sessions: 10_499)
        #expect(heap.walks == 1, "499 sessions more")
        _ = trimmer.check(sessions: 9_500)
        #expect(heap.walks == 2, "500 sessions fewer than at the last walk")
    }

    @Test("sessions closed in bulk, resident memory unchanged: the heap they freed is trimmed at the next look")
    func massClose() {
        let heap = Heap()
        var trimmer = Self.trimmer(heap)
        _ = trimmer.check(sessions: 10_000)
        #expect(heap.walks == 0)
        heap.inUse -= 60 << 20
        let trim = trimmer.check(sessions: 3_000)
        #expect(heap.walks == 2, "one walk, and one more after the trim to see what it gave back")
        #expect(trim?.slackBefore == 160 << 20)
        #expect(heap.trims == 1)
    }

    @Test("slack over the threshold while the heap still grows is looked at again at the next look, and trimmed once the heap is quiet")
    func pendingTrim() {
        let heap = Heap()
        var trimmer = Self.trimmer(heap)
        heap.resident += 100 << 20
        heap.inUse += 40 << 20
        #expect(trimmer.check(sessions: 10_000) == nil, "the heap in use grew by 40 MiB since the last walk: a burst under way")
        #expect(heap.walks == 1)
        #expect(trimmer.check(sessions: 10_000) != nil, "nothing moved, but the trim the last walk put off is due")
        #expect(heap.walks == 3, "a walk, and one after the trim")
        #expect(heap.trims == 1)
        #expect(trimmer.check(sessions: 10_000) == nil)
        #expect(heap.walks == 3, "the trim's own drop in resident memory is no reason to walk again")
    }
}
