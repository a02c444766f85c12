import NIOConcurrencyHelpers
import NIOCore

/// What the sessions of one event loop are asked to do from other threads (send, close, expire),
/// carried to the loop in one hop per burst rather than one per call: a change that 5,000
/// sessions of a loop watch costs the loop one task, not 5,000, and each connection is flushed
/// once per batch however many frames it got.
///
/// Calls run on the loop in the order they were posted, whichever session they are for, so a
/// session that sends under its lock has its frames written in that order, and a close comes
/// after the frames sent before it.
final class LoopMailbox: Sendable {
    enum Operation: Sendable {
        case send(TextFrame)
        case close(code: UInt16, reason: String)
        case expire(at: NIODeadline)
        /// Completes the promise once what was sent before is taken by the socket (below NIO's
        /// high-water mark), or the connection is gone.
        case drained(EventLoopPromise<Void>)
    }

    /// An operation for a handler of this loop. The handler is touched only on the loop, in
    /// ``drain()``; the lock only carries the reference there.
    private struct Posted: @unchecked Sendable {
        let handler: SessionChannelHandler
        let operation: Operation
    }

    private struct Pending {
        var posted: [Posted] = []
        /// A drain is queued on the loop and has not taken the list yet.
        var scheduled = false
    }

    let eventLoop: any EventLoop
    /// Runs the work of this loop's sessions on the loop.
    let executor: EventLoopTaskExecutor
    private let pending = NIOLockedValueBox(Pending())

    init(eventLoop: any EventLoop) {
        self.eventLoop = eventLoop
        executor = EventLoopTaskExecutor(eventLoop: eventLoop)
    }

    /// Queues `operation` for `handler`, which must belong to this loop's channels; the first
    /// post after a drain queues the next drain.
    func post(_ operation: Operation, to handler: SessionChannelHandler) {
        let posted = Posted(handler: handler, operation: operation)
        let first = pending.withLockedValue { pending -> Bool in
            pending.posted.append(posted)
            defer { pending.scheduled = true }
            return !pending.scheduled
        }
        if first { eventLoop.execute { self.drain() } }
    }

    /// Runs what was posted so far, in order, then flushes every connection written to.
    private func drain() {
        let batch = pending.withLockedValue { pending -> [Posted] in
            pending.scheduled = false
            defer { pending.posted.removeAll(keepingCapacity: true) }
            return pending.posted
        }
        var written: [SessionChannelHandler] = []
        for posted in batch {
            switch posted.operation {
            case .send(let frame):
                if posted.handler.enqueue(frame) { written.append(posted.handler) }
            case .close(let code, let reason):
                posted.handler.close(code, reason: reason)
            case .expire(let deadline):
                posted.handler.expire(at: deadline)
            case .drained(let promise):
                posted.handler.whenDrained(promise)
            }
        }
        for handler in written { handler.flush() }
    }
}

/// One mailbox per event loop of the node's server, made on a loop's first session.
final class LoopMailboxes: Sendable {
    private let mailboxes = NIOLockedValueBox([ObjectIdentifier: LoopMailbox]())

    init() {}

    func mailbox(for eventLoop: any EventLoop) -> LoopMailbox {
        mailboxes.withLockedValue { mailboxes in
            let key = ObjectIdentifier(eventLoop)
            if let mailbox = mailboxes[key] { return mailbox }
            let mailbox = LoopMailbox(eventLoop: eventLoop)
            mailboxes[key] = mailbox
            return mailbox
        }
    }
}
