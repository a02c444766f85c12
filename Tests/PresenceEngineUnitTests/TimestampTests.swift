import Foundation
@testable import PresenceEngine
import Testing

@Suite("Timestamps")
struct TimestampTests {
    @Test("ISO 8601 UTC with milliseconds, as docs/API.md writes them")
    func format() {
        #expect(PresenceTimestamp.iso8601(0) == "1970-01-01T00:00:00.000Z")
        #expect(PresenceTimestamp.iso8601(1_795_262_400_123) == "2026-11-21T12:00:00.123Z")
        #expect(PresenceTimestamp.iso8601(1_795_262_405_007) == "2026-11-21T12:00:05.007Z")
    }
}
