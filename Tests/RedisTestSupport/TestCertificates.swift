import Foundation

/// Certificates for a TLS test, made by the `openssl` CLI in a folder of their own: a CA, a
/// server certificate for `127.0.0.1` and `localhost` signed by it, a client certificate signed
/// by it, and a second CA that signed nothing here (to be refused with).
public final class TestCertificates: Sendable {
    public let directory: String

    public var caFile: String { directory + "/ca.crt" }
    public var otherCAFile: String { directory + "/other-ca.crt" }
    public var serverCertificateFile: String { directory + "/server.crt" }
    public var serverKeyFile: String { directory + "/server.key" }
    public var clientCertificateFile: String { directory + "/client.crt" }
    public var clientKeyFile: String { directory + "/client.key" }

    public init() throws {
        directory = NSTemporaryDirectory() + "presence-tls-" + UUID().uuidString.prefix(8).lowercased()
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        // P-256 keys: quick to make, and what a managed Redis would likely use too.
        let script = """
        set -e
        cd '\(directory)'
        key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
        for ca in ca other-ca; do
          key $ca.key
          openssl req -x509 -new -key $ca.key -out $ca.crt -days 2 -subj "/CN=presence test $ca"
        done
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth\\n' > server.ext
        printf 'extendedKeyUsage=clientAuth\\n' > client.ext
        for who in server client; do
          key $who.key
          openssl req -new -key $who.key -out $who.csr -subj "/CN=presence test $who"
          openssl x509 -req -in $who.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out $who.crt -days 2 -extfile $who.ext 2>/dev/null
        done
        """
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/bin/sh")
        process.arguments = ["-c", script]
        let errors = Pipe()
        process.standardError = errors
        try process.run()
        process.waitUntilExit()
        guard process.terminationStatus == 0 else {
            let text = String(decoding: errors.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
            throw CocoaError(.fileWriteUnknown, userInfo: [NSLocalizedDescriptionKey: "openssl could not make test certificates: \(text)"])
        }
    }

    deinit { try? FileManager.default.removeItem(atPath: directory) }

    /// Arguments for `redis-server` to also listen with TLS on `port`, asking clients for a
    /// certificate signed by the CA when `clientCertificates`.
    public func redisArguments(tlsPort port: Int, clientCertificates: Bool) -> [String] {
        [
            "--tls-port", "\(port)",
            "--tls-cert-file", serverCertificateFile, "--tls-key-file", serverKeyFile,
            "--tls-ca-cert-file", caFile,
            "--tls-auth-clients", clientCertificates ? "yes" : "no",
        ]
    }
}
