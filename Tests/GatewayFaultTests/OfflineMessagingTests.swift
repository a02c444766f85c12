import ClientTestSupport
import Foundation
import PresenceProtocol
import RedisTestSupport
import Testing

/// The chat app's own test plan for offline messaging (seed 004), against two node processes:
/// devices that keep what they write offline in an outbox and send it, with the same client ids,
/// once a session opens again (``MessageDevice``).
@Suite("Offline messaging, the chat app's test plan", .serialized)
struct OfflineMessagingTests {
    static func texts(_ device: MessageDevice) -> [String] { device.received("chat").map(\.text) }

    /// Two nodes, the conversation `chat` of alice and bob, and a device of each, alice's on
    /// the first node and bob's on the second.
    static func start() async throws -> (nodes: [GatewayProcess], alice: MessageDevice, bob: MessageDevice) {
        let environment = nodeEnvironment(prefix: TestRedis.uniquePrefix("offline"), extra: ["PRESENCE_VISIBILITY": "open"])
        let nodes = [try await GatewayProcess(nodeID: "node0", environment: environment), try await GatewayProcess(nodeID: "node1", environment: environment)]
        #expect(admin(nodes[0], "PUT", "/api/admin/conversations/chat", #"{"member_ids":["alice","bob"]}"#)?.status == 200)
        let alice = MessageDevice(user: "alice", device: "phone", conversations: ["chat"])
        let bob = MessageDevice(user: "bob", device: "phone", conversations: ["chat"])
        try await alice.connect(port: nodes[0].port)
        try await bob.connect(port: nodes[1].port)
        return (nodes, alice, bob)
    }

    @Test("case 2: A writes 5 messages offline; back online they all go, and B has all 5, in order, within 3 s")
    func fiveWrittenOffline() async throws {
        let (nodes, alice, bob) = try await Self.start()
        alice.drop()
        for number in 1...5 { alice.send("offline \(number)", to: "chat", clientID: "a-\(number)") }
        #expect(alice.unacknowledged == 5, "written offline, nothing sent yet")
        let back = ContinuousClock.now
        try await alice.connect(port: nodes[1].port)
        let arrived = await eventually(timeout: .seconds(3), poll: .milliseconds(10)) { Self.texts(bob).count >= 5 }
        let took = ContinuousClock.now - back
        #expect(arrived, "B had \(Self.texts(bob).count) of 5 after \(took)")
        #expect(Self.texts(bob) == (1...5).map { "offline \($0)" })
        #expect(await eventually { alice.unacknowledged == 0 } && alice.acknowledged.count == 5)
        print("offline messaging case 2: B had all 5 \(took) after A's session opened again")
    }

    @Test("case 3: A offline 3, online; B offline 2, online; A offline 5, online: both end with the complete history, in one order")
    func cycles() async throws {
        let (nodes, alice, bob) = try await Self.start()
        var number = 0
        func cycle(_ device: MessageDevice, count: Int, backOn port: Int) async throws {
            device.drop()
            for _ in 0..<count {
                number += 1
                device.send("\(device.user) \(number)", to: "chat", clientID: "\(device.user)-\(number)")
            }
            try await Task.sleep(for: .milliseconds(300))
            try await device.connect(port: port)
            #expect(await eventually(timeout: .seconds(5)) { device.unacknowledged == 0 })
        }
        try await cycle(alice, count: 3, backOn: nodes[1].port)
        try await cycle(bob, count: 2, backOn: nodes[0].port)
        try await cycle(alice, count: 5, backOn: nodes[0].port)
        #expect(await eventually(timeout: .seconds(5)) { Self.texts(alice).count == 10 && Self.texts(bob).count == 10 })
        let want = (1...3).map { "alice \($0)" } + (4...5).map { "bob \($0)" } + (6...10).map { "alice \($0)" }
        #expect(Self.texts(alice) == want && Self.texts(bob) == want, "alice \(Self.texts(alice)), bob \(Self.texts(bob))")
        #expect(alice.received("chat").map(\.seq) == Array(1...10) && alice.repeats.isEmpty && bob.repeats.isEmpty)
    }
}
