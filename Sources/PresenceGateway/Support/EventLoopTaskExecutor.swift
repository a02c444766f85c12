import NIOCore

/// Runs a task's jobs on one event loop: a session's work (its opening, its frames, its end)
/// runs on the loop that holds its connection, so that the reply it awaits from Redis resumes it
/// there, and what it sends back is written without another thread being woken.
///
/// Without a preference a task runs on the concurrency runtime's pool: each await on Redis put
/// the task back on a pool thread (a wake-up), and each frame it sent went on to the loop (a
/// second). Work here must not block: it shares the loop with the connections' I/O.
final class EventLoopTaskExecutor: TaskExecutor {
    let eventLoop: any EventLoop

    init(eventLoop: any EventLoop) {
        self.eventLoop = eventLoop
    }

    func enqueue(_ job: consuming ExecutorJob) {
        let job = UnownedJob(job)
        eventLoop.execute {
            job.runSynchronously(on: self.asUnownedTaskExecutor())
        }
    }
}
