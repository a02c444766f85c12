#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Standard output for the command-line tools, which behave as `cat` does in a pipeline: once
/// the reader is gone (`presencectl watch | head -1`), the tool ends quietly, at once, instead of
/// trapping on the failed write or waiting for its next line to find out.
public enum StandardOutput {
    /// Writes `line` and a newline unbuffered, so that it shows at once in a file or a pipe.
    /// A reader that has gone away ends the process with status 0.
    public static func say(_ line: String) {
        var bytes = Array((line + "\n").utf8)
        bytes.withUnsafeMutableBytes { buffer in
            var offset = 0
            while offset < buffer.count {
                let written = write(1, buffer.baseAddress! + offset, buffer.count - offset)
                if written > 0 {
                    offset += written
                } else if written < 0, errno == EINTR {
                    continue
                } else {
                    // EPIPE (the reader closed the pipe) or any other failure: nobody reads us.
                    exit(0)
                }
            }
        }
    }

    /// When standard output is a pipe, ends the process with status 0 as soon as the pipe's
    /// reader closes it, even while the tool has nothing to print (a live tail that is quiet).
    /// A terminal or a file is never closed under the tool: nothing is watched then.
    public static func exitWhenReaderCloses() {
        var info = stat()
        guard fstat(1, &info) == 0, info.st_mode & S_IFMT == S_IFIFO else { return }
        var thread = pthread_t()
        let started = pthread_create(&thread, nil, { _ in
            // With no event asked for, poll wakes for POLLERR alone: the read end is closed.
            var descriptor = pollfd(fd: 1, events: 0, revents: 0)
            while true {
                let ready = poll(&descriptor, 1, -1)
                if ready > 0, descriptor.revents & Int16(POLLERR | POLLHUP) != 0 { exit(0) }
                if ready < 0, errno != EINTR { return nil }
            }
        }, nil)
        if started == 0 { pthread_detach(thread) }
    }
}
