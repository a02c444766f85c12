import Foundation
import PresenceFuzz
import Testing

/// The fuzz targets over the committed seeds and every input that once made them fail
/// (`Fuzz/regressions/`): a crash found by `make fuzz` is kept there and replayed here on every
/// test run, fuzzer or not.
@Suite("Fuzz corpus and regressions")
struct FuzzRegressionTests {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    @Test("every committed input runs through its target", arguments: FuzzTarget.allCases)
    func replay(target: FuzzTarget) throws {
        var count = 0
        for folder in ["Fuzz/corpus", "Fuzz/regressions"] {
            let directory = Self.root.appendingPathComponent("\(folder)/\(target.rawValue)")
            let names = try FileManager.default.contentsOfDirectory(atPath: directory.path).filter { !$0.hasPrefix(".") }
            for name in names.sorted() {
                target.run(Array(try Data(contentsOf: directory.appendingPathComponent(name))))
                count += 1
            }
        }
        #expect(count >= 5, "the seeds of \(target.rawValue) are there")
    }
}
