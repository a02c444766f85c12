import Foundation
import PresenceProtocol

/// One conversation's history as this device holds it, apart from any I/O: where the last seq
/// stands around gaps, and what an epoch that changed keeps (docs/API.md, "Epochs", "Forks").
extension ChatState.Log {
    /// Puts a stored message in the log once, in history order (by seq within its epoch, so one
    /// that came past a gap keeps its place and what fills the gap goes before it), and moves
    /// the last seq over it when it is the next. Returns whether it is new here, and the message
    /// it displaced: one held with the same epoch and seq but another id, which was carried
    /// across a fork whose point was not known and which Redis had lost.
    mutating func insert(_ message: ChatMessage) -> (isNew: Bool, displaced: ChatMessage?) {
        guard let id = message.id else { return (false, nil) }
        if seen.contains(id) {
            // Already there (the ack and the gateway's copy): the sender's id is learned.
            if let index = messages.firstIndex(where: { $0.id == id }), messages[index].senderID == nil {
                messages[index].senderID = message.senderID
            }
            return (false, nil)
        }
        if epoch == nil, let first = message.epoch { adopt(epoch: first) }
        seen.insert(id)
        var position = messages.endIndex
        var taken: Int?
        while position > messages.startIndex {
            let before = messages[position - 1]
            if before.epoch != message.epoch || (before.seq ?? 0) < (message.seq ?? 0) { break }
            if before.seq == message.seq { taken = position - 1 }
            position -= 1
        }
        var displaced: ChatMessage?
        if let taken {
            // At or after `position`: removing it leaves `position` where it is.
            let gone = messages.remove(at: taken)
            if let goneID = gone.id { seen.remove(goneID) }
            displaced = gone
        }
        messages.insert(message, at: position)
        if message.epoch == epoch, let seq = message.seq, seq > lastSeq {
            above.insert(seq)
            advanceLastSeq()
        }
        return (true, displaced)
    }

    /// Moves the last seq over what follows it that is held here or was named as missing.
    mutating func advanceLastSeq() {
        while true {
            let next = lastSeq + 1
            if above.remove(next) != nil {
                lastSeq = next
                continue
            }
            guard let range = named.first(where: { $0.contains(next) }) else { break }
            lastSeq = range.upperBound
        }
        let last = lastSeq
        named.removeAll { $0.upperBound <= last }
        above = above.filter { $0 > last }
    }

    /// A range a `synced` of epoch `current` named as missing: what Redis cannot give no longer
    /// holds the last seq (and `delivered`) back. Ranges of another epoch, and the open end of a
    /// lost epoch, name nothing of this one.
    mutating func name(missing range: MissingRange, current: String) {
        guard let to = range.toSeq, (range.epoch ?? current) == current, epoch == current, range.fromSeq <= to, to > lastSeq else { return }
        named.append(range.fromSeq...to)
    }

    /// The seqs of the log's epoch held above its last seq.
    func heldAbove() -> Set<Int64> {
        Set(messages.compactMap { message -> Int64? in
            guard message.epoch == epoch, let seq = message.seq, seq > lastSeq else { return nil }
            return seq
        })
    }

    /// The first epoch heard of the conversation. Messages stored while it was not known (from a
    /// gateway too old to say it) are of it.
    mutating func adopt(epoch first: String) {
        epoch = first
        for index in messages.indices where messages[index].epoch == nil && messages[index].seq != nil {
            messages[index].epoch = first
        }
        above = heldAbove()
        advanceLastSeq()
    }

    /// The history this device knew is gone (lost, expired, or the conversation made again):
    /// seqs start again from 1 and every cursor from 0 (docs/API.md, "Epochs"), so the last seq,
    /// what was said, what the app read and the members' cursors heard of the old epoch are
    /// forgotten; kept, they would show the new history's messages read at once and hold back its
    /// `delivered` until its seqs passed the old ones. The old epoch's messages stay, with their
    /// epoch and statuses.
    mutating func epochLost(to current: String) {
        epoch = current
        lastSeq = 0
        named = []
        stuckAt = nil
        receipts = [:]
        receiptsComplete = false
        deliveredSent = 0
        readSent = 0
        readUpTo = 0
        above = heldAbove()
    }

    /// The history forked (Redis went back in time): what is at or below the fork point carried
    /// over unchanged and is the new epoch's now (same seqs and ids), and so are the cursors up
    /// to it. What this device holds above it Redis lost: `truncated` names it, from the fork
    /// point + 1. Without `truncated`, the position synced was at or below the fork point and
    /// everything carried over, unless the new epoch gives a seq held here to another message.
    /// Returns the messages lost, which leave the log.
    mutating func forked(to current: String, truncated: [MissingRange]) -> [ChatMessage] {
        let old = epoch
        let forkPoint = truncated.map(\.fromSeq).min().map { $0 - 1 }
        // The new epoch's messages this sync gave already (they came before its `synced`).
        var given: [Int64: String] = [:]
        for message in messages where message.epoch == current {
            if let seq = message.seq, let id = message.id { given[seq] = id }
        }
        var lost: [ChatMessage] = []
        var kept: [ChatMessage] = []
        var earlier: [ChatMessage] = []
        for message in messages {
            guard message.epoch != current else {
                kept.append(message)
                continue
            }
            guard message.epoch == old, let seq = message.seq else {
                earlier.append(message)
                continue
            }
            let aboveFork = forkPoint.map { seq > $0 } ?? false
            let retaken = given[seq].map { $0 != message.id } ?? false
            if aboveFork || retaken {
                lost.append(message)
            } else {
                var carried = message
                carried.epoch = current
                kept.append(carried)
            }
        }
        // Carried-over messages come before the new epoch's, in seq order (ties keep their order).
        let ordered = kept.enumerated().sorted { first, second in
            let (one, other) = (first.element.seq ?? 0, second.element.seq ?? 0)
            return one != other ? one < other : first.offset < second.offset
        }
        messages = earlier + ordered.map(\.element)
        for message in lost {
            if let id = message.id { seen.remove(id) }
        }
        epoch = current
        let point = forkPoint ?? lastSeq
        lastSeq = min(lastSeq, point)
        named = named.compactMap { range -> ClosedRange<Int64>? in
            guard range.lowerBound <= point else { return nil }
            return range.lowerBound...min(range.upperBound, point)
        }
        above = heldAbove()
        stuckAt = nil
        receipts = receipts.mapValues { receipt in
            MemberReceipt(userID: receipt.userID, deliveredSeq: min(receipt.deliveredSeq, point), readSeq: min(receipt.readSeq, point))
        }
        deliveredSent = min(deliveredSent, point)
        readSent = min(readSent, point)
        readUpTo = min(readUpTo, point)
        return lost
    }

    /// Merges a member's cursors: they only move forward within an epoch.
    mutating func merge(_ row: ReceiptPayload) {
        guard let user = row.userID else { return }
        let known = receipts[user]
        receipts[user] = MemberReceipt(userID: user, deliveredSeq: max(known?.deliveredSeq ?? 0, row.deliveredSeq),
                                       readSeq: max(known?.readSeq ?? 0, row.readSeq))
    }
}
