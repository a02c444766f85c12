@testable import PresenceEngine
import Testing

/// The devices a node let go of lately, which a settle after a Redis rollback checks again (no
/// server: the list alone).
@Suite("Devices let go of lately")
struct RecentReleasesTests {
    @Test("a release is remembered for the window and no longer, and a device let go twice is named once")
    func window() {
        var releases = RecentReleases(window: .seconds(60), capacity: 100)
        let start = ContinuousClock.now
        releases.note("alice|phone", at: start)
        releases.note("bob|phone", at: start + .seconds(30))
        releases.note("alice|phone", at: start + .seconds(40))
        #expect(releases.members(now: start + .seconds(50)) == ["alice|phone", "bob|phone"])
        #expect(releases.members(now: start + .seconds(95)) == ["alice|phone"], "bob's release is past the window, alice's second is not")
        #expect(releases.members(now: start + .seconds(101)).isEmpty)
        #expect(releases.count == 0)
    }

    @Test("past the capacity the oldest go first, and the list stays that long through many releases")
    func capacity() {
        var releases = RecentReleases(window: .seconds(3600), capacity: 100)
        let start = ContinuousClock.now
        for index in 0..<5_000 { releases.note("u\(index)|phone", at: start + .milliseconds(index)) }
        #expect(releases.count == 100)
        let kept = releases.members(now: start + .seconds(5))
        #expect(kept == Set((4_900..<5_000).map { "u\($0)|phone" }), "the newest hundred")
    }
}
