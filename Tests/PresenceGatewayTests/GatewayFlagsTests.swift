import Foundation
import PresenceGateway
import Testing

/// The built `presence-gateway` binary's command line (the settings themselves are read in
/// PresenceGatewayUnitTests' `ConfigurationTests`).
@Suite("presence-gateway's flags, run as a built binary")
struct GatewayFlagsTests {
    @Test("presence-gateway prints its settings as JSON, and a flag it does not know or a value out of range stops it with a message naming it")
    func gatewayFlags() async throws {
        let schema = try await CTL.run(["--print-config-schema"], program: "presence-gateway")
        #expect(schema.status == 0 && schema.out == GatewaySetting.schema + "\n", "\(schema.err)")
        let help = try await CTL.run(["--help"], program: "presence-gateway")
        #expect(help.status == 0 && GatewaySetting.all.allSatisfy { help.out.contains($0.flag) && help.out.contains("[\($0.name)]") }, "--help lists every setting: \(help.out)")
        let unknown = try await CTL.run(["--lease-tll", "5"], program: "presence-gateway")
        #expect(unknown.status == 64 && unknown.err.contains("unknown option '--lease-tll'"), "\(unknown)")
        let misspelt = try await CTL.run(["--jwt-secrt=hunter2-hunter2"], program: "presence-gateway")
        #expect(misspelt.status == 64 && misspelt.err.contains("'--jwt-secrt'") && !misspelt.err.contains("hunter2"), "a misspelt flag's value is not printed: \(misspelt)")
        let missing = try await CTL.run(["--port"], program: "presence-gateway")
        #expect(missing.status == 64 && missing.err.contains("--port needs a value"), "\(missing)")
        for arguments in [["--lease-ttl", "0"], ["--lease-ttl=0"]] {
            let refused = try await CTL.run(arguments + ["--jwt-secret", String(repeating: "s", count: 32)], program: "presence-gateway")
            #expect(refused.status == 2 && refused.err.contains("PRESENCE_LEASE_TTL=0 must be a whole number between 1 and 3600"), "\(arguments): \(refused)")
        }
        let message = try await CTL.run(["--message-max-bytes", "0", "--jwt-secret", String(repeating: "s", count: 32)], program: "presence-gateway")
        #expect(message.status == 2 && message.err.contains("PRESENCE_MESSAGE_MAX_BYTES=0"), "a setting that had no flag before has one: \(message)")
    }
}
