#if canImport(UIKit) && canImport(Network)
import Foundation
import Network
import UIKit

extension PresenceClient {
    /// Feeds UIKit's lifecycle notifications and the network path to the client until the
    /// calling task is cancelled: active → `didBecomeActive()`, background →
    /// `didEnterBackground()`, terminate → `willTerminate()`, path changes →
    /// `networkChanged(available:)`.
    ///
    /// Run it beside `run()`, for example in the same task group.
    @MainActor
    public func followAppLifecycle() async {
        let center = NotificationCenter.default
        let active = UIApplication.didBecomeActiveNotification
        let background = UIApplication.didEnterBackgroundNotification
        let terminate = UIApplication.willTerminateNotification
        await withTaskGroup(of: Void.self) { group in
            group.addTask {
                for await _ in center.notifications(named: active) { await self.didBecomeActive() }
            }
            group.addTask {
                for await _ in center.notifications(named: background) { await self.didEnterBackground() }
            }
            group.addTask {
                for await _ in center.notifications(named: terminate) { await self.willTerminate() }
            }
            group.addTask {
                let paths = AsyncStream<Bool> { continuation in
                    let monitor = NWPathMonitor()
                    monitor.pathUpdateHandler = { continuation.yield($0.status == .satisfied) }
                    monitor.start(queue: DispatchQueue(label: "presence.network-path"))
                    continuation.onTermination = { _ in monitor.cancel() }
                }
                var last: Bool?
                for await available in paths where available != last {
                    last = available
                    await self.networkChanged(available: available)
                }
            }
        }
    }
}
#endif
