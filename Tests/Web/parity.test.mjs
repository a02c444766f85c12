// Feeds the recorded gateway frames of Tests/Fixtures/parity.json to the browser SDK and checks
// it announces exactly the events (and labels) the fixture expects; its `about` gives the format.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { FakeClock, settle } from "./fake-clock.mjs";

import { MemoryOutboxStore, PresenceClient, PresenceText, formatTimestamp, parseTimestamp } from "../../Sources/PresenceWebClient/presence.js";

const fixture = JSON.parse(readFileSync(new URL("../Fixtures/parity.json", import.meta.url), "utf8"));

/** The gateway's end of one session: open at once, frames delivered as given. */
class FakeSocket extends EventTarget {
  static sockets = [];

  constructor(url) {
    super();
    this.url = url;
    this.readyState = 0;
    FakeSocket.sockets.push(this);
  }

  send() {}

  close() {}

  accept() {
    this.readyState = 1;
    this.dispatchEvent(new Event("open"));
  }

  deliver(text) {
    this.dispatchEvent(Object.assign(new Event("message"), { data: text }));
  }
}

/** A client event in the fixture's words. */
function describeEvent(type, detail, now, typing) {
  switch (type) {
    case "connection":
      return { event: type, state: detail.state };
    case "presence": {
      const lastSeen = detail.lastSeen === null ? null : formatTimestamp(detail.lastSeen);
      return { event: type, user_id: detail.userId, status: detail.status, last_seen: lastSeen, label: PresenceText.status(detail, now) };
    }
    case "removed":
      return { event: type, user_id: detail.userId };
    case "typing": {
      const users = typing.get(detail.conversationId) ?? new Set();
      if (detail.isTyping) users.add(detail.userId);
      else users.delete(detail.userId);
      typing.set(detail.conversationId, users);
      const label = PresenceText.typing([...users].sort());
      return { event: type, conversation_id: detail.conversationId, user_id: detail.userId, is_typing: detail.isTyping, label };
    }
    case "group":
      return { event: type, conversation_id: detail.conversationId, total: detail.total, online: detail.online, away: detail.away, label: PresenceText.group(detail) };
    case "message":
      return {
        event: type, conversation_id: detail.conversationId, client_message_id: detail.clientMessageId, seq: detail.seq, sender_id: detail.senderId,
        text: detail.text, status: detail.status,
      };
    case "messagestatus":
      return { event: "message_status", conversation_id: detail.conversationId, client_message_id: detail.clientMessageId, status: detail.status };
    case "messagegap":
      return { event: "message_gap", conversation_id: detail.conversationId, epoch: detail.epoch, from_seq: detail.fromSeq, to_seq: detail.toSeq };
    default:
      return { event: type, code: detail.code, message: detail.message };
  }
}

test("the browser SDK announces exactly what parity.json expects for its gateway frames", async () => {
  const start = parseTimestamp(fixture.now);
  assert.notEqual(start, null);
  const clock = new FakeClock(start);
  const client = new PresenceClient({
    gatewayURLs: "wss://gateway.test",
    deviceId: "parity",
    token: async () => "token",
    clock,
    WebSocket: FakeSocket,
    window: null,
    document: null,
    storage: null,
    outboxStore: new MemoryOutboxStore(),
  });
  /** Who types where, as the events tell. */
  const typing = new Map();
  let heard = [];
  for (const type of ["connection", "presence", "removed", "typing", "group", "error", "message", "messagestatus", "messagegap"]) {
    client.addEventListener(type, (event) => heard.push(describeEvent(type, event.detail, clock.now(), typing)));
  }

  let total = 0;
  for (const [index, step] of fixture.steps.entries()) {
    heard = [];
    if (step.start) {
      client.start();
      await settle();
      assert.equal(FakeSocket.sockets.length, 1, "one connection attempt");
      FakeSocket.sockets[0].accept();
    } else if (typeof step.frame === "string") {
      FakeSocket.sockets[0].deliver(step.frame);
      await settle();
    } else if (typeof step.advance_seconds === "number") {
      await clock.advance(step.advance_seconds);
    } else {
      assert.fail(`step ${index} is none of start, frame, advance_seconds`);
    }
    assert.deepEqual(heard, step.expect, `step ${index}: ${step.note ?? step.frame ?? JSON.stringify(step)}`);
    // The cache says the same as the events.
    for (const [conversation, users] of typing) assert.deepEqual(client.typingUsers(conversation), [...users].sort(), `step ${index}: typing in ${conversation}`);
    total += step.expect.length;
  }
  assert.ok(total >= 20, "the fixture exercises a real sequence");
  assert.equal(FakeSocket.sockets.length, 1, "one session throughout");
});
