// @ts-check
/**
 * The operator dashboard of the presence gateway: served at `/dashboard` (this module at
 * `/dashboard/dashboard.js`), no dependency, no build step, nothing inline (the page's CSP allows
 * scripts and styles from 'self' only). Every string from the server reaches the page through
 * `textContent` or `setAttribute`.
 *
 * The feed it expects: `GET /api/admin/events` with `Authorization: Bearer <admin token>`
 * (EventSource cannot send that header, so the page reads the body as a stream and parses the
 * Server-Sent Events itself). 401 = wrong token, 404 = admin routes off on this node, 200 = a
 * `text/event-stream` in UTF-8 whose lines end in LF, CRLF or CR:
 *   - `event: NAME`, then one `data: JSON` line (several would be joined with "\n"), then a blank
 *     line, which ends the event; a line starting with `:` is a comment (a keepalive);
 *   - `overview`, right after connecting and then every 2 s:
 *     `{at, users_online, users_away, users: [{user_id, status, last_seen}], users_truncated,
 *       nodes: [{node_id, sessions, lease_expires_at}],
 *       conversations: [{conversation_id, total, online, away}], conversations_truncated}`
 *     (`users`: at most 500, online or away, sorted by id; `conversations`: at most 200);
 *   - `presence`, on every change of a user's aggregate status:
 *     `{user_id, status, last_seen, shown_status, at}` (`shown_status` differs from `status` when
 *     the user hides their status).
 * Ids are JSON strings or numbers (shown as `String(id)`); times are ISO 8601 strings (a last
 * seen may be null). The page reconnects after 1, 2, 4, 8, 8… s when the stream ends or fails,
 * or when nothing at all (not even a keepalive) arrives for 10 s; the delay starts again at 1 s
 * once an overview arrives.
 *
 * The pure parts (the SSE parser, the per-second ring, the lease and time arithmetic) are
 * exported for Tests/Web/dashboard.test.mjs; the page itself starts only where there is a
 * `document`, so Node can import this module.
 *
 * @module dashboard
 */

export const TOKEN_STORAGE_KEY = "presence.admin_token";
export const EVENTS_PATH = "/api/admin/events";
export const USER_PATH = "/api/admin/users/";
/** A conversation's newest messages and members' cursors, for its id (URL-encoded) appended. */
export const CONVERSATION_PATH = "/api/admin/conversations/";
/** Seconds the chart covers. */
export const CHART_SECONDS = 300;
/** Presence changes kept in the tail. */
export const MAX_EVENTS = 200;
/** A feed that sends nothing (not even a keepalive) for this long is dropped and reopened. */
export const STALL_MILLISECONDS = 10_000;

export const WRONG_TOKEN_TEXT = "the admin token is wrong";
export const ADMIN_OFF_TEXT = "admin endpoints are off on this node (PRESENCE_ADMIN_TOKEN is not set)";

// MARK: - Server-Sent Events

/** @typedef {{ event: string, data: string, id: string }} SSEEvent */

/**
 * An incremental Server-Sent Events parser: push the body's chunks as they come (bytes, decoded
 * as UTF-8 across chunk boundaries, or strings), get back the events they complete.
 */
export class SSEParser {
  /** @param {number} [maxLineLength] a longer unfinished line throws (a broken or hostile stream) */
  constructor(maxLineLength = 8 * 1024 * 1024) {
    this.maxLineLength = maxLineLength;
    this.decoder = new TextDecoder("utf-8");
    /** The unfinished line; it holds no line terminator. */
    this.buffer = "";
    /** The previous chunk ended with CR: a LF starting the next one belongs to it. */
    this.skipLF = false;
    this.eventName = "";
    /** @type {string[]} */
    this.data = [];
    this.lastEventId = "";
    /** @type {number | null} the last `retry:` field, in milliseconds */
    this.retry = null;
    /** Comment lines seen (keepalives). */
    this.comments = 0;
  }

  /**
   * @param {Uint8Array | string} chunk
   * @returns {SSEEvent[]} the events this chunk completes, in order
   */
  push(chunk) {
    const text = typeof chunk === "string" ? chunk : this.decoder.decode(chunk, { stream: true });
    /** @type {SSEEvent[]} */
    const events = [];
    let start = 0;
    if (text.length > 0 && this.skipLF) {
      this.skipLF = false;
      if (text.charCodeAt(0) === 10) start = 1;
    }
    for (let index = start; index < text.length; index += 1) {
      const code = text.charCodeAt(index);
      if (code !== 10 && code !== 13) continue;
      const line = this.buffer + text.slice(start, index);
      this.buffer = "";
      this.#line(line, events);
      if (code === 13) {
        if (index + 1 === text.length) this.skipLF = true;
        else if (text.charCodeAt(index + 1) === 10) index += 1;
      }
      start = index + 1;
    }
    this.buffer += text.slice(start);
    if (this.buffer.length > this.maxLineLength) {
      throw new Error(`an event stream line is longer than ${this.maxLineLength} characters`);
    }
    return events;
  }

  /** The stream ended: an unfinished event is dropped (as the SSE spec says) and the parser reset. */
  end() {
    this.decoder = new TextDecoder("utf-8");
    this.buffer = "";
    this.skipLF = false;
    this.eventName = "";
    this.data = [];
  }

  /**
   * @param {string} line
   * @param {SSEEvent[]} events
   */
  #line(line, events) {
    if (line === "") {
      if (this.data.length > 0) {
        events.push({ event: this.eventName || "message", data: this.data.join("\n"), id: this.lastEventId });
      }
      this.eventName = "";
      this.data = [];
      return;
    }
    if (line.charCodeAt(0) === 58) { // ":"
      this.comments += 1;
      return;
    }
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.charCodeAt(0) === 32) value = value.slice(1);
    switch (field) {
      case "event": this.eventName = value; break;
      case "data": this.data.push(value); break;
      case "id": if (!value.includes("\0")) this.lastEventId = value; break;
      case "retry": if (/^[0-9]+$/.test(value)) this.retry = Number(value); break;
      default: break; // unknown fields are ignored
    }
  }
}

// MARK: - The chart's ring

/** Counts per second over the last `size` seconds: slot `second mod size`, tagged with its second. */
export class SecondRing {
  /** @param {number} [size] */
  constructor(size = CHART_SECONDS) {
    this.size = size;
    /** @type {number[]} */
    this.counts = new Array(size).fill(0);
    /** @type {number[]} the second each slot counts (NaN: none yet) */
    this.seconds = new Array(size).fill(Number.NaN);
  }

  /**
   * Counts `count` happenings at `milliseconds` (Date.now()-style). One older than what its slot
   * holds already (more than `size` seconds older than a later record) is dropped.
   * @param {number} milliseconds
   * @param {number} [count]
   */
  record(milliseconds, count = 1) {
    const second = Math.floor(milliseconds / 1000);
    const slot = mod(second, this.size);
    const held = this.seconds[slot];
    if (held === second) {
      this.counts[slot] += count;
    } else if (Number.isNaN(held) || held < second) {
      this.seconds[slot] = second;
      this.counts[slot] = count;
    }
  }

  /**
   * The count of the second holding `milliseconds`.
   * @param {number} milliseconds
   */
  countAt(milliseconds) {
    const second = Math.floor(milliseconds / 1000);
    const slot = mod(second, this.size);
    return this.seconds[slot] === second ? this.counts[slot] : 0;
  }

  /**
   * The last `size` seconds' counts, oldest first; the last one is the second in progress.
   * @param {number} nowMilliseconds
   * @returns {number[]}
   */
  series(nowMilliseconds) {
    const now = Math.floor(nowMilliseconds / 1000);
    /** @type {number[]} */
    const values = new Array(this.size);
    for (let index = 0; index < this.size; index += 1) {
      const second = now - (this.size - 1) + index;
      const slot = mod(second, this.size);
      values[index] = this.seconds[slot] === second ? this.counts[slot] : 0;
    }
    return values;
  }
}

/**
 * The top of the chart's y axis: at least 5, else the next of 10, 20, 50, 100, 200, 500…
 * @param {number} peak
 */
export function chartScaleMax(peak) {
  if (!Number.isFinite(peak) || peak <= 5) return 5;
  for (let magnitude = 10; ; magnitude *= 10) {
    for (const step of [1, 2, 5]) if (step * magnitude >= peak) return step * magnitude;
  }
}

// MARK: - Time

/**
 * Milliseconds since the epoch of an ISO 8601 string (or a number of milliseconds); null else.
 * @param {unknown} value
 * @returns {number | null}
 */
export function parseTime(value) {
  if (typeof value === "number") return Number.isFinite(value) ? value : null;
  if (typeof value !== "string" || value === "") return null;
  const milliseconds = Date.parse(value);
  return Number.isNaN(milliseconds) ? null : milliseconds;
}

/**
 * How far the server's clock is ahead of the local one: the overview's `at` minus the local time
 * it arrived (0 when `at` is unreadable). Server time = local time + offset.
 * @param {unknown} serverAt
 * @param {number} localArrivalMilliseconds
 */
export function clockOffset(serverAt, localArrivalMilliseconds) {
  const at = parseTime(serverAt);
  return at === null ? 0 : at - localArrivalMilliseconds;
}

/**
 * The server clock's offset from recent overviews. An overview's `at` is when the node read it
 * (it may serve one read up to 1 s earlier to every dashboard) and it spends time on the way:
 * both only make `at - arrival` smaller than the true offset, so the largest of the recent samples
 * is the best estimate.
 */
export class ClockEstimate {
  /** @param {number} [samples] how many recent overviews count (every 2 s: 20 s by default) */
  constructor(samples = 10) {
    this.limit = samples;
    /** @type {number[]} */
    this.samples = [];
  }

  /**
   * @param {unknown} serverAt the overview's `at`
   * @param {number} localArrivalMilliseconds
   */
  add(serverAt, localArrivalMilliseconds) {
    if (parseTime(serverAt) === null) return;
    this.samples.push(clockOffset(serverAt, localArrivalMilliseconds));
    if (this.samples.length > this.limit) this.samples.shift();
  }

  /** Milliseconds to add to the local clock to read the server's (0 before any sample). */
  get offset() {
    return this.samples.length === 0 ? 0 : Math.max(...this.samples);
  }
}

/**
 * Whole seconds left on a lease (negative once expired), by the local clock corrected by `offset`.
 * @param {unknown} leaseExpiresAt ISO string or milliseconds
 * @param {number} localNowMilliseconds
 * @param {number} offsetMilliseconds from {@link ClockEstimate} (or {@link clockOffset})
 * @returns {number | null} null when the expiry is unreadable
 */
export function leaseSecondsLeft(leaseExpiresAt, localNowMilliseconds, offsetMilliseconds) {
  const expires = parseTime(leaseExpiresAt);
  if (expires === null) return null;
  return Math.floor((expires - (localNowMilliseconds + offsetMilliseconds)) / 1000);
}

/**
 * "9 s", "0 s", then "expired" below 0.
 * @param {number | null} seconds
 */
export function formatLease(seconds) {
  if (seconds === null) return "–";
  return seconds < 0 ? "expired" : `${seconds} s`;
}

/**
 * The reconnect delay after `attempt` failures in a row: 1, 2, 4, 8, 8… seconds.
 * @param {number} attempt 0 for the first
 */
export function backoffSeconds(attempt) {
  return Math.min(8, 2 ** Math.max(0, Math.floor(attempt)));
}

/**
 * "12s ago", "3m ago", "in 8s", "never", as presencectl writes them.
 * @param {number | null} milliseconds
 * @param {number} nowMilliseconds
 */
export function formatRelative(milliseconds, nowMilliseconds) {
  if (milliseconds === null) return "never";
  const delta = Math.trunc((nowMilliseconds - milliseconds) / 1000);
  const magnitude = Math.abs(delta);
  let text;
  if (magnitude < 60) text = `${magnitude}s`;
  else if (magnitude < 3600) text = `${Math.trunc(magnitude / 60)}m`;
  else if (magnitude < 86400) text = `${Math.trunc(magnitude / 3600)}h`;
  else text = `${Math.trunc(magnitude / 86400)}d`;
  return delta >= 0 ? `${text} ago` : `in ${text}`;
}

/**
 * ISO 8601 UTC with milliseconds, or "-".
 * @param {number | null} milliseconds
 */
export function formatTimestamp(milliseconds) {
  return milliseconds === null ? "-" : new Date(milliseconds).toISOString();
}

/**
 * "12:00:01" (UTC), or with milliseconds "12:00:01.456".
 * @param {number | null} milliseconds
 * @param {boolean} [withMilliseconds]
 */
export function formatClock(milliseconds, withMilliseconds = false) {
  if (milliseconds === null) return "–";
  return new Date(milliseconds).toISOString().slice(11, withMilliseconds ? 23 : 19);
}

// MARK: - Feed payloads

/** @typedef {string | number} JSONID */
/** @typedef {{ id: JSONID, key: string, status: string, lastSeen: number | null }} UserRow */
/** @typedef {{ key: string, sessions: number, leaseExpiresAt: number | null }} NodeRow */
/** @typedef {{ key: string, total: number, online: number, away: number }} ConversationRow */
/**
 * @typedef {{ at: number | null, usersOnline: number, usersAway: number, users: UserRow[],
 *   usersTruncated: boolean, nodes: NodeRow[], conversations: ConversationRow[],
 *   conversationsTruncated: boolean, messagesStored: number }} Overview
 */
/**
 * @typedef {{ id: JSONID, key: string, status: string, lastSeen: number | null,
 *   shownStatus: string | null, at: number | null }} PresenceChange
 */

/**
 * How an id is shown: `String(id)`; "" for anything but a string or a number.
 * @param {unknown} id
 */
export function idText(id) {
  return typeof id === "string" || typeof id === "number" ? String(id) : "";
}

/**
 * The order of the users table: by `String(id)`, as the gateway and presencectl sort (so numeric
 * ids too: "10" before "9").
 * @param {JSONID} a
 * @param {JSONID} b
 */
export function compareIds(a, b) {
  const x = String(a), y = String(b);
  return x < y ? -1 : x > y ? 1 : 0;
}

/**
 * The note of a change whose user hides their status, else "".
 * @param {{ status: string, shownStatus: string | null }} change
 */
export function hiddenNote(change) {
  if (change.shownStatus === null || change.shownStatus === change.status) return "";
  return `(hidden: others see ${change.shownStatus})`;
}

/**
 * @param {unknown} value
 * @returns {Record<string, unknown>}
 */
function record(value) {
  return typeof value === "object" && value !== null && !Array.isArray(value) ? /** @type {Record<string, unknown>} */ (value) : {};
}

/** @param {unknown} value */
function list(value) {
  return Array.isArray(value) ? value : [];
}

/** @param {unknown} value */
function count(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : 0;
}

/** @param {unknown} value */
function text(value) {
  return typeof value === "string" ? value : value === null || value === undefined ? "" : String(value);
}

/**
 * @param {unknown} value
 * @returns {JSONID | null}
 */
function jsonId(value) {
  return typeof value === "string" || typeof value === "number" ? value : null;
}

/**
 * An `overview` event's data, checked and typed; entries without an id are left out.
 * @param {unknown} raw
 * @returns {Overview}
 */
export function readOverview(raw) {
  const body = record(raw);
  /** @type {UserRow[]} */
  const users = [];
  for (const entry of list(body.users)) {
    const user = record(entry);
    const id = jsonId(user.user_id);
    if (id !== null) users.push({ id, key: String(id), status: text(user.status), lastSeen: parseTime(user.last_seen) });
  }
  /** @type {NodeRow[]} */
  const nodes = [];
  for (const entry of list(body.nodes)) {
    const node = record(entry);
    const id = jsonId(node.node_id);
    if (id !== null) nodes.push({ key: String(id), sessions: count(node.sessions), leaseExpiresAt: parseTime(node.lease_expires_at) });
  }
  /** @type {ConversationRow[]} */
  const conversations = [];
  for (const entry of list(body.conversations)) {
    const conversation = record(entry);
    const id = jsonId(conversation.conversation_id);
    if (id !== null) {
      conversations.push({ key: String(id), total: count(conversation.total), online: count(conversation.online), away: count(conversation.away) });
    }
  }
  return {
    at: parseTime(body.at),
    usersOnline: count(body.users_online),
    usersAway: count(body.users_away),
    users,
    usersTruncated: body.users_truncated === true,
    nodes,
    conversations,
    conversationsTruncated: body.conversations_truncated === true,
    messagesStored: count(body.messages_stored),
  };
}

/**
 * Messages a second across the nodes, from the running total each overview carries (every node
 * records its own at each lease renewal, a few seconds apart): the change over the last minute of
 * overviews, once they span at least 5 s. A total that goes down (a node restarted, or left)
 * starts the window again.
 */
export class MessageRate {
  /** @type {{ at: number, total: number }[]} */
  #samples = [];

  /**
   * @param {number | null} at the overview's moment (server milliseconds)
   * @param {number} total
   * @returns {number | null} messages a second, or null while the window is too short
   */
  add(at, total) {
    if (at === null) return this.rate();
    const last = this.#samples.at(-1);
    if (last && (total < last.total || at < last.at)) this.#samples = [];
    this.#samples.push({ at, total });
    while (this.#samples.length > 2 && at - this.#samples[1].at >= 60_000) this.#samples.shift();
    return this.rate();
  }

  /** @returns {number | null} */
  rate() {
    const first = this.#samples[0], last = this.#samples.at(-1);
    if (!first || !last || last.at - first.at < 5_000) return null;
    return ((last.total - first.total) * 1000) / (last.at - first.at);
  }
}

/**
 * A `presence` event's data, checked and typed; null without a user id.
 * @param {unknown} raw
 * @returns {PresenceChange | null}
 */
export function readPresence(raw) {
  const body = record(raw);
  const id = jsonId(body.user_id);
  if (id === null) return null;
  return {
    id,
    key: String(id),
    status: text(body.status),
    lastSeen: parseTime(body.last_seen),
    shownStatus: typeof body.shown_status === "string" ? body.shown_status : null,
    at: parseTime(body.at),
  };
}

/** @param {number} value @param {number} modulus */
function mod(value, modulus) {
  return ((value % modulus) + modulus) % modulus;
}

// MARK: - The page

/** @param {unknown} error */
function errorText(error) {
  return error instanceof Error ? error.message : String(error);
}

/** @param {string} status */
function statusClass(status) {
  return status === "online" || status === "away" || status === "offline" ? `status-${status}` : "";
}

function startDashboard() {
  /**
   * @template {HTMLElement} T
   * @param {string} id
   * @param {{ new (): T, prototype: T }} type
   * @returns {T}
   */
  const byId = (id, type) => {
    const element = document.getElementById(id);
    if (!(element instanceof type)) throw new Error(`the dashboard has no #${id}`);
    return element;
  };

  /**
   * @template {keyof HTMLElementTagNameMap} K
   * @param {K} tag
   * @param {string} [content]
   * @param {string} [className]
   * @returns {HTMLElementTagNameMap[K]}
   */
  const make = (tag, content, className) => {
    const element = document.createElement(tag);
    if (content !== undefined) element.textContent = content;
    if (className) element.className = className;
    return element;
  };

  /** @param {HTMLTableElement} table */
  const bodyOf = (table) => table.tBodies[0] ?? table.appendChild(document.createElement("tbody"));

  const ui = {
    feedState: byId("feed-state", HTMLElement),
    feedDetail: byId("feed-detail", HTMLElement),
    lastUpdate: byId("last-update", HTMLElement),
    forget: byId("forget-token", HTMLButtonElement),
    auth: byId("auth", HTMLElement),
    tokenForm: byId("token-form", HTMLFormElement),
    tokenInput: byId("token-input", HTMLInputElement),
    authMessage: byId("auth-message", HTMLElement),
    countOnline: byId("count-online", HTMLElement),
    countAway: byId("count-away", HTMLElement),
    countNodes: byId("count-nodes", HTMLElement),
    countSessions: byId("count-sessions", HTMLElement),
    countMessages: byId("count-messages", HTMLElement),
    chart: byId("chart", HTMLCanvasElement),
    chartRate: byId("chart-rate", HTMLElement),
    users: bodyOf(byId("users", HTMLTableElement)),
    usersNote: byId("users-note", HTMLElement),
    nodes: bodyOf(byId("nodes", HTMLTableElement)),
    conversations: bodyOf(byId("conversations", HTMLTableElement)),
    conversationsNote: byId("conversations-note", HTMLElement),
    lookupForm: byId("lookup-form", HTMLFormElement),
    lookupUser: byId("lookup-user", HTMLInputElement),
    lookupResult: byId("lookup-result", HTMLElement),
    conversationForm: byId("conversation-form", HTMLFormElement),
    conversationId: byId("conversation-id", HTMLInputElement),
    conversationResult: byId("conversation-result", HTMLElement),
    events: byId("events", HTMLElement),
  };

  // State.
  /** @type {string | null} */
  let token = null;
  try { token = sessionStorage.getItem(TOKEN_STORAGE_KEY); } catch { token = null; }
  let clock = new ClockEstimate();
  /** @type {Overview | null} */
  let overview = null;
  /** @type {Map<string, UserRow>} */
  let users = new Map();
  let ring = new SecondRing();
  let messageRate = new MessageRate();
  let adminOff = false;

  const serverNow = () => Date.now() + clock.offset;

  // Small DOM helpers that touch the page only when something changed.
  /**
   * @param {HTMLElement} element
   * @param {string} value
   */
  const setText = (element, value) => { if (element.textContent !== value) element.textContent = value; };
  /**
   * @param {Element} element
   * @param {string} name
   * @param {string} value
   */
  const setAttr = (element, name, value) => { if (element.getAttribute(name) !== value) element.setAttribute(name, value); };
  /**
   * The `index`th cell of a row, made as needed, with its text, class and title.
   * @param {HTMLTableRowElement} row
   * @param {number} index
   * @param {string} value
   * @param {string} [className]
   * @param {string} [title]
   */
  const setCell = (row, index, value, className = "", title = "") => {
    while (row.cells.length <= index) row.appendChild(document.createElement("td"));
    const cell = row.cells[index];
    setText(cell, value);
    setAttr(cell, "class", className);
    if (title) setAttr(cell, "title", title); else cell.removeAttribute("title");
  };
  /**
   * Makes a table body hold one row per item, in order, keyed by `attribute`; rows are reused.
   * @template T
   * @param {HTMLTableSectionElement} body
   * @param {T[]} items
   * @param {(item: T) => string} keyOf
   * @param {string} attribute
   * @param {(row: HTMLTableRowElement, item: T) => void} fill
   */
  const syncRows = (body, items, keyOf, attribute, fill) => {
    /** @type {Map<string, HTMLTableRowElement>} */
    const existing = new Map();
    for (const row of Array.from(body.rows)) existing.set(row.getAttribute(attribute) ?? "", row);
    let cursor = body.firstElementChild;
    for (const item of items) {
      const key = keyOf(item);
      let row = existing.get(key);
      if (row) existing.delete(key);
      else {
        row = document.createElement("tr");
        row.setAttribute(attribute, key);
      }
      fill(row, item);
      if (row === cursor) cursor = cursor.nextElementSibling;
      else body.insertBefore(row, cursor);
    }
    for (const row of existing.values()) row.remove();
  };

  // MARK: Token

  /** @param {string | null} message */
  const askForToken = (message) => {
    ui.auth.hidden = false;
    ui.authMessage.hidden = message === null;
    ui.authMessage.textContent = message ?? "";
    ui.forget.hidden = token === null;
    ui.tokenInput.focus();
  };
  const tokenAccepted = () => {
    ui.auth.hidden = true;
    ui.authMessage.hidden = true;
    ui.forget.hidden = false;
  };
  /** @param {string | null} value */
  const storeToken = (value) => {
    token = value;
    try {
      if (value === null) sessionStorage.removeItem(TOKEN_STORAGE_KEY);
      else sessionStorage.setItem(TOKEN_STORAGE_KEY, value);
    } catch {
      // Storage off (a privacy mode): the token lives in this page only.
    }
  };
  const authorization = () => ({ Authorization: `Bearer ${token ?? ""}` });

  // MARK: Feed

  let generation = 0;
  /** @type {AbortController | null} */
  let controller = null;
  let attempt = 0;
  let retryAt = 0;
  let streaming = false;
  let lastByteAt = 0;
  let stalled = false;
  /** @type {(() => void) | null} */
  let wake = null;

  /**
   * @param {string} value
   * @param {"live" | "wait" | "error" | "idle"} kind
   * @param {string} [detail]
   */
  const setFeedState = (value, kind, detail = "") => {
    setText(ui.feedState, value);
    setAttr(ui.feedState, "class", `state state-${kind}`);
    setText(ui.feedDetail, detail);
  };
  const reconnectText = () => `reconnecting in ${Math.max(1, Math.ceil((retryAt - Date.now()) / 1000))} s`;

  const stopFeed = () => {
    generation += 1;
    controller?.abort();
    controller = null;
    retryAt = 0;
    streaming = false;
    const resume = wake;
    wake = null;
    resume?.();
  };

  const startFeed = () => {
    stopFeed();
    attempt = 0;
    adminOff = false;
    void runFeed(generation);
  };

  const onUnauthorized = () => {
    stopFeed();
    storeToken(null);
    setFeedState("unauthorized", "error");
    askForToken(WRONG_TOKEN_TEXT);
  };

  const onAdminOff = () => {
    stopFeed();
    adminOff = true;
    setFeedState("admin endpoints off", "error");
    askForToken(ADMIN_OFF_TEXT);
  };

  /** @param {number} current */
  const runFeed = async (current) => {
    while (current === generation && token !== null) {
      const abort = new AbortController();
      controller = abort;
      stalled = false;
      setFeedState("connecting", "wait");
      let detail;
      try {
        const response = await fetch(EVENTS_PATH, {
          headers: { ...authorization(), Accept: "text/event-stream" },
          cache: "no-store",
          signal: abort.signal,
        });
        if (current !== generation) {
          abort.abort();
          return;
        }
        if (response.status === 401) return onUnauthorized();
        if (response.status === 404) return onAdminOff();
        if (!response.ok || !response.body) throw new Error(`HTTP ${response.status}`);
        setFeedState("live", "live");
        streaming = true;
        lastByteAt = Date.now();
        await readFeed(response.body, current);
        detail = "the stream ended";
      } catch (error) {
        detail = stalled ? `no data for ${STALL_MILLISECONDS / 1000} s` : errorText(error);
      } finally {
        if (current === generation) streaming = false;
      }
      if (current !== generation) return;
      const seconds = backoffSeconds(attempt);
      attempt += 1;
      retryAt = Date.now() + seconds * 1000;
      setFeedState(reconnectText(), "wait", detail);
      await new Promise((resolve) => {
        const resume = () => resolve(undefined);
        wake = resume;
        setTimeout(() => { if (wake === resume) { wake = null; resume(); } }, seconds * 1000);
      });
      retryAt = 0;
    }
  };

  /**
   * @param {ReadableStream<Uint8Array>} body
   * @param {number} current
   */
  const readFeed = async (body, current) => {
    const reader = body.getReader();
    const parser = new SSEParser();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done || current !== generation) return;
        lastByteAt = Date.now();
        for (const event of parser.push(value)) handleEvent(event);
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  };

  /** @param {SSEEvent} event */
  const handleEvent = (event) => {
    let data;
    try {
      data = JSON.parse(event.data);
    } catch {
      console.warn(`dashboard: the ${event.event} event's data is not JSON`);
      return;
    }
    try {
      if (event.event === "overview") {
        applyOverview(readOverview(data), Date.now());
        attempt = 0;
      } else if (event.event === "presence") {
        const change = readPresence(data);
        if (change) applyPresence(change);
      }
    } catch (error) {
      console.warn(`dashboard: the ${event.event} event could not be shown: ${errorText(error)}`);
    }
  };

  // MARK: Rendering

  /**
   * @param {Overview} next
   * @param {number} arrival local milliseconds
   */
  const applyOverview = (next, arrival) => {
    clock.add(next.at, arrival);
    overview = next;
    users = new Map(next.users.map((user) => [user.key, user]));
    setText(ui.countOnline, String(next.usersOnline));
    setText(ui.countAway, String(next.usersAway));
    setText(ui.countNodes, String(next.nodes.length));
    setText(ui.countSessions, String(next.nodes.reduce((sum, node) => sum + node.sessions, 0)));
    const rate = messageRate.add(next.at, next.messagesStored);
    setText(ui.countMessages, rate === null ? "–" : rate.toFixed(rate < 10 ? 1 : 0));
    setText(ui.lastUpdate, next.at === null ? "–" : `${formatClock(next.at)} UTC`);
    setAttr(ui.lastUpdate, "datetime", formatTimestamp(next.at));
    renderUsers();
    renderNodes();
    renderConversations();
  };

  /** @param {PresenceChange} change */
  const applyPresence = (change) => {
    ring.record(serverNow());
    if (change.status === "online" || change.status === "away") {
      users.set(change.key, { id: change.id, key: change.key, status: change.status, lastSeen: change.lastSeen });
    } else {
      users.delete(change.key);
    }
    renderUsers();
    addEvent(change);
  };

  const renderUsers = () => {
    const now = serverNow();
    const rows = Array.from(users.values()).sort((a, b) => compareIds(a.id, b.id));
    syncRows(ui.users, rows, (user) => user.key, "data-user-id", (row, user) => {
      setCell(row, 0, user.key);
      setCell(row, 1, user.status, statusClass(user.status));
      setCell(row, 2, formatRelative(user.lastSeen, now), "", formatTimestamp(user.lastSeen));
    });
    let note = "";
    if (overview && overview.usersTruncated) {
      note = `the first ${overview.users.length} of ${overview.usersOnline + overview.usersAway} users present (by id)`;
    } else if (overview && rows.length === 0) {
      note = "nobody is online or away";
    }
    ui.usersNote.hidden = note === "";
    setText(ui.usersNote, note);
  };

  const renderNodes = () => {
    const now = Date.now();
    syncRows(ui.nodes, overview?.nodes ?? [], (node) => node.key, "data-node-id", (row, node) => {
      const left = leaseSecondsLeft(node.leaseExpiresAt, now, clock.offset);
      setCell(row, 0, node.key);
      setCell(row, 1, String(node.sessions), "num");
      setCell(row, 2, formatLease(left), left !== null && left < 0 ? "num expired" : "num", formatTimestamp(node.leaseExpiresAt));
    });
  };

  const renderConversations = () => {
    syncRows(ui.conversations, overview?.conversations ?? [], (conversation) => conversation.key, "data-conversation-id", (row, conversation) => {
      setCell(row, 0, conversation.key);
      setCell(row, 1, `${conversation.online} of ${conversation.total} online`);
      setCell(row, 2, String(conversation.away), "num");
    });
    const note = overview?.conversationsTruncated ? `the first ${overview.conversations.length} conversations` : "";
    ui.conversationsNote.hidden = note === "";
    setText(ui.conversationsNote, note);
  };

  /** @param {PresenceChange} change */
  const addEvent = (change) => {
    const item = make("li");
    item.setAttribute("data-user-id", change.key);
    const time = make("time", formatClock(change.at, true));
    time.setAttribute("datetime", formatTimestamp(change.at));
    // The spaces are for the text (copying, tests); the layout spaces the parts itself.
    item.append(time, " ", make("span", change.key, "user"), " ", make("span", change.status, statusClass(change.status)));
    const note = hiddenNote(change);
    if (note) item.append(" ", make("span", note, "note"));
    ui.events.prepend(item);
    while (ui.events.children.length > MAX_EVENTS) ui.events.lastElementChild?.remove();
  };

  const drawChart = () => {
    const series = ring.series(serverNow());
    const current = series[series.length - 2]; // the last whole second
    let peak = 0, total = 0;
    for (const value of series) {
      if (value > peak) peak = value;
      total += value;
    }
    const label = `${current}/s now · peak ${peak}/s · ${total} in 5 min`;
    setText(ui.chartRate, label);
    setAttr(ui.chart, "aria-label", `transitions per second over the last 5 minutes: ${label}`);

    const canvas = ui.chart;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    const context = canvas.getContext("2d");
    if (!context || width === 0 || height === 0) return;
    const ratio = window.devicePixelRatio || 1;
    const pixelWidth = Math.round(width * ratio), pixelHeight = Math.round(height * ratio);
    if (canvas.width !== pixelWidth || canvas.height !== pixelHeight) {
      canvas.width = pixelWidth;
      canvas.height = pixelHeight;
    }
    context.setTransform(ratio, 0, 0, ratio, 0, 0);
    context.clearRect(0, 0, width, height);
    const left = 28, right = 4, top = 6, bottom = 16;
    const plotWidth = width - left - right, plotHeight = height - top - bottom;
    const max = chartScaleMax(peak);
    context.font = "10px system-ui, sans-serif";
    context.lineWidth = 1;
    context.strokeStyle = "#e1e4ea";
    context.fillStyle = "#687083";
    context.textAlign = "right";
    context.textBaseline = "middle";
    for (const value of [0, max / 2, max]) {
      const y = Math.round(top + plotHeight - (value / max) * plotHeight) + 0.5;
      context.beginPath();
      context.moveTo(left, y);
      context.lineTo(width - right, y);
      context.stroke();
      context.fillText(String(value), left - 4, y);
    }
    context.textBaseline = "top";
    for (let minutes = 5; minutes >= 0; minutes -= 1) {
      context.textAlign = minutes === 5 ? "left" : minutes === 0 ? "right" : "center";
      context.fillText(minutes === 0 ? "now" : `−${minutes} min`, left + plotWidth * (1 - minutes / 5), top + plotHeight + 3);
    }
    const step = plotWidth / series.length;
    context.fillStyle = "#2f6fdb";
    series.forEach((value, index) => {
      if (value <= 0) return;
      const barHeight = Math.max(1, (Math.min(value, max) / max) * plotHeight);
      context.fillRect(left + index * step, top + plotHeight - barHeight, Math.max(1, step), barHeight);
    });
    context.fillStyle = "#1d2330";
    context.textAlign = "right";
    context.textBaseline = "top";
    context.font = "600 11px system-ui, sans-serif";
    context.fillText(`${current}/s`, width - right - 2, top + 2);
  };

  const clearData = () => {
    overview = null;
    users = new Map();
    ring = new SecondRing();
    messageRate = new MessageRate();
    clock = new ClockEstimate();
    for (const element of [ui.countOnline, ui.countAway, ui.countNodes, ui.countSessions, ui.countMessages, ui.lastUpdate]) setText(element, "–");
    ui.users.replaceChildren();
    ui.nodes.replaceChildren();
    ui.conversations.replaceChildren();
    ui.events.replaceChildren();
    ui.lookupResult.replaceChildren();
    ui.conversationResult.replaceChildren();
    ui.usersNote.hidden = true;
    ui.conversationsNote.hidden = true;
    drawChart();
  };

  /**
   * One card's admin reads (the user lookup, the conversation card): a newer read supersedes the
   * one under way, and every refusal is told in the card, in its own words.
   * @param {(message: string) => void} say what the card shows instead of a result
   * @param {string} missing the card's 404 (when admin routes are on)
   * @param {string} failed how a failure starts
   * @param {(body: Record<string, unknown>) => void} render shows a result
   */
  const adminCard = (say, missing, failed, render) => {
    /** @type {AbortController | null} */
    let current = null;
    return {
      abort() {
        current?.abort();
      },
      /** @param {string} url @param {string} reading shown while the read is under way */
      async read(url, reading) {
        current?.abort();
        const abort = new AbortController();
        current = abort;
        say(reading);
        try {
          const response = await fetch(url, {
            headers: { ...authorization(), Accept: "application/json" },
            cache: "no-store",
            signal: abort.signal,
          });
          const body = record(await response.json().catch(() => null));
          if (abort !== current) return;
          if (response.status === 401) {
            say(WRONG_TOKEN_TEXT);
            onUnauthorized();
          } else if (response.status === 404) {
            // Both "admin routes off" and "no such …" are 404 not_found; the feed tells them apart.
            say(adminOff || text(record(body.error).message) === "no such route" ? ADMIN_OFF_TEXT : missing);
          } else if (!response.ok) {
            const message = text(record(body.error).message);
            say(`${failed}: HTTP ${response.status}${message ? `: ${message}` : ""}`);
          } else {
            render(body);
          }
        } catch (error) {
          if (abort === current) say(`${failed}: ${errorText(error)}`);
        }
      },
    };
  };

  // MARK: Lookup

  /** @param {string} message */
  const lookupMessage = (message) => {
    ui.lookupResult.replaceChildren(make("p", message, "muted"));
  };

  /**
   * "2026-11-25T12:00:00.123Z (12s ago)", or "-".
   * @param {number | null} milliseconds
   * @param {number} now
   */
  const moment = (milliseconds, now) =>
    milliseconds === null ? "-" : `${formatTimestamp(milliseconds)} (${formatRelative(milliseconds, now)})`;

  /** @param {unknown} raw */
  const renderLookup = (raw) => {
    const body = record(raw);
    const now = serverNow();
    const status = text(body.status);
    const shown = record(body.shown_to_others);
    const summary = make("dl", undefined, "lookup-summary");
    /**
     * @param {string} term
     * @param {string} value
     * @param {string} [className]
     */
    const pair = (term, value, className) => summary.append(make("dt", term), make("dd", value, className));
    pair("user", idText(body.user_id));
    pair("status", status, statusClass(status));
    pair("last seen", moment(parseTime(body.last_seen), now));
    pair("privacy", body.show_online_status === false
      ? `hidden: others see ${text(shown.status)}, last seen ${formatTimestamp(parseTime(shown.last_seen))}`
      : "visible");

    const conversations = lookupConversations(list(body.conversations).map(record));
    const devices = list(body.devices).map(record);
    if (devices.length === 0) {
      ui.lookupResult.replaceChildren(summary, make("p", "no devices", "muted"), conversations);
      return;
    }
    const table = make("table", undefined, "devices");
    const head = table.createTHead().insertRow();
    for (const title of ["device", "status", "node", "since", "live until"]) {
      const cell = make("th", title);
      cell.scope = "col";
      head.appendChild(cell);
    }
    const rows = table.createTBody();
    for (const device of devices) {
      const row = rows.insertRow();
      const deviceId = idText(device.device_id);
      row.setAttribute("data-device-id", deviceId);
      const deviceStatus = text(device.status);
      const node = device.node === null || device.node === undefined || device.node === "" ? "(REST/lingering)" : text(device.node);
      const deadline = parseTime(device.deadline);
      setCell(row, 0, deviceId);
      setCell(row, 1, deviceStatus, statusClass(deviceStatus));
      setCell(row, 2, node);
      setCell(row, 3, moment(parseTime(device.since), now));
      setCell(row, 4, deadline === null ? "while its session lives" : moment(deadline, now),
        "", `last alive ${formatTimestamp(parseTime(device.last_alive))}`);
    }
    const scroll = make("div", undefined, "scroll");
    scroll.appendChild(table);
    ui.lookupResult.replaceChildren(summary, scroll, conversations);
  };

  /**
   * The looked-up user's conversations with their cursors: a table, or a note when none.
   * @param {Record<string, unknown>[]} entries
   */
  const lookupConversations = (entries) => {
    if (entries.length === 0) return make("p", "no conversations", "muted");
    const table = make("table", undefined, "user-conversations");
    const head = table.createTHead().insertRow();
    for (const title of ["conversation", "last seq", "delivered", "read", "unread"]) {
      const cell = make("th", title);
      cell.scope = "col";
      head.appendChild(cell);
    }
    const rows = table.createTBody();
    for (const entry of entries) {
      const row = rows.insertRow();
      const id = idText(entry.conversation_id);
      row.setAttribute("data-conversation-id", id);
      setCell(row, 0, id, "", entry.epoch ? `epoch ${text(entry.epoch)}` : "no history yet");
      setCell(row, 1, String(count(entry.last_seq)));
      setCell(row, 2, String(count(entry.delivered_seq)));
      setCell(row, 3, String(count(entry.read_seq)));
      setCell(row, 4, String(count(entry.unread)));
    }
    const scroll = make("div", undefined, "scroll");
    scroll.appendChild(table);
    return scroll;
  };

  const userCard = adminCard(lookupMessage, "no such user", "lookup failed", renderLookup);

  /** @param {string} user */
  const lookUp = (user) => userCard.read(USER_PATH + encodeURIComponent(user), `looking up ${user} …`);

  // MARK: Conversation

  /** @param {string} message */
  const conversationMessage = (message) => {
    ui.conversationResult.replaceChildren(make("p", message, "muted"));
  };

  /**
   * A table with a header row of `titles`; returns its scrolling box and its body.
   * @param {string} className
   * @param {string[]} titles
   */
  const tableOf = (className, titles) => {
    const table = make("table", undefined, className);
    const head = table.createTHead().insertRow();
    for (const title of titles) {
      const cell = make("th", title);
      cell.scope = "col";
      head.appendChild(cell);
    }
    const scroll = make("div", undefined, "scroll");
    scroll.appendChild(table);
    return { scroll, rows: table.createTBody() };
  };

  /** @param {unknown} raw */
  const renderConversation = (raw) => {
    const body = record(raw);
    const now = serverNow();
    const summary = make("dl", undefined, "lookup-summary");
    summary.append(make("dt", "conversation"), make("dd", idText(body.conversation_id)));
    summary.append(make("dt", "epoch"), make("dd", body.epoch ? text(body.epoch) : "no history yet"));
    summary.append(make("dt", "seqs kept"), make("dd", count(body.last_seq) === 0 ? "none" : `${count(body.first_seq)}–${count(body.last_seq)}`));
    const members = tableOf("conversation-members", ["member", "delivered", "read"]);
    for (const member of list(body.members).map(record)) {
      const row = members.rows.insertRow();
      const id = idText(member.user_id);
      row.setAttribute("data-user-id", id);
      setCell(row, 0, id);
      setCell(row, 1, String(count(member.delivered_seq)));
      setCell(row, 2, String(count(member.read_seq)));
    }
    const messages = list(body.messages).map(record);
    if (messages.length === 0) {
      ui.conversationResult.replaceChildren(summary, members.scroll, make("p", "no messages", "muted"));
      return;
    }
    const table = tableOf("conversation-messages", ["seq", "sender", "text", "sent", "status"]);
    // Newest first, as the event tail.
    for (const message of [...messages].reverse()) {
      const row = table.rows.insertRow();
      const seq = String(count(message.seq));
      const reach = text(message.status);
      row.setAttribute("data-seq", seq);
      row.setAttribute("data-status", reach);
      setCell(row, 0, seq, "", text(message.id));
      setCell(row, 1, idText(message.sender_id));
      setCell(row, 2, message.type === "image" ? `[image] ${text(message.text)}` : text(message.text), "message-text");
      setCell(row, 3, moment(parseTime(message.created_at), now));
      setCell(row, 4, reach, `reach-${reach}`);
    }
    ui.conversationResult.replaceChildren(summary, members.scroll, table.scroll);
  };

  const conversationCard = adminCard(conversationMessage, "no such conversation", "reading the conversation failed", renderConversation);

  /** @param {string} conversation */
  const showConversation = (conversation) =>
    conversationCard.read(`${CONVERSATION_PATH}${encodeURIComponent(conversation)}?limit=50`, `reading ${conversation} …`);

  // MARK: Wiring

  ui.tokenForm.addEventListener("submit", (event) => {
    event.preventDefault();
    const value = ui.tokenInput.value.trim();
    if (value === "") return;
    ui.tokenInput.value = "";
    storeToken(value);
    tokenAccepted();
    clearData();
    startFeed();
  });

  ui.forget.addEventListener("click", () => {
    stopFeed();
    userCard.abort();
    conversationCard.abort();
    storeToken(null);
    clearData();
    setFeedState("no token", "idle");
    askForToken(null);
  });

  ui.lookupForm.addEventListener("submit", (event) => {
    event.preventDefault();
    const user = ui.lookupUser.value.trim();
    if (user === "") return;
    if (token === null) {
      askForToken("paste the admin token first");
      return;
    }
    void lookUp(user);
  });

  ui.conversationForm.addEventListener("submit", (event) => {
    event.preventDefault();
    const conversation = ui.conversationId.value.trim();
    if (conversation === "") return;
    if (token === null) {
      askForToken("paste the admin token first");
      return;
    }
    void showConversation(conversation);
  });

  // A conversation of the looked-up user opens in the conversation card.
  ui.lookupResult.addEventListener("click", (event) => {
    const row = /** @type {Element | null} */ (event.target instanceof Element ? event.target.closest("tr[data-conversation-id]") : null);
    const conversation = row?.getAttribute("data-conversation-id");
    if (!conversation || token === null) return;
    ui.conversationId.value = conversation;
    void showConversation(conversation);
  });

  // Once a second: the reconnect countdown, the stall watchdog, relative times, leases, the chart.
  setInterval(() => {
    if (retryAt !== 0) setText(ui.feedState, reconnectText());
    if (streaming && Date.now() - lastByteAt > STALL_MILLISECONDS) {
      stalled = true;
      controller?.abort();
    }
    renderUsers();
    renderNodes();
    drawChart();
  }, 1000);

  drawChart();
  if (token === null) {
    setFeedState("no token", "idle");
    askForToken(null);
  } else {
    tokenAccepted();
    startFeed();
  }
}

if (typeof document !== "undefined") {
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", startDashboard, { once: true });
  else startDashboard();
}
