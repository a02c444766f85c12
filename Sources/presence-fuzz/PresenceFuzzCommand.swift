import Foundation
import PresenceFuzz

#if FUZZING
import CFuzzerDriver
#endif

/// `presence-fuzz TARGET ...`, TARGET one of `resp` and `frames`.
///
/// Built by `make fuzz` (`-sanitize=fuzzer,address -DFUZZING`) it is a libFuzzer program: the
/// arguments after the target are libFuzzer's (corpus folders, `-max_total_time=N`...). Built
/// plainly it replays files and folders of inputs, to reproduce a crash in a debugger.
@main
struct PresenceFuzzCommand {
    static func main() throws {
        let arguments = Array(CommandLine.arguments.dropFirst())
        guard let name = arguments.first, let target = FuzzTarget(rawValue: name) else {
            print("usage: presence-fuzz \(FuzzTarget.allCases.map(\.rawValue).joined(separator: "|")) [FILE-OR-FOLDER... | libFuzzer arguments]")
            exit(2)
        }
        #if FUZZING
        try fuzz(target, arguments: Array(arguments.dropFirst()))
        #else
        try replay(target, paths: Array(arguments.dropFirst()))
        #endif
    }

    static func replay(_ target: FuzzTarget, paths: [String]) throws {
        var count = 0
        for path in paths {
            var isFolder: ObjCBool = false
            guard FileManager.default.fileExists(atPath: path, isDirectory: &isFolder) else {
                print("presence-fuzz: no such file or folder: \(path)")
                exit(2)
            }
            let files = isFolder.boolValue
                ? try FileManager.default.contentsOfDirectory(atPath: path).filter { !$0.hasPrefix(".") }.sorted().map { path + "/" + $0 }
                : [path]
            for file in files {
                target.run(Array(try Data(contentsOf: URL(fileURLWithPath: file))))
                count += 1
            }
        }
        print("presence-fuzz: \(count) inputs ran through \(target.rawValue) without a failure")
    }

    #if FUZZING
    /// The target libFuzzer calls; set once, before the driver starts.
    nonisolated(unsafe) static var current = FuzzTarget.resp

    static func fuzz(_ target: FuzzTarget, arguments: [String]) throws {
        current = target
        // libFuzzer parses argv itself: the program name, then its own arguments.
        var cStrings: [UnsafeMutablePointer<CChar>?] = ([CommandLine.arguments[0]] + arguments).map { strdup($0) } + [nil]
        var argc = Int32(arguments.count + 1)
        let status = cStrings.withUnsafeMutableBufferPointer { buffer -> Int32 in
            var argv: UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>? = buffer.baseAddress
            return LLVMFuzzerRunDriver(&argc, &argv, fuzzOne)
        }
        exit(status)
    }
    #endif
}

#if FUZZING
/// One input; libFuzzer's runtime also refers to it by this name.
@_cdecl("LLVMFuzzerTestOneInput")
func fuzzOne(_ data: UnsafePointer<UInt8>?, _ size: Int) -> Int32 {
    PresenceFuzzCommand.current.run(data.map { Array(UnsafeBufferPointer(start: $0, count: size)) } ?? [])
    return 0
}
#endif
