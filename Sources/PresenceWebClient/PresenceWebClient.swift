/// The browser client: `presence.js`, an ES module with no dependencies that behaves like the
/// Swift `PresenceClient` (the same parity fixtures hold both), and `presence.d.ts`, its
/// TypeScript declarations. Compiled into the binary, so that a gateway node serves them
/// (`/client/presence.js`, `/client/presence.d.ts`) with no files beside it.
public enum PresenceWebClient {
    /// `presence.js`.
    public static var module: [UInt8] { PackageResources.presence_js }
    /// `presence.d.ts`.
    public static var declarations: [UInt8] { PackageResources.presence_d_ts }
}
