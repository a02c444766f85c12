// The frames of the hot paths, read and written without Foundation's coders (see
// JSONText.swift): a change's `status` or `typing` frame and its answer, a message's `send`, and
// every update a watcher or a member gets. Each gives the same result as the Codable path, byte
// for byte where it writes (`JSONTextTests`); anything else goes through the Codable path.

extension ServerMessage {
    /// The frame's JSON text as ``FrameCoder`` writes it, or `nil` for a frame that only the
    /// Codable path writes (the snapshots: `initial_state` and `synced`).
    func directJSON(ids: PresenceIDFormat) -> [UInt8]? {
        switch frame {
        case .initialState, .synced: return nil
        default: break
        }
        var writer = JSONWriter()
        writer.object { json in
            json.key("data")
            switch frame {
            case .ack, .pong:
                json.object { _ in }
            case .presenceUpdate(let presence):
                json.object { presence.write(to: &$0, ids: ids) }
            case .typingUpdate(let typing):
                json.object { data in
                    data.key("conversation_id"); data.id(typing.conversationID, ids)
                    data.key("is_typing"); data.bool(typing.isTyping)
                    data.key("user_id"); data.id(typing.userID, ids)
                }
            case .groupPresence(let group):
                json.object { data in
                    data.key("away"); data.integer(group.away)
                    data.key("conversation_id"); data.id(group.conversationID, ids)
                    data.key("online"); data.integer(group.online)
                    data.key("total"); data.integer(group.total)
                }
            case .error(let error):
                json.object { data in
                    data.key("code"); data.string(error.code.rawValue)
                    if let conversation = error.conversationID { data.key("conversation_id"); data.id(conversation, ids) }
                    data.key("message"); data.string(error.message)
                }
            case .receipt(let receipt):
                json.object { data in
                    if let conversation = receipt.conversationID { data.key("conversation_id"); data.id(conversation, ids) }
                    data.key("delivered_seq"); data.integer(receipt.deliveredSeq)
                    data.key("read_seq"); data.integer(receipt.readSeq)
                    if let user = receipt.userID { data.key("user_id"); data.id(user, ids) }
                }
            case .message(let message):
                json.object { message.write(to: &$0, ids: ids) }
            case .messageAck(let ack):
                json.object { data in
                    data.key("client_message_id"); data.string(ack.clientMessageID)
                    data.key("conversation_id"); data.id(ack.conversationID, ids)
                    data.key("created_at"); data.timestamp(ack.createdAt)
                    data.key("duplicate"); data.bool(ack.duplicate)
                    if let epoch = ack.epoch { data.key("epoch"); data.string(epoch) }
                    data.key("id"); data.string(ack.id)
                    data.key("seq"); data.integer(ack.seq)
                }
            case .initialState, .synced:
                break  // left to the Codable path above
            }
            if let id { json.key("id"); json.string(id) }
            json.key("type"); json.string(frame.type)
        }
        return writer.bytes
    }
}

extension PresencePayload {
    fileprivate func write(to json: inout JSONWriter, ids: PresenceIDFormat) {
        if let isTyping { json.key("is_typing"); json.bool(isTyping) }
        json.key("last_seen"); json.timestamp(lastSeen)
        json.key("status"); json.string(status.rawValue)
        json.key("user_id"); json.id(userID, ids)
    }
}

extension MessagePayload {
    fileprivate func write(to json: inout JSONWriter, ids: PresenceIDFormat) {
        json.key("client_created_at"); json.timestamp(clientCreatedAt)
        json.key("client_message_id"); json.string(clientMessageID)
        json.key("conversation_id"); json.id(conversationID, ids)
        json.key("created_at"); json.timestamp(createdAt)
        if let duplicate { json.key("duplicate"); json.bool(duplicate) }
        if let epoch { json.key("epoch"); json.string(epoch) }
        json.key("id"); json.string(id)
        json.key("image_url"); if let imageURL { json.string(imageURL) } else { json.null() }
        json.key("sender_id"); json.id(senderID, ids)
        json.key("seq"); json.integer(seq)
        json.key("text"); json.string(text)
        json.key("type"); json.string(type)
    }
}

extension ClientMessage {
    /// The frames a session sends most (`ping`, `status`, `typing`, `send`, `delivered`, `read`)
    /// read directly; `nil` for any other frame and for anything this reading is not sure of (an
    /// error among them), which ``FrameCoder`` then reads through `Codable` for its result and
    /// its words.
    static func direct(_ bytes: some Collection<UInt8>, ids: PresenceIDFormat) -> ClientMessage? {
        guard let json = JSONValue.parse(bytes), json.isObject, let type = json["type"]?.string else { return nil }
        var id: String?
        if let value = json["id"] {
            guard let text = value.string, text.utf8.count <= maxIDBytes else { return nil }
            id = text
        }
        let data = json["data"]
        if let data, !data.isObject { return nil }
        func conversation() -> String? {
            switch data?["conversation_id"] {
            case .string(let text): ids.canonical(text)
            case .integer(let number): ids.canonical(number: number)
            default: nil
            }
        }
        func seq() -> Int64? {
            data?["seq"]?.integer.flatMap { SeqBounds.range.contains($0) ? $0 : nil }
        }
        switch type {
        case "ping":
            return ClientMessage(.ping, id: id)
        case "status":
            guard let status = data?["status"]?.string.flatMap(PresenceStatus.init(rawValue:)) else { return nil }
            return ClientMessage(.status(status), id: id)
        case "typing":
            guard let conversation = conversation(), let isTyping = data?["is_typing"]?.bool else { return nil }
            return ClientMessage(.typing(conversationID: conversation, isTyping: isTyping), id: id)
        case "send":
            guard let conversation = conversation(), let draft = data.flatMap({ MessageDraft(direct: $0, conversation: conversation) }) else { return nil }
            return ClientMessage(.send(draft), id: id)
        case "delivered", "read":
            guard let conversation = conversation(), let seq = seq() else { return nil }
            return ClientMessage(type == "read" ? .read(conversationID: conversation, seq: seq) : .delivered(conversationID: conversation, seq: seq), id: id)
        default:
            return nil
        }
    }
}

extension MessageDraft {
    /// A `send` frame's `data` as ``ClientMessage/init(from:)`` reads it; `nil` where that
    /// reading would refuse it (it then says why).
    fileprivate init?(direct data: JSONValue, conversation: String) {
        guard let clientID = data["client_message_id"]?.string, let text = data["text"]?.string else { return nil }
        self.init(conversationID: conversation, clientMessageID: clientID, text: text)
        // Each optional field: absent and null alike leave it unset.
        switch data["type"] {
        case nil, .null?: break
        case .string(let type)? where type == "text" || type == "image": self.type = type
        default: return nil
        }
        switch data["image_url"] {
        case nil, .null?: break
        case .string(let url)?: imageURL = url
        default: return nil
        }
        switch data["client_created_at"] {
        case nil, .null?: break
        case .string(let moment)?:
            guard let milliseconds = PresenceTimestamp.milliseconds(moment), milliseconds >= 0 else { return nil }
            clientCreatedAt = milliseconds
        default: return nil
        }
    }
}
