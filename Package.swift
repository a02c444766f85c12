// swift-tools-version:6.1
import PackageDescription

let swiftSettings: [SwiftSetting] = [
    .enableUpcomingFeature("ExistentialAny"),
    .enableUpcomingFeature("MemberImportVisibility"),
]

/// The client's tests and the gateway's fault tests: clients against live gateway processes.
let liveClientTestDependencies: [Target.Dependency] = [
    "ClientTestSupport", "PresenceClient", "PresenceGateway", "PresenceEngine", "PresenceProtocol", "RedisClient", "RedisTestSupport",
    .product(name: "Hummingbird", package: "hummingbird"),
    .product(name: "HummingbirdTesting", package: "hummingbird"),
    .product(name: "JWTKit", package: "jwt-kit"),
    .product(name: "Logging", package: "swift-log"),
    .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
]

/// The Redis client's tests, with and without a server (RedisClientTests, RedisClientUnitTests).
let redisClientTestDependencies: [Target.Dependency] = [
    "RedisClient", "RedisTestSupport",
    .product(name: "NIOCore", package: "swift-nio"),
    .product(name: "NIOEmbedded", package: "swift-nio"),
    .product(name: "NIOPosix", package: "swift-nio"),
]

let package = Package(
    name: "presence-gateway",
    platforms: [.macOS(.v14), .iOS(.v17)],
    products: [
        .library(name: "RedisClient", targets: ["RedisClient"]),
        .library(name: "PresenceProtocol", targets: ["PresenceProtocol"]),
        .library(name: "PresenceEngine", targets: ["PresenceEngine"]),
        .library(name: "PresenceGateway", targets: ["PresenceGateway"]),
        .library(name: "PresenceClient", targets: ["PresenceClient"]),
        .executable(name: "presence-gateway", targets: ["presence-gateway"]),
        .executable(name: "presencectl", targets: ["presencectl"]),
        .executable(name: "presence-client", targets: ["presence-client"]),
        .executable(name: "presence-bench", targets: ["presence-bench"]),
        .executable(name: "redis-client-bench", targets: ["redis-client-bench"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-nio.git", from: "2.101.2"),
        .package(url: "https://github.com/apple/swift-nio-ssl.git", from: "2.37.6"),
        .package(url: "https://github.com/apple/swift-nio-extras.git", from: "1.35.2"),
        .package(url: "https://github.com/apple/swift-log.git", from: "1.16.2"),
        .package(url: "https://github.com/apple/swift-crypto.git", "3.12.3"..<"5.0.0"),
        .package(url: "https://github.com/swift-server/swift-service-lifecycle.git", from: "2.13.0"),
        .package(url: "https://github.com/apple/swift-argument-parser.git", from: "1.8.2"),
        .package(url: "https://github.com/hummingbird-project/hummingbird.git", from: "2.28.1", traits: []),
        .package(url: "https://github.com/hummingbird-project/hummingbird-websocket.git", from: "2.8.1"),
        .package(url: "https://github.com/vapor/jwt-kit.git", from: "5.8.0"),
        .package(url: "https://github.com/apple/swift-metrics.git", from: "2.13.0"),
        .package(url: "https://github.com/swift-server/swift-prometheus.git", from: "2.4.1"),
        .package(url: "https://github.com/HdrHistogram/hdrhistogram-swift.git", from: "0.2.0"),
    ],
    targets: [
        .systemLibrary(
            name: "CHiredis",
            pkgConfig: "hiredis",
            providers: [.apt(["libhiredis-dev"])]
        ),
        .target(
            name: "RedisClient",
            dependencies: [
                "CHiredis",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ],
            swiftSettings: swiftSettings
        ),
        // The wire protocol: frames, statuses, close and error codes, node messages. Foundation
        // only, so that the SDK on iOS and every server part share it.
        .target(
            name: "PresenceProtocol",
            swiftSettings: swiftSettings
        ),
        .target(
            name: "PresenceEngine",
            dependencies: [
                "PresenceProtocol", "RedisClient",
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ],
            swiftSettings: swiftSettings
        ),
        .target(
            name: "PresenceGateway",
            dependencies: [
                "CMallocTrim",
                "PresenceEngine",
                "PresenceWebClient",
                "RedisClient",
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "HummingbirdCore", package: "hummingbird"),
                .product(name: "JWTKit", package: "jwt-kit"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "NIOHTTPTypes", package: "swift-nio-extras"),
                .product(name: "NIOHTTPTypesHTTP1", package: "swift-nio-extras"),
                .product(name: "NIOWebSocket", package: "swift-nio"),
                .product(name: "UnixSignals", package: "swift-service-lifecycle"),
            ],
            // The dashboard, compiled into the binary: a node serves it with no files beside it.
            resources: [
                .embedInCode("Web/dashboard.html"),
                .embedInCode("Web/dashboard.js"),
                .embedInCode("Web/dashboard.css"),
            ],
            swiftSettings: swiftSettings
        ),
        // The browser client, a second SDK beside PresenceClient: JavaScript, compiled into the
        // binary for the gateway to serve.
        .target(
            name: "PresenceWebClient",
            resources: [
                .embedInCode("presence.js"),
                .embedInCode("presence.d.ts"),
            ],
            swiftSettings: swiftSettings
        ),
        .target(
            name: "PresenceClient",
            // On Apple platforms the client talks through URLSession and builds no SwiftNIO; the
            // NIO transport (and what it needs) is Linux's.
            dependencies: [
                "PresenceProtocol",
                .product(name: "Logging", package: "swift-log"),
                .product(name: "HummingbirdWSClient", package: "hummingbird-websocket", condition: .when(platforms: [.linux])),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio", condition: .when(platforms: [.linux])),
                .product(name: "NIOCore", package: "swift-nio", condition: .when(platforms: [.linux])),
                .product(name: "NIOPosix", package: "swift-nio", condition: .when(platforms: [.linux])),
                .product(name: "NIOWebSocket", package: "swift-nio", condition: .when(platforms: [.linux])),
            ],
            swiftSettings: swiftSettings
        ),
        .executableTarget(
            name: "presence-client",
            dependencies: [
                "CommandLineOutput", "PresenceClient",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "Logging", package: "swift-log"),
            ],
            swiftSettings: swiftSettings
        ),
        .executableTarget(
            name: "presence-gateway",
            dependencies: [
                "PresenceGateway",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ],
            swiftSettings: swiftSettings
        ),
        // What both command-line tools print through: a closed pipe ends them quietly.
        .target(name: "CommandLineOutput", swiftSettings: swiftSettings),
        .executableTarget(
            name: "presencectl",
            dependencies: [
                "CommandLineOutput", "PresenceEngine", "PresenceProtocol", "RedisClient",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "Logging", package: "swift-log"),
            ],
            swiftSettings: swiftSettings
        ),
        .executableTarget(
            name: "presence-bench",
            dependencies: [
                "PresenceClient", "PresenceGateway", "PresenceEngine", "PresenceProtocol", "RedisClient", "RedisTestSupport",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "HummingbirdWSClient", package: "hummingbird-websocket"),
                .product(name: "JWTKit", package: "jwt-kit"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOWebSocket", package: "swift-nio"),
                .product(name: "Histogram", package: "hdrhistogram-swift"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ],
            swiftSettings: swiftSettings
        ),
        .target(
            name: "PresenceFuzz",
            dependencies: [
                "PresenceProtocol", "RedisClient",
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOEmbedded", package: "swift-nio"),
                .product(name: "NIOWebSocket", package: "swift-nio"),
            ],
            swiftSettings: swiftSettings
        ),
        .target(name: "CFuzzerDriver"),
        // glibc's malloc statistics and trim, for the gateway's MemoryTrimService.
        .target(name: "CMallocTrim"),
        .executableTarget(
            name: "presence-fuzz",
            dependencies: ["PresenceFuzz", "CFuzzerDriver"],
            swiftSettings: swiftSettings
        ),
        .executableTarget(
            name: "redis-client-bench",
            dependencies: [
                "RedisClient",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ],
            swiftSettings: swiftSettings
        ),
        .target(
            name: "RedisTestSupport",
            dependencies: ["RedisClient"],
            path: "Tests/RedisTestSupport",
            swiftSettings: swiftSettings
        ),
        .testTarget(
            name: "RedisClientTests",
            dependencies: redisClientTestDependencies,
            swiftSettings: swiftSettings
        ),
        .testTarget(
            name: "PresenceGatewayTests",
            dependencies: [
                "PresenceGateway", "PresenceEngine", "PresenceFuzz", "PresenceProtocol", "RedisTestSupport",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "HummingbirdTesting", package: "hummingbird"),
                .product(name: "HummingbirdWSClient", package: "hummingbird-websocket"),
                .product(name: "NIOEmbedded", package: "swift-nio"),
                .product(name: "NIOWebSocket", package: "swift-nio"),
            ],
            swiftSettings: swiftSettings
        ),
        // A client that records what it reports, tokens and node environments: shared by the
        // client's tests and the gateway's fault tests.
        .target(
            name: "ClientTestSupport",
            dependencies: [
                "PresenceClient", "RedisTestSupport",
                .product(name: "JWTKit", package: "jwt-kit"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
            ],
            path: "Tests/ClientTestSupport",
            swiftSettings: swiftSettings
        ),
        .testTarget(
            name: "PresenceClientTests",
            dependencies: liveClientTestDependencies,
            swiftSettings: swiftSettings
        ),
        // The gateway under faults, as processes: nodes killed or frozen, Redis down or emptied,
        // skewed clocks, slow readers, floods, and the benchmark runs. They load the whole
        // machine, so `make test` runs them after the others, one at a time.
        .testTarget(
            name: "GatewayFaultTests",
            dependencies: liveClientTestDependencies + ["CMallocTrim"],
            swiftSettings: swiftSettings
        ),
        .testTarget(
            name: "PresenceProtocolTests",
            dependencies: ["PresenceProtocol"],
            swiftSettings: swiftSettings
        ),
        .testTarget(
            name: "PresenceEngineTests",
            dependencies: ["PresenceEngine", "PresenceProtocol", "RedisTestSupport"],
            swiftSettings: swiftSettings
        ),
        // The suites that need no Redis, no node and no network: `make unit` runs these targets
        // (and PresenceProtocolTests) whole. A suite that starts a server belongs in the target
        // without "Unit" beside it.
        .testTarget(
            name: "RedisClientUnitTests",
            dependencies: redisClientTestDependencies,
            swiftSettings: swiftSettings
        ),
        .testTarget(
            name: "PresenceEngineUnitTests",
            dependencies: ["PresenceEngine", "PresenceProtocol"],
            swiftSettings: swiftSettings
        ),
        .testTarget(
            name: "PresenceGatewayUnitTests",
            dependencies: [
                "CMallocTrim", "PresenceGateway", "PresenceEngine", "PresenceFuzz", "PresenceProtocol", "RedisClient", "RedisTestSupport",
                .product(name: "JWTKit", package: "jwt-kit"),
                .product(name: "NIOEmbedded", package: "swift-nio"),
                .product(name: "NIOWebSocket", package: "swift-nio"),
            ],
            swiftSettings: swiftSettings
        ),
        .testTarget(
            name: "PresenceClientUnitTests",
            dependencies: ["ClientTestSupport", "PresenceClient", "PresenceProtocol", .product(name: "NIOConcurrencyHelpers", package: "swift-nio")],
            swiftSettings: swiftSettings
        ),
    ]
)
