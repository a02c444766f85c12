import Testing

@testable import PresenceGateway

/// The heap trimmer of `MemoryTrimService`. Here, with the heavy tests that run one at a time:
/// `malloc_trim` walks the whole process's heap under malloc's locks, which would stall the
/// parallel suites' threads and their timing.
@Suite("Heap trim")
struct HeapTrimTests {
    @Test("the trimmer gives back heap pages freed after a burst, once the burst is over, and does not trim again for slack it cannot give back")
    func trim() throws {
        var trimmer = MemoryTrimmer(threshold: 16 << 20)
        // A burst: 96 MiB in 16 KiB blocks, of which three in four are freed (the rest stay live,
        // so the freed memory sits in the middle of the heap, where free() alone keeps it).
        let blocks = (0..<6144).map { _ -> UnsafeMutableRawPointer in
            let block = UnsafeMutableRawPointer.allocate(byteCount: 16 << 10, alignment: 16)
            block.initializeMemory(as: UInt8.self, repeating: 1, count: 16 << 10)
            return block
        }
        for (index, block) in blocks.enumerated() where index % 4 != 0 { block.deallocate() }
        defer { for (index, block) in blocks.enumerated() where index % 4 == 0 { block.deallocate() } }
        // The heap in use grew by 24 MiB since the trimmer last looked: still in the burst.
        let during = trimmer.check()
        #expect(during == nil, "trimmed while the heap in use was growing")
        let first = trimmer.check()
        let trim = try #require(first, "72 MiB freed in the heap's middle did not call for a trim")
        #expect(trim.slackBefore - trim.slackAfter > 48 << 20, "the trim gave back \(trim.slackBefore - trim.slackAfter) bytes")
        let again = trimmer.check()
        #expect(again == nil, "trimmed again with nothing new to give back")
    }
}
