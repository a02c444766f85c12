// The browser SDK (Sources/PresenceWebClient/presence.js) on a fake clock and a fake
// WebSocket: `node --test Tests/Web/`.
import assert from "node:assert/strict";
import { describe, test } from "node:test";

import { FakeClock as SharedFakeClock, settle } from "./fake-clock.mjs";

import {
  DEVICE_ID_STORAGE_KEY,
  MemoryOutboxStore,
  PresenceClient,
  PresenceClientError,
  PresenceText,
  ReconnectBackoff,
  TypingDebouncer,
  parseTimestamp,
} from "../../Sources/PresenceWebClient/presence.js";

const START = Date.parse("2026-11-21T12:00:00.000Z");

/** A fake clock starting at START unless told otherwise. */
class FakeClock extends SharedFakeClock {
  constructor(start = START) { super(start); }
}

/** A WebSocket class whose instances the test drives from the gateway's side. */
function fakeWebSocket() {
  const sockets = [];
  class FakeSocket extends EventTarget {
    static sockets = sockets;
    /** Whether a close from the client is answered (as the gateway does). */
    static answersClose = true;

    /** The test's clock, so that each frame written has its moment. */
    static clock = null;

    constructor(url) {
      super();
      this.url = url;
      this.readyState = 0;
      this.sent = [];
      this.sentAt = [];
      this.closeCalls = [];
      sockets.push(this);
    }

    send(text) {
      if (this.readyState === 0) throw new Error("InvalidStateError: still connecting");
      if (this.readyState === 1) {
        this.sent.push(text);
        this.sentAt.push(FakeSocket.clock?.now() ?? null);
      }
    }

    close(code) {
      this.closeCalls.push(code ?? null);
      if (this.readyState >= 2) return;
      this.readyState = 2;
      // The gateway answers a close without a code with 1000.
      if (FakeSocket.answersClose) queueMicrotask(() => this.serverClose(code ?? 1000));
    }

    get frames() { return this.sent.map((text) => JSON.parse(text)); }

    framesOf(type) { return this.frames.filter((frame) => frame.type === type); }

    // The gateway's side.
    accept() {
      this.readyState = 1;
      this.dispatchEvent(new Event("open"));
    }

    deliver(frame) {
      this.dispatchEvent(Object.assign(new Event("message"), { data: typeof frame === "string" ? frame : JSON.stringify(frame) }));
    }

    /** Accepts and sends the session's first `initial_state`. */
    open(presences = []) {
      this.accept();
      this.deliver({ type: "initial_state", data: { presences } });
    }

    serverClose(code) {
      if (this.readyState === 3) return;
      this.readyState = 3;
      this.dispatchEvent(Object.assign(new Event("close"), { code }));
    }

    /** The upgrade failed (refused or unreachable): the browser says 1006 and no more. */
    fail() {
      this.readyState = 3;
      this.dispatchEvent(new Event("error"));
      this.dispatchEvent(Object.assign(new Event("close"), { code: 1006 }));
    }
  }
  return FakeSocket;
}

function memoryStorage(entries = {}) {
  const map = new Map(Object.entries(entries));
  return { getItem: (key) => map.get(key) ?? null, setItem: (key, value) => map.set(key, String(value)), map };
}

const EVENT_NAMES = ["connection", "presence", "removed", "typing", "group", "error", "message", "messagestatus", "messagegap", "messagetruncated"];

/** A client on fakes, its page, and what it announced. */
function setup(options = {}) {
  const clock = new FakeClock();
  const WebSocket = fakeWebSocket();
  WebSocket.clock = clock;
  const document = Object.assign(new EventTarget(), { visibilityState: "visible" });
  const window = Object.assign(new EventTarget(), { navigator: { onLine: true } });
  const tokenCalls = [];
  const client = new PresenceClient({
    gatewayURLs: "https://gateway.test",
    deviceId: "browser-1",
    token: async (refresh) => {
      tokenCalls.push(refresh);
      return `token-${tokenCalls.length}`;
    },
    clock,
    random: () => 0.5,
    WebSocket,
    window,
    document,
    storage: null,
    ...options,
  });
  const events = [];
  for (const type of EVENT_NAMES) client.addEventListener(type, (event) => events.push({ type, detail: event.detail }));
  const harness = {
    client, clock, WebSocket, document, window, tokenCalls, events,
    get sockets() { return WebSocket.sockets; },
    last() { return WebSocket.sockets.at(-1); },
    states() { return events.filter((event) => event.type === "connection").map((event) => event.detail.state); },
    of(type) { return events.filter((event) => event.type === type).map((event) => event.detail); },
    setHidden(hidden) {
      document.visibilityState = hidden ? "hidden" : "visible";
      document.dispatchEvent(new Event("visibilitychange"));
    },
    /** Seconds until the next attempt, from the waiting state. */
    waitingDelay() {
      const state = client.connectionState;
      assert.equal(state.state, "waiting", `waiting, not ${JSON.stringify(state)}`);
      return Math.round(state.retryAt.getTime() - clock.now()) / 1000;
    },
    /** Starts and opens the first session. */
    async connect(presences = []) {
      client.start();
      await settle();
      harness.last().open(presences);
      await settle();
      assert.equal(client.connectionState.state, "connected");
      return harness.last();
    },
  };
  return harness;
}

const typingFrames = (socket) => socket.framesOf("typing").map((frame) => frame.data);
const statusFrames = (socket) => socket.framesOf("status").map((frame) => frame.data.status);

describe("reconnecting", () => {
  test("failed attempts wait 1, 2, 4, 8, 16, 16 s on the clock; a session that opened starts again from 1 s", async () => {
    const h = setup();
    h.client.start();
    await settle();
    const delays = [];
    for (let step = 0; step < 6; step += 1) {
      h.last().fail();
      await settle();
      const delay = h.waitingDelay();
      delays.push(delay);
      const attempts = h.sockets.length;
      await h.clock.advance(delay - 0.01);
      assert.equal(h.sockets.length, attempts, "no attempt before the delay is over");
      await h.clock.advance(0.01);
      assert.equal(h.sockets.length, attempts + 1, "an attempt once it is");
    }
    assert.deepEqual(delays, [1, 2, 4, 8, 16, 16]);
    h.last().open();
    await settle();
    assert.equal(h.client.connectionState.state, "connected");
    h.last().serverClose(1006);
    await settle();
    assert.equal(h.waitingDelay(), 1, "back to 1 s after a session opened");
  });

  test("jitter moves each delay by at most ±20 %, and uses the injected random()", async () => {
    for (const [random, expected] of [[() => 0, 0.8], [() => 0.999999, 1.2]]) {
      const h = setup({ random });
      h.client.start();
      await settle();
      h.last().fail();
      await settle();
      assert.ok(Math.abs(h.waitingDelay() - expected) < 0.001, `${h.waitingDelay()} for ${expected}`);
    }
    const backoff = new ReconnectBackoff();
    const seen = new Set();
    for (let run = 0; run < 50; run += 1) {
      backoff.reset();
      for (const base of [1, 2, 4, 8, 16, 16]) {
        const delay = backoff.nextDelay();
        assert.ok(delay >= base * 0.8 && delay <= base * 1.2, `${delay} for ${base}`);
        if (base === 1) seen.add(delay);
      }
    }
    assert.ok(seen.size > 40, "first delays differ from run to run");
    assert.deepEqual(Array.from({ length: 7 }, ((plain) => () => plain.nextDelay())(new ReconnectBackoff({ jitter: 0 }))), [1, 2, 4, 8, 16, 16, 16]);
  });

  test("attempts rotate through the gateway URLs; http(s) becomes ws(s) with the session path and query", async () => {
    const h = setup({ gatewayURLs: ["https://a.test/base/", "http://b.test:8080"] });
    h.client.start();
    await settle();
    h.last().fail();
    await settle();
    assert.equal(h.sockets.length, 2, "a node not reached: the next URL at once");
    h.last().fail();
    await settle();
    await h.clock.advance(h.waitingDelay());
    const urls = h.sockets.map((socket) => new URL(socket.url));
    assert.deepEqual(urls.map((url) => `${url.origin}${url.pathname}`), [
      "wss://a.test/base/api/presence/subscribe",
      "ws://b.test:8080/api/presence/subscribe",
      "wss://a.test/base/api/presence/subscribe",
    ]);
    assert.equal(urls[0].searchParams.get("token"), "token-1");
    assert.equal(urls[0].searchParams.get("device_id"), "browser-1");
    assert.equal(urls[0].searchParams.get("status"), "online");
    assert.equal(urls[2].searchParams.get("token"), "token-3", "a token for each attempt");
  });

  test("1001 reconnects at once to the next URL; a second 1001 before a session opened backs off", async () => {
    const h = setup({ gatewayURLs: ["wss://a.test", "wss://b.test"] });
    await h.connect();
    h.last().serverClose(1001);
    await settle();
    assert.equal(h.sockets.length, 2, "without the clock moving");
    assert.equal(new URL(h.last().url).host, "b.test");
    h.last().accept();
    h.last().serverClose(1001);
    await settle();
    assert.equal(h.sockets.length, 2);
    assert.equal(h.waitingDelay(), 1);
    assert.equal(h.client.lastCloseCode, 1001);
  });

  test("1011 and 1013 try each other URL at once, then back off; a session that opens starts the count again", async () => {
    const h = setup({ gatewayURLs: ["wss://a.test", "wss://b.test", "wss://c.test"] });
    await h.connect();
    h.last().serverClose(1011);
    await settle();
    assert.equal(h.sockets.length, 2, "without the clock moving");
    assert.equal(new URL(h.last().url).host, "b.test");
    h.last().accept();
    h.last().serverClose(1013);
    await settle();
    assert.equal(h.sockets.length, 3);
    assert.equal(new URL(h.last().url).host, "c.test");
    h.last().accept();
    h.last().serverClose(1011);
    await settle();
    assert.equal(h.sockets.length, 3, "every URL said it cannot serve: back off");
    assert.equal(h.waitingDelay(), 1);
    await h.clock.advance(h.waitingDelay());
    assert.equal(h.sockets.length, 4);
    h.last().open();
    await settle();
    h.last().serverClose(1011);
    await settle();
    assert.equal(h.sockets.length, 5, "after a session, the next URL at once again");
  });

  test("a node not reached (down, or gone before initial_state): each other URL at once, then the backoff with a fresh token", async () => {
    const h = setup({ gatewayURLs: ["wss://a.test", "wss://b.test", "wss://c.test"] });
    await h.connect();
    // The node dies: a drop waits the backoff, as before (a dead node's clients spread out).
    h.last().serverClose(1006);
    await settle();
    assert.equal(h.waitingDelay(), 1);
    await h.clock.advance(1);
    assert.equal(new URL(h.last().url).host, "b.test");
    // b is down too: c at once, not after 2 s.
    h.last().fail();
    await settle();
    assert.equal(h.sockets.length, 3, "without the clock moving");
    assert.equal(new URL(h.last().url).host, "c.test");
    // c takes the connection and drops it before initial_state: a at once.
    h.last().accept();
    h.last().serverClose(1006);
    await settle();
    assert.equal(h.sockets.length, 4);
    assert.equal(new URL(h.last().url).host, "a.test");
    // Every URL was tried: the backoff, and a fresh token after it (a refused upgrade looks the same).
    h.last().fail();
    await settle();
    assert.equal(h.sockets.length, 4, "all three failed: back off");
    assert.equal(h.waitingDelay(), 2);
    await h.clock.advance(2);
    assert.equal(h.sockets.length, 5);
    assert.deepEqual(h.tokenCalls, [false, false, false, false, true]);
    h.last().open();
    await settle();
    assert.equal(h.client.connectionState.state, "connected");
  });

  test("the token provider is asked for a fresh token after 4001, and the reconnect is immediate", async () => {
    const h = setup();
    await h.connect();
    assert.deepEqual(h.tokenCalls, [false]);
    h.last().serverClose(4001);
    await settle();
    assert.deepEqual(h.tokenCalls, [false, true]);
    assert.equal(h.sockets.length, 2, "at once");
    assert.equal(new URL(h.last().url).searchParams.get("token"), "token-2");
    // Refused again before any session opened: back off, still asking for a fresh token.
    h.last().accept();
    h.last().serverClose(4001);
    await settle();
    await h.clock.advance(h.waitingDelay());
    assert.deepEqual(h.tokenCalls, [false, true, true]);
    h.last().open();
    await settle();
    h.last().serverClose(1006);
    await settle();
    await h.clock.advance(h.waitingDelay());
    assert.deepEqual(h.tokenCalls, [false, true, true, false], "a drop needs no new token");
  });

  test("a token provider that fails is an error event and a backoff", async () => {
    let fail = true;
    const h = setup({ token: async () => { if (fail) throw new Error("no session cookie"); return "t"; } });
    h.client.start();
    await settle();
    assert.deepEqual(h.of("error"), [{ code: "unauthorized", message: "the token provider failed: no session cookie" }]);
    assert.equal(h.sockets.length, 0);
    fail = false;
    await h.clock.advance(h.waitingDelay());
    assert.equal(h.sockets.length, 1);
  });

  test("4003 stops for good: no reconnect, whatever the page does", async () => {
    const h = setup();
    await h.connect();
    h.last().serverClose(4003);
    await settle();
    assert.deepEqual(h.client.connectionState, { state: "stopped", reason: "disconnectedByAdmin" });
    await h.clock.advance(120);
    h.window.dispatchEvent(new Event("online"));
    h.setHidden(true);
    h.setHidden(false);
    await settle();
    assert.equal(h.sockets.length, 1);
    assert.equal(h.client.connectionState.state, "stopped");
  });

  test("4009 (another session took the device over) stops with reason replaced", async () => {
    const h = setup();
    await h.connect();
    h.last().serverClose(4009);
    await settle();
    await h.clock.advance(60);
    assert.deepEqual(h.client.connectionState, { state: "stopped", reason: "replaced" });
    assert.equal(h.sockets.length, 1);
  });

  test("an attempt without its initial_state is given up after openTimeout and tried again after the backoff", async () => {
    const h = setup();
    h.client.start();
    await settle();
    h.last().accept();
    await h.clock.advance(9.9);
    assert.equal(h.client.connectionState.state, "connecting");
    assert.deepEqual(h.last().closeCalls, []);
    await h.clock.advance(0.1);
    assert.deepEqual(h.sockets[0].closeCalls, [null], "given up at 10 s, closed without a code");
    assert.equal(h.waitingDelay(), 1);
    await h.clock.advance(1);
    assert.equal(h.sockets.length, 2);
  });
});

describe("catching up", () => {
  const presence = (user, status, lastSeen = "2026-11-21T11:59:00.000Z") => ({ user_id: user, status, last_seen: lastSeen });

  test("after each (re)connect, watched users and joined conversations are asked again; the answers are fresh state", async () => {
    const h = setup();
    h.client.watch(["bob", "alice"]);
    h.client.join("room");
    h.client.start();
    await settle();
    let socket = h.last();
    socket.open([presence("carol", "online")]);
    await settle();
    // The joined conversation's messages are synced too (from the start: none known yet), first.
    assert.deepEqual(socket.sent, [
      '{"data":{"positions":[{"after_seq":0,"conversation_id":"room"}]},"id":"1.1","type":"sync"}',
      '{"data":{"user_ids":["alice","bob"]},"id":"1.2","type":"subscribe"}',
      '{"data":{"conversation_id":"room"},"id":"1.3","type":"subscribe"}',
    ]);
    assert.equal(h.client.connectionState.state, "connecting", "connected only once the catch-up is answered");
    socket.deliver({ type: "initial_state", id: "1.2", data: { presences: [presence("alice", "online"), presence("bob", "away")] } });
    socket.deliver({ type: "group_presence", id: "1.3", data: { conversation_id: "room", total: 3, online: 2, away: 1 } });
    socket.deliver({ type: "initial_state", id: "1.3", data: { presences: [presence("alice", "online"), presence("carol", "online")] } });
    socket.deliver({ type: "presence_update", data: presence("dave", "online") });
    await settle();
    assert.equal(h.client.connectionState.state, "connected");
    assert.deepEqual(h.client.presences.map((p) => `${p.userId}:${p.status}`), ["alice:online", "bob:away", "carol:online", "dave:online"]);

    h.events.length = 0;
    socket.serverClose(1006);
    await settle();
    await h.clock.advance(h.waitingDelay());
    socket = h.last();
    assert.equal(h.sockets.length, 2);
    socket.open([presence("carol", "online")]);
    await settle();
    assert.deepEqual(socket.framesOf("subscribe").map((frame) => frame.data), [{ user_ids: ["alice", "bob"] }, { conversation_id: "room" }], "the same requests again");
    const [users, room] = socket.framesOf("subscribe").map((frame) => frame.id);
    // bob is no longer visible: left out of the answer.
    socket.deliver({ type: "initial_state", id: users, data: { presences: [presence("alice", "away")] } });
    socket.deliver({ type: "group_presence", id: room, data: { conversation_id: "room", total: 3, online: 2, away: 1 } });
    assert.equal(h.client.connectionState.state, "connecting");
    socket.deliver({ type: "initial_state", id: room, data: { presences: [presence("alice", "away")] } });
    await settle();
    assert.deepEqual(h.events.map(({ type, detail }) => `${type}:${detail.userId ?? detail.state}${detail.status ? `:${detail.status}` : ""}`), [
      "connection:waiting", "connection:connecting",
      "presence:alice:away", "removed:bob",
      // dave was heard of in the last session only; this one did not confirm him.
      "removed:dave",
      "connection:connected",
    ], "unchanged presences (carol) and counts (room) cause no event");
    assert.equal(h.client.presence("bob"), undefined);
  });

  test("a conversation the gateway refuses is dropped, with an error event", async () => {
    const h = setup();
    const socket = await h.connect();
    h.client.join("secret");
    const [frame] = socket.framesOf("subscribe");
    socket.deliver({ type: "error", id: frame.id, data: { code: "forbidden", message: "you are not a member of this conversation" } });
    await settle();
    assert.deepEqual(h.client.joinedConversations, []);
    assert.deepEqual(h.of("error"), [{ code: "forbidden", message: "you are not a member of this conversation" }]);
  });

  test("ids are checked before anything is sent", () => {
    const h = setup();
    assert.throws(() => h.client.watch(["no spaces"]), (error) => error instanceof PresenceClientError && error.code === "invalid_request");
    assert.throws(() => h.client.join(""), PresenceClientError);
    assert.throws(() => h.client.setStatus("busy"), PresenceClientError);
    assert.deepEqual(h.client.watchedUsers, []);
  });
});

describe("status", () => {
  test("changes while disconnected: the latest opens the next session, and no status frame follows", async () => {
    const h = setup();
    h.client.start();
    await settle();
    h.last().fail();
    await settle();
    h.client.setStatus("away");
    h.client.setStatus("offline");
    h.client.setStatus("away");
    await h.clock.advance(h.waitingDelay());
    const socket = h.last();
    assert.equal(new URL(socket.url).searchParams.get("status"), "away");
    socket.open();
    await settle();
    assert.deepEqual(statusFrames(socket), []);
    h.client.setStatus("online");
    assert.deepEqual(statusFrames(socket), ["online"]);
  });

  test("changes while the session opens: only the latest is sent, once, after its initial_state", async () => {
    const h = setup();
    h.client.start();
    await settle();
    const socket = h.last();
    socket.accept();
    h.client.setStatus("offline");
    h.client.setStatus("away");
    assert.deepEqual(statusFrames(socket), []);
    socket.deliver({ type: "initial_state", data: { presences: [] } });
    assert.deepEqual(statusFrames(socket), ["away"]);
    h.client.setStatus("away");
    assert.deepEqual(statusFrames(socket), ["away"], "no change, no frame");
  });

  test("a refused status change is sent again after retryDelay", async () => {
    const h = setup();
    const socket = await h.connect();
    h.client.setStatus("away");
    const [frame] = socket.framesOf("status");
    socket.deliver({ type: "error", id: frame.id, data: { code: "rate_limited", message: "too many status changes" } });
    assert.deepEqual(h.of("error"), [{ code: "rate_limited", message: "too many status changes" }]);
    await h.clock.advance(0.9);
    assert.deepEqual(statusFrames(socket), ["away"]);
    await h.clock.advance(0.1);
    assert.deepEqual(statusFrames(socket), ["away", "away"]);
  });
});

describe("typing", () => {
  test("the debouncer: true at once and at most every 2 s, false after 3 s idle, on send and on leave", () => {
    const debouncer = new TypingDebouncer();
    const sent = [];
    for (let step = 0; step < 50; step += 1) {
      const send = debouncer.keystroke("room", START + step * 100, true);
      if (send) sent.push([step * 100, send.isTyping]);
    }
    assert.deepEqual(sent, [[0, true], [2000, true], [4000, true]]);
    assert.equal(debouncer.nextDeadline, START + 4900 + 3000);
    assert.deepEqual(debouncer.expire(START + 7899), []);
    assert.deepEqual(debouncer.expire(START + 7900), [{ conversationId: "room", isTyping: false }]);
    assert.deepEqual(debouncer.expire(START + 9000), [], "one false only");
    debouncer.keystroke("a", START, true);
    assert.deepEqual(debouncer.stop("a"), { conversationId: "a", isTyping: false });
    assert.equal(debouncer.stop("a"), null);
    assert.equal(debouncer.keystroke("b", START, false), null, "nothing while the device cannot type");
    assert.equal(debouncer.nextDeadline, null);
  });

  test("on the clock: true, no repeat within 2 s, a refresh at 2 s, false 3 s after the last keystroke", async () => {
    const h = setup();
    const socket = await h.connect();
    h.client.userTyped("room");
    await h.clock.advance(1);
    h.client.userTyped("room");
    assert.deepEqual(typingFrames(socket), [{ conversation_id: "room", is_typing: true }]);
    await h.clock.advance(1);
    h.client.userTyped("room");
    assert.equal(typingFrames(socket).length, 2, "refreshed 2 s after the first");
    await h.clock.advance(2.9);
    assert.equal(typingFrames(socket).length, 2, "still typing 2.9 s after the last keystroke");
    await h.clock.advance(0.1);
    assert.deepEqual(typingFrames(socket).at(-1), { conversation_id: "room", is_typing: false });
    assert.equal(typingFrames(socket).length, 3);
  });

  test("false at once on messageSent and on leave; nothing when not typing", async () => {
    const h = setup();
    const socket = await h.connect();
    h.client.userTyped("room");
    h.client.messageSent("room");
    h.client.messageSent("room");
    assert.deepEqual(typingFrames(socket).map((frame) => frame.is_typing), [true, false]);
    h.client.join("room");
    h.client.userTyped("room");
    h.client.leave("room");
    assert.deepEqual(socket.frames.slice(-2).map((frame) => [frame.type, frame.data]), [
      ["typing", { conversation_id: "room", is_typing: false }],
      ["unsubscribe", { conversation_id: "room" }],
    ]);
    await h.clock.advance(10);
    assert.equal(typingFrames(socket).length, 4, "no late false after a stop");
  });

  test("nothing is sent while disconnected or appearing offline", async () => {
    const h = setup();
    h.client.userTyped("room");
    const socket = await h.connect();
    h.client.setStatus("offline");
    h.client.userTyped("room");
    await h.clock.advance(5);
    assert.deepEqual(typingFrames(socket), []);
    h.client.setStatus("online");
    h.client.userTyped("room");
    assert.equal(typingFrames(socket).length, 1);
    // Appearing offline ends typing at once.
    h.client.setStatus("offline");
    assert.deepEqual(typingFrames(socket).at(-1), { conversation_id: "room", is_typing: false });
  });

  test("others' typing: shown until the stop or typingDisplayTimeout (8 s); hidden while this device appears offline", async () => {
    const h = setup();
    const socket = await h.connect();
    const typing = (user, isTyping) => socket.deliver({ type: "typing_update", data: { user_id: user, conversation_id: "room", is_typing: isTyping } });
    typing("alice", true);
    assert.deepEqual(h.client.typingUsers("room"), ["alice"]);
    await h.clock.advance(7.9);
    assert.deepEqual(h.client.typingUsers("room"), ["alice"]);
    await h.clock.advance(0.1);
    assert.deepEqual(h.client.typingUsers("room"), [], "the stop was never heard: gone after 8 s");

    typing("alice", true);
    h.client.setStatus("offline");
    assert.deepEqual(h.client.typingUsers("room"), []);
    typing("bob", true);
    assert.deepEqual(h.client.typingUsers("room"), []);
    h.client.setStatus("online");
    assert.deepEqual(h.client.typingUsers("room"), [], "those heard while offline are not shown afterwards");
    typing("bob", true);
    assert.deepEqual(h.client.typingUsers("room"), ["bob"]);
    assert.deepEqual(h.of("typing").map((t) => `${t.userId}:${t.isTyping}`), ["alice:true", "alice:false", "alice:true", "alice:false", "bob:true"]);
  });
});

describe("the page's life", () => {
  test("hidden: away at once; visible: back to the chosen status; the session stays", async () => {
    const h = setup();
    const socket = await h.connect();
    h.setHidden(true);
    assert.equal(h.client.status, "away");
    h.setHidden(false);
    assert.deepEqual(statusFrames(socket), ["away", "online"]);
    h.client.setStatus("offline");
    h.setHidden(true);
    h.setHidden(false);
    assert.deepEqual(statusFrames(socket), ["away", "online", "offline"], "appearing offline stays offline when hidden");
    assert.deepEqual(socket.closeCalls, []);
  });

  test("a page hidden at start opens its session away", async () => {
    const h = setup();
    h.document.visibilityState = "hidden";
    h.client.start();
    await settle();
    assert.equal(new URL(h.last().url).searchParams.get("status"), "away");
  });

  test("background policy offline-after-N: away, then a 1000 close after N s hidden; visible reconnects", async () => {
    const h = setup({ backgroundPolicy: { kind: "offline", afterSeconds: 30 } });
    const socket = await h.connect();
    h.setHidden(true);
    assert.deepEqual(statusFrames(socket), ["away"]);
    await h.clock.advance(29.9);
    assert.deepEqual(socket.closeCalls, []);
    await h.clock.advance(0.1);
    assert.deepEqual(socket.closeCalls, [1000]);
    assert.equal(h.client.connectionState.state, "idle");
    await h.clock.advance(300);
    assert.equal(h.sockets.length, 1, "no session while hidden");
    h.setHidden(false);
    await settle();
    assert.equal(h.sockets.length, 2, "at once when visible");
    assert.equal(new URL(h.last().url).searchParams.get("status"), "online");
  });

  test("background policy: visible again before N s keeps the session", async () => {
    const h = setup({ backgroundPolicy: { kind: "offline", afterSeconds: 30 } });
    const socket = await h.connect();
    h.setHidden(true);
    await h.clock.advance(20);
    h.setHidden(false);
    await h.clock.advance(60);
    assert.deepEqual(socket.closeCalls, []);
    assert.equal(h.client.connectionState.state, "connected");
  });

  test("pagehide: typing stops, close 1000 at once, no reconnect; a page restored from the cache reconnects", async () => {
    const h = setup();
    const socket = await h.connect();
    h.client.userTyped("room");
    h.window.dispatchEvent(new Event("pagehide"));
    assert.deepEqual(socket.closeCalls, [1000]);
    assert.deepEqual(typingFrames(socket).at(-1), { conversation_id: "room", is_typing: false });
    assert.equal(h.client.connectionState.state, "idle");
    await h.clock.advance(60);
    assert.equal(h.sockets.length, 1);
    h.window.dispatchEvent(Object.assign(new Event("pageshow"), { persisted: true }));
    await settle();
    assert.equal(h.sockets.length, 2);
  });

  test("offline ends the session without a close code (the device lingers); online reconnects at once", async () => {
    const h = setup();
    const socket = await h.connect();
    h.window.dispatchEvent(new Event("offline"));
    assert.deepEqual(socket.closeCalls, [null]);
    await settle();
    assert.equal(h.client.connectionState.state, "idle");
    await h.clock.advance(60);
    assert.equal(h.sockets.length, 1, "no attempt while offline");
    h.window.dispatchEvent(new Event("online"));
    await settle();
    assert.equal(h.sockets.length, 2);
  });

  test("online cuts a backoff wait short", async () => {
    const h = setup();
    h.client.start();
    await settle();
    for (let attempt = 0; attempt < 3; attempt += 1) {
      h.last().fail();
      await settle();
      if (attempt < 2) await h.clock.advance(h.waitingDelay());
    }
    assert.equal(h.waitingDelay(), 4);
    h.window.dispatchEvent(new Event("online"));
    await settle();
    assert.equal(h.sockets.length, 4, "without the clock moving");
  });
});

describe("stopping", () => {
  test("signOut: typing stops, close 1000, stopped for good", async () => {
    const h = setup();
    const socket = await h.connect();
    h.client.userTyped("room");
    await h.client.signOut();
    assert.deepEqual(socket.closeCalls, [1000]);
    assert.deepEqual(typingFrames(socket).at(-1), { conversation_id: "room", is_typing: false });
    assert.deepEqual(h.client.connectionState, { state: "stopped", reason: "signedOut" });
    h.client.start();
    await h.clock.advance(60);
    assert.equal(h.sockets.length, 1);
  });

  test("signOut waits closeTimeout at most for the gateway's answer", async () => {
    const h = setup();
    await h.connect();
    h.WebSocket.answersClose = false;
    let done = false;
    h.client.signOut().then(() => { done = true; });
    await h.clock.advance(2.9);
    assert.equal(done, false);
    await h.clock.advance(0.1);
    assert.equal(done, true);
    assert.equal(h.client.connectionState.state, "stopped");
  });

  test("stop then start: idle, then a new session", async () => {
    const h = setup();
    await h.connect();
    await h.client.stop();
    assert.deepEqual(h.client.connectionState, { state: "idle" });
    assert.deepEqual(h.sockets[0].closeCalls, [1000]);
    h.client.start();
    await settle();
    assert.equal(h.sockets.length, 2);
  });
});

describe("the device id", () => {
  test(`made with crypto.randomUUID() and kept under ${DEVICE_ID_STORAGE_KEY}`, () => {
    const storage = memoryStorage();
    const first = setup({ deviceId: undefined, storage }).client.deviceId;
    assert.match(first, /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/);
    assert.equal(storage.map.get("presence.device_id"), first);
    assert.equal(setup({ deviceId: undefined, storage }).client.deviceId, first, "the same on the next load");
    const broken = memoryStorage({ [DEVICE_ID_STORAGE_KEY]: "not valid!" });
    assert.notEqual(setup({ deviceId: undefined, storage: broken }).client.deviceId, "not valid!");
    assert.throws(() => setup({ deviceId: "white space" }), PresenceClientError);
  });

  test("sent with every attempt", async () => {
    const h = setup({ deviceId: undefined, storage: memoryStorage({ [DEVICE_ID_STORAGE_KEY]: "kept-id" }) });
    h.client.start();
    await settle();
    assert.equal(new URL(h.last().url).searchParams.get("device_id"), "kept-id");
  });
});

describe("PresenceText", () => {
  const now = new Date(1_800_000_000_000);
  const offline = (secondsAgo) => ({ userId: "a", status: "offline", lastSeen: secondsAgo === null ? null : new Date(now.getTime() - secondsAgo * 1000) });

  test("status labels, as the Swift SDK's", () => {
    assert.equal(PresenceText.status({ userId: "a", status: "online", lastSeen: now }, now), "Online");
    assert.equal(PresenceText.status({ userId: "a", status: "away", lastSeen: now }, now), "Away");
    assert.equal(PresenceText.status(undefined, now), "Offline");
    assert.equal(PresenceText.status(offline(null), now), "Offline");
    const cases = [
      [0, "Last seen just now"], [59, "Last seen just now"], [60, "Last seen 1m ago"], [5 * 60 + 30, "Last seen 5m ago"],
      [3 * 3600 + 1, "Last seen 3h ago"], [2 * 86_400, "Last seen 2d ago"], [30 * 86_400, "Last seen on 2026-12-16"], [-30, "Last seen just now"],
    ];
    for (const [ago, text] of cases) assert.equal(PresenceText.status(offline(ago), now), text, `${ago} s ago`);
    assert.equal(PresenceText.lastSeen(now.getTime() - 7200_000, now.getTime()), "Last seen 2h ago", "milliseconds work too");
  });

  test("nextChange is exactly when the text changes", () => {
    const seen = now.getTime() - 30_000;
    const next = PresenceText.nextChange(seen, now);
    assert.equal(next.getTime(), seen + 60_000);
    assert.notEqual(PresenceText.lastSeen(seen, next.getTime() - 1), PresenceText.lastSeen(seen, next));
    assert.equal(PresenceText.nextChange(seen, seen + 125_000).getTime(), seen + 180_000);
    assert.equal(PresenceText.nextChange(seen, seen + (3 * 3600 + 10) * 1000).getTime(), seen + 4 * 3600_000);
    assert.equal(PresenceText.nextChange(null, now), null);
    assert.equal(PresenceText.nextChange(seen, seen + 8 * 86_400_000), null);
  });

  test("updatingStatus follows the clock", async () => {
    const clock = new FakeClock(now.getTime());
    const labels = [];
    const stop = PresenceText.updatingStatus(offline(50), (label) => labels.push(label), { clock });
    await clock.advance(10);
    await clock.advance(60);
    stop();
    await clock.advance(600);
    assert.deepEqual(labels, ["Last seen just now", "Last seen 1m ago", "Last seen 2m ago"]);
  });

  test("groups and typing", () => {
    assert.equal(PresenceText.group({ conversationId: "c", total: 5, online: 3, away: 1 }), "3 of 5 online");
    assert.equal(PresenceText.typing([]), "");
    assert.equal(PresenceText.typing(["Alice"]), "Alice is typing…");
    assert.equal(PresenceText.typing(["Alice", "Bob"]), "Alice and Bob are typing…");
    assert.equal(PresenceText.typing(["Alice", "Bob", "Carol"]), "Alice, Bob and Carol are typing…");
    assert.equal(PresenceText.typing(["Alice", "Bob", "Carol", "Dan", "Eve"]), "Alice, Bob and 3 others are typing…");
  });
});

test("timestamps: ISO 8601 UTC, the fraction optional and cut at milliseconds", () => {
  assert.equal(parseTimestamp("2026-11-21T12:00:00.123Z"), Date.UTC(2026, 10, 21, 12, 0, 0, 123));
  assert.equal(parseTimestamp("2026-11-21T12:00:00Z"), Date.UTC(2026, 10, 21, 12));
  assert.equal(parseTimestamp("2026-11-21T12:00:00.5Z"), Date.UTC(2026, 10, 21, 12, 0, 0, 500));
  assert.equal(parseTimestamp("2026-11-21T12:00:00.123456789Z"), Date.UTC(2026, 10, 21, 12, 0, 0, 123));
  for (const bad of ["2026-11-21 12:00:00Z", "2026-13-01T00:00:00Z", "2026-11-21T12:00:00", "2026-11-21T12:00:00.Z", "yesterday", null]) {
    assert.equal(parseTimestamp(bad), null, String(bad));
  }
});

// MARK: Messages

/** A `message` frame's data as the gateway writes it. */
const stored = (seq, sender, text, clientMessageId = `${sender}-${seq}`, epoch = "e1") => ({
  conversation_id: "room", epoch, seq, id: `${epoch}-${seq}`, sender_id: sender, client_message_id: clientMessageId, type: "text", text,
  image_url: null, created_at: "2026-11-21T12:00:00.000Z", client_created_at: null,
});

/** The answer to a `send` frame. */
const ackOf = (frame, seq, epoch = "e1") => ({
  type: "message_ack", id: frame.id, data: {
    conversation_id: frame.data.conversation_id, client_message_id: frame.data.client_message_id, epoch, seq, id: `${epoch}-${seq}`,
    created_at: "2026-11-21T12:00:00.000Z", duplicate: false,
  },
});

const syncedOf = (frame, lastSeq, extra = {}) => ({
  type: "synced", id: frame.id, data: { conversation_id: "room", epoch: "e1", last_seq: lastSeq, complete: true, more: false, missing: [], ...extra },
});

describe("messages", () => {
  test("written offline: returned at once as sending, nothing sent; the session syncs, then sends; the ack makes it sent, the gateway's copy is no second message", async () => {
    const store = new MemoryOutboxStore();
    const h = setup({ outboxStore: store });
    const local = h.client.send("room", "hello");
    assert.equal(local.status, "sending");
    assert.equal(local.seq, null);
    assert.deepEqual(h.client.messages("room").map((message) => message.text), ["hello"]);
    const socket = await h.connect();
    assert.deepEqual(socket.frames.map((frame) => frame.type), ["sync", "send"]);
    const [sync, send] = socket.frames;
    assert.deepEqual(sync.data, { positions: [{ after_seq: 0, conversation_id: "room" }] });
    assert.equal(send.data.client_message_id, local.clientMessageId);
    assert.equal(send.data.text, "hello");
    socket.deliver(syncedOf(sync, 0, { receipts: [{ user_id: "alice", delivered_seq: 0, read_seq: 0 }, { user_id: "bob", delivered_seq: 0, read_seq: 0 }] }));
    socket.deliver(ackOf(send, 1));
    socket.deliver({ type: "message", data: stored(1, "alice", "hello", local.clientMessageId) });
    await settle();
    assert.deepEqual(h.of("messagestatus").map((change) => change.status), ["sent"]);
    assert.equal(h.of("message").length, 1, "announced once, when written");
    assert.deepEqual(h.client.messages("room").map((message) => `${message.seq}:${message.status}:${message.senderId}`), ["1:sent:alice"]);
    await h.client.outboxSaved();
    assert.deepEqual(await store.load(), [], "stored by the gateway: out of the outbox");
    // bob's device has it, then bob read it.
    socket.deliver({ type: "receipt", data: { conversation_id: "room", user_id: "bob", delivered_seq: 1, read_seq: 0 } });
    socket.deliver({ type: "receipt", data: { conversation_id: "room", user_id: "bob", delivered_seq: 1, read_seq: 1 } });
    await settle();
    assert.deepEqual(h.of("messagestatus").map((change) => change.status), ["sent", "delivered", "read"]);
  });

  test("3 attempts on a live session, 1 s and 2 s apart, with the same client_message_id; then failed, kept, and the next message goes; retry sends it again", async () => {
    const h = setup({ outboxStore: new MemoryOutboxStore() });
    const socket = await h.connect();
    const first = h.client.send("room", "one");
    const second = h.client.send("room", "two");
    await settle();
    const sends = () => socket.framesOf("send");
    assert.equal(sends().length, 1, "one message of a conversation under way at a time");
    socket.deliver({ type: "error", id: sends()[0].id, data: { code: "internal", message: "boom" } });
    await settle();
    await h.clock.advance(0.9);
    assert.equal(sends().length, 1);
    await h.clock.advance(0.1);
    assert.equal(sends().length, 2, "the second attempt after 1 s");
    // No answer within 10 s counts as a failed attempt too.
    await h.clock.advance(10);
    await h.clock.advance(2);
    assert.equal(sends().length, 3, "the third attempt 2 s after the second failed");
    socket.deliver({ type: "error", id: sends()[2].id, data: { code: "unavailable", message: "later" } });
    await settle();
    assert.deepEqual(sends().map((frame) => frame.data.client_message_id), [first.clientMessageId, first.clientMessageId, first.clientMessageId, second.clientMessageId]);
    const failed = h.client.messages("room").find((message) => message.clientMessageId === first.clientMessageId);
    assert.equal(failed.status, "failed");
    assert.equal(failed.failure, "unavailable: later");
    socket.deliver(ackOf(sends()[3], 1));
    await settle();
    assert.equal(h.client.retry(first.clientMessageId), true);
    await settle();
    assert.equal(sends().length, 5);
    assert.equal(sends()[4].data.client_message_id, first.clientMessageId);
    socket.deliver(ackOf(sends()[4], 2));
    await settle();
    assert.deepEqual(h.client.messages("room").map((message) => `${message.seq}:${message.text}:${message.status}`), ["1:two:sent", "2:one:sent"]);
  });

  test("forbidden fails at once with the reason; rate_limited waits retryDelay and costs no attempt; a dropped session costs none either", async () => {
    const h = setup({ outboxStore: new MemoryOutboxStore() });
    let socket = await h.connect();
    const refused = h.client.send("other", "not mine");
    const limited = h.client.send("room", "busy");
    await settle();
    const sendOf = (message) => socket.framesOf("send").filter((frame) => frame.data.client_message_id === message.clientMessageId);
    socket.deliver({ type: "error", id: sendOf(refused)[0].id, data: { code: "forbidden", message: "you are not a member of this conversation" } });
    await settle();
    assert.equal(h.client.messages("other")[0].status, "failed");
    assert.equal(h.client.messages("other")[0].failure, "forbidden: you are not a member of this conversation");
    for (let answer = 0; answer < 4; answer += 1) {
      socket.deliver({ type: "error", id: sendOf(limited).at(-1).id, data: { code: "rate_limited", message: "slow down" } });
      await settle();
      await h.clock.advance(1);
    }
    assert.equal(sendOf(limited).length, 5, "four rate-limited answers, still going");
    assert.equal(h.client.messages("room")[0].status, "sending");
    socket.serverClose(1006);
    await settle();
    await h.clock.advance(h.waitingDelay());
    socket = h.last();
    socket.open();
    await settle();
    assert.equal(sendOf(limited).length, 1, "sent again on the new session");
    socket.deliver(ackOf(sendOf(limited)[0], 1));
    await settle();
    assert.equal(h.client.messages("room")[0].status, "sent");
  });

  test("received messages are announced once each, in order; delivered and read go to the gateway; gaps are announced; a cut sync goes on", async () => {
    const h = setup({ outboxStore: new MemoryOutboxStore() });
    h.client.join("room");
    h.client.start();
    await settle();
    const socket = h.last();
    socket.open();
    await settle();
    const sync = socket.framesOf("sync")[0];
    socket.deliver({ type: "message", data: stored(1, "bob", "b1") });
    socket.deliver({ type: "message", data: stored(2, "bob", "b2") });
    socket.deliver(syncedOf(sync, 5, { more: true }));
    await settle();
    const again = socket.framesOf("sync").at(-1);
    assert.deepEqual(again.data, { positions: [{ after_seq: 2, conversation_id: "room", epoch: "e1" }] }, "the cut sync goes on from the last seq");
    socket.deliver({ type: "message", data: stored(2, "bob", "b2") });
    socket.deliver(syncedOf(again, 5, { complete: false, missing: [{ epoch: "e1", from_seq: 3, to_seq: 5 }] }));
    await settle();
    assert.deepEqual(h.of("message").map((message) => message.text), ["b1", "b2"]);
    assert.deepEqual(h.of("messagegap"), [{ conversationId: "room", epoch: "e1", fromSeq: 3, toSeq: 5 }]);
    assert.deepEqual(socket.framesOf("delivered").map((frame) => frame.data), [{ conversation_id: "room", seq: 5 }]);
    socket.deliver({ type: "message", data: stored(6, "bob", "b6") });
    await settle();
    assert.deepEqual(socket.framesOf("delivered").map((frame) => frame.data.seq), [5, 6]);
    h.client.markRead("room");
    await settle();
    assert.deepEqual(socket.framesOf("read").map((frame) => frame.data), [{ conversation_id: "room", seq: 6 }]);
    assert.deepEqual(h.client.messages("room").map((message) => message.status), ["read", "read", "read"]);
    // On screen in a visible page: what arrives is read at once.
    h.client.showConversation("room");
    socket.deliver({ type: "message", data: stored(7, "bob", "b7") });
    await settle();
    assert.deepEqual(socket.framesOf("read").map((frame) => frame.data.seq), [6, 7]);
  });

  test("setOffline: a clean close, no typing either way; writes wait; setOffline(false) connects and sends them", async () => {
    const h = setup({ outboxStore: new MemoryOutboxStore() });
    const socket = await h.connect();
    h.client.setOffline(true);
    await settle();
    assert.deepEqual(socket.closeCalls, [1000]);
    assert.equal(h.client.connectionState.state, "idle");
    assert.equal(h.client.isOffline, true);
    h.client.userTyped("room");
    h.client.send("room", "offline 1");
    h.client.send("room", "offline 2");
    await h.clock.advance(30);
    assert.equal(h.sockets.length, 1, "no connection while offline");
    h.client.setOffline(false);
    await settle();
    const next = h.last();
    assert.equal(h.sockets.length, 2);
    next.open();
    await settle();
    assert.deepEqual(next.framesOf("send").map((frame) => frame.data.text), ["offline 1"]);
    assert.deepEqual(next.framesOf("typing"), [], "no typing was kept for later");
    next.deliver(ackOf(next.framesOf("send")[0], 1));
    await settle();
    assert.deepEqual(next.framesOf("send").map((frame) => frame.data.text), ["offline 1", "offline 2"]);
  });

  test("the outbox in a store survives the client: a new client on the same store sends it once", async () => {
    const store = new MemoryOutboxStore();
    const before = setup({ outboxStore: store });
    before.client.start();
    await settle();
    before.client.send("room", "kept 1");
    before.client.send("room", "kept 2");
    await before.client.outboxSaved();
    await before.client.stop();
    assert.deepEqual((await store.load()).map((message) => `${message.text}:${message.status}`), ["kept 1:sending", "kept 2:sending"]);
    const after = setup({ outboxStore: store });
    const socket = await after.connect();
    await settle();
    assert.deepEqual(after.client.messages("room").map((message) => message.text), ["kept 1", "kept 2"]);
    const send = socket.framesOf("send")[0];
    assert.equal(send.data.text, "kept 1");
    socket.deliver(ackOf(send, 1));
    await settle();
    socket.deliver(ackOf(socket.framesOf("send")[1], 2));
    await settle();
    await after.client.outboxSaved();
    assert.deepEqual(await store.load(), []);
    assert.equal(socket.framesOf("send").length, 2, "each sent once");
  });
});

describe("syncing: retries, pacing, gaps and epochs", () => {
  /** A sync frame's positions as `conversation:after_seq[:epoch]`. */
  const positionsOf = (frame) => frame.data.positions.map((p) => `${p.conversation_id}:${p.after_seq}${p.epoch ? `:${p.epoch}` : ""}`);
  const syncedFor = (frame, conversation, lastSeq, extra = {}) => ({
    type: "synced", id: frame.id, data: { conversation_id: conversation, epoch: "e1", last_seq: lastSeq, complete: true, more: false, missing: [], ...extra },
  });
  const errorFor = (frame, code, extra = {}) => ({ type: "error", id: frame.id, data: { code, message: `${code} here`, ...extra } });
  const deliveredSeqs = (socket) => socket.framesOf("delivered").map((frame) => frame.data.seq);

  /** Starts a client following `conversations` and opens its session (not caught up: nothing answers the subscribes). */
  async function opened(conversations, options = {}) {
    const h = setup({ outboxStore: new MemoryOutboxStore(), ...options });
    for (const conversation of conversations) h.client.join(conversation);
    h.client.start();
    await settle();
    h.last().open();
    await settle();
    return h;
  }

  /** The gateway's budget as FrameHandler keeps it: full at first, `rate` tokens a second. */
  function gatewayBucket(rate, burst) {
    let tokens = burst;
    let updated = null;
    return {
      take(at) {
        if (updated !== null) tokens = Math.min(burst, tokens + ((at - updated) * rate) / 1000);
        updated = at;
        if (tokens < 1) return false;
        tokens -= 1;
        return true;
      },
    };
  }

  test("a refused or failed sync goes again: a position after its backoff with jitter, a refused frame after its retry_after; forbidden does not", async () => {
    const h = await opened(["a", "b", "c", "d"], { random: () => 0.75 });
    const socket = h.last();
    const syncs = () => socket.framesOf("sync");
    assert.deepEqual(syncs().map(positionsOf), [["a:0", "b:0", "c:0", "d:0"]]);
    const [first] = syncs();
    socket.deliver(syncedFor(first, "a", 0));
    socket.deliver(errorFor(first, "unavailable", { conversation_id: "b" }));
    socket.deliver(errorFor(first, "forbidden", { conversation_id: "c" }));
    socket.deliver(errorFor(first, "internal", { conversation_id: "d" }));
    await settle();
    assert.deepEqual(h.of("error"), [{ code: "forbidden", message: "forbidden here" }], "only the refusal for good is an error event");
    // The first wait is 1 s moved by up to ±20 %: random() 0.75 makes it 1.1 s.
    await h.clock.advance(1.09);
    assert.equal(syncs().length, 1);
    await h.clock.advance(0.02);
    assert.deepEqual(syncs().map(positionsOf).slice(1), [["b:0", "d:0"]], "both again, in one frame; c never");
    // The whole frame refused (no conversation_id): every position of it goes again, after the
    // gateway's retry_after (2 s) and up to a fifth more: 2.3 s.
    socket.deliver(errorFor(syncs()[1], "rate_limited", { retry_after: 2 }));
    await settle();
    await h.clock.advance(2.29);
    assert.equal(syncs().length, 2);
    await h.clock.advance(0.02);
    assert.deepEqual(positionsOf(syncs()[2]), ["b:0", "d:0"]);
    // b fails a third time: its wait has grown to 4 s (× 1.1); d is answered.
    socket.deliver(errorFor(syncs()[2], "unavailable", { conversation_id: "b" }));
    socket.deliver(syncedFor(syncs()[2], "d", 0));
    await settle();
    await h.clock.advance(4.39);
    assert.equal(syncs().length, 3);
    await h.clock.advance(0.02);
    assert.deepEqual(positionsOf(syncs()[3]), ["b:0"]);
    socket.deliver(syncedFor(syncs()[3], "b", 0));
    await h.clock.advance(120);
    assert.equal(syncs().length, 4, "answered: nothing more");
    assert.deepEqual(h.of("error").map((error) => error.code), ["forbidden"]);
  });

  test("a sync's retries end with its session; the next session syncs anyway", async () => {
    const h = await opened(["room"]);
    const socket = h.last();
    socket.deliver(errorFor(socket.framesOf("sync")[0], "unavailable", { conversation_id: "room" }));
    await settle();
    await h.clock.advance(1);
    assert.equal(socket.framesOf("sync").length, 2, "sent again after 1 s");
    // Failed again: the next try would be in 2 s, but the session ends first.
    socket.deliver(errorFor(socket.framesOf("sync")[1], "unavailable", { conversation_id: "room" }));
    await settle();
    socket.serverClose(1006);
    await settle();
    await h.clock.advance(h.waitingDelay());
    const next = h.last();
    assert.notEqual(next, socket);
    next.open();
    await settle();
    await h.clock.advance(60);
    assert.equal(socket.framesOf("sync").length, 2, "nothing more on the session that ended");
    assert.deepEqual(next.framesOf("sync").map(positionsOf), [["room:0"]], "one sync on the next, at its opening");
  });

  test("300 conversations: the opening's 3 syncs go at once, first; subscribes, syncs and all frames stay within the gateway's budgets", async () => {
    const conversations = Array.from({ length: 300 }, (_, index) => `c${String(index).padStart(3, "0")}`);
    const h = await opened(conversations);
    const socket = h.last();
    const start = h.clock.now();
    const syncs = socket.framesOf("sync");
    assert.equal(syncs.length, 3);
    assert.deepEqual(syncs.flatMap((frame) => frame.data.positions.map((position) => position.conversation_id)), conversations);
    assert.deepEqual(socket.frames.slice(0, 3).map((frame) => frame.type), ["sync", "sync", "sync"], "the syncs first");
    assert.deepEqual(socket.sentAt.slice(0, 3), [start, start, start], "at once");
    // Each conversation has two seqs to say delivered: 300 frames more on top of the subscribes.
    for (const frame of syncs) {
      for (const position of frame.data.positions) {
        socket.deliver(syncedFor(frame, position.conversation_id, 2, { complete: false, missing: [{ epoch: "e1", from_seq: 1, to_seq: 2 }] }));
      }
    }
    // The gateway answers each subscribe as it arrives.
    let answered = 0;
    for (let second = 0; second < 90; second += 1) {
      for (const frame of socket.framesOf("subscribe").slice(answered)) {
        const conversation = frame.data.conversation_id;
        socket.deliver({ type: "group_presence", id: frame.id, data: { conversation_id: conversation, total: 2, online: 1, away: 0 } });
        socket.deliver({ type: "initial_state", id: frame.id, data: { presences: [] } });
      }
      answered = socket.framesOf("subscribe").length;
      await h.clock.advance(1);
    }
    assert.equal(socket.framesOf("subscribe").length, 300, "every conversation followed");
    assert.equal(deliveredSeqs(socket).length, 300);
    assert.equal(h.client.connectionState.state, "connected");
    assert.deepEqual(h.of("error"), []);
    // Frames per one-second window: at most the burst and a second's worth.
    const frames = socket.frames.map((frame, index) => ({ type: frame.type, at: socket.sentAt[index] }));
    for (const { at } of frames) {
      const window = frames.filter((frame) => frame.at >= at && frame.at < at + 1000);
      assert.ok(window.filter((frame) => frame.type === "subscribe").length <= 10 + 5, `subscribes in the second from ${at - start} ms`);
      assert.ok(window.filter((frame) => frame.type === "sync").length <= 10 + 5, `syncs in the second from ${at - start} ms`);
      assert.ok(window.length <= 100 + 50, `frames in the second from ${at - start} ms`);
    }
    // And exactly as the gateway counts: none of them would be refused.
    const gateway = { frame: gatewayBucket(50, 100), subscribe: gatewayBucket(5, 10), sync: gatewayBucket(5, 10) };
    for (const [index, { type, at }] of frames.entries()) {
      assert.ok(gateway.frame.take(at), `frame ${index} (${type}) at ${at - start} ms is over the frame rate`);
      if (type === "subscribe") assert.ok(gateway.subscribe.take(at), `subscribe ${index} at ${at - start} ms is over the subscribe budget`);
      if (type === "sync") assert.ok(gateway.sync.take(at), `sync ${index} at ${at - start} ms is over the sync budget`);
    }
  });

  test("leaving a conversation whose subscribe still waits for the budget drops it: never written, no unsubscribe", async () => {
    const conversations = Array.from({ length: 12 }, (_, index) => `c${String(index).padStart(2, "0")}`);
    const h = await opened(conversations);
    const socket = h.last();
    const subscribed = () => socket.framesOf("subscribe").map((frame) => frame.data.conversation_id);
    assert.deepEqual(subscribed(), conversations.slice(0, 8), "the burst of 8");
    h.client.leave("c11");
    await h.clock.advance(5);
    assert.deepEqual(subscribed(), conversations.slice(0, 11));
    assert.deepEqual(socket.framesOf("unsubscribe"), []);
    for (const frame of socket.framesOf("subscribe")) {
      socket.deliver({ type: "group_presence", id: frame.id, data: { conversation_id: frame.data.conversation_id, total: 2, online: 1, away: 0 } });
      socket.deliver({ type: "initial_state", id: frame.id, data: { presences: [] } });
    }
    await settle();
    assert.equal(h.client.connectionState.state, "connected", "the dropped subscribe is not waited for");
  });

  test("a live message past a gap keeps the last seq before it: kept in order, synced from the last seq, delivered only up to what is held or named", async () => {
    const h = await opened(["room"]);
    const socket = h.last();
    const [first] = socket.framesOf("sync");
    socket.deliver({ type: "message", data: stored(1, "bob", "b1") });
    socket.deliver({ type: "message", data: stored(2, "bob", "b2") });
    socket.deliver(syncedOf(first, 2));
    await settle();
    assert.deepEqual(deliveredSeqs(socket), [2]);
    // 3 and 4 never came (a node that missed them); 5 does.
    socket.deliver({ type: "message", data: stored(5, "bob", "b5") });
    await settle();
    assert.deepEqual(deliveredSeqs(socket), [2], "not past the gap");
    assert.deepEqual(h.client.messages("room").map((message) => message.seq), [1, 2, 5], "kept, in order");
    const again = socket.framesOf("sync").at(-1);
    assert.deepEqual(again.data, { positions: [{ after_seq: 2, conversation_id: "room", epoch: "e1" }] }, "synced from the last seq");
    // While that sync is under way, a live message starts no other.
    socket.deliver({ type: "message", data: stored(6, "bob", "b6") });
    await settle();
    assert.equal(socket.framesOf("sync").length, 2);
    // The session was sent 5 and 6 already: the gateway names 3-4, for the page to read over REST.
    socket.deliver(syncedOf(again, 6, { complete: false, missing: [{ epoch: "e1", from_seq: 3, to_seq: 4 }] }));
    await settle();
    assert.deepEqual(h.of("messagegap"), [{ conversationId: "room", epoch: "e1", fromSeq: 3, toSeq: 4 }]);
    assert.deepEqual(deliveredSeqs(socket), [2, 6]);
    socket.deliver({ type: "message", data: stored(7, "bob", "b7") });
    await settle();
    assert.equal(socket.framesOf("sync").length, 2, "no gap: no sync");
    assert.deepEqual(deliveredSeqs(socket), [2, 6, 7]);
    assert.deepEqual(h.of("message").map((message) => message.seq), [1, 2, 5, 6, 7]);
  });

  test("a live message of another epoch syncs from the old position (epoch and last seq) instead of starting again", async () => {
    const h = await opened(["room"]);
    const socket = h.last();
    const [first] = socket.framesOf("sync");
    for (const seq of [1, 2, 3]) socket.deliver({ type: "message", data: stored(seq, "bob", `b${seq}`) });
    socket.deliver(syncedOf(first, 3));
    await settle();
    // Redis restarted without losing anything: the next message is in a new epoch.
    socket.deliver({ type: "message", data: stored(4, "bob", "b4", "bob-4", "e2") });
    await settle();
    const again = socket.framesOf("sync").at(-1);
    assert.deepEqual(again.data, { positions: [{ after_seq: 3, conversation_id: "room", epoch: "e1" }] });
    assert.deepEqual(deliveredSeqs(socket), [3], "nothing said of the new epoch before the answer");
    // The answer: e2 forked from e1 at or past 3, so everything here carried over.
    socket.deliver(syncedOf(again, 4, { epoch: "e2" }));
    await settle();
    assert.deepEqual(h.client.messages("room").map((message) => `${message.epoch}:${message.seq}`), ["e2:1", "e2:2", "e2:3", "e2:4"]);
    assert.deepEqual(h.of("messagetruncated"), []);
    assert.deepEqual(deliveredSeqs(socket), [3, 4]);
  });

  test("delivered after a synced with missing: the highest seq up to which every seq is held or named, never past one that did not arrive", async () => {
    const h = await opened(["room"]);
    let socket = h.last();
    const [first] = socket.framesOf("sync");
    for (const seq of [1, 2, 6, 7]) socket.deliver({ type: "message", data: stored(seq, "bob", `b${seq}`) });
    // 8 is sent in a frame that does not read: dropped.
    const { created_at: _dropped, ...unreadable } = stored(8, "bob", "b8");
    socket.deliver({ type: "message", data: unreadable });
    socket.deliver(syncedOf(first, 8, { complete: false, missing: [{ epoch: "e1", from_seq: 3, to_seq: 5 }] }));
    await settle();
    assert.deepEqual(h.of("messagegap"), [{ conversationId: "room", epoch: "e1", fromSeq: 3, toSeq: 5 }]);
    assert.deepEqual(deliveredSeqs(socket), [7], "past the named range 3-5, not past 8");
    // This session counts 8 as given and will not send it again: a live 9 asks for nothing more.
    socket.deliver({ type: "message", data: stored(9, "bob", "b9") });
    await settle();
    assert.equal(socket.framesOf("sync").length, 1);
    assert.deepEqual(deliveredSeqs(socket), [7]);
    assert.deepEqual(h.client.messages("room").map((message) => message.seq), [1, 2, 6, 7, 9]);
    // The next session syncs from 7 and gets it.
    socket.serverClose(1006);
    await settle();
    await h.clock.advance(h.waitingDelay());
    socket = h.last();
    socket.open();
    await settle();
    const next = socket.framesOf("sync")[0];
    assert.deepEqual(next.data, { positions: [{ after_seq: 7, conversation_id: "room", epoch: "e1" }] });
    socket.deliver({ type: "message", data: stored(8, "bob", "b8") });
    socket.deliver({ type: "message", data: stored(9, "bob", "b9") });
    socket.deliver(syncedOf(next, 9));
    await settle();
    assert.deepEqual(deliveredSeqs(socket), [9]);
    assert.deepEqual(h.client.messages("room").map((message) => message.seq), [1, 2, 6, 7, 8, 9]);
  });

  test("the epoch is the frame's (message and message_ack), never read from the id", async () => {
    const h = await opened(["room"]);
    const socket = h.last();
    const [first] = socket.framesOf("sync");
    socket.deliver({ type: "message", data: { ...stored(1, "bob", "b1"), id: "4b1d-77", epoch: "blue" } });
    socket.deliver(syncedOf(first, 1, { epoch: "blue" }));
    await settle();
    const local = h.client.send("room", "mine");
    await settle();
    const send = socket.framesOf("send")[0];
    const ack = ackOf(send, 2, "blue");
    socket.deliver({ ...ack, data: { ...ack.data, id: "9f3e" } });
    await settle();
    assert.deepEqual(h.client.messages("room").map((message) => `${message.epoch}:${message.seq}:${message.id}`), ["blue:1:4b1d-77", "blue:2:9f3e"]);
    assert.equal(h.client.messages("room")[1].clientMessageId, local.clientMessageId);
  });

  test("a fork with truncated: others' lost messages leave messages(); own ones go back in the outbox ahead of its unsent ones and are sent again with the same client_message_id", async () => {
    const h = await opened(["room"]);
    let socket = h.last();
    const [first] = socket.framesOf("sync");
    for (let seq = 1; seq <= 8; seq += 1) socket.deliver({ type: "message", data: stored(seq, "bob", `b${seq}`) });
    socket.deliver(syncedOf(first, 8, { receipts: [{ user_id: "bob", delivered_seq: 8, read_seq: 8 }, { user_id: "me", delivered_seq: 8, read_seq: 8 }] }));
    await settle();
    const mine = h.client.send("room", "mine");
    await settle();
    socket.deliver(ackOf(socket.framesOf("send")[0], 9));
    socket.deliver({ type: "message", data: stored(9, "me", "mine", mine.clientMessageId) });
    socket.deliver({ type: "message", data: stored(10, "bob", "b10") });
    socket.deliver({ type: "receipt", data: { conversation_id: "room", user_id: "bob", delivered_seq: 10, read_seq: 9 } });
    await settle();
    assert.equal(h.client.messages("room").find((message) => message.text === "mine").status, "read");
    // Two messages written while the connection is down.
    socket.serverClose(1006);
    await settle();
    h.client.send("room", "later 1");
    h.client.send("room", "later 2");
    await h.clock.advance(h.waitingDelay());
    socket = h.last();
    socket.open();
    await settle();
    const sync = socket.framesOf("sync")[0];
    assert.deepEqual(sync.data, { positions: [{ after_seq: 10, conversation_id: "room", epoch: "e1" }] });
    const sends = () => socket.framesOf("send");
    assert.deepEqual(sends().map((frame) => frame.data.text), ["later 1"], "the outbox went at the opening, one message at a time");
    // Redis came back from a snapshot that had up to 8: e2 forked from e1 at 8, and carol's new message took seq 9.
    h.events.length = 0;
    socket.deliver({ type: "message", data: stored(9, "carol", "c9", "carol-9", "e2") });
    socket.deliver(syncedOf(sync, 9, {
      epoch: "e2", truncated: [{ epoch: "e1", from_seq: 9, to_seq: 10 }],
      receipts: [{ user_id: "bob", delivered_seq: 8, read_seq: 8 }, { user_id: "carol", delivered_seq: 9, read_seq: 9 }, { user_id: "me", delivered_seq: 8, read_seq: 8 }],
    }));
    await settle();
    const shown = () => h.client.messages("room").map((message) => `${message.epoch}:${message.seq}:${message.text}:${message.status}`);
    assert.deepEqual(shown(), [
      ...[1, 2, 3, 4, 5, 6, 7, 8].map((seq) => `e2:${seq}:b${seq}:delivered`), "e2:9:c9:delivered",
      "null:null:mine:sending", "null:null:later 1:sending", "null:null:later 2:sending",
    ], "kept up to the fork point (now e2's), b10 gone, mine back in the outbox ahead of what was written after it");
    assert.deepEqual(h.of("messagetruncated"), [{ conversationId: "room", epoch: "e1", fromSeq: 9, toSeq: 10 }]);
    assert.deepEqual(h.of("messagestatus").map((change) => `${change.clientMessageId === mine.clientMessageId ? "mine" : "?"}:${change.status}`), ["mine:sending"]);
    assert.deepEqual(deliveredSeqs(socket), [9], "the fork point, and the new epoch's 9");
    // "later 1" was under way: answered first; then mine, once, with its client_message_id; then "later 2".
    socket.deliver(ackOf(sends()[0], 10, "e2"));
    await settle();
    assert.deepEqual(sends().map((frame) => frame.data.text), ["later 1", "mine"]);
    assert.equal(sends()[1].data.client_message_id, mine.clientMessageId);
    socket.deliver(ackOf(sends()[1], 11, "e2"));
    await settle();
    socket.deliver(ackOf(sends()[2], 12, "e2"));
    await settle();
    assert.deepEqual(sends().map((frame) => frame.data.text), ["later 1", "mine", "later 2"]);
    assert.deepEqual(shown().slice(9), ["e2:10:later 1:sent", "e2:11:mine:sent", "e2:12:later 2:sent"]);
  });

  test("a new epoch that is no fork (the old one lost): last seq, cursors and receipts start again from 0; the old messages stay as they were", async () => {
    const h = await opened(["room"]);
    const socket = h.last();
    const [first] = socket.framesOf("sync");
    for (const seq of [1, 2, 3]) socket.deliver({ type: "message", data: stored(seq, "bob", `b${seq}`) });
    socket.deliver(syncedOf(first, 3, { receipts: [{ user_id: "bob", delivered_seq: 3, read_seq: 3 }] }));
    await settle();
    const old = h.client.send("room", "old");
    await settle();
    socket.deliver(ackOf(socket.framesOf("send")[0], 4));
    socket.deliver({ type: "message", data: stored(4, "me", "old", old.clientMessageId) });
    socket.deliver({ type: "receipt", data: { conversation_id: "room", user_id: "bob", delivered_seq: 4, read_seq: 4 } });
    await settle();
    assert.deepEqual(deliveredSeqs(socket), [3, 4]);
    // The history expired; bob starts a new one.
    socket.deliver({ type: "message", data: stored(1, "bob", "new b1", "bob-new-1", "e2") });
    await settle();
    const again = socket.framesOf("sync").at(-1);
    assert.deepEqual(again.data, { positions: [{ after_seq: 4, conversation_id: "room", epoch: "e1" }] });
    socket.deliver(syncedOf(again, 1, {
      epoch: "e2", complete: false, missing: [{ epoch: "e1", from_seq: 5, to_seq: null }],
      receipts: [{ user_id: "bob", delivered_seq: 1, read_seq: 0 }, { user_id: "me", delivered_seq: 0, read_seq: 0 }],
    }));
    await settle();
    assert.deepEqual(h.of("messagegap"), [{ conversationId: "room", epoch: "e1", fromSeq: 5, toSeq: null }]);
    assert.deepEqual(deliveredSeqs(socket), [3, 4, 1], "the new history's cursor from 0");
    assert.deepEqual(h.client.receipts("room"), [{ userId: "bob", deliveredSeq: 1, readSeq: 0 }, { userId: "me", deliveredSeq: 0, readSeq: 0 }]);
    const next = h.client.send("room", "new");
    await settle();
    socket.deliver(ackOf(socket.framesOf("send")[1], 2, "e2"));
    await settle();
    assert.deepEqual(h.client.messages("room").map((message) => `${message.epoch}:${message.seq}:${message.text}:${message.status}`), [
      "e1:1:b1:delivered", "e1:2:b2:delivered", "e1:3:b3:delivered", "e1:4:old:read", "e2:1:new b1:delivered", "e2:2:new:sent",
    ], "bob read 4 of the old history, not 2 of the new");
    assert.equal(h.client.messages("room").at(-1).clientMessageId, next.clientMessageId);
  });
});

// MARK: Tabs of one browser

/**
 * Web Locks as a browser keeps them for one origin: the names held, and the requests waiting for
 * one, granted in order as it is let go. `ifAvailable` answers `null` when the name is held (or
 * others wait for it). The callback runs after the request returns, and the lock is held until the
 * promise it returned settles.
 */
class FakeLocks {
  held = new Set();
  /** @type {Array<{ name: string, grant: () => void }>} */
  waiting = [];
  /** Every request: its name, and whether it was `ifAvailable`. */
  requests = [];

  request(name, options, callback) {
    this.requests.push({ name, ifAvailable: options.ifAvailable === true });
    if (this.held.has(name) || this.waiting.some((entry) => entry.name === name)) {
      if (options.ifAvailable) return Promise.resolve().then(() => callback(null));
      return new Promise((resolve, reject) => {
        this.waiting.push({ name, grant: () => this.#grant(name, callback).then(resolve, reject) });
      });
    }
    return this.#grant(name, callback);
  }

  /** Another tab holds `name` until the returned function is called (the tab goes away). */
  hold(name) {
    assert.ok(!this.held.has(name), `${name} is free`);
    this.held.add(name);
    return () => this.#letGo(name);
  }

  #grant(name, callback) {
    this.held.add(name);
    return Promise.resolve().then(() => callback({ name, mode: "exclusive" })).finally(() => this.#letGo(name));
  }

  #letGo(name) {
    this.held.delete(name);
    const next = this.waiting.findIndex((entry) => entry.name === name);
    if (next >= 0) this.waiting.splice(next, 1)[0].grant();
  }
}

/**
 * IndexedDB reduced to what `IndexedDBOutboxStore` uses: the `outbox` records of one database by
 * key, each step answered on a microtask. `holdWrites(key)` keeps writes to a key from completing
 * until `releaseWrites(key)`; `writes` lists the keys written, in the order their writes completed.
 */
function fakeIndexedDB() {
  const records = new Map();
  const writes = [];
  const heldWrites = new Map();
  const database = {
    close() {},
    createObjectStore() {},
    transaction() {
      const transaction = {
        objectStore: () => ({
          get(key) {
            const request = {};
            queueMicrotask(() => {
              request.result = structuredClone(records.get(key));
              request.onsuccess?.();
            });
            return request;
          },
          put(value, key) {
            const commit = () => {
              records.set(key, structuredClone(value));
              writes.push(key);
              transaction.oncomplete?.();
            };
            queueMicrotask(() => (heldWrites.has(key) ? heldWrites.get(key).push(commit) : commit()));
          },
        }),
      };
      return transaction;
    },
  };
  return {
    records,
    writes,
    open() {
      const request = { result: database };
      queueMicrotask(() => request.onsuccess?.());
      return request;
    },
    holdWrites(key) { heldWrites.set(key, []); },
    releaseWrites(key) {
      const commits = heldWrites.get(key) ?? [];
      heldWrites.delete(key);
      for (const commit of commits) commit();
    },
  };
}

/** A message as the outbox store keeps it. */
const kept = (clientMessageId, text) => ({
  conversationId: "room", clientMessageId, seq: null, id: null, epoch: null, senderId: null, type: "text", text, imageUrl: null,
  createdAt: START - 60_000, status: "sending", failure: null,
});

const slotLock = (slot) => `presence.device-slot:kept-id:${slot}`;

describe("tabs of one browser: a device slot each, held through Web Locks", () => {
  /** A tab: a client with no device id of its own, on the browser's storage and locks. */
  const tab = (browser, options = {}) => setup({ deviceId: undefined, storage: browser.storage, locks: browser.locks, outboxStore: new MemoryOutboxStore(), ...options });
  const browser = () => ({ storage: memoryStorage({ [DEVICE_ID_STORAGE_KEY]: "kept-id" }), locks: new FakeLocks() });

  test("two tabs: the stored id, then the stored id with .tab2, each its own session; no session before the slot is held", async () => {
    const shared = browser();
    const first = tab(shared);
    const second = tab(shared);
    assert.equal(first.client.deviceId, null, "no device id before start() claims a slot");
    first.client.start();
    assert.equal(first.sockets.length, 0, "no session before the slot is held");
    assert.equal(first.client.deviceId, null);
    await settle();
    assert.equal(first.client.deviceId, "kept-id");
    assert.equal(new URL(first.last().url).searchParams.get("device_id"), "kept-id");
    second.client.start();
    await settle();
    assert.equal(second.client.deviceId, "kept-id.tab2");
    assert.equal(new URL(second.last().url).searchParams.get("device_id"), "kept-id.tab2");
    assert.deepEqual(shared.locks.requests.map(({ name, ifAvailable }) => `${name}${ifAvailable ? "?" : ""}`),
      [`${slotLock(1)}?`, `${slotLock(1)}?`, `${slotLock(2)}?`], "the first free slot, each asked ifAvailable");
    assert.deepEqual([...shared.locks.held].sort(), [slotLock(1), slotLock(2)]);
  });

  test("every slot held: the tab waits for slot 1, with no device id and no session, and connects once it is let go", async () => {
    const shared = browser();
    const tabsGone = [];
    for (let slot = 1; slot <= 32; slot += 1) tabsGone.push(shared.locks.hold(slotLock(slot)));
    const h = tab(shared);
    h.client.start();
    await settle();
    await h.clock.advance(60);
    assert.equal(h.client.deviceId, null);
    assert.equal(h.sockets.length, 0, "no session while no slot is held");
    assert.equal(h.client.connectionState.state, "idle");
    assert.deepEqual(shared.locks.requests.at(-1), { name: slotLock(1), ifAvailable: false }, "the 33rd request waits for slot 1");
    tabsGone[1]();
    await settle();
    assert.equal(h.sockets.length, 0, "slot 2 let go is not what it waits for");
    tabsGone[0]();
    await settle();
    assert.equal(h.client.deviceId, "kept-id");
    assert.equal(h.sockets.length, 1);
    assert.equal(new URL(h.last().url).searchParams.get("device_id"), "kept-id");
  });

  test("signOut lets the slot go (the device id is null again) and the next tab gets it; start() after it claims nothing", async () => {
    const shared = browser();
    const first = tab(shared);
    const second = tab(shared);
    await first.connect();
    second.client.start();
    await settle();
    second.last().open();
    await settle();
    assert.equal(second.client.deviceId, "kept-id.tab2");
    await second.client.signOut();
    await settle();
    assert.equal(second.client.deviceId, null);
    assert.ok(!shared.locks.held.has(slotLock(2)), "slot 2 is free");
    second.client.start();
    await settle();
    assert.ok(!shared.locks.held.has(slotLock(2)), "a signed-out client claims no slot again");
    const third = tab(shared);
    third.client.start();
    await settle();
    assert.equal(third.client.deviceId, "kept-id.tab2");
    assert.equal(first.client.deviceId, "kept-id");
  });

  test("4009 (replaced) lets the slot go too", async () => {
    const shared = browser();
    const h = tab(shared);
    const socket = await h.connect();
    socket.serverClose(4009);
    await settle();
    assert.deepEqual(h.client.connectionState, { state: "stopped", reason: "replaced" });
    assert.ok(!shared.locks.held.has(slotLock(1)));
  });

  test("signOut or stop before the slot arrives: no session after it; a signed-out client lets the slot go at once", async () => {
    const shared = browser();
    const tabGone = shared.locks.hold(slotLock(1));
    for (let slot = 2; slot <= 32; slot += 1) shared.locks.hold(slotLock(slot));
    const signedOut = tab(shared);
    signedOut.client.start();
    await settle();
    await signedOut.client.signOut();
    assert.deepEqual(signedOut.client.connectionState, { state: "stopped", reason: "signedOut" });
    const stopped = tab(shared);
    stopped.client.start();
    await settle();
    await stopped.client.stop();
    tabGone();
    await settle();
    assert.equal(signedOut.client.deviceId, null);
    assert.equal(signedOut.sockets.length, 0);
    assert.equal(stopped.client.deviceId, "kept-id", "the slot went on to the next waiting");
    assert.equal(stopped.sockets.length, 0, "stopped: no session");
    assert.deepEqual(stopped.client.connectionState, { state: "idle" });
    stopped.client.start();
    await settle();
    assert.equal(stopped.sockets.length, 1, "started again, on the slot it holds");
  });

  test("no slots with the app's own device id, or with locks: null; locks without request() is refused", async () => {
    const shared = browser();
    const own = tab(shared, { deviceId: "app-device" });
    assert.equal(own.client.deviceId, "app-device");
    await own.connect();
    const none = tab(shared, { locks: null });
    assert.equal(none.client.deviceId, "kept-id", "the stored id at once, as without Web Locks");
    assert.deepEqual(shared.locks.requests, [], "no lock asked for");
    assert.throws(() => tab(shared, { locks: {} }), (error) => error instanceof PresenceClientError
      && /^locks must have request\(name, options, callback\)/.test(error.message));
  });

  test("a closed tab's outbox is adopted once its slot is free: sent from here, emptied there only after saved here", async () => {
    const database = fakeIndexedDB();
    database.records.set("kept-id.tab2", [kept("left-1", "left behind 1"), kept("left-2", "left behind 2")]);
    database.records.set("kept-id.tab3", [kept("live-1", "a live tab's")]);
    globalThis.indexedDB = database;
    try {
      const shared = browser();
      const secondTabGone = shared.locks.hold(slotLock(2));
      shared.locks.hold(slotLock(3));
      const h = tab(shared, { outboxStore: undefined });
      const socket = await h.connect();
      assert.equal(h.client.deviceId, "kept-id");
      await settle();
      assert.deepEqual(h.of("message"), [], "slots held by live tabs are not touched");
      // Tab 2 closes; this page is shown again.
      secondTabGone();
      database.holdWrites("kept-id");
      h.setHidden(true);
      h.setHidden(false);
      await settle();
      assert.deepEqual(h.of("message").map((message) => message.clientMessageId), ["left-1", "left-2"], "announced like restored ones");
      assert.deepEqual(database.records.get("kept-id.tab2").map((message) => message.clientMessageId), ["left-1", "left-2"],
        "not emptied there while this outbox is not saved");
      assert.ok(shared.locks.held.has(slotLock(2)), "slot 2 is held while its outbox is adopted");
      const send = socket.framesOf("send")[0];
      assert.equal(send.data.client_message_id, "left-1", "sent like the rest");
      database.releaseWrites("kept-id");
      await settle();
      assert.deepEqual(database.writes, ["kept-id", "kept-id.tab2"], "saved here, then emptied there");
      assert.deepEqual(database.records.get("kept-id").map((message) => message.clientMessageId), ["left-1", "left-2"]);
      assert.deepEqual(database.records.get("kept-id.tab2"), []);
      assert.deepEqual(database.records.get("kept-id.tab3").map((message) => message.clientMessageId), ["live-1"]);
      assert.ok(!shared.locks.held.has(slotLock(2)), "slot 2 let go after");
      socket.deliver(ackOf(send, 1));
      await settle();
      socket.deliver(ackOf(socket.framesOf("send")[1], 2));
      await settle();
      assert.deepEqual(h.client.messages("room").map((message) => `${message.seq}:${message.text}:${message.status}`),
        ["1:left behind 1:sent", "2:left behind 2:sent"]);
      // Shown again: nothing left to adopt, and what is here already is not taken twice.
      database.records.set("kept-id.tab2", [kept("left-2", "left behind 2")]);
      h.setHidden(true);
      h.setHidden(false);
      await settle();
      assert.equal(h.of("message").length, 2);
      assert.equal(socket.framesOf("send").length, 2);
      assert.deepEqual(database.records.get("kept-id.tab2"), [], "emptied all the same");
    } finally {
      delete globalThis.indexedDB;
    }
  });

  test("a tab closing while an adoption pass is under way is adopted by a pass after it", async () => {
    const database = fakeIndexedDB();
    database.records.set("kept-id.tab2", [kept("second-1", "from tab 2")]);
    database.records.set("kept-id.tab3", [kept("third-1", "from tab 3")]);
    globalThis.indexedDB = database;
    try {
      const shared = browser();
      const secondTabGone = shared.locks.hold(slotLock(2));
      const h = tab(shared, { outboxStore: undefined });
      // The pass that follows the claim gets past slot 2 (held) and waits at slot 3 for this outbox's save.
      database.holdWrites("kept-id");
      await h.connect();
      assert.deepEqual(h.of("message").map((message) => message.clientMessageId), ["third-1"]);
      secondTabGone();
      h.setHidden(true);
      h.setHidden(false);
      await settle();
      assert.deepEqual(h.of("message").map((message) => message.clientMessageId), ["third-1"], "one pass at a time");
      database.releaseWrites("kept-id");
      await settle();
      assert.deepEqual(h.of("message").map((message) => message.clientMessageId), ["third-1", "second-1"]);
      assert.deepEqual(database.records.get("kept-id.tab2"), []);
      assert.deepEqual(database.records.get("kept-id.tab3"), []);
      assert.deepEqual(database.records.get("kept-id").map((message) => message.clientMessageId), ["third-1", "second-1"]);
    } finally {
      delete globalThis.indexedDB;
    }
  });
});
