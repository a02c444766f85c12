import Foundation

/// A wall clock set off from the machine's, for a gateway process: libfaketime (Debian's
/// `libfaketime`, installed by `scripts/install-deps`) preloaded into the process itself.
/// Only the wall clock moves (`Date()`, `CLOCK_REALTIME`); the monotonic clock and the timers
/// on it keep true time, as on a machine whose NTP is off. libfaketime alone would shift the
/// process's monotonic timers too: `scripts/skewed-clock/true-timers.c`, preloaded before it,
/// says why and keeps them true.
public enum SkewedClock {
    /// Where Debian puts the library: `/usr/lib/<multiarch>/faketime/libfaketime.so.1`.
    public static var library: String? {
        let lib = URL(fileURLWithPath: "/usr/lib")
        let folders = (try? FileManager.default.contentsOfDirectory(atPath: lib.path)) ?? []
        return folders.map { lib.appendingPathComponent($0).appendingPathComponent("faketime/libfaketime.so.1").path }
            .first { FileManager.default.fileExists(atPath: $0) }
    }

    /// The environment that runs a process `seconds` ahead (positive) or behind (negative).
    public static func environment(offset seconds: Int) throws -> [String: String] {
        guard let library else { throw GatewayProcessError("libfaketime is not installed (apt-get install libfaketime)") }
        let timers = try trueTimers.get()
        return [
            "LD_PRELOAD": "\(timers) \(library)", "FAKETIME": seconds >= 0 ? "+\(seconds)s" : "\(seconds)s",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        ]
    }

    /// `true-timers.c` built once per test process, with the system's C compiler.
    private static let trueTimers: Result<String, GatewayProcessError> = {
        var root = URL(fileURLWithPath: #filePath)
        for _ in 0..<3 { root.deleteLastPathComponent() }
        let source = root.appendingPathComponent("scripts/skewed-clock/true-timers.c").path
        let output = FileManager.default.temporaryDirectory.appendingPathComponent("true-timers-\(UUID().uuidString.prefix(8)).so").path
        let compiler = Process()
        compiler.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        compiler.arguments = ["cc", "-shared", "-fPIC", "-O2", "-o", output, source, "-ldl"]
        let errors = Pipe()
        compiler.standardError = errors
        do {
            try compiler.run()
            compiler.waitUntilExit()
        } catch {
            return .failure(GatewayProcessError("cannot run cc for \(source): \(error)"))
        }
        guard compiler.terminationStatus == 0 else {
            let text = String(decoding: errors.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
            return .failure(GatewayProcessError("cc could not build \(source): \(text)"))
        }
        return .success(output)
    }()
}
