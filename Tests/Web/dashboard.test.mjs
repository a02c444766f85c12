// The operator dashboard's pure parts (Sources/PresenceGateway/Web/dashboard.js), in Node without
// a DOM: `node --test Tests/Web/`. Importing the module must not start the page.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { describe, test } from "node:test";

import {
  ClockEstimate,
  MessageRate,
  SSEParser,
  SecondRing,
  backoffSeconds,
  chartScaleMax,
  clockOffset,
  compareIds,
  formatLease,
  formatRelative,
  hiddenNote,
  leaseSecondsLeft,
  readOverview,
  readPresence,
} from "../../Sources/PresenceGateway/Web/dashboard.js";

const web = new URL("../../Sources/PresenceGateway/Web/", import.meta.url);

// A feed as the gateway sends it: keepalive comments, an overview, presence changes whose ids
// and statuses hold multi-byte UTF-8 (2-, 3- and 4-byte characters), and a numeric id.
const overviewData = {
  at: "2026-11-25T12:00:00.123Z", users_online: 2, users_away: 1,
  users: [{ user_id: "zoë", status: "online", last_seen: "2026-11-25T12:00:00.123Z" }, { user_id: 42, status: "away", last_seen: null }],
  users_truncated: false,
  nodes: [{ node_id: "node-a", sessions: 12, lease_expires_at: "2026-11-25T12:00:09.000Z" }],
  conversations: [{ conversation_id: "équipe", total: 5, online: 3, away: 1 }], conversations_truncated: false,
  messages_stored: 40,
};
const presenceData = [
  { user_id: "日本🙂", status: "away", last_seen: "2026-11-25T12:00:01.000Z", shown_status: "away", at: "2026-11-25T12:00:01.456Z" },
  { user_id: 7, status: "online", last_seen: null, shown_status: "offline", at: "2026-11-25T12:00:02.000Z" },
];
const feedText =
  ": keepalive\n\n" +
  `event: overview\ndata: ${JSON.stringify(overviewData)}\n\n` +
  ": keepalive\n" +
  `event: presence\ndata: ${JSON.stringify(presenceData[0])}\n\n` +
  `event: presence\ndata: ${JSON.stringify(presenceData[1])}\n\n`;
const feedBytes = new TextEncoder().encode(feedText);

/** The events (name and parsed data) a parser gives for these chunks. */
function parseAll(chunks) {
  const parser = new SSEParser();
  const events = [];
  for (const chunk of chunks) events.push(...parser.push(chunk));
  return { events: events.map((event) => ({ event: event.event, data: JSON.parse(event.data) })), comments: parser.comments };
}

const expectedEvents = [
  { event: "overview", data: overviewData },
  { event: "presence", data: presenceData[0] },
  { event: "presence", data: presenceData[1] },
];

/** A small deterministic PRNG (mulberry32) for the random splits. */
function random(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let value = state;
    value = Math.imul(value ^ (value >>> 15), value | 1);
    value ^= value + Math.imul(value ^ (value >>> 7), value | 61);
    return ((value ^ (value >>> 14)) >>> 0) / 4294967296;
  };
}

describe("SSEParser", () => {
  test("parses a whole feed: events, data, comments", () => {
    const { events, comments } = parseAll([feedBytes]);
    assert.deepEqual(events, expectedEvents);
    assert.equal(comments, 2);
  });

  test("gives the same events for a split at every byte, inside lines and inside UTF-8 characters", () => {
    // The multi-byte characters really are split by some of these cuts.
    const multiByteStarts = [...feedBytes.keys()].filter((index) => feedBytes[index] >= 0xc0);
    assert.ok(multiByteStarts.length >= 4);
    for (let cut = 0; cut <= feedBytes.length; cut += 1) {
      const { events } = parseAll([feedBytes.subarray(0, cut), feedBytes.subarray(cut)]);
      assert.deepEqual(events, expectedEvents, `split at byte ${cut}`);
    }
  });

  test("gives the same events for one byte at a time and for random chunkings", () => {
    assert.deepEqual(parseAll([...feedBytes].map((byte) => Uint8Array.of(byte))).events, expectedEvents);
    const next = random(2026);
    for (let round = 0; round < 200; round += 1) {
      const chunks = [];
      for (let start = 0; start < feedBytes.length;) {
        const length = 1 + Math.floor(next() * 40);
        chunks.push(feedBytes.subarray(start, start + length));
        start += length;
      }
      assert.deepEqual(parseAll(chunks).events, expectedEvents, `round ${round}`);
    }
  });

  test("takes CRLF and CR line ends, a CR and its LF in different chunks counting once", () => {
    const crlf = feedText.replaceAll("\n", "\r\n");
    const cr = feedText.replaceAll("\n", "\r");
    for (const text of [crlf, cr]) {
      assert.deepEqual(parseAll([text]).events, expectedEvents);
      for (let cut = 0; cut <= text.length; cut += 1) {
        assert.deepEqual(parseAll([text.slice(0, cut), text.slice(cut)]).events, expectedEvents, `split at ${cut}`);
      }
    }
    // "event: a\r" then "\n…": the LF must not read as a blank line (which would reset the name).
    const parser = new SSEParser();
    assert.deepEqual(parser.push("event: a\r"), []);
    assert.deepEqual(parser.push("\ndata: 1\r"), []);
    assert.deepEqual(parser.push("\n\r\n"), [{ event: "a", data: "1", id: "" }]);
  });

  test("follows the SSE field rules", () => {
    const parser = new SSEParser();
    const events = parser.push(
      "data:no space\ndata:  two spaces\nfoo: ignored\nid: 9\n\n" + // two data lines, one space dropped
      "event: lonely\n\n" + // no data: not dispatched
      "data\n\n" + // a field without a colon: an empty value
      "event: presence\ndata: {}\n", // unfinished at the end
    );
    assert.deepEqual(events, [
      { event: "message", data: "no space\n two spaces", id: "9" },
      { event: "message", data: "", id: "9" },
    ]);
    parser.end();
    assert.deepEqual(parser.push("\n"), [], "an event unfinished when the stream ended is dropped");
  });

  test("refuses an endless line", () => {
    const parser = new SSEParser(16);
    assert.throws(() => parser.push("data: " + "x".repeat(20)), /longer than 16/);
  });
});

describe("SecondRing", () => {
  const t0 = Date.parse("2026-11-25T12:00:00.000Z");

  test("counts per second, oldest first, the last entry being the second in progress", () => {
    const ring = new SecondRing(300);
    ring.record(t0 + 100);
    ring.record(t0 + 999);
    ring.record(t0 + 1000, 3);
    ring.record(t0 + 5500);
    const series = ring.series(t0 + 5999);
    assert.equal(series.length, 300);
    assert.deepEqual(series.slice(-6), [2, 3, 0, 0, 0, 1]);
    assert.equal(series.reduce((a, b) => a + b, 0), 6);
    assert.equal(ring.countAt(t0 + 1500), 3);
  });

  test("forgets seconds older than its size, also when a slot is reused", () => {
    const ring = new SecondRing(300);
    ring.record(t0);
    assert.equal(ring.series(t0 + 299_999)[0], 1, "still inside the 300 s window");
    assert.equal(ring.series(t0 + 300_000).reduce((a, b) => a + b, 0), 0, "out of the window");
    ring.record(t0 + 300_000, 2); // the same slot, 300 s later: replaces, does not add
    assert.deepEqual(ring.series(t0 + 300_000).slice(-1), [2]);
    ring.record(t0); // now older than the slot holds: dropped
    assert.equal(ring.countAt(t0 + 300_000), 2);
    assert.equal(ring.countAt(t0), 0);
  });

  test("chart scale: at least 5, then 10, 20, 50, 100…", () => {
    assert.deepEqual([0, 5, 6, 10, 11, 20, 21, 51, 101, 4999].map(chartScaleMax), [5, 5, 10, 10, 20, 20, 50, 100, 200, 5000]);
  });
});

describe("lease countdown", () => {
  const at = "2026-11-25T12:00:00.000Z";
  const lease = "2026-11-25T12:00:09.000Z";

  test("counts down from the server's clock, corrected by the overview's arrival", () => {
    const local = Date.parse("2026-11-25T11:59:58.000Z"); // the local clock is 2 s behind
    const offset = clockOffset(at, local);
    assert.equal(offset, 2000);
    assert.equal(leaseSecondsLeft(lease, local, offset), 9);
    assert.equal(leaseSecondsLeft(lease, local + 1000, offset), 8);
    assert.equal(leaseSecondsLeft(lease, local + 8999, offset), 0);
    assert.equal(formatLease(leaseSecondsLeft(lease, local + 8999, offset)), "0 s");
    assert.equal(formatLease(leaseSecondsLeft(lease, local + 9001, offset)), "expired");
    assert.equal(formatLease(leaseSecondsLeft(lease, local + 1000, offset)), "8 s");
    // Without the correction, the lease would look 2 s longer.
    assert.equal(leaseSecondsLeft(lease, local, 0), 11);
  });

  test("the estimate keeps the largest recent offset: a cached or delayed overview looks older", () => {
    const clock = new ClockEstimate(3);
    assert.equal(clock.offset, 0);
    const local = Date.parse("2026-11-25T11:59:58.000Z");
    clock.add(at, local); // +2000
    clock.add("2026-11-25T12:00:01.200Z", local + 2000); // read 0.8 s before it was sent: +1200
    clock.add("not a time", local + 3000); // ignored
    assert.equal(clock.offset, 2000);
    assert.equal(leaseSecondsLeft(lease, local + 1000, clock.offset), 8);
    clock.add("2026-11-25T12:00:04.000Z", local + 4500); // +1500
    clock.add("2026-11-25T12:00:06.000Z", local + 6500); // +1500: the +2000 sample has left the window
    assert.equal(clock.offset, 1500);
  });

  test("a local clock ahead of the server's, and unreadable times", () => {
    const local = Date.parse("2026-11-25T12:00:30.500Z");
    const offset = clockOffset(at, local);
    assert.equal(offset, -30_500);
    assert.equal(leaseSecondsLeft(lease, local + 2500, offset), 6);
    assert.equal(clockOffset("not a time", local), 0);
    assert.equal(leaseSecondsLeft(null, local, offset), null);
    assert.equal(formatLease(null), "–");
  });
});

describe("helpers", () => {
  test("reconnect backoff: 1, 2, 4, 8, then 8", () => {
    assert.deepEqual([0, 1, 2, 3, 4, 10, 5000].map(backoffSeconds), [1, 2, 4, 8, 8, 8, 8]);
  });

  test("users sort by String(id), as the gateway and presencectl sort", () => {
    assert.deepEqual(["b", 10, "a", 9, 100].sort(compareIds), [10, 100, 9, "a", "b"]);
  });

  test("relative times as presencectl writes them", () => {
    const now = Date.parse("2026-11-25T12:00:00.000Z");
    assert.equal(formatRelative(now - 12_900, now), "12s ago");
    assert.equal(formatRelative(now - 3 * 60_000, now), "3m ago");
    assert.equal(formatRelative(now + 8_000, now), "in 8s");
    assert.equal(formatRelative(now - 2 * 86_400_000, now), "2d ago");
    assert.equal(formatRelative(null, now), "never");
  });

  test("feed payloads: ids shown with String(id), hidden statuses noted", () => {
    const overview = readOverview(overviewData);
    assert.deepEqual(overview.users.map((user) => user.key), ["zoë", "42"]);
    assert.equal(overview.users[1].lastSeen, null);
    assert.deepEqual(overview.nodes, [{ key: "node-a", sessions: 12, leaseExpiresAt: Date.parse("2026-11-25T12:00:09.000Z") }]);
    assert.deepEqual(overview.conversations, [{ key: "équipe", total: 5, online: 3, away: 1 }]);
    assert.deepEqual(readOverview("garbage").users, []);
    assert.equal(overview.messagesStored, 40);
    assert.equal(readOverview({}).messagesStored, 0);

    const hidden = readPresence(presenceData[1]);
    assert.equal(hidden.key, "7");
    assert.equal(hiddenNote(hidden), "(hidden: others see offline)");
    assert.equal(hiddenNote(readPresence(presenceData[0])), "");
    assert.equal(readPresence({ status: "online" }), null);
  });
});

describe("messages a second", () => {
  test("the change of the nodes' total over the last minute, once it spans 5 s; a total that drops starts again", () => {
    const rate = new MessageRate();
    assert.equal(rate.add(0, 100), null);
    assert.equal(rate.add(2_000, 100), null, "2 s is too short to say");
    assert.equal(rate.add(5_000, 150), 10, "50 messages over 5 s");
    assert.equal(rate.add(10_000, 200), 10);
    for (let at = 12_000; at <= 70_000; at += 2_000) rate.add(at, 200);
    assert.equal(rate.rate(), 0, "a minute with no message: the old samples are gone");
    assert.equal(rate.add(72_000, 20), null, "a node restarted: its count began again");
    assert.equal(rate.add(null, 30), null);
  });
});

describe("page files", () => {
  test("the HTML has the ids the end-to-end test looks for, and nothing inline", () => {
    const html = readFileSync(new URL("dashboard.html", web), "utf8");
    const ids = new Set([...html.matchAll(/\sid="([^"]+)"/g)].map((match) => match[1]));
    for (const id of ["feed-state", "count-online", "count-away", "count-nodes", "count-sessions", "users", "nodes",
      "conversations", "lookup-form", "lookup-user", "lookup-result", "events", "chart"]) {
      assert.ok(ids.has(id), `#${id}`);
    }
    assert.doesNotMatch(html, /\sstyle=|<style|\son[a-z]+=/i);
    for (const script of html.matchAll(/<script\b[^>]*>([\s\S]*?)<\/script>/gi)) {
      assert.match(script[0], /\ssrc="/);
      assert.equal(script[1].trim(), "");
    }
  });

  test("the script builds no HTML from strings", () => {
    const source = readFileSync(new URL("dashboard.js", web), "utf8");
    assert.doesNotMatch(source, /innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function/);
  });
});
