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
/// objects) becomes the new reference, so it is not trimmed again and again. On other C
/// libraries it does nothing.
struct MemoryTrimService: Service {
    var interval: Duration = .seconds(5)
    let logger: Logger

    func run() async throws {
        // The heap is the process's: `GatewayNode.run()` starts one service per process.
        var trimmer = MemoryTrimmer()
        while !Task.isShuttingDownGracefully, !Task.isCancelled {
            try? await cancelWhenGracefulShutdown { try await Task.sleep(for: interval) }
            if let trim = trimmer.check() {
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

    /// Growth of the slack, in bytes, that calls for a trim.
    var threshold: Int
    /// Growth of the heap in use between two looks, in bytes, under which the heap counts as quiet.
    var quiet: Int
    /// The slack after the last trim, or the least seen since.
    private var settled: Int
    /// The heap in use at the last look.
    private var lastInUse: Int

    init(threshold: Int = 32 << 20, quiet: Int = 4 << 20) {
        self.threshold = threshold
        self.quiet = quiet
        lastInUse = presence_malloc_in_use_bytes()
        settled = presence_resident_bytes() - lastInUse
    }

    /// Resident bytes that are not heap in use: code, stacks, and free pages malloc still holds.
    static func slack() -> Int {
        presence_resident_bytes() - presence_malloc_in_use_bytes()
    }

    /// Trims if the slack grew by more than `threshold` since it last settled while the heap in
    /// use grew by less than `quiet` since the last look.
    mutating func check() -> Trim? {
        let inUse = presence_malloc_in_use_bytes()
        let before = presence_resident_bytes() - inUse
        defer { lastInUse = inUse }
        guard before - settled > threshold, inUse - lastInUse < quiet else {
            settled = min(settled, before)
            return nil
        }
        let started = ContinuousClock.now
        presence_malloc_trim()
        let after = Self.slack()
        settled = after
        return Trim(slackBefore: before, slackAfter: after, took: ContinuousClock.now - started)
    }
}
