private import CMallocTrim
import Logging
import ServiceLifecycle

/// Gives memory that the allocator holds free back to the system after a burst.
///
/// A burst of opens and subscribes (Redis calls, replies and message tasks in flight together)
/// leaves glibc's arenas with pages that are free but still resident: without this, the node's
/// RSS keeps the burst's peak although its idle sessions need much less. ``MemoryTrimmer`` looks
/// at the slack (resident bytes beyond the heap in use) and, when it has grown by more than a
/// threshold since the last trim and the heap in use has stopped growing (the burst is over: a
/// trim during one hands back pages that are taken again at once, and holds malloc's locks while
/// sessions open), calls `malloc_trim(0)`, which hands whole free pages back with `madvise`, also
/// from the middle of an arena. Slack that a trim cannot give back (pages shared with live
/// objects) becomes the new reference, so it is not trimmed again and again. Reading the heap in
/// use walks it, so a heap whose resident size and sessions hold still is read once a minute,
/// not at each look. On other C libraries it does nothing.
struct MemoryTrimService: Service {
    var interval: Duration = .seconds(5)
    let logger: Logger
    /// The node's open sessions: their count moving is a reason to walk the heap.
    var sessions: @Sendable () -> Int = { 0 }

    func run() async throws {
        // The heap is the process's: `GatewayNode.run()` starts one service per process.
        var trimmer = MemoryTrimmer()
        while !Task.isShuttingDownGracefully, !Task.isCancelled {
            try? await cancelWhenGracefulShutdown { try await Task.sleep(for: interval) }
            if let trim = trimmer.check(sessions: sessions()) {
                logger.debug("returned free heap memory to the system", metadata: [
                    "presence.slack_before": "\(trim.slackBefore)", "presence.slack_after": "\(trim.slackAfter)",
                    "presence.took": "\(trim.took)",
                ])
            }
        }
    }
}

/// Decides when to trim the heap (see ``MemoryTrimService``).
struct MemoryTrimmer {
    /// What one trim did.
    struct Trim {
        var slackBefore: Int
        var slackAfter: Int
        var took: Duration
    }

    /// Where the trimmer reads the process's memory, and how it trims: the C library's, or a
    /// test's.
    struct Memory {
        var resident: () -> Int
        var inUse: () -> Int
        var trim: () -> Void

        static var process: Memory {
            Memory(resident: { presence_resident_bytes() }, inUse: { presence_malloc_in_use_bytes() }, trim: { _ = presence_malloc_trim() })
        }
    }

    /// Growth of the slack, in bytes, that calls for a trim.
    var threshold: Int
    /// Growth of the heap in use between two walks, in bytes, under which the heap counts as
    /// quiet; resident memory that moved by less since the last walk is no reason for one.
    var quiet: Int
    /// How far the session count may move from its value at the last walk before it is a reason
    /// for one: a session is some 9 KiB, so 500 are about the quiet step. (Sessions that came and
    /// went between two looks leave the count as it was; what they left in the heap shows in
    /// resident memory, or at the walk once a minute.)
    var sessionStep = 500
    /// The heap is walked at least once in this many looks (a minute, at the service's 5 s).
    var walkEvery = 12
    private let memory: Memory
    /// The slack after the last trim, or the least seen since.
    private var settled: Int
    /// The heap in use at the last walk.
    private var lastInUse: Int
    /// Resident memory and sessions at the last walk (or trim), and looks since.
    private var residentAtWalk: Int
    private var sessionsAtWalk = 0
    private var looksSinceWalk = 0
    /// The last walk found slack to trim while the heap was still growing: walk at the next look.
    private var trimPending = false

    init(threshold: Int = 32 << 20, quiet: Int = 4 << 20, memory: Memory = .process) {
        self.threshold = threshold
        self.quiet = quiet
        self.memory = memory
        lastInUse = memory.inUse()
        residentAtWalk = memory.resident()
        settled = residentAtWalk - lastInUse
    }

    /// Resident bytes that are not heap in use: code, stacks, and free pages malloc still holds.
    private func slack() -> Int {
        memory.resident() - memory.inUse()
    }

    /// Trims if the slack grew by more than `threshold` since it last settled while the heap in
    /// use grew by less than `quiet` since the last walk. `sessions` is the node's count now.
    ///
    /// Resident memory and `sessions` are read at every look, the heap in use only when one of
    /// them moved since the last walk (a burst, or sessions gone whose memory the heap now holds
    /// free), when that walk put a trim off, or once in ``walkEvery`` looks: reading it walks the
    /// heap under each arena's lock in turn, which stalls a thread allocating meanwhile.
    mutating func check(sessions: Int = 0) -> Trim? {
        let resident = memory.resident()
        looksSinceWalk += 1
        guard trimPending || abs(resident - residentAtWalk) >= quiet || abs(sessions - sessionsAtWalk) >= sessionStep
            || looksSinceWalk >= walkEvery
        else { return nil }
        looksSinceWalk = 0
        residentAtWalk = resident
        sessionsAtWalk = sessions
        let inUse = memory.inUse()
        let before = resident - inUse
        defer { lastInUse = inUse }
        trimPending = before - settled > threshold
        guard trimPending, inUse - lastInUse < quiet else {
            settled = min(settled, before)
            return nil
        }
        trimPending = false
        let started = ContinuousClock.now
        memory.trim()
        let after = slack()
        settled = after
        residentAtWalk = memory.resident()
        return Trim(slackBefore: before, slackAfter: after, took: ContinuousClock.now - started)
    }
}
