// @ts-check
/**
 * The browser client of the presence gateway: an ES module with no build step and no
 * dependency, served by the gateway at `/client/presence.js`.
 *
 * It behaves like the Swift SDK's `PresenceClient` (Sources/PresenceClient): it keeps a session
 * open (reconnecting with backoff, rotating through gateway URLs, catching up after each
 * reconnect), tells the gateway the status the page's life calls for (visible: the chosen
 * status; hidden: the background policy; `pagehide`: offline at once), debounces typing, and
 * keeps a cache of what it hears, announcing every change as an event.
 *
 * Durations in options are seconds, as in the Swift SDK; the clock works in milliseconds
 * (`Date.now()`-style), and every moment it hands out is a `Date`.
 *
 * @module presence
 */

/** @typedef {"online" | "away" | "offline"} PresenceStatus */
/** @typedef {"signedOut" | "disconnectedByAdmin" | "replaced"} StopReason */

/**
 * What is known of one user.
 * @typedef {Readonly<{ userId: string, status: PresenceStatus, lastSeen: Date | null }>} PresenceSnapshot
 */

/**
 * The counts of a followed conversation, "3 of 5 online".
 * @typedef {Readonly<{ conversationId: string, total: number, online: number, away: number }>} GroupPresence
 */

/**
 * The client's link to the gateway.
 * @typedef {Readonly<{ state: "idle" }> | Readonly<{ state: "connecting" }> | Readonly<{ state: "connected" }>
 *   | Readonly<{ state: "waiting", retryAt: Date }> | Readonly<{ state: "stopped", reason: StopReason }>} ConnectionState
 */

/** @typedef {Readonly<{ conversationId: string, userId: string, isTyping: boolean }>} TypingChange */
/** @typedef {Readonly<{ userId: string }>} RemovedUser */
/** @typedef {Readonly<{ code: string, message: string }>} PresenceErrorDetail */

/**
 * Where the client reads the time and sets its timers; tests pass a fake one.
 * @typedef {{ now(): number, setTimeout(callback: () => void, milliseconds: number): unknown, clearTimeout(handle: unknown): void }} PresenceClock
 */

/**
 * What a hidden page does: `away` at once (the default), or also `offline` (the session closes
 * with 1000) once it has been hidden for `afterSeconds`.
 * @typedef {{ kind: "away" } | { kind: "offline", afterSeconds: number }} BackgroundPolicy
 */

/** @typedef {{ getItem(key: string): string | null, setItem(key: string, value: string): void }} DeviceIdStorage */
/** @typedef {{ debug?(...values: unknown[]): void, info?(...values: unknown[]): void, warn?(...values: unknown[]): void }} PresenceLogger */

/**
 * Returns a token for the gateway; `refresh` is true when the last one was refused or has
 * expired, so a cached token must not be returned again.
 * @typedef {(refresh: boolean) => string | Promise<string>} TokenProvider
 */

/**
 * @typedef {object} PresenceClientOptions
 * @property {TokenProvider} token Called before each connection attempt.
 * @property {string | URL | Array<string | URL>} [gatewayURLs] Gateway base URLs (http(s) or
 *   ws(s)), tried in turn; relative ones are read against the page. Default: the gateway that
 *   served this module.
 * @property {string} [deviceId] This device's stable id. Default: one per tab: the first tab of
 *   the browser has the id kept in storage under {@link DEVICE_ID_STORAGE_KEY} (made with
 *   `crypto.randomUUID()` when missing), each other open tab that id with `.tab2`, `.tab3`, …
 *   (the tab slots held through `locks`). An app that passes its own id gives each tab its own.
 * @property {DeviceIdStorage | null} [storage] Where the device id is kept. Default: `localStorage`.
 * @property {TabLocks | null} [locks] The Web Locks through which the tabs of a browser share out
 *   the slots of the stored device id (only without `deviceId`). Default: `navigator.locks`
 *   where there is one; `null`: no slots, every tab has the stored id (and the gateway lets only
 *   the last tab's session live).
 * @property {BackgroundPolicy} [backgroundPolicy] What a hidden page does. Default: `{ kind: "away" }`.
 * @property {{ initial?: number, maximum?: number, jitter?: number }} [backoff] Delays between
 *   reconnect attempts. Default: 1 s doubling up to 16 s, each ±20 %.
 * @property {number} [typingRefreshInterval] Least seconds between two typing starts sent for one conversation (2).
 * @property {number} [typingIdleTimeout] Seconds without a keystroke after which typing stops (3).
 * @property {number} [typingDisplayTimeout] Seconds another user's typing shows without an update (8).
 * @property {number} [retryDelay] Seconds before a rate-limited request is sent again (1).
 * @property {number} [closeTimeout] Seconds `signOut()` and `stop()` wait for the clean close (3).
 * @property {number} [openTimeout] Seconds from a connection attempt to its `initial_state` (10).
 * @property {PresenceClock} [clock] Default: `Date.now` and the global timers.
 * @property {() => number} [random] Numbers in [0, 1) for the jitter. Default: `Math.random`.
 * @property {new (url: string) => WebSocket} [WebSocket] Default: `globalThis.WebSocket`.
 * @property {EventTarget & { navigator?: { onLine?: boolean } } | null} [window] Where
 *   `pagehide`, `pageshow`, `online` and `offline` come from. Default: `globalThis.window`; `null`: none.
 * @property {EventTarget & { visibilityState?: string } | null} [document] Where
 *   `visibilitychange` comes from. Default: `globalThis.document`; `null`: none.
 * @property {PresenceLogger | null} [logger] Gets connection detail. Default: none.
 * @property {OutboxStore} [outboxStore] Where messages not stored by the gateway yet are kept,
 *   as is (one store, whatever the tab). Default: IndexedDB (one record per device id, made
 *   once the tab's slot is held), or memory where IndexedDB is missing.
 */

/**
 * What the client uses of the Web Locks API (`navigator.locks`). With `ifAvailable` the callback
 * gets `null` at once when the lock is held elsewhere; else it gets the lock when granted, and
 * the lock is held until the promise the callback returns settles (or the page goes away).
 * @typedef {{ request(name: string, options: { ifAvailable?: boolean },
 *   callback: (lock: unknown) => unknown): Promise<unknown> }} TabLocks
 */

/** @typedef {"sending" | "sent" | "delivered" | "read" | "failed"} MessageStatus */

/**
 * A conversation's message on this device: one it wrote (in the outbox until the gateway stores
 * it) or one the gateway delivered. `seq`, `id` and `epoch` are null until stored; `senderId` is
 * null for this device's messages until the gateway's copy names it. `epoch` is the frame's (a
 * gateway too old to send one: the conversation's as known here); a message kept across a fork
 * takes the new epoch, with the same seq and id.
 * @typedef {Readonly<{ conversationId: string, clientMessageId: string, seq: number | null, id: string | null,
 *   epoch: string | null, senderId: string | null, type: string, text: string, imageUrl: string | null,
 *   createdAt: Date, status: MessageStatus, failure: string | null }>} ChatMessage
 */

/** @typedef {Readonly<{ conversationId: string, clientMessageId: string, status: MessageStatus, failure: string | null }>} MessageStatusChange */
/** @typedef {Readonly<{ userId: string, deliveredSeq: number, readSeq: number }>} MemberReceipt */
/** @typedef {Readonly<{ conversationId: string, epoch: string | null, fromSeq: number, toSeq: number | null }>} MessageGap */

/**
 * Keeps the outbox (messages written here and not stored by the gateway yet, `sending` or
 * `failed`) across page loads. The client reads it once when it starts and writes the whole
 * outbox after every change, one write after another.
 * @typedef {{ load(): Promise<ChatMessage[]>, save(messages: ChatMessage[]): Promise<void> }} OutboxStore
 */

/** The `localStorage` key of the device id the client makes when none is given. */
export const DEVICE_ID_STORAGE_KEY = "presence.device_id";

/** The path of the session upgrade, appended to each gateway URL. */
const SESSION_PATH = "/api/presence/subscribe";
const STATUSES = ["online", "away", "offline"];
const ERROR_CODES = [
  "unauthorized", "forbidden", "not_found", "payload_too_large", "method_not_allowed", "invalid_request", "rate_limited", "unavailable", "internal",
];
const ID_PATTERN = /^[A-Za-z0-9._:@-]{1,128}$/;
const ID_RULE = "1-128 characters of A-Z a-z 0-9 . _ : @ -";
/**
 * Tab slots: the most tabs of one browser that get a device id of their own (slot 1 has the
 * stored id, slot n the stored id with `.tabN`). A tab opened while every slot is held waits
 * for slot 1.
 */
const MAX_TABS = 32;
/** The Web Lock of a slot is named `presence.device-slot:<stored id>:<slot>`. */
const SLOT_LOCK_PREFIX = "presence.device-slot";
/** Ids per `subscribe` frame, as the Swift client sends them. */
const SUBSCRIBE_CHUNK = 500;
/**
 * `subscribe` frames a session may send: within the gateway's subscribe budget (5 a second, a
 * burst of 10) with a fifth to spare, as its buckets start with its end of the session and the
 * network may bunch frames, so that following hundreds of conversations never meets a refusal.
 */
const SUBSCRIBE_RATE = 4;
const SUBSCRIBE_BURST = 8;
/** Positions per `sync` frame (the gateway's limit). */
const SYNC_CHUNK = 100;
/** `sync` frames a session may send: within the gateway's sync budget (5 a second, a burst of 10), as above. */
const SYNC_RATE = 4;
const SYNC_BURST = 8;
/**
 * Frames of every kind a session may send, under the gateway's frame rate (50 a second, a burst
 * of 100). Not mirrored exactly: the gateway counts frames as they arrive, and the network may
 * bunch frames sent apart; a frame it refuses for the rate is answered without its id (its
 * content is not kept), so the request is lost, and the 51st refusal in a row closes with 4029.
 */
const FRAME_RATE = 40;
const FRAME_BURST = 80;
/** Codes a `sync` (or one of its positions) may get past by being sent again later. */
const SYNC_RETRIED = ["rate_limited", "unavailable", "internal"];
/** Waits (s) before a refused or failed `sync` goes again: 1 s doubling up to 30 s, each ±20 %. */
const SYNC_BACKOFF = { initial: 1, maximum: 30, jitter: 0.2 };
/** Attempts per message on live sessions, and the waits (s) before the second and third. */
const MESSAGE_ATTEMPTS = 3;
const ATTEMPT_DELAYS = [1, 2];
/** Seconds an attempt waits for its `message_ack`. */
const ACK_TIMEOUT = 10;
const STATUS_RANK = { failed: 0, sending: 1, sent: 2, delivered: 3, read: 4 };
/** Refusals a message cannot get past by being sent again. */
const FINAL_REFUSALS = ["forbidden", "not_found", "invalid_request", "payload_too_large"];

/** The close codes of the API, and the two this service adds (4009 and 1013). */
export const CloseCode = Object.freeze({
  normal: 1000,
  goingAway: 1001,
  policyViolation: 1008,
  messageTooBig: 1009,
  internalError: 1011,
  tryAgainLater: 1013,
  unauthorized: 4001,
  disconnectedByAdmin: 4003,
  replaced: 4009,
  rateLimited: 4029,
});

/** An error of the client library: a bad argument or option (`code` is `invalid_request`). */
export class PresenceClientError extends Error {
  /**
   * @param {string} code A machine-readable code.
   * @param {string} message Words for a person.
   */
  constructor(code, message) {
    super(message);
    this.name = "PresenceClientError";
    /** A machine-readable code. */
    this.code = code;
  }
}

/** @param {string} message */
const invalid = (message) => new PresenceClientError("invalid_request", message);

// MARK: - Timestamps

/**
 * Milliseconds since 1970 for an API timestamp (`2026-11-21T12:00:00.123Z`); the fraction may
 * be left out or have 1 to 9 digits (past milliseconds they are cut). `null` for any other text.
 * @param {unknown} text
 * @returns {number | null}
 */
export function parseTimestamp(text) {
  if (typeof text !== "string") return null;
  const match = /^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?Z$/.exec(text);
  if (!match) return null;
  const [year, month, day, hour, minute, second] = match.slice(1, 7).map(Number);
  if (month < 1 || month > 12 || day < 1 || day > 31 || hour > 23 || minute > 59 || second > 60) return null;
  const milliseconds = match[7] ? Number(match[7].slice(0, 3).padEnd(3, "0")) : 0;
  // setUTCFullYear, not Date.UTC: the latter reads years 0-99 as 1900-1999.
  const date = new Date(0);
  date.setUTCFullYear(year, month - 1, day);
  date.setUTCHours(hour, minute, second, milliseconds);
  return date.getTime();
}

/**
 * The API's text for a moment: ISO 8601 UTC with milliseconds.
 * @param {Date | number} moment
 * @returns {string}
 */
export function formatTimestamp(moment) {
  return new Date(typeof moment === "number" ? moment : moment.getTime()).toISOString();
}

/**
 * @param {Date | number | null | undefined} moment
 * @returns {number | null}
 */
function millis(moment) {
  if (moment === null || moment === undefined) return null;
  return typeof moment === "number" ? moment : moment.getTime();
}

// MARK: - Display text

/**
 * The words apps show for presence, exactly as the Swift SDK's `PresenceText`: "Online",
 * "Last seen 5m ago", "3 of 5 online", "Alice is typing…". English; pages in other languages
 * build theirs from the same values.
 */
export const PresenceText = Object.freeze({
  /**
   * "Online", "Away", "Last seen just now / 5m ago / 3h ago / 2d ago / on 2026-11-01", or
   * "Offline" for a user never seen (or not known).
   * @param {PresenceSnapshot | null | undefined} presence
   * @param {Date | number} now
   * @returns {string}
   */
  status(presence, now) {
    if (!presence) return "Offline";
    switch (presence.status) {
      case "online": return "Online";
      case "away": return "Away";
      default: return PresenceText.lastSeen(presence.lastSeen, now);
    }
  },

  /**
   * "Last seen 5m ago" and its kin; "Offline" for `null`.
   * @param {Date | number | null | undefined} lastSeen
   * @param {Date | number} now
   * @returns {string}
   */
  lastSeen(lastSeen, now) {
    const seen = millis(lastSeen);
    if (seen === null) return "Offline";
    const seconds = Math.max(0, (/** @type {number} */ (millis(now)) - seen) / 1000);
    if (seconds < 60) return "Last seen just now";
    if (seconds < 3600) return `Last seen ${Math.floor(seconds / 60)}m ago`;
    if (seconds < 86_400) return `Last seen ${Math.floor(seconds / 3600)}h ago`;
    if (seconds < 7 * 86_400) return `Last seen ${Math.floor(seconds / 86_400)}d ago`;
    return `Last seen on ${formatTimestamp(seen).slice(0, 10)}`;
  },

  /**
   * When `lastSeen(lastSeen, now)` next reads differently, so a label can be refreshed then
   * and not every second; `null` when it never will.
   * @param {Date | number | null | undefined} lastSeen
   * @param {Date | number} now
   * @returns {Date | null}
   */
  nextChange(lastSeen, now) {
    const seen = millis(lastSeen);
    if (seen === null) return null;
    const seconds = Math.max(0, (/** @type {number} */ (millis(now)) - seen) / 1000);
    let step;
    if (seconds < 3600) step = 60;
    else if (seconds < 86_400) step = 3600;
    else if (seconds < 7 * 86_400) step = 86_400;
    else return null;
    return new Date(seen + (Math.floor(seconds / step) * step + step) * 1000);
  },

  /**
   * Calls `onLabel` with the status label now, then each time it changes, until the returned
   * function is called.
   * @param {PresenceSnapshot | null | undefined} presence
   * @param {(label: string) => void} onLabel
   * @param {{ clock?: PresenceClock }} [options]
   * @returns {() => void} Stops the updates.
   */
  updatingStatus(presence, onLabel, options = {}) {
    const clock = options.clock ?? systemClock();
    /** @type {unknown} */
    let timer = null;
    let stopped = false;
    const tick = () => {
      timer = null;
      if (stopped) return;
      const now = clock.now();
      onLabel(PresenceText.status(presence, now));
      const next = presence?.status === "offline" ? PresenceText.nextChange(presence.lastSeen, now) : null;
      if (next) timer = clock.setTimeout(tick, Math.max(0, next.getTime() - now));
    };
    tick();
    return () => {
      stopped = true;
      if (timer !== null) clock.clearTimeout(timer);
    };
  },

  /**
   * "3 of 5 online" (members away are not counted as online).
   * @param {{ total: number, online: number }} group
   * @returns {string}
   */
  group(group) {
    return `${group.online} of ${group.total} online`;
  },

  /**
   * "Alice is typing…", "Alice and Bob are typing…", "Alice, Bob and 2 others are typing…";
   * empty when nobody is.
   * @param {readonly string[]} names
   * @returns {string}
   */
  typing(names) {
    switch (names.length) {
      case 0: return "";
      case 1: return `${names[0]} is typing…`;
      case 2: return `${names[0]} and ${names[1]} are typing…`;
      case 3: return `${names[0]}, ${names[1]} and ${names[2]} are typing…`;
      default: return `${names[0]}, ${names[1]} and ${names.length - 2} others are typing…`;
    }
  },
});

// MARK: - Backoff and typing

/**
 * Delays between reconnect attempts: `initial`, doubling up to `maximum`, each moved by up to
 * ±`jitter` of itself so that a node's clients do not all come back in the same instant.
 */
export class ReconnectBackoff {
  #attempts = 0;

  /** @param {{ initial?: number, maximum?: number, jitter?: number }} [options] seconds, and a fraction */
  constructor(options = {}) {
    const { initial = 1, maximum = 16, jitter = 0.2 } = options;
    if (!(initial > 0 && maximum >= initial && jitter >= 0 && jitter < 1)) {
      throw invalid("backoff: 0 < initial <= maximum, 0 <= jitter < 1");
    }
    /** The first delay, seconds. */
    this.initial = initial;
    /** The largest delay, seconds. */
    this.maximum = maximum;
    /** The fraction each delay may move by (0.2: ±20 %). */
    this.jitter = jitter;
  }

  /** Failed attempts since the last success. */
  get attempts() { return this.#attempts; }

  /**
   * The delay before the next attempt in seconds, counting this failure.
   * @param {() => number} [random] numbers in [0, 1)
   * @returns {number}
   */
  nextDelay(random = Math.random) {
    const base = Math.min(this.maximum, this.initial * 2 ** Math.min(this.#attempts, 30));
    this.#attempts += 1;
    if (this.jitter <= 0) return base;
    return base * (1 - this.jitter + 2 * this.jitter * random());
  }

  /** A connection succeeded: the next failure starts again from `initial`. */
  reset() { this.#attempts = 0; }
}

/**
 * A budget of `rate` frames a second with a burst of `burst`, as the gateway keeps one per
 * session: the client spends from its own copy before it writes, so the gateway's never refuses.
 * Moments are milliseconds.
 */
class TokenBucket {
  #tokens;
  #updated;

  /**
   * @param {number} rate tokens a second
   * @param {number} burst the most it holds (it starts full, as the gateway's does)
   * @param {number} now
   */
  constructor(rate, burst, now) {
    this.rate = rate;
    this.burst = burst;
    this.#tokens = burst;
    this.#updated = now;
  }

  /** @param {number} now */
  #refill(now) {
    // Milliseconds times the rate first: whole milliseconds then add whole tokens exactly.
    this.#tokens = Math.min(this.burst, this.#tokens + (Math.max(0, now - this.#updated) * this.rate) / 1000);
    this.#updated = Math.max(this.#updated, now);
  }

  /**
   * Whether a token is there at `now`.
   * @param {number} now
   */
  ready(now) {
    this.#refill(now);
    return this.#tokens >= 1 - 1e-9;
  }

  /**
   * Spends a token; call after `ready(now)`.
   * @param {number} now
   */
  take(now) {
    this.#refill(now);
    this.#tokens = Math.max(0, this.#tokens - 1);
  }

  /**
   * When (ms) a token will be there: `now` if it is.
   * @param {number} now
   */
  readyAt(now) {
    if (this.ready(now)) return now;
    return now + Math.ceil(((1 - this.#tokens) * 1000) / this.rate);
  }
}

/** @typedef {{ conversationId: string, isTyping: boolean }} TypingSend */

/**
 * Turns keystrokes into the few typing frames the gateway needs: `true` on the first keystroke
 * and at most once per `refreshInterval` while typing goes on; `false` after `idleTimeout`
 * without a keystroke, when the message is sent, or when the conversation is left. Nothing is
 * sent while the device cannot type (disconnected or appearing offline). Moments are
 * milliseconds, intervals seconds.
 */
export class TypingDebouncer {
  /** @type {Map<string, { lastKeystroke: number, lastSent: number }>} */
  #typing = new Map();

  /** @param {{ refreshInterval?: number, idleTimeout?: number }} [options] seconds */
  constructor(options = {}) {
    const { refreshInterval = 2, idleTimeout = 3 } = options;
    /** Least seconds between two `true` frames of one conversation. */
    this.refreshInterval = refreshInterval;
    /** Seconds without a keystroke after which typing stops. */
    this.idleTimeout = idleTimeout;
  }

  /** Conversations this device is typing in now, sorted. */
  get conversations() { return [...this.#typing.keys()].sort(); }

  /**
   * A keystroke in `conversation` at `now`. With `canSend` false nothing is sent and nothing
   * is remembered.
   * @param {string} conversation
   * @param {number} now
   * @param {boolean} canSend
   * @returns {TypingSend | null}
   */
  keystroke(conversation, now, canSend) {
    if (!canSend) return null;
    const state = this.#typing.get(conversation);
    if (state) {
      state.lastKeystroke = now;
      const refresh = now - state.lastSent >= this.refreshInterval * 1000;
      if (refresh) state.lastSent = now;
      return refresh ? { conversationId: conversation, isTyping: true } : null;
    }
    this.#typing.set(conversation, { lastKeystroke: now, lastSent: now });
    return { conversationId: conversation, isTyping: true };
  }

  /**
   * The message was sent, or the conversation left: typing there stops now.
   * @param {string} conversation
   * @returns {TypingSend | null}
   */
  stop(conversation) {
    return this.#typing.delete(conversation) ? { conversationId: conversation, isTyping: false } : null;
  }

  /**
   * Stops typing everywhere (the device goes offline): one `false` per conversation.
   * @returns {TypingSend[]}
   */
  stopAll() {
    const sends = this.conversations.map((conversationId) => ({ conversationId, isTyping: false }));
    this.#typing.clear();
    return sends;
  }

  /** The connection dropped: the gateway ends this device's typing by itself, so forget it. */
  forget() { this.#typing.clear(); }

  /**
   * Typing that went idle by `now`: one `false` each.
   * @param {number} now
   * @returns {TypingSend[]}
   */
  expire(now) {
    const idle = [...this.#typing]
      .filter(([, state]) => now - state.lastKeystroke >= this.idleTimeout * 1000)
      .map(([conversation]) => conversation)
      .sort();
    for (const conversation of idle) this.#typing.delete(conversation);
    return idle.map((conversationId) => ({ conversationId, isTyping: false }));
  }

  /** When the next `expire(now)` has something to do (milliseconds), or `null`. */
  get nextDeadline() {
    let next = null;
    for (const state of this.#typing.values()) {
      const deadline = state.lastKeystroke + this.idleTimeout * 1000;
      if (next === null || deadline < next) next = deadline;
    }
    return next;
  }
}

// MARK: - The cache

/**
 * A change to announce: the name of the event and its `detail`.
 * @typedef {{ type: "connection", detail: ConnectionState } | { type: "presence", detail: PresenceSnapshot }
 *   | { type: "removed", detail: RemovedUser } | { type: "typing", detail: TypingChange }
 *   | { type: "group", detail: GroupPresence } | { type: "error", detail: PresenceErrorDetail }
 *   | { type: "message", detail: ChatMessage } | { type: "messagestatus", detail: MessageStatusChange }
 *   | { type: "messagegap", detail: MessageGap } | { type: "messagetruncated", detail: MessageGap }} ClientEvent
 */

/**
 * @param {PresenceSnapshot} a
 * @param {PresenceSnapshot} b
 */
function sameSnapshot(a, b) {
  return a.userId === b.userId && a.status === b.status && millis(a.lastSeen) === millis(b.lastSeen);
}

/**
 * @param {GroupPresence} a
 * @param {GroupPresence} b
 */
function sameGroup(a, b) {
  return a.conversationId === b.conversationId && a.total === b.total && a.online === b.online && a.away === b.away;
}

/**
 * @param {string} conversationId
 * @param {string} userId
 * @param {boolean} isTyping
 * @returns {ClientEvent}
 */
const typingEvent = (conversationId, userId, isTyping) => ({ type: "typing", detail: Object.freeze({ conversationId, userId, isTyping }) });

/**
 * What the client knows of others: presences, conversation counts and who is typing. Every
 * change returns the events it causes, and only real changes cause one (as the Swift
 * `PresenceCache`).
 */
class PresenceCache {
  /** @type {Map<string, PresenceSnapshot>} */
  presences = new Map();
  /** @type {Map<string, GroupPresence>} */
  groups = new Map();
  /**
   * Conversation → user → when their indicator goes away if no update comes (ms).
   * @type {Map<string, Map<string, number>>}
   */
  #typing = new Map();
  /**
   * Users not yet confirmed by the session catching up after a (re)connect.
   * @type {Set<string> | null}
   */
  #unconfirmed = null;

  /** @param {string} conversation */
  typingUsers(conversation) {
    return [...(this.#typing.get(conversation)?.keys() ?? [])].sort();
  }

  /**
   * Takes in a presence: `initial_state` entries and `presence_update`s alike.
   * @param {PresenceSnapshot} snapshot
   * @returns {ClientEvent[]}
   */
  apply(snapshot) {
    this.#unconfirmed?.delete(snapshot.userId);
    const known = this.presences.get(snapshot.userId);
    if (known && sameSnapshot(known, snapshot)) return [];
    this.presences.set(snapshot.userId, snapshot);
    /** @type {ClientEvent[]} */
    const events = [{ type: "presence", detail: snapshot }];
    // Someone who went offline stops typing everywhere.
    if (snapshot.status === "offline") events.push(...this.#stopTypingEverywhere(snapshot.userId));
    return events;
  }

  /**
   * The answer to a `subscribe` of `requested` users: those left out are not visible.
   * @param {PresenceSnapshot[]} snapshots
   * @param {string[]} requested
   */
  applySnapshot(snapshots, requested) {
    const events = snapshots.flatMap((snapshot) => this.apply(snapshot));
    const answered = new Set(snapshots.map((snapshot) => snapshot.userId));
    events.push(...this.remove(requested.filter((user) => !answered.has(user))));
    return events;
  }

  /**
   * Forgets users (unwatched, or not visible any more).
   * @param {string[]} users
   * @returns {ClientEvent[]}
   */
  remove(users) {
    /** @type {ClientEvent[]} */
    const events = [];
    for (const user of users) {
      if (!this.presences.delete(user)) continue;
      events.push(...this.#stopTypingEverywhere(user), { type: "removed", detail: Object.freeze({ userId: user }) });
    }
    return events;
  }

  /** @param {string} user */
  #stopTypingEverywhere(user) {
    return [...this.#typing.keys()].sort()
      .filter((conversation) => this.#typing.get(conversation)?.has(user))
      .flatMap((conversation) => this.setTyping(user, conversation, false, null));
  }

  /**
   * Takes in a conversation's counts.
   * @param {GroupPresence} group
   * @returns {ClientEvent[]}
   */
  applyGroup(group) {
    const known = this.groups.get(group.conversationId);
    if (known && sameGroup(known, group)) return [];
    this.groups.set(group.conversationId, group);
    return [{ type: "group", detail: group }];
  }

  /**
   * Forgets a conversation that was left: its counts and its typing.
   * @param {string} conversation
   */
  removeConversation(conversation) {
    this.groups.delete(conversation);
    const users = this.typingUsers(conversation);
    this.#typing.delete(conversation);
    return users.map((user) => typingEvent(conversation, user, false));
  }

  /**
   * Takes in a `typing_update`. A start shows until a stop or until `expiresAt`, in case the
   * stop is never heard.
   * @param {string} user
   * @param {string} conversation
   * @param {boolean} isTyping
   * @param {number | null} expiresAt
   * @returns {ClientEvent[]}
   */
  setTyping(user, conversation, isTyping, expiresAt) {
    const users = this.#typing.get(conversation);
    const wasTyping = users?.has(user) ?? false;
    if (isTyping && expiresAt !== null) {
      if (users) users.set(user, expiresAt);
      else this.#typing.set(conversation, new Map([[user, expiresAt]]));
    } else if (users) {
      users.delete(user);
      if (users.size === 0) this.#typing.delete(conversation);
    }
    return wasTyping === isTyping ? [] : [typingEvent(conversation, user, isTyping)];
  }

  /**
   * Ends typing indicators whose time ran out by `now`.
   * @param {number} now
   */
  expireTyping(now) {
    /** @type {ClientEvent[]} */
    const events = [];
    for (const conversation of [...this.#typing.keys()].sort()) {
      for (const user of this.typingUsers(conversation)) {
        const expiry = this.#typing.get(conversation)?.get(user);
        if (expiry !== undefined && expiry <= now) events.push(...this.setTyping(user, conversation, false, null));
      }
    }
    return events;
  }

  /** Ends every typing indicator (the connection dropped, or this device appears offline). */
  clearTyping() {
    const events = [...this.#typing.keys()].sort()
      .flatMap((conversation) => this.typingUsers(conversation).map((user) => typingEvent(conversation, user, false)));
    this.#typing.clear();
    return events;
  }

  /** When the next typing indicator runs out (ms), or `null`. */
  get nextTypingExpiry() {
    let next = null;
    for (const users of this.#typing.values()) {
      for (const expiry of users.values()) if (next === null || expiry < next) next = expiry;
    }
    return next;
  }

  /** A new session starts catching up: every presence known now must be confirmed by it. */
  beginCatchUp() {
    this.#unconfirmed = new Set(this.presences.keys());
  }

  /** The new session has answered everything it was asked: who it did not confirm is gone. */
  endCatchUp() {
    const stale = this.#unconfirmed;
    this.#unconfirmed = null;
    return stale ? this.remove([...stale].sort()) : [];
  }
}

// MARK: - Lifecycle

/** @typedef {"active" | "background" | "suspended" | "unloaded" | "signedOut"} Phase */
/**
 * @typedef {{ kind: "reconnectNow", newToken: boolean } | { kind: "reconnectAfterBackoff", newToken: boolean }
 *   | { kind: "stop", reason: StopReason }} AfterClose
 */

/**
 * The decisions of the client apart from any I/O, as the Swift `ClientLifecycle`: which status
 * the device should have, whether to be connected, what to do after a close, and which status
 * change is still owed to the gateway (latest wins, sent once). The page's phases: `active`
 * (visible), `background` (hidden: away), `suspended` (hidden past the background policy's
 * time: offline, no session), `unloaded` (`pagehide` or `stop()`), `signedOut` (for good).
 */
class ClientLifecycle {
  /** @type {Phase} */
  phase = "active";
  networkAvailable = true;
  /** The page's own offline switch (airplane mode for this client): offline, no session. */
  offlineMode = false;
  /** @type {PresenceStatus} */
  chosenStatus = "online";
  /** @type {StopReason | null} */
  stopReason = null;
  /**
   * The status the open session has on the gateway; `null` without a session or after a refusal.
   * @type {PresenceStatus | null}
   */
  sessionStatus = null;
  inSession = false;
  /**
   * Not before this moment (ms) may a refused status change be sent again.
   * @type {number | null}
   */
  statusRetryAt = null;
  #quickRetryUsed = false;
  /** Nodes tried in a row, each closing with 1011 or 1013, or not reached at all. */
  #nodesThatCouldNotServe = 0;

  /** @returns {PresenceStatus} */
  get desiredStatus() {
    if (this.offlineMode) return "offline";
    switch (this.phase) {
      case "active": return this.chosenStatus;
      case "background": return this.chosenStatus === "online" ? "away" : this.chosenStatus;
      default: return "offline";
    }
  }

  get shouldConnect() {
    return this.stopReason === null && this.networkAvailable && !this.offlineMode && (this.phase === "active" || this.phase === "background");
  }

  /** Whether the device may send typing and be shown others' typing. */
  get canType() { return this.inSession && this.desiredStatus !== "offline"; }

  didBecomeActive() {
    if (this.phase === "background" || this.phase === "suspended") this.phase = "active";
  }

  didEnterBackground() {
    if (this.phase === "active") this.phase = "background";
  }

  /** Hidden past the background policy's time. */
  suspend() {
    if (this.phase === "background") this.phase = "suspended";
  }

  /** `pagehide` or `stop()`: offline, no session, until `resume`. */
  unload() {
    if (this.phase !== "signedOut") this.phase = "unloaded";
  }

  /** @param {boolean} hidden */
  resume(hidden) {
    if (this.phase === "unloaded") this.phase = hidden ? "background" : "active";
  }

  signOut() {
    this.phase = "signedOut";
    this.stopReason = this.stopReason ?? "signedOut";
  }

  /** @param {boolean} available */
  networkChanged(available) {
    this.networkAvailable = available;
    if (available) {
      this.#quickRetryUsed = false;
      this.#nodesThatCouldNotServe = 0;
    }
  }

  /** @param {PresenceStatus} status */
  choose(status) { this.chosenStatus = status; }

  /** @param {boolean} offline the page's offline switch was turned on or off */
  setOffline(offline) {
    this.offlineMode = offline;
    if (!offline) this.#quickRetryUsed = false;
  }

  /** The status to open the next session with: the latest wanted. */
  get openingStatus() { return this.desiredStatus; }

  /** @param {PresenceStatus} status the session opened with it and caught up */
  opened(status) {
    this.inSession = true;
    this.sessionStatus = status;
    this.statusRetryAt = null;
    this.#quickRetryUsed = false;
    this.#nodesThatCouldNotServe = 0;
  }

  /**
   * The status frame owed to the gateway at `now`, if any; it counts as sent.
   * @param {number} now
   * @returns {PresenceStatus | null}
   */
  statusToSend(now) {
    if (!this.inSession || this.sessionStatus === this.desiredStatus) return null;
    if (this.statusRetryAt !== null && now < this.statusRetryAt) return null;
    this.statusRetryAt = null;
    this.sessionStatus = this.desiredStatus;
    return this.desiredStatus;
  }

  /** @param {number} retryAt the gateway refused the last status frame: send it again then */
  statusRefused(retryAt) {
    this.sessionStatus = null;
    this.statusRetryAt = retryAt;
  }

  /**
   * The session ended with the server's close `code` (`null`: none, the connection dropped),
   * or never opened (`upgradeRefused`); `unreachable`: the attempt never became a session and
   * no close code came (the node is down, or the upgrade refused: a browser cannot tell which);
   * the client knows `gateways` URLs. Says what to do next.
   * @param {number | null} code
   * @param {boolean} upgradeRefused
   * @param {number} [gateways]
   * @param {boolean} [unreachable]
   * @returns {AfterClose}
   */
  closed(code, upgradeRefused, gateways = 1, unreachable = false) {
    this.inSession = false;
    this.sessionStatus = null;
    this.statusRetryAt = null;
    if (this.stopReason) return { kind: "stop", reason: this.stopReason };
    if (code === null && unreachable) {
      // A node that is down cannot serve either: the next URL at once, as for 1011. Waited
      // out, the backoff after such an attempt (2 s, after the drop's 1 s) outlasted the linger
      // of a device whose node died while the next one in its list was down too. A refused
      // upgrade looks the same here: the fresh token is asked for after the round, as before.
      return this.#nodeCouldNotServe(gateways, upgradeRefused);
    }
    if (code !== CloseCode.internalError && code !== CloseCode.tryAgainLater) this.#nodesThatCouldNotServe = 0;
    switch (code) {
      case CloseCode.disconnectedByAdmin:
        this.stopReason = "disconnectedByAdmin";
        return { kind: "stop", reason: this.stopReason };
      case CloseCode.replaced:
        this.stopReason = "replaced";
        return { kind: "stop", reason: this.stopReason };
      case CloseCode.goingAway:
      case CloseCode.unauthorized: {
        // One quick retry: the node is draining (another takes over) or the token just
        // expired. A second in a row without a session that opened backs off.
        const newToken = code === CloseCode.unauthorized;
        if (this.#quickRetryUsed) return { kind: "reconnectAfterBackoff", newToken };
        this.#quickRetryUsed = true;
        return { kind: "reconnectNow", newToken };
      }
      case CloseCode.internalError:
      case CloseCode.tryAgainLater:
        return this.#nodeCouldNotServe(gateways, false);
      default:
        // A refused upgrade is most often a token the gateway no longer accepts.
        return { kind: "reconnectAfterBackoff", newToken: upgradeRefused };
    }
  }

  /**
   * This node cannot serve now (it cannot reach Redis, it is full, starting or down); another
   * may. Each other URL is tried at once, so that a device handed off to such a node is back,
   * elsewhere, within its linger; once every URL has said so, back off (with a fresh token if
   * `tokenAfterRound`).
   * @param {number} gateways
   * @param {boolean} tokenAfterRound
   * @returns {AfterClose}
   */
  #nodeCouldNotServe(gateways, tokenAfterRound) {
    this.#nodesThatCouldNotServe += 1;
    if (this.#nodesThatCouldNotServe < gateways) return { kind: "reconnectNow", newToken: false };
    this.#nodesThatCouldNotServe = 0;
    return { kind: "reconnectAfterBackoff", newToken: tokenAfterRound };
  }
}

// MARK: - Frames

/**
 * @typedef {{ type: "initial_state", id: string | null, presences: PresenceSnapshot[] }
 *   | { type: "presence_update", id: string | null, presence: PresenceSnapshot }
 *   | { type: "typing_update", id: string | null, userId: string, conversationId: string, isTyping: boolean }
 *   | { type: "group_presence", id: string | null, group: GroupPresence }
 *   | { type: "ack" | "pong", id: string | null }
 *   | { type: "error", id: string | null, code: string, message: string, conversationId: string | null, retryAfter: number | null }
 *   | { type: "message", id: string | null, message: ChatMessage }
 *   | { type: "message_ack", id: string | null, conversationId: string, clientMessageId: string, seq: number, messageId: string,
 *       epoch: string | null, createdAt: Date }
 *   | { type: "synced", id: string | null, conversationId: string, epoch: string, lastSeq: number, more: boolean,
 *       missing: SeqRange[], truncated: SeqRange[], receipts: MemberReceipt[] | null }
 *   | { type: "receipt", id: string | null, conversationId: string, receipt: MemberReceipt }
 *   | { type: "unknown", id: string | null, name: string }} ServerMessage
 */

/** @typedef {{ epoch: string | null, fromSeq: number, toSeq: number | null }} SeqRange */

/** A frame that does not read as the protocol says. */
class Unreadable extends Error {}

/** @param {unknown} value */
const isObject = (value) => typeof value === "object" && value !== null && !Array.isArray(value);

/**
 * A user or conversation id: a string, or a whole number from a gateway that writes ids as
 * numbers (`PRESENCE_ID_FORMAT=numeric`), kept as its decimal text.
 * @param {unknown} value
 */
function readId(value) {
  if (typeof value === "number" && Number.isSafeInteger(value)) return String(value);
  if (typeof value === "string") return value;
  throw new Unreadable("an id is not a string or a whole number");
}

/** @param {unknown} value */
function readCount(value) {
  if (typeof value === "number" && Number.isInteger(value)) return value;
  throw new Unreadable("a count is not a whole number");
}

/**
 * @param {unknown} data
 * @returns {PresenceSnapshot}
 */
function readPresence(data) {
  if (!isObject(data)) throw new Unreadable("a presence is not an object");
  const record = /** @type {Record<string, unknown>} */ (data);
  const status = record.status;
  if (typeof status !== "string" || !STATUSES.includes(status)) throw new Unreadable("a status is not online, away or offline");
  let lastSeen = null;
  if (record.last_seen !== undefined && record.last_seen !== null) {
    const parsed = parseTimestamp(record.last_seen);
    if (parsed === null) throw new Unreadable("last_seen is not an ISO 8601 UTC timestamp");
    lastSeen = new Date(parsed);
  }
  return Object.freeze({ userId: readId(record.user_id), status: /** @type {PresenceStatus} */ (status), lastSeen });
}

/** @param {unknown} value */
function readSeq(value) {
  if (typeof value === "number" && Number.isSafeInteger(value) && value >= 0) return value;
  throw new Unreadable("a seq is not a whole number");
}

/** @param {unknown} value */
function readString(value, what) {
  if (typeof value === "string") return value;
  throw new Unreadable(`${what} is not a string`);
}

/**
 * A frame's `epoch`: the field itself, never read from a message's `id` (whose text the API does
 * not promise). `null` from a gateway older than the field.
 * @param {unknown} value
 * @returns {string | null}
 */
function readEpoch(value) {
  if (value === undefined || value === null) return null;
  return readString(value, "epoch");
}

/**
 * A `message` frame's data.
 * @param {Record<string, unknown>} record
 * @param {MessageStatus} status
 * @returns {ChatMessage}
 */
function readMessage(record, status) {
  const id = readString(record.id, "a message id");
  const created = parseTimestamp(record.created_at);
  if (created === null) throw new Unreadable("created_at is not an ISO 8601 UTC timestamp");
  return Object.freeze({
    conversationId: readId(record.conversation_id), clientMessageId: readString(record.client_message_id, "client_message_id"),
    seq: readSeq(record.seq), id, epoch: readEpoch(record.epoch), senderId: readId(record.sender_id),
    type: readString(record.type, "type"), text: readString(record.text, "text"),
    imageUrl: typeof record.image_url === "string" ? record.image_url : null, createdAt: new Date(created), status, failure: null,
  });
}

/**
 * The ranges of `missing` or `truncated`.
 * @param {unknown} value
 * @param {string} what
 * @returns {SeqRange[]}
 */
function readRanges(value, what) {
  if (!Array.isArray(value)) throw new Unreadable(`${what} is not an array`);
  return value.map((range) => {
    if (!isObject(range)) throw new Unreadable(`a ${what} range is not an object`);
    const entry = /** @type {Record<string, unknown>} */ (range);
    return { epoch: typeof entry.epoch === "string" ? entry.epoch : null, fromSeq: readSeq(entry.from_seq),
      toSeq: entry.to_seq === null || entry.to_seq === undefined ? null : readSeq(entry.to_seq) };
  });
}

/** @param {unknown} value */
function readReceipt(value) {
  if (!isObject(value)) throw new Unreadable("a receipt is not an object");
  const record = /** @type {Record<string, unknown>} */ (value);
  return Object.freeze({ userId: readId(record.user_id), deliveredSeq: readSeq(record.delivered_seq), readSeq: readSeq(record.read_seq) });
}

/**
 * Reads a server frame as the Swift SDK's decoder does: a frame whose fields do not read is
 * `null` (dropped), a `type` this version does not know is `unknown` (newer gateways may send more).
 * @param {string} text
 * @returns {ServerMessage | null}
 */
function readServerMessage(text) {
  let message;
  try {
    message = JSON.parse(text);
  } catch {
    return null;
  }
  if (!isObject(message)) return null;
  try {
    if (message.id !== undefined && message.id !== null && typeof message.id !== "string") throw new Unreadable("id is not a string");
    const id = message.id ?? null;
    const type = message.type;
    if (typeof type !== "string") throw new Unreadable("the frame has no type");
    const data = message.data;
    const record = /** @type {Record<string, unknown>} */ (isObject(data) ? data : {});
    if (["initial_state", "presence_update", "typing_update", "group_presence", "error", "message", "message_ack", "synced", "receipt"].includes(type)
      && !isObject(data)) {
      throw new Unreadable("data is not an object");
    }
    switch (type) {
      case "initial_state":
        if (!Array.isArray(record.presences)) throw new Unreadable("presences is not an array");
        return { type, id, presences: record.presences.map(readPresence) };
      case "presence_update":
        return { type, id, presence: readPresence(data) };
      case "typing_update":
        if (typeof record.is_typing !== "boolean") throw new Unreadable("is_typing is not a boolean");
        return { type, id, userId: readId(record.user_id), conversationId: readId(record.conversation_id), isTyping: record.is_typing };
      case "group_presence":
        return {
          type, id, group: Object.freeze({
            conversationId: readId(record.conversation_id),
            total: readCount(record.total), online: readCount(record.online), away: readCount(record.away),
          }),
        };
      case "ack":
      case "pong":
        return { type, id };
      case "error": {
        if (typeof record.code !== "string" || typeof record.message !== "string") throw new Unreadable("an error needs a code and a message");
        // A code from a newer gateway reads as `internal`, so the page still sees the error.
        const code = ERROR_CODES.includes(record.code) ? record.code : "internal";
        const conversationId = record.conversation_id === undefined || record.conversation_id === null ? null : readId(record.conversation_id);
        // Seconds until the refused budget has room again, where the gateway says.
        const retryAfter = typeof record.retry_after === "number" && Number.isFinite(record.retry_after) && record.retry_after >= 0
          ? record.retry_after : null;
        return { type, id, code, message: record.message, conversationId, retryAfter };
      }
      case "message":
        return { type, id, message: readMessage(record, "delivered") };
      case "message_ack": {
        const messageId = readString(record.id, "a message id");
        const created = parseTimestamp(record.created_at);
        if (created === null) throw new Unreadable("created_at is not an ISO 8601 UTC timestamp");
        return {
          type, id, conversationId: readId(record.conversation_id), clientMessageId: readString(record.client_message_id, "client_message_id"),
          seq: readSeq(record.seq), messageId, epoch: readEpoch(record.epoch), createdAt: new Date(created),
        };
      }
      case "synced": {
        if (typeof record.more !== "boolean" || !Array.isArray(record.missing)) throw new Unreadable("synced needs more and missing");
        const missing = readRanges(record.missing, "missing");
        // A gateway older than `truncated` never forks an epoch.
        const truncated = record.truncated === undefined || record.truncated === null ? [] : readRanges(record.truncated, "truncated");
        const receipts = Array.isArray(record.receipts) ? record.receipts.map(readReceipt) : null;
        return {
          type, id, conversationId: readId(record.conversation_id), epoch: readString(record.epoch, "epoch"),
          lastSeq: readSeq(record.last_seq), more: record.more, missing, truncated, receipts,
        };
      }
      case "receipt":
        return { type, id, conversationId: readId(record.conversation_id), receipt: readReceipt(data) };
      default:
        return { type: "unknown", id, name: type.slice(0, 64) };
    }
  } catch (error) {
    if (error instanceof Unreadable) return null;
    throw error;
  }
}

/**
 * A client frame's text, keys sorted as the Swift SDK writes them.
 * @param {string} type
 * @param {Record<string, unknown>} data keys in sorted order
 * @param {string} id
 */
const frameText = (type, data, id) => JSON.stringify({ data, id, type });

/**
 * @param {unknown} ids
 * @param {string} what
 * @returns {string[]}
 */
function checkIds(ids, what) {
  if (!Array.isArray(ids)) throw invalid(`${what}s must be an array`);
  for (const id of ids) {
    if (typeof id !== "string" || !ID_PATTERN.test(id)) throw invalid(`${what} ${JSON.stringify(id)} is not ${ID_RULE}`);
  }
  return ids;
}

/**
 * @param {unknown} id
 * @param {string} what
 * @returns {string}
 */
const checkId = (id, what) => checkIds([id], what)[0];

// MARK: - The outbox's stores

/**
 * A message as plain data, for a store (`createdAt` in milliseconds).
 * @param {ChatMessage} message
 */
const storable = (message) => ({ ...message, createdAt: message.createdAt.getTime() });

/**
 * A stored message read back; an entry that does not read is left out.
 * @param {unknown} value
 * @returns {ChatMessage[]}
 */
function readStored(value) {
  if (!isObject(value)) return [];
  const record = /** @type {Record<string, any>} */ (value);
  if (typeof record.conversationId !== "string" || typeof record.clientMessageId !== "string" || typeof record.text !== "string"
    || typeof record.createdAt !== "number") return [];
  return [Object.freeze({
    conversationId: record.conversationId, clientMessageId: record.clientMessageId, seq: null, id: null, epoch: null, senderId: null,
    type: typeof record.type === "string" ? record.type : "text", text: record.text,
    imageUrl: typeof record.imageUrl === "string" ? record.imageUrl : null, createdAt: new Date(record.createdAt),
    status: record.status === "failed" ? "failed" : "sending", failure: typeof record.failure === "string" ? record.failure : null,
  })];
}

/** An outbox kept in memory, for as long as the store object lives (tests, or a page that keeps its own). */
export class MemoryOutboxStore {
  /** @type {ChatMessage[]} */
  #saved = [];

  async load() { return [...this.#saved]; }

  /** @param {ChatMessage[]} messages */
  async save(messages) { this.#saved = [...messages]; }
}

/**
 * An outbox in IndexedDB: one record per key (the device id) in the `outbox` object store of a
 * database (`presence` by default), so that a reload or a closed tab keeps what was not sent.
 */
export class IndexedDBOutboxStore {
  #key;
  #name;
  #indexedDB;

  /**
   * @param {string} key
   * @param {{ databaseName?: string, indexedDB?: IDBFactory }} [options]
   */
  constructor(key, options = {}) {
    this.#key = key;
    this.#name = options.databaseName ?? "presence";
    this.#indexedDB = options.indexedDB ?? globalThis.indexedDB;
    if (!this.#indexedDB) throw invalid("IndexedDB is not available here: use MemoryOutboxStore");
  }

  /** @returns {Promise<IDBDatabase>} */
  #open() {
    return new Promise((resolve, reject) => {
      const request = this.#indexedDB.open(this.#name, 1);
      request.onupgradeneeded = () => request.result.createObjectStore("outbox");
      request.onsuccess = () => resolve(request.result);
      request.onerror = () => reject(request.error);
    });
  }

  /** @returns {Promise<ChatMessage[]>} */
  async load() {
    const database = await this.#open();
    try {
      const value = await new Promise((resolve, reject) => {
        const request = database.transaction("outbox").objectStore("outbox").get(this.#key);
        request.onsuccess = () => resolve(request.result);
        request.onerror = () => reject(request.error);
      });
      return Array.isArray(value) ? value.flatMap(readStored) : [];
    } finally {
      database.close();
    }
  }

  /** @param {ChatMessage[]} messages */
  async save(messages) {
    const database = await this.#open();
    try {
      await new Promise((resolve, reject) => {
        const transaction = database.transaction("outbox", "readwrite");
        transaction.objectStore("outbox").put(messages.map(storable), this.#key);
        transaction.oncomplete = () => resolve(undefined);
        transaction.onerror = () => reject(transaction.error);
        transaction.onabort = () => reject(transaction.error);
      });
    } finally {
      database.close();
    }
  }
}

/**
 * A new client message id: a UUID, or 32 random hex digits where `crypto.randomUUID` is missing.
 * @param {() => number} random
 */
const makeMessageId = (random) => makeDeviceId(random);

// MARK: - Options

/** @returns {PresenceClock} */
function systemClock() {
  return {
    now: () => Date.now(),
    setTimeout: (callback, milliseconds) => globalThis.setTimeout(callback, milliseconds),
    clearTimeout: (handle) => globalThis.clearTimeout(/** @type {any} */ (handle)),
  };
}

/**
 * Gateway URLs as given, or the gateway that served this module.
 * @param {PresenceClientOptions["gatewayURLs"]} given
 * @param {string | undefined} pageURL
 * @returns {URL[]}
 */
function gatewayURLs(given, pageURL) {
  let list = given === undefined ? [] : Array.isArray(given) ? given : [given];
  if (given === undefined) {
    const served = new URL("/", import.meta.url);
    if (served.protocol === "http:" || served.protocol === "https:") list = [served];
  }
  if (list.length === 0) throw invalid("at least one gateway URL is needed");
  return list.map((entry) => {
    let url;
    try {
      url = new URL(String(entry), pageURL);
    } catch {
      throw invalid(`gateway URL ${String(entry)} is not a URL`);
    }
    if (!["ws:", "wss:", "http:", "https:"].includes(url.protocol) || url.hostname === "") {
      throw invalid(`gateway URL ${url.href} must be ws(s)://host[:port] or http(s)://host[:port]`);
    }
    return url;
  });
}

/**
 * The WebSocket URL of a session: `/api/presence/subscribe` with the token, the device and
 * the status to open with (so a page reconnecting while away is never shown online).
 * @param {URL} base
 * @param {string} token
 * @param {string} deviceId
 * @param {PresenceStatus} status
 */
function sessionURL(base, token, deviceId, status) {
  const url = new URL(base.href);
  if (url.protocol === "http:") url.protocol = "ws:";
  else if (url.protocol === "https:") url.protocol = "wss:";
  const path = url.pathname.endsWith("/") ? url.pathname.slice(0, -1) : url.pathname;
  url.pathname = path + SESSION_PATH;
  // URLSearchParams writes `+` as %2B, so the server cannot read it as a space.
  url.search = new URLSearchParams({ token, device_id: deviceId, status }).toString();
  url.hash = "";
  return url.href;
}

/**
 * A new device id: a UUID, or 32 random hex digits where `crypto.randomUUID` is missing (it
 * needs a secure context).
 * @param {() => number} random
 */
function makeDeviceId(random) {
  const crypto = globalThis.crypto;
  if (typeof crypto?.randomUUID === "function") return crypto.randomUUID();
  const bytes = new Uint8Array(16);
  if (typeof crypto?.getRandomValues === "function") crypto.getRandomValues(bytes);
  else for (let index = 0; index < bytes.length; index += 1) bytes[index] = Math.floor(random() * 256);
  return Array.from(bytes, (byte) => byte.toString(16).padStart(2, "0")).join("");
}

/**
 * The device id kept in `storage`, made and kept when missing or not a valid id. Storage that
 * throws (disabled, private mode) gives an id for this client only.
 * @param {DeviceIdStorage | null} storage
 * @param {() => number} random
 */
function storedDeviceId(storage, random) {
  try {
    const stored = storage?.getItem(DEVICE_ID_STORAGE_KEY);
    if (stored && ID_PATTERN.test(stored)) return stored;
  } catch {
    // Unreadable storage: a new id below.
  }
  const made = makeDeviceId(random);
  try {
    storage?.setItem(DEVICE_ID_STORAGE_KEY, made);
  } catch {
    // Not kept: the next page load makes another id, which lingers and goes like any device.
  }
  return made;
}

/**
 * The device id of a tab slot: the stored id for slot 1, else the stored id with `.tabN`, its
 * start cut so that the whole stays within 128 characters.
 * @param {string} stored
 * @param {number} slot
 */
function slotDeviceId(stored, slot) {
  if (slot === 1) return stored;
  const suffix = `.tab${slot}`;
  return stored.slice(0, 128 - suffix.length) + suffix;
}

/**
 * @param {string} stored
 * @param {number} slot
 */
const slotLockName = (stored, slot) => `${SLOT_LOCK_PREFIX}:${stored}:${slot}`;

/**
 * The outbox store the client makes for a device id: IndexedDB, or memory where it is missing.
 * @param {string} deviceId
 * @returns {OutboxStore}
 */
const defaultOutboxStore = (deviceId) => (globalThis.indexedDB ? new IndexedDBOutboxStore(deviceId) : new MemoryOutboxStore());

/**
 * @param {unknown} locks
 * @returns {TabLocks | null}
 */
function tabLocks(locks) {
  /** @param {unknown} value */
  const usable = (value) => isObject(value) && typeof /** @type {any} */ (value).request === "function";
  if (locks === undefined) {
    // No Web Locks (Node, an insecure context): no slots, as before them.
    const found = /** @type {any} */ (globalThis).navigator?.locks;
    return usable(found) ? found : null;
  }
  if (locks === null) return null;
  if (!usable(locks)) throw invalid("locks must have request(name, options, callback), as navigator.locks has, or be null");
  return /** @type {TabLocks} */ (locks);
}

/** @returns {DeviceIdStorage | null} */
function defaultStorage() {
  try {
    return globalThis.localStorage ?? null;
  } catch {
    // Reading `localStorage` throws where storage is blocked.
    return null;
  }
}

/**
 * @param {unknown} value
 * @param {string} name
 * @param {number} fallback
 */
function seconds(value, name, fallback) {
  if (value === undefined) return fallback;
  if (typeof value !== "number" || !(value >= 0) || !Number.isFinite(value)) throw invalid(`${name} must be a number of seconds`);
  return value;
}

/**
 * @param {unknown} policy
 * @returns {BackgroundPolicy}
 */
function backgroundPolicy(policy) {
  if (policy === undefined) return { kind: "away" };
  if (isObject(policy)) {
    const { kind, afterSeconds } = /** @type {Record<string, unknown>} */ (policy);
    if (kind === "away") return { kind };
    if (kind === "offline") return { kind, afterSeconds: seconds(afterSeconds ?? 0, "backgroundPolicy.afterSeconds", 0) };
  }
  throw invalid('backgroundPolicy must be { kind: "away" } or { kind: "offline", afterSeconds: N }');
}

// MARK: - The client

/**
 * @param {ConnectionState} a
 * @param {ConnectionState} b
 */
function sameState(a, b) {
  if (a.state === "waiting" && b.state === "waiting") return a.retryAt.getTime() === b.retryAt.getTime();
  if (a.state === "stopped" && b.state === "stopped") return a.reason === b.reason;
  return a.state === b.state;
}

/**
 * What a request sent under a frame id was, until the gateway answers it.
 * @typedef {{ kind: "status" } | { kind: "users", users: string[] } | { kind: "conversation", conversationId: string }
 *   | { kind: "typing" } | { kind: "message", clientMessageId: string } | { kind: "sync", waiting: Set<string> } | { kind: "other" }} Request
 */

/** @typedef {{ conversationId: string, afterSeq: number, epoch: string | null }} SyncPosition */

/**
 * One conversation as this device knows it.
 * @typedef {object} ConversationLog
 * @property {string | null} epoch The history's epoch; null before any message.
 * @property {number} lastSeq The highest seq of the epoch such that every seq up to it is held
 *   here or was named unrecoverable (`missing`): where the next `sync` starts, and what
 *   `delivered` says. Never moved past a gap this device was neither given nor told about.
 * @property {Set<number>} above Seqs of the epoch held here above `lastSeq` (past a gap).
 * @property {Array<{ fromSeq: number, toSeq: number }>} named Ranges of the epoch above `lastSeq` a
 *   `synced` named as missing.
 * @property {number | null} stuckAt A complete `synced` of this session left `lastSeq` here
 *   below its `last_seq` (the gateway counts the gap as given and never sends a seq twice on a
 *   session): the gap is not asked for again until the next session.
 * @property {ChatMessage[]} messages Stored messages, in history order.
 * @property {Set<string>} seen Their ids.
 * @property {Map<string, MemberReceipt>} receipts Members' cursors.
 * @property {boolean} receiptsComplete A `synced` named every member.
 * @property {number} deliveredSent The highest seq said `delivered` on this session.
 * @property {number} readUpTo The highest seq the page read.
 * @property {number} readSent The highest seq said `read` on this session.
 */

/**
 * A message of the outbox and its attempts.
 * @typedef {{ message: ChatMessage, attempts: number, frameId: string | null, deadline: number | null, due: number | null }} Outgoing
 */

/** @returns {ConversationLog} */
const newLog = () => ({
  epoch: null, lastSeq: 0, above: new Set(), named: [], stuckAt: null, messages: [], seen: new Set(), receipts: new Map(),
  receiptsComplete: false, deliveredSent: 0, readUpTo: 0, readSent: 0,
});

/**
 * @param {ChatMessage} message
 * @param {Partial<ChatMessage>} changes
 * @returns {ChatMessage}
 */
const changed = (message, changes) => Object.freeze({ ...message, ...changes });

/**
 * A frame waiting to be written. Frames of a lane go in the order they were made; a lane whose
 * budget is spent does not hold up the others (a `sync` never waits behind `subscribe`s).
 * `unsubscribe` shares the `subscribe` lane without spending its budget, so it never overtakes
 * the `subscribe` it undoes.
 * @typedef {{ id: string, text: string, lane: "subscribe" | "sync" | "other", bucket: "subscribe" | "sync" | null,
 *   request: Request, onWrite: (() => void) | null }} PacedFrame
 */

/**
 * One WebSocket attempt, from its creation to its close.
 * @typedef {object} Session
 * @property {number} serial
 * @property {WebSocket} socket
 * @property {boolean} opened The socket's `open` came (else a close means the upgrade failed).
 * @property {boolean} awaitingInitialState
 * @property {PresenceStatus} openedWith
 * @property {number} openDeadline Given up at this moment (ms) unless its `initial_state` came.
 * @property {Map<string, Request>} pending
 * @property {Set<string>} catchUp Ids of the catch-up's requests not yet answered.
 * @property {Array<{ due: number, type: string, data: Record<string, unknown>, request: Request, catchingUp: boolean }>} retries
 * @property {PacedFrame[]} paced Frames not written yet, oldest first: the socket is not open, or
 *   the budgets (`buckets`) have no room.
 * @property {{ frame: TokenBucket, subscribe: TokenBucket, sync: TokenBucket }} buckets The
 *   gateway's budgets for this session, as the client spends them.
 * @property {Map<string, number>} syncRetries Conversations whose refused or failed `sync` goes
 *   again at that moment (ms).
 * @property {Map<string, ReconnectBackoff>} syncBackoffs Their waits, growing with each failure.
 * @property {boolean} closing
 * @property {unknown} closeTimer
 * @property {Array<() => void>} endWaiters
 * @property {() => void} detach
 */

/**
 * A client's tab slots: the Web Locks, the slot it holds and how to let that go, whether a
 * claim is under way, whether an adoption of other slots' outboxes is, and whether another
 * was asked for meanwhile.
 * @typedef {{ locks: TabLocks, held: { slot: number, release: () => void } | null, claiming: boolean, adopting: boolean,
 *   adoptAgain: boolean }} TabSlots
 */

/**
 * A browser's link to the presence gateway. Call `start()`; listen for `connection`,
 * `presence`, `removed`, `typing`, `group` and `error` (`CustomEvent`s, the change in
 * `detail`); read the cache with `presence()`, `presences`, `group()` and `typingUsers()`.
 */
export class PresenceClient extends EventTarget {
  #urls;
  /** The stored id (or the app's): the device id of tab slot 1. */
  #storedDeviceId;
  /**
   * The device id of this client's sessions; `null` while its tab slot is not held.
   * @type {string | null}
   */
  #deviceId;
  /**
   * Tab slots; `null`: not used, the device id is fixed.
   * @type {TabSlots | null}
   */
  #slots;
  #tokenProvider;
  #policy;
  #typingDisplayTimeout;
  #retryDelay;
  #closeTimeout;
  #openTimeout;
  #clock;
  #random;
  #WebSocket;
  #window;
  #document;
  #logger;

  #lifecycle = new ClientLifecycle();
  #backoff;
  #debouncer;
  #cache = new PresenceCache();
  /** @type {ConnectionState} */
  #state = Object.freeze({ state: "idle" });
  /** @type {number | null} */
  #lastCloseCode = null;
  /** @type {Set<string>} */
  #watched = new Set();
  /** @type {Set<string>} */
  #joined = new Set();
  /** @type {Session | null} */
  #session = null;
  #serial = 0;
  #nextFrameId = 0;
  #needsNewToken = false;
  #urlIndex = 0;
  #started = false;
  #tokenPending = false;
  /** @type {unknown} */
  #waitTimer = null;
  /** @type {unknown} */
  #suspendTimer = null;
  /** @type {unknown} */
  #timer = null;
  /** @type {number | null} */
  #timerDeadline = null;
  /** @type {(() => void) | null} */
  #detachPage = null;
  /** @type {ClientEvent[]} */
  #events = [];
  #depth = 0;
  #dispatching = false;
  /**
   * The outbox's store: the app's, or the one made for the device id (`null` until the tab's
   * slot is held, and again once it is let go).
   * @type {OutboxStore | null}
   */
  #outboxStore = null;
  /** The app passed `outboxStore`: it is used as is, and no other slot's outbox is adopted. */
  #outboxGiven = false;
  /**
   * Messages: each conversation as this device knows it, the outbox (oldest first), this
   * device's user (learned from the gateway's copy of a message it wrote), the client message
   * ids written here, the conversations whose `sync` is under way, and the conversation on screen.
   * @type {{ logs: Map<string, ConversationLog>, outbox: Outgoing[], ownUserId: string | null, written: Set<string>,
   *   syncing: Set<string>, loaded: boolean, loading: boolean, saving: Promise<void>, onScreen: string | null }}
   */
  #chat = {
    logs: new Map(), outbox: [], ownUserId: null, written: new Set(), syncing: new Set(), loaded: false, loading: false,
    saving: Promise.resolve(), onScreen: null,
  };

  /** @param {PresenceClientOptions} options */
  constructor(options) {
    super();
    if (!isObject(options)) throw invalid("options are required");
    if (typeof options.token !== "function") throw invalid("token must be a function returning the gateway token");
    this.#window = options.window === undefined ? /** @type {any} */ (globalThis).window ?? null : options.window;
    this.#document = options.document === undefined ? /** @type {any} */ (globalThis).document ?? null : options.document;
    const pageURL = /** @type {any} */ (this.#window)?.location?.href ?? /** @type {any} */ (globalThis).location?.href;
    this.#urls = gatewayURLs(options.gatewayURLs, pageURL);
    this.#tokenProvider = options.token;
    this.#random = options.random ?? Math.random;
    this.#storedDeviceId = options.deviceId === undefined
      ? storedDeviceId(options.storage === undefined ? defaultStorage() : options.storage, this.#random)
      : checkId(options.deviceId, "device id");
    const locks = tabLocks(options.locks);
    // An app that passes its own device id gives each tab its own: slots only for the stored one.
    this.#slots = options.deviceId === undefined && locks !== null ? { locks, held: null, claiming: false, adopting: false, adoptAgain: false } : null;
    this.#deviceId = this.#slots === null ? this.#storedDeviceId : null;
    this.#policy = backgroundPolicy(options.backgroundPolicy);
    this.#backoff = new ReconnectBackoff(options.backoff);
    this.#debouncer = new TypingDebouncer({
      refreshInterval: seconds(options.typingRefreshInterval, "typingRefreshInterval", 2),
      idleTimeout: seconds(options.typingIdleTimeout, "typingIdleTimeout", 3),
    });
    this.#typingDisplayTimeout = seconds(options.typingDisplayTimeout, "typingDisplayTimeout", 8);
    this.#retryDelay = seconds(options.retryDelay, "retryDelay", 1);
    this.#closeTimeout = seconds(options.closeTimeout, "closeTimeout", 3);
    this.#openTimeout = seconds(options.openTimeout, "openTimeout", 10);
    this.#clock = options.clock ?? systemClock();
    this.#WebSocket = options.WebSocket ?? globalThis.WebSocket;
    if (typeof this.#WebSocket !== "function") throw invalid("no WebSocket: pass the WebSocket option");
    this.#logger = options.logger ?? null;
    if (options.outboxStore !== undefined) {
      if (!isObject(options.outboxStore) || typeof options.outboxStore.load !== "function" || typeof options.outboxStore.save !== "function") {
        throw invalid("outboxStore must have load() and save(messages)");
      }
      this.#outboxStore = options.outboxStore;
      this.#outboxGiven = true;
    } else if (this.#deviceId !== null) {
      this.#outboxStore = defaultOutboxStore(this.#deviceId);
    }
  }

  // MARK: Reading

  /**
   * This client's device id. With tab slots (no `deviceId` option, Web Locks there) it is `null`
   * until `start()` has claimed the tab's slot (no session opens before), and again once the
   * slot is let go (`signOut()`, or stopped for good).
   * @returns {string | null}
   */
  get deviceId() { return this.#deviceId; }

  /** The link to the gateway. */
  get connectionState() { return this.#state; }

  /** The close code of the last session (`null`: none yet, or it dropped without one). */
  get lastCloseCode() { return this.#lastCloseCode; }

  /** The status this device is meant to have now. */
  get status() { return this.#lifecycle.desiredStatus; }

  /** Users watched explicitly, sorted. */
  get watchedUsers() { return [...this.#watched].sort(); }

  /** Conversations followed, sorted. */
  get joinedConversations() { return [...this.#joined].sort(); }

  /**
   * The presence of a user, if known.
   * @param {string} userId
   * @returns {PresenceSnapshot | undefined}
   */
  presence(userId) { return this.#cache.presences.get(userId); }

  /** Every known presence, sorted by user id. */
  get presences() {
    return [...this.#cache.presences.values()].sort((a, b) => (a.userId < b.userId ? -1 : a.userId > b.userId ? 1 : 0));
  }

  /**
   * The counts of a followed conversation, if known.
   * @param {string} conversationId
   * @returns {GroupPresence | undefined}
   */
  group(conversationId) { return this.#cache.groups.get(conversationId); }

  /**
   * Who is typing in a conversation, sorted; nobody while this device is disconnected or offline.
   * @param {string} conversationId
   * @returns {string[]}
   */
  typingUsers(conversationId) {
    return this.#lifecycle.canType ? this.#cache.typingUsers(conversationId) : [];
  }

  // MARK: Starting and stopping

  /**
   * Starts keeping a session open and following the page's life (visibility, `pagehide`,
   * `online`/`offline`). A client stopped for good (signed out, disconnected by an admin,
   * replaced) stays stopped. With tab slots, the first start claims the tab's slot: the
   * session opens once it is held.
   */
  start() {
    this.#act(() => {
      if (this.#started) return;
      this.#started = true;
      this.#claimSlot();
      this.#loadOutbox();
      this.#attachPage();
      this.#lifecycle.resume(false);
      this.#lifecycle.networkChanged(/** @type {any} */ (this.#window)?.navigator?.onLine !== false);
      this.#backoffReset();
      if (this.#isHidden()) this.#pageHidden();
      this.#statusChanged();
    });
  }

  /**
   * Stops: offline at once with a clean close (1000); `start()` may be called again (the tab
   * keeps its slot). Resolves once the gateway answered the close, or after `closeTimeout`.
   * @returns {Promise<void>}
   */
  stop() {
    return this.#act(() => {
      this.#started = false;
      this.#detachPageListeners();
      this.#clearSuspendTimer();
      this.#lifecycle.unload();
      return this.#closeCleanly(CloseCode.normal);
    });
  }

  /**
   * The person signed out: offline at once with a clean close (1000), and never again
   * (`connection` ends `stopped` with reason `signedOut`); the tab's slot is let go, for
   * another tab to take. Resolves once the close is done, or after `closeTimeout`.
   * @returns {Promise<void>}
   */
  signOut() {
    return this.#act(() => {
      this.#started = false;
      this.#detachPageListeners();
      this.#clearSuspendTimer();
      this.#lifecycle.signOut();
      return this.#closeCleanly(CloseCode.normal);
    });
  }

  // MARK: Status, watching, typing

  /**
   * Chooses the status shown while the page is visible: `online`, `away`, or `offline` to
   * appear offline while still hearing others. Changes made while disconnected are sent on
   * reconnect (the latest wins).
   * @param {PresenceStatus} status
   */
  setStatus(status) {
    this.#act(() => {
      if (!STATUSES.includes(status)) throw invalid("status must be one of online, away, offline");
      this.#lifecycle.choose(status);
      this.#statusChanged();
    });
  }

  /**
   * Watches users besides those the gateway watches for the session. Users the caller may not
   * see are left out silently, as the gateway does.
   * @param {string[]} userIds
   */
  watch(userIds) {
    this.#act(() => {
      /** @type {string[]} */
      const added = [];
      for (const user of checkIds(userIds, "user id")) {
        if (this.#watched.has(user)) continue;
        this.#watched.add(user);
        added.push(user);
      }
      const session = this.#session;
      if (session && !session.awaitingInitialState) this.#subscribeUsers(added, false);
    });
  }

  /**
   * Stops watching users.
   * @param {string[]} userIds
   */
  unwatch(userIds) {
    this.#act(() => {
      const removed = checkIds(userIds, "user id").filter((user) => this.#watched.delete(user));
      if (removed.length === 0) return;
      for (let start = 0; start < removed.length; start += SUBSCRIBE_CHUNK) {
        this.#send("unsubscribe", { user_ids: removed.slice(start, start + SUBSCRIBE_CHUNK) }, { kind: "other" });
      }
      this.#emit(this.#cache.remove(removed));
    });
  }

  /**
   * Follows a conversation: its counts, its typing, and its members' presence.
   * @param {string} conversationId
   */
  join(conversationId) {
    this.#act(() => {
      checkId(conversationId, "conversation id");
      if (this.#joined.has(conversationId)) return;
      this.#joined.add(conversationId);
      const session = this.#session;
      if (session && !session.awaitingInitialState) this.#subscribeConversation(conversationId, false);
    });
  }

  /**
   * Stops following a conversation, and stops typing in it.
   * @param {string} conversationId
   */
  leave(conversationId) {
    this.#act(() => {
      checkId(conversationId, "conversation id");
      const stop = this.#debouncer.stop(conversationId);
      if (stop) this.#sendTyping(stop);
      if (!this.#joined.delete(conversationId)) return;
      // A `subscribe` still waiting for the budget never reached the gateway: nothing to undo.
      if (!this.#unqueueSubscribe(conversationId)) this.#send("unsubscribe", { conversation_id: conversationId }, { kind: "other" });
      this.#emit(this.#cache.removeConversation(conversationId));
    });
  }

  /**
   * A keystroke in a conversation's composer. Nothing is sent while disconnected or offline.
   * @param {string} conversationId
   */
  userTyped(conversationId) {
    this.#act(() => {
      checkId(conversationId, "conversation id");
      const send = this.#debouncer.keystroke(conversationId, this.#clock.now(), this.#lifecycle.canType);
      if (send) this.#sendTyping(send);
    });
  }

  /**
   * The message was sent (or the draft cleared): typing stops now.
   * @param {string} conversationId
   */
  messageSent(conversationId) {
    this.#act(() => {
      checkId(conversationId, "conversation id");
      const stop = this.#debouncer.stop(conversationId);
      if (stop) this.#sendTyping(stop);
    });
  }

  // MARK: Messages

  /**
   * Writes a message: it is returned at once as `sending` (not a Promise), kept in the outbox
   * (saved in the background) and goes out when a session is open, in the order written.
   * @param {string} conversationId
   * @param {string} text
   * @param {{ type?: "text" | "image", imageUrl?: string }} [options]
   * @returns {ChatMessage}
   */
  send(conversationId, text, options = {}) {
    return this.#act(() => {
      checkId(conversationId, "conversation id");
      if (typeof text !== "string" || text === "") throw invalid("a message's text must be a string that is not empty");
      const type = options.type ?? "text";
      if (type !== "text" && type !== "image") throw invalid("a message's type is text or image");
      /** @type {ChatMessage} */
      const message = Object.freeze({
        conversationId, clientMessageId: makeMessageId(this.#random), seq: null, id: null, epoch: null, senderId: null, type, text,
        imageUrl: options.imageUrl ?? null, createdAt: new Date(this.#clock.now()), status: /** @type {MessageStatus} */ ("sending"), failure: null,
      });
      this.#chat.outbox.push({ message, attempts: 0, frameId: null, deadline: null, due: null });
      this.#chat.written.add(message.clientMessageId);
      if (!this.#chat.logs.has(conversationId)) this.#chat.logs.set(conversationId, newLog());
      const stop = this.#debouncer.stop(conversationId);
      if (stop) this.#sendTyping(stop);
      this.#saveOutbox();
      this.#emit([{ type: "message", detail: message }]);
      this.#sendOutbox();
      return message;
    });
  }

  /**
   * A conversation's messages, at once: those the gateway stored, in seq order (a message that
   * came past a gap keeps its place, and what fills the gap goes before it), then this device's
   * not stored yet (sending or failed), in the order they go out.
   * @param {string} conversationId
   * @returns {ChatMessage[]}
   */
  messages(conversationId) {
    return [
      ...(this.#chat.logs.get(conversationId)?.messages ?? []),
      ...this.#chat.outbox.map((entry) => entry.message).filter((message) => message.conversationId === conversationId),
    ];
  }

  /**
   * Every member's cursors in a conversation, as last heard, sorted by user id.
   * @param {string} conversationId
   * @returns {MemberReceipt[]}
   */
  receipts(conversationId) {
    return [...(this.#chat.logs.get(conversationId)?.receipts.values() ?? [])].sort((a, b) => (a.userId < b.userId ? -1 : 1));
  }

  /**
   * Sends a `failed` message again (three new attempts); returns whether it was in the outbox.
   * @param {string} clientMessageId
   */
  retry(clientMessageId) {
    return this.#act(() => {
      const index = this.#chat.outbox.findIndex((entry) => entry.message.clientMessageId === clientMessageId && entry.message.status === "failed");
      if (index < 0) return false;
      const message = changed(this.#chat.outbox[index].message, { status: "sending", failure: null });
      this.#chat.outbox[index] = { message, attempts: 0, frameId: null, deadline: null, due: null };
      this.#messageStatusChanged(message);
      this.#saveOutbox();
      this.#sendOutbox();
      return true;
    });
  }

  /**
   * The conversation is on screen: everything received in it counts as read (said to the
   * gateway now, or when a session opens).
   * @param {string} conversationId
   */
  markRead(conversationId) {
    this.#act(() => this.#markRead(conversationId));
  }

  /**
   * The conversation the page shows (`null`: none). While the page is visible, messages
   * arriving in it are read at once; when the page becomes visible again, it is marked read.
   * @param {string | null} conversationId
   */
  showConversation(conversationId) {
    this.#act(() => {
      if (conversationId !== null) checkId(conversationId, "conversation id");
      this.#chat.onScreen = conversationId;
      if (conversationId !== null && !this.#isHidden()) this.#markRead(conversationId);
    });
  }

  /**
   * The page's own offline switch, like airplane mode: `true` closes the session cleanly
   * (others see this device offline), sends nothing (messages wait in the outbox) and hides
   * others' typing; `false` connects again and sends the outbox.
   * @param {boolean} offline
   */
  setOffline(offline) {
    this.#act(() => {
      if (typeof offline !== "boolean") throw invalid("setOffline takes true or false");
      this.#lifecycle.setOffline(offline);
      if (offline) {
        for (const send of this.#debouncer.stopAll()) this.#sendTyping(send);
        this.#emit(this.#cache.clearTyping());
        const session = this.#session;
        if (session) this.#closeSession(session, CloseCode.normal);
      } else {
        this.#backoffReset();
      }
      this.#advance();
    });
  }

  /** Whether the page's offline switch is on. */
  get isOffline() { return this.#lifecycle.offlineMode; }

  /**
   * Resolves once every outbox change so far is saved.
   * @returns {Promise<void>}
   */
  outboxSaved() { return this.#chat.saving; }

  // MARK: Running things

  /**
   * Runs one change of state; then the timers are set again and the events it caused are
   * announced, so listeners always see a settled client (and may call it).
   * @template T
   * @param {() => T} body
   * @returns {T}
   */
  #act(body) {
    this.#depth += 1;
    try {
      return body();
    } finally {
      this.#depth -= 1;
      if (this.#depth === 0) {
        this.#rescheduleTimers();
        this.#dispatchEvents();
      }
    }
  }

  /** @param {ClientEvent[]} events */
  #emit(events) {
    this.#events.push(...events);
  }

  #dispatchEvents() {
    // A listener calling the client queues more events; this loop announces them in order.
    if (this.#dispatching) return;
    this.#dispatching = true;
    try {
      for (let event = this.#events.shift(); event; event = this.#events.shift()) {
        this.dispatchEvent(new CustomEvent(event.type, { detail: event.detail }));
      }
    } finally {
      this.#dispatching = false;
    }
  }

  /** @param {ConnectionState} state */
  #setState(state) {
    if (sameState(this.#state, state)) return;
    this.#state = Object.freeze(state);
    this.#log("debug", "connection state", state.state);
    this.#emit([{ type: "connection", detail: this.#state }]);
  }

  /**
   * @param {"debug" | "info" | "warn"} level
   * @param {...unknown} values
   */
  #log(level, ...values) {
    this.#logger?.[level]?.("[presence]", ...values);
  }

  // MARK: The page

  #isHidden() {
    return this.#document?.visibilityState === "hidden";
  }

  #attachPage() {
    const page = this.#window;
    const document = this.#document;
    const visibility = () => this.#act(() => (this.#isHidden() ? this.#pageHidden() : this.#pageVisible()));
    const pagehide = () => this.#act(() => this.#pageUnloaded());
    /** @param {Event} event */
    const pageshow = (event) => this.#act(() => {
      // Restored from the back/forward cache: the page lives again.
      if (/** @type {any} */ (event).persisted) this.#pageRestored();
    });
    const online = () => this.#act(() => this.#networkChanged(true));
    const offline = () => this.#act(() => this.#networkChanged(false));
    document?.addEventListener("visibilitychange", visibility);
    page?.addEventListener("pagehide", pagehide);
    page?.addEventListener("pageshow", pageshow);
    page?.addEventListener("online", online);
    page?.addEventListener("offline", offline);
    this.#detachPage = () => {
      document?.removeEventListener("visibilitychange", visibility);
      page?.removeEventListener("pagehide", pagehide);
      page?.removeEventListener("pageshow", pageshow);
      page?.removeEventListener("online", online);
      page?.removeEventListener("offline", offline);
    };
  }

  #detachPageListeners() {
    this.#detachPage?.();
    this.#detachPage = null;
  }

  /** Hidden: away at once; with the offline policy, no session once hidden for long enough. */
  #pageHidden() {
    this.#lifecycle.didEnterBackground();
    if (this.#policy.kind === "offline" && this.#policy.afterSeconds <= 0) {
      this.#suspend();
      return;
    }
    this.#statusChanged();
    if (this.#policy.kind === "offline" && this.#suspendTimer === null) {
      this.#suspendTimer = this.#clock.setTimeout(() => this.#act(() => {
        this.#suspendTimer = null;
        this.#suspend();
      }), this.#policy.afterSeconds * 1000);
    }
  }

  /** Visible: the chosen status, and a session now if there was none. */
  #pageVisible() {
    this.#clearSuspendTimer();
    this.#lifecycle.didBecomeActive();
    this.#backoffReset();
    this.#statusChanged();
    if (this.#chat.onScreen !== null) this.#markRead(this.#chat.onScreen);
    // A tab closed since, with messages unsent, left them under its slot.
    this.#adoptOrphans();
  }

  /** Hidden past the offline policy's time: offline at once (1000); visible reconnects. */
  #suspend() {
    this.#lifecycle.suspend();
    if (this.#lifecycle.phase !== "suspended") return;
    this.#log("info", "hidden past the background policy: offline");
    for (const send of this.#debouncer.stopAll()) this.#sendTyping(send);
    this.#emit(this.#cache.clearTyping());
    const session = this.#session;
    if (session) this.#closeSession(session, CloseCode.normal);
    this.#advance();
  }

  /** `pagehide`: offline at once. The page may not run again, so nothing waits for the close. */
  #pageUnloaded() {
    this.#clearSuspendTimer();
    this.#lifecycle.unload();
    for (const send of this.#debouncer.stopAll()) this.#sendTyping(send);
    const session = this.#session;
    if (session) {
      this.#closeSession(session, CloseCode.normal);
      this.#sessionEnded(session, CloseCode.normal, false);
    }
    this.#advance();
  }

  #pageRestored() {
    this.#lifecycle.resume(false);
    this.#backoffReset();
    if (this.#isHidden()) this.#pageHidden();
    this.#statusChanged();
  }

  /**
   * The network went away or came back. Going away ends the session without a close code, so
   * the device lingers on the gateway and a quick return shows no offline (browsers may not
   * send 1001); coming back reconnects now.
   * @param {boolean} available
   */
  #networkChanged(available) {
    this.#lifecycle.networkChanged(available);
    if (available) {
      this.#backoffReset();
    } else if (this.#session) {
      this.#closeSession(this.#session, null);
    }
    this.#advance();
  }

  #clearSuspendTimer() {
    if (this.#suspendTimer !== null) this.#clock.clearTimeout(this.#suspendTimer);
    this.#suspendTimer = null;
  }

  /** The backoff starts again, and a wait for the next attempt is cut short. */
  #backoffReset() {
    this.#backoff.reset();
    if (this.#waitTimer !== null) {
      this.#clock.clearTimeout(this.#waitTimer);
      this.#waitTimer = null;
    }
  }

  #statusChanged() {
    if (this.#lifecycle.desiredStatus === "offline") {
      for (const send of this.#debouncer.stopAll()) this.#sendTyping(send);
      this.#emit(this.#cache.clearTyping());
    }
    this.#sendOwedStatus();
    this.#advance();
  }

  /**
   * Typing stops, then a close with `code`; resolves when the session has ended.
   * @param {number} code
   * @returns {Promise<void>}
   */
  #closeCleanly(code) {
    for (const send of this.#debouncer.stopAll()) this.#sendTyping(send);
    const session = this.#session;
    /** @type {Promise<void>} */
    let ended = Promise.resolve();
    if (session) {
      ended = new Promise((resolve) => session.endWaiters.push(resolve));
      this.#closeSession(session, code);
    }
    this.#advance();
    return ended;
  }

  // MARK: Connecting

  /** Decides what comes next when no session or token request is under way. */
  #advance() {
    if (this.#session || this.#tokenPending) return;
    if (this.#lifecycle.stopReason) {
      this.#cancelWait();
      this.#releaseSlot();
      this.#setState({ state: "stopped", reason: this.#lifecycle.stopReason });
      return;
    }
    if (!this.#started || !this.#lifecycle.shouldConnect) {
      this.#cancelWait();
      this.#setState({ state: "idle" });
      return;
    }
    // No device id before the tab's slot is held: its arrival advances.
    if (this.#deviceId === null) return;
    if (this.#waitTimer !== null) return;
    this.#connect();
  }

  #cancelWait() {
    if (this.#waitTimer !== null) this.#clock.clearTimeout(this.#waitTimer);
    this.#waitTimer = null;
  }

  /** @param {number} delay seconds before the next attempt */
  #pause(delay) {
    const retryAt = this.#clock.now() + delay * 1000;
    this.#setState({ state: "waiting", retryAt: new Date(retryAt) });
    this.#waitTimer = this.#clock.setTimeout(() => this.#act(() => {
      this.#waitTimer = null;
      this.#advance();
    }), delay * 1000);
  }

  #connect() {
    this.#setState({ state: "connecting" });
    this.#tokenPending = true;
    const refresh = this.#needsNewToken;
    Promise.resolve()
      .then(() => this.#tokenProvider(refresh))
      .then(
        (token) => this.#act(() => this.#tokenArrived(token)),
        (error) => this.#act(() => this.#tokenFailed(error)),
      );
  }

  /** @param {unknown} token */
  #tokenArrived(token) {
    this.#tokenPending = false;
    if (typeof token !== "string" || token === "") {
      this.#tokenFailed(new Error("it returned no token"));
      return;
    }
    this.#needsNewToken = false;
    // The page may have changed its mind while the token was fetched.
    if (!this.#started || !this.#lifecycle.shouldConnect || this.#deviceId === null) {
      this.#advance();
      return;
    }
    this.#openSession(token, this.#deviceId);
  }

  /** @param {unknown} error */
  #tokenFailed(error) {
    this.#tokenPending = false;
    const reason = error instanceof Error ? error.message : String(error);
    this.#log("warn", "the token provider failed", reason);
    this.#emit([{ type: "error", detail: Object.freeze({ code: "unauthorized", message: `the token provider failed: ${reason}` }) }]);
    if (!this.#started || !this.#lifecycle.shouldConnect) {
      this.#advance();
      return;
    }
    this.#pause(this.#backoff.nextDelay(this.#random));
  }

  /**
   * @param {string} token
   * @param {string} deviceId
   */
  #openSession(token, deviceId) {
    const base = this.#urls[this.#urlIndex % this.#urls.length];
    const openedWith = this.#lifecycle.openingStatus;
    const url = sessionURL(base, token, deviceId, openedWith);
    this.#serial += 1;
    /** @type {WebSocket} */
    let socket;
    try {
      socket = new this.#WebSocket(url);
    } catch (error) {
      this.#log("warn", "the WebSocket could not be made", error);
      this.#urlIndex += 1;
      this.#pause(this.#backoff.nextDelay(this.#random));
      return;
    }
    const now = this.#clock.now();
    /** @type {Session} */
    const session = {
      serial: this.#serial, socket, opened: false, awaitingInitialState: true, openedWith,
      openDeadline: now + this.#openTimeout * 1000,
      pending: new Map(), catchUp: new Set(), retries: [], paced: [],
      buckets: {
        frame: new TokenBucket(FRAME_RATE, FRAME_BURST, now),
        subscribe: new TokenBucket(SUBSCRIBE_RATE, SUBSCRIBE_BURST, now),
        sync: new TokenBucket(SYNC_RATE, SYNC_BURST, now),
      },
      syncRetries: new Map(), syncBackoffs: new Map(),
      closing: false, closeTimer: null, endWaiters: [], detach: () => {},
    };
    const onOpen = () => this.#act(() => {
      if (this.#session !== session) return;
      session.opened = true;
      this.#writePaced(session);
    });
    /** @param {MessageEvent} event */
    const onMessage = (event) => this.#act(() => {
      // Binary frames are not the protocol's; the gateway sends none.
      if (typeof event.data === "string") this.#receive(session, event.data);
    });
    /** @param {CloseEvent} event */
    const onClose = (event) => this.#act(() => {
      // 1006: the connection dropped without a close frame (browsers make it up).
      const code = typeof event.code === "number" && event.code !== 1006 && event.code !== 0 ? event.code : null;
      // The browser cannot say why an upgrade failed; a refused token is the likely cause.
      this.#sessionEnded(session, code, !session.opened);
    });
    socket.addEventListener("open", onOpen);
    socket.addEventListener("message", /** @type {EventListener} */ (onMessage));
    socket.addEventListener("close", /** @type {EventListener} */ (onClose));
    session.detach = () => {
      socket.removeEventListener("open", onOpen);
      socket.removeEventListener("message", /** @type {EventListener} */ (onMessage));
      socket.removeEventListener("close", /** @type {EventListener} */ (onClose));
    };
    this.#session = session;
    this.#cache.beginCatchUp();
    this.#log("debug", "connecting", base.href);
  }

  /**
   * Asks the gateway to close (`null`: a close without a code, so the device lingers), and
   * gives the session up if the answer does not come within `closeTimeout`.
   * @param {Session} session
   * @param {number | null} code
   */
  #closeSession(session, code) {
    if (session.closing) return;
    session.closing = true;
    try {
      if (code === null) session.socket.close();
      else session.socket.close(code);
    } catch (error) {
      this.#log("debug", "close failed", error);
    }
    session.closeTimer = this.#clock.setTimeout(() => this.#act(() => this.#sessionEnded(session, null, false)), this.#closeTimeout * 1000);
  }

  /**
   * The session ended: clean up, then reconnect now, after the backoff, or not at all.
   * @param {Session} session
   * @param {number | null} code the gateway's close code, `null` without one
   * @param {boolean} refused the socket never opened
   */
  #sessionEnded(session, code, refused) {
    if (this.#session !== session) return;
    this.#session = null;
    session.detach();
    if (session.closeTimer !== null) this.#clock.clearTimeout(session.closeTimer);
    // An attempt that never became a session leaves the code of the last session as it was.
    if (code !== null || !session.awaitingInitialState) this.#lastCloseCode = code;
    this.#debouncer.forget();
    this.#emit(this.#cache.clearTyping());
    this.#outboxSessionEnded();
    for (const resolve of session.endWaiters) resolve();
    this.#log("info", "session ended", { code, refused });
    const wanted = this.#started && this.#lifecycle.shouldConnect;
    // Nothing answered: no close code and no session (a node down, or gone while it opened).
    const unreachable = code === null && session.awaitingInitialState;
    const after = this.#lifecycle.closed(code, refused, this.#urls.length, unreachable);
    if (!wanted) {
      this.#advance();
      return;
    }
    switch (after.kind) {
      case "stop":
        this.#releaseSlot();
        this.#setState({ state: "stopped", reason: after.reason });
        break;
      case "reconnectNow":
        this.#needsNewToken = after.newToken;
        this.#urlIndex += 1;
        this.#advance();
        break;
      case "reconnectAfterBackoff":
        this.#needsNewToken = after.newToken;
        this.#urlIndex += 1;
        this.#pause(this.#backoff.nextDelay(this.#random));
        break;
    }
  }

  /**
   * Gives a session up without waiting for its socket.
   * @param {Session} session
   */
  #abandon(session) {
    session.detach();
    try {
      session.socket.close();
    } catch {
      // Already closing.
    }
    this.#sessionEnded(session, null, false);
  }

  // MARK: Timers

  /** One timer for the timed work: idle typing, typing indicators, retries, the open deadline. */
  #rescheduleTimers() {
    const session = this.#session;
    const deadlines = [
      this.#debouncer.nextDeadline,
      this.#cache.nextTypingExpiry,
      this.#lifecycle.statusRetryAt,
      session?.awaitingInitialState ? session.openDeadline : null,
      ...(session?.retries.map((retry) => retry.due) ?? []),
      ...(session?.syncRetries.values() ?? []),
      session ? this.#pacedDeadline(session, this.#clock.now()) : null,
      this.#outboxDeadline(this.#clock.now()),
    ].filter((deadline) => deadline !== null);
    const next = deadlines.length > 0 ? Math.min(.../** @type {number[]} */ (deadlines)) : null;
    if (next === this.#timerDeadline) return;
    if (this.#timer !== null) this.#clock.clearTimeout(this.#timer);
    this.#timer = null;
    this.#timerDeadline = next;
    if (next === null) return;
    this.#timer = this.#clock.setTimeout(() => this.#act(() => {
      this.#timer = null;
      this.#timerDeadline = null;
      this.#fireTimers();
    }), Math.max(0, next - this.#clock.now()));
  }

  #fireTimers() {
    const now = this.#clock.now();
    const opening = this.#session;
    if (opening?.awaitingInitialState && opening.openDeadline <= now) {
      this.#log("info", "the session did not open in time; trying again");
      this.#abandon(opening);
    }
    for (const send of this.#debouncer.expire(now)) this.#sendTyping(send);
    this.#emit(this.#cache.expireTyping(now));
    const session = this.#session;
    if (session) {
      // What waited for the budgets goes before what is made now.
      this.#writePaced(session);
      const due = session.retries.filter((retry) => retry.due <= now);
      session.retries = session.retries.filter((retry) => retry.due > now);
      for (const retry of due) {
        const id = this.#send(retry.type, retry.data, retry.request);
        if (id !== null && retry.catchingUp) session.catchUp.add(id);
      }
      this.#syncRetriesDue(session, now);
    }
    this.#sendOwedStatus();
    this.#outboxTimers(now);
  }

  // MARK: Sending

  /**
   * Sends a frame with a fresh id if there is a session; returns the id. It is written now if
   * the socket is open and the session's budgets have room, else as soon as they do.
   * @param {string} type
   * @param {Record<string, unknown>} data keys in sorted order
   * @param {Request} request
   * @param {(() => void) | null} [onWrite] called when the frame is written
   * @returns {string | null}
   */
  #send(type, data, request, onWrite = null) {
    const session = this.#session;
    if (!session) return null;
    this.#nextFrameId += 1;
    const id = `${session.serial}.${this.#nextFrameId}`;
    session.pending.set(id, request);
    const text = frameText(type, data, id);
    const lane = type === "subscribe" || type === "unsubscribe" ? "subscribe" : type === "sync" ? "sync" : "other";
    const bucket = type === "subscribe" ? "subscribe" : type === "sync" ? "sync" : null;
    session.paced.push({ id, text, lane, bucket, request, onWrite });
    this.#writePaced(session);
    return id;
  }

  /**
   * Writes the waiting frames the budgets have room for, oldest first in each lane.
   * @param {Session} session
   */
  #writePaced(session) {
    if (!session.opened || session.paced.length === 0) return;
    const now = this.#clock.now();
    const { buckets } = session;
    /** @type {Set<string>} */
    const held = new Set();
    /** @type {PacedFrame[]} */
    const waiting = [];
    for (const frame of session.paced) {
      if (held.has(frame.lane) || !buckets.frame.ready(now) || (frame.bucket !== null && !buckets[frame.bucket].ready(now))) {
        held.add(frame.lane);
        waiting.push(frame);
        continue;
      }
      buckets.frame.take(now);
      if (frame.bucket !== null) buckets[frame.bucket].take(now);
      try {
        session.socket.send(frame.text);
      } catch (error) {
        this.#log("debug", "a frame could not be written", error);
      }
      frame.onWrite?.();
    }
    session.paced = waiting;
  }

  /**
   * When (ms) the budgets have room for a waiting frame, or `null`.
   * @param {Session} session
   * @param {number} now
   */
  #pacedDeadline(session, now) {
    if (!session.opened) return null;
    let next = null;
    /** @type {Set<string>} */
    const lanes = new Set();
    for (const frame of session.paced) {
      if (lanes.has(frame.lane)) continue;
      lanes.add(frame.lane);
      let at = session.buckets.frame.readyAt(now);
      if (frame.bucket !== null) at = Math.max(at, session.buckets[frame.bucket].readyAt(now));
      if (next === null || at < next) next = at;
    }
    return next;
  }

  /** @param {TypingSend} typing */
  #sendTyping(typing) {
    this.#send("typing", { conversation_id: typing.conversationId, is_typing: typing.isTyping }, { kind: "typing" });
  }

  #sendOwedStatus() {
    if (!this.#session || this.#session.awaitingInitialState) return;
    const status = this.#lifecycle.statusToSend(this.#clock.now());
    if (status) this.#send("status", { status }, { kind: "status" });
  }

  /**
   * @param {string[]} users
   * @param {boolean} catchingUp
   */
  #subscribeUsers(users, catchingUp) {
    const sorted = [...users].sort();
    for (let start = 0; start < sorted.length; start += SUBSCRIBE_CHUNK) {
      const chunk = sorted.slice(start, start + SUBSCRIBE_CHUNK);
      const id = this.#send("subscribe", { user_ids: chunk }, { kind: "users", users: chunk });
      if (id !== null && catchingUp) this.#session?.catchUp.add(id);
    }
  }

  /**
   * @param {string} conversationId
   * @param {boolean} catchingUp
   */
  #subscribeConversation(conversationId, catchingUp) {
    const id = this.#send("subscribe", { conversation_id: conversationId }, { kind: "conversation", conversationId });
    if (id !== null && catchingUp) this.#session?.catchUp.add(id);
  }

  /**
   * Drops a conversation's `subscribe` that was not written yet (waiting for the budget, or to be
   * sent again after a refusal); returns whether there was one.
   * @param {string} conversationId
   */
  #unqueueSubscribe(conversationId) {
    const session = this.#session;
    if (!session) return false;
    /** @param {Request} request */
    const isIt = (request) => request.kind === "conversation" && request.conversationId === conversationId;
    const queued = session.paced.filter((frame) => isIt(frame.request));
    const refused = session.retries.filter((retry) => isIt(retry.request));
    if (queued.length === 0 && refused.length === 0) return false;
    session.paced = session.paced.filter((frame) => !isIt(frame.request));
    session.retries = session.retries.filter((retry) => !isIt(retry.request));
    for (const frame of queued) {
      session.pending.delete(frame.id);
      session.catchUp.delete(frame.id);
    }
    this.#answered(null);
    return true;
  }

  // MARK: Tab slots

  /**
   * Claims the tab's slot: the first that no other tab of the browser holds, each asked with
   * `ifAvailable` (a held one answers `null` at once); with every slot held, it waits for slot
   * 1. Once per client; the slot is held until the tab goes away, `signOut()`, or a stop for good.
   */
  #claimSlot() {
    const slots = this.#slots;
    if (slots === null || slots.held !== null || slots.claiming || this.#lifecycle.stopReason) return;
    slots.claiming = true;
    this.#requestSlot(slots, 1);
  }

  /**
   * Asks for `slot`, or, past the last one, waits for slot 1.
   * @param {TabSlots} slots
   * @param {number} slot
   */
  #requestSlot(slots, slot) {
    const waits = slot > MAX_TABS;
    const asked = waits ? 1 : slot;
    if (waits) this.#log("info", `all ${MAX_TABS} tab slots are held: waiting for slot 1`);
    let granted = false;
    Promise.resolve()
      .then(() => slots.locks.request(slotLockName(this.#storedDeviceId, asked), waits ? {} : { ifAvailable: true }, (lock) => this.#act(() => {
        if (lock === null) {
          this.#requestSlot(slots, slot + 1);
          return undefined;
        }
        granted = true;
        return this.#slotGranted(slots, asked);
      })))
      .catch((error) => this.#act(() => {
        if (granted) {
          // Taken from this tab (another page asked with `steal`): nothing to do but say so.
          this.#log("warn", "the lock of this tab's slot was lost", error);
        } else {
          this.#slotsRefused(slots, error);
        }
      }));
  }

  /**
   * This tab holds `slot`. Returns the promise the lock is held by, pending until the slot is
   * let go; nothing (the lock goes at once) for a client stopped for good meanwhile.
   * @param {TabSlots} slots
   * @param {number} slot
   * @returns {Promise<void> | undefined}
   */
  #slotGranted(slots, slot) {
    slots.claiming = false;
    if (this.#lifecycle.stopReason) return undefined;
    /** @type {() => void} */
    let release = () => {};
    /** @type {Promise<void>} */
    const holding = new Promise((resolve) => { release = resolve; });
    slots.held = { slot, release };
    this.#log("info", "tab slot", slot);
    this.#deviceKnown(slotDeviceId(this.#storedDeviceId, slot));
    return holding;
  }

  /**
   * The Web Locks refused the request (an opaque origin, say): no slots, as with `locks: null`.
   * @param {TabSlots} slots
   * @param {unknown} error
   */
  #slotsRefused(slots, error) {
    this.#log("warn", "the Web Locks refused a tab slot: going on with the stored device id", error);
    slots.claiming = false;
    this.#slots = null;
    if (!this.#lifecycle.stopReason) this.#deviceKnown(this.#storedDeviceId);
  }

  /**
   * The device id is known: its outbox store is made (unless the app gave one) and read, and
   * the session may open.
   * @param {string} deviceId
   */
  #deviceKnown(deviceId) {
    this.#deviceId = deviceId;
    if (this.#outboxStore === null) this.#outboxStore = defaultOutboxStore(deviceId);
    this.#loadOutbox();
    this.#advance();
  }

  /**
   * Lets the tab's slot go (signed out, or stopped for good) once the outbox saves under way are
   * written, so that the next tab to hold it reads the outbox whole; nothing is saved after.
   */
  #releaseSlot() {
    const slots = this.#slots;
    const held = slots?.held;
    if (!slots || !held) return;
    slots.held = null;
    this.#deviceId = null;
    if (!this.#outboxGiven) this.#outboxStore = null;
    this.#chat.saving.then(held.release);
  }

  /**
   * Adopts the outboxes that closed tabs left: for each other slot no tab holds, while holding
   * its lock, the messages of its outbox that this client never had join this outbox; once this
   * outbox is saved with them, that one is saved empty. Saved here before emptied there: a crash between
   * the two can only send a message twice, and the gateway takes the second as a duplicate (same
   * `client_message_id`, same user and conversation). Only the IndexedDB stores the client
   * makes are read: an app's own `outboxStore` is one store, whatever the tab.
   */
  #adoptOrphans() {
    const slots = this.#slots;
    if (slots === null || slots.held === null || !this.#chat.loaded || this.#outboxGiven || !globalThis.indexedDB) return;
    if (slots.adopting) {
      // A pass under way may have gone by a slot whose tab closed since: another pass after it.
      slots.adoptAgain = true;
      return;
    }
    slots.adopting = true;
    const mine = slots.held.slot;
    const adoptAll = async () => {
      // One slot at a time, and no further once this tab's slot is let go.
      for (let slot = 1; slot <= MAX_TABS && slots.held?.slot === mine; slot += 1) {
        if (slot !== mine) await this.#adoptSlot(slots, slot);
      }
    };
    adoptAll().finally(() => this.#act(() => {
      slots.adopting = false;
      if (!slots.adoptAgain) return;
      slots.adoptAgain = false;
      this.#adoptOrphans();
    }));
  }

  /**
   * Adopts the outbox of `slot` if no tab holds the slot.
   * @param {TabSlots} slots
   * @param {number} slot
   */
  async #adoptSlot(slots, slot) {
    try {
      await slots.locks.request(slotLockName(this.#storedDeviceId, slot), { ifAvailable: true }, async (lock) => {
        // Held: a live tab's, or another tab is adopting it.
        if (lock === null || slots.held === null) return;
        const store = new IndexedDBOutboxStore(slotDeviceId(this.#storedDeviceId, slot));
        const orphaned = await store.load();
        if (orphaned.length === 0) return;
        const saved = this.#act(() => this.#adopt(orphaned, slot));
        // Not saved here (the write failed, or this tab let its slot go): left there, for later.
        if (await saved) await store.save([]);
      });
    } catch (error) {
      this.#log("warn", `the outbox of tab slot ${slot} could not be adopted`, error);
    }
  }

  /**
   * A closed tab's messages join the outbox's end, announced and sent like restored ones; not
   * those this client has had in its outbox already (there still, or sent since: a pass that
   * stopped between saving here and emptying there left them there too). Resolves to whether
   * the outbox was saved with them.
   * @param {ChatMessage[]} orphaned
   * @param {number} slot
   * @returns {Promise<boolean>}
   */
  #adopt(orphaned, slot) {
    if (!this.#slots?.held) return Promise.resolve(false);
    /** @type {Outgoing[]} */
    const adopted = [];
    for (const message of orphaned) {
      if (this.#chat.written.has(message.clientMessageId)) continue;
      adopted.push({ message, attempts: 0, frameId: null, deadline: null, due: null });
      this.#chat.written.add(message.clientMessageId);
      if (!this.#chat.logs.has(message.conversationId)) this.#chat.logs.set(message.conversationId, newLog());
    }
    this.#chat.outbox.push(...adopted);
    if (adopted.length > 0) {
      this.#log("info", `adopted ${adopted.length} unsent messages of tab slot ${slot}`);
      this.#emit(adopted.map((entry) => ({ type: "message", detail: entry.message })));
    }
    const saved = this.#saveOutbox();
    this.#sendOutbox();
    return saved;
  }

  // MARK: The outbox

  /** Reads the store's outbox once; messages written before it came go after the saved ones. */
  #loadOutbox() {
    const store = this.#outboxStore;
    // With tab slots, the store is known once the slot is held: that reads it.
    if (store === null || this.#chat.loaded || this.#chat.loading) return;
    this.#chat.loading = true;
    Promise.resolve()
      .then(() => store.load())
      .then(
        (saved) => this.#act(() => this.#outboxLoaded(Array.isArray(saved) ? saved : [])),
        (error) => this.#act(() => {
          this.#log("warn", "the outbox store could not be read; starting with an empty outbox", error);
          this.#outboxLoaded([]);
        }),
      );
  }

  /** @param {ChatMessage[]} saved */
  #outboxLoaded(saved) {
    const known = new Set(this.#chat.outbox.map((entry) => entry.message.clientMessageId));
    const writtenBefore = this.#chat.outbox.length > 0;
    const restored = saved.filter((message) => !known.has(message.clientMessageId))
      .map((message) => ({ message, attempts: 0, frameId: null, deadline: null, due: null }));
    this.#chat.outbox = [...restored, ...this.#chat.outbox];
    for (const message of saved) {
      this.#chat.written.add(message.clientMessageId);
      if (!this.#chat.logs.has(message.conversationId)) this.#chat.logs.set(message.conversationId, newLog());
    }
    this.#chat.loading = false;
    this.#chat.loaded = true;
    if (restored.length > 0) {
      this.#log("info", "outbox restored", restored.length);
      this.#emit(restored.map((entry) => ({ type: "message", detail: entry.message })));
    }
    // Messages written before the read were not saved (that would have replaced the store's
    // outbox): saved with it now.
    if (writtenBefore) this.#saveOutbox();
    const session = this.#session;
    if (session && !session.awaitingInitialState) this.#messagesSessionOpened();
    this.#adoptOrphans();
  }

  /**
   * Saves the outbox, after the saves before it; not before the store's outbox was read, nor
   * once the tab's slot is let go. Resolves to whether this save was written.
   * @returns {Promise<boolean>}
   */
  #saveOutbox() {
    const store = this.#outboxStore;
    if (!this.#chat.loaded || store === null) return Promise.resolve(false);
    const snapshot = this.#chat.outbox.map((entry) => entry.message);
    const saved = this.#chat.saving
      .then(() => store.save(snapshot))
      .then(() => true, (error) => {
        this.#log("warn", "the outbox could not be saved", error);
        return false;
      });
    this.#chat.saving = saved.then(() => undefined);
    return saved;
  }

  /**
   * Sends what is due: per conversation, its oldest `sending` message, unless another of the
   * conversation is under way (so a conversation's messages are stored in the outbox's order).
   * Nothing without an open session, or before the outbox is read.
   */
  #sendOutbox() {
    const session = this.#session;
    if (!session || session.awaitingInitialState || !this.#chat.loaded) return;
    const now = this.#clock.now();
    const busy = new Set(this.#chat.outbox.filter((entry) => entry.frameId !== null).map((entry) => entry.message.conversationId));
    for (const entry of this.#chat.outbox) {
      const { message } = entry;
      if (message.status !== "sending" || entry.frameId !== null || busy.has(message.conversationId)) continue;
      busy.add(message.conversationId);
      if (entry.due !== null && entry.due > now) continue;
      /** @type {Record<string, unknown>} */
      const data = {
        client_created_at: formatTimestamp(message.createdAt), client_message_id: message.clientMessageId,
        conversation_id: message.conversationId,
      };
      if (message.imageUrl !== null) data.image_url = message.imageUrl;
      data.text = message.text;
      data.type = message.type;
      // The wait for the answer starts when the frame is written, not while it waits for the frame budget.
      entry.deadline = null;
      /** @type {string | null} */
      let id = null;
      id = this.#send("send", data, { kind: "message", clientMessageId: message.clientMessageId }, () => {
        // Written at once (its id not returned yet), or later and still this attempt.
        if (id === null || entry.frameId === id) entry.deadline = this.#clock.now() + ACK_TIMEOUT * 1000;
      });
      entry.frameId = id;
    }
  }

  /**
   * The earliest moment after `now` an outbox message needs attention: an attempt's answer is
   * overdue, or a wait before the next attempt ends.
   * @param {number} now
   */
  #outboxDeadline(now) {
    const deadlines = this.#chat.outbox.flatMap((entry) => {
      if (entry.frameId !== null) return entry.deadline === null ? [] : [entry.deadline];
      return entry.message.status === "sending" && entry.due !== null && entry.due > now ? [entry.due] : [];
    });
    return deadlines.length > 0 ? Math.min(...deadlines) : null;
  }

  /**
   * Attempts that went unanswered count as failed ones; then what is due goes.
   * @param {number} now
   */
  #outboxTimers(now) {
    for (const entry of this.#chat.outbox) {
      if (entry.frameId === null || entry.deadline === null || entry.deadline > now) continue;
      this.#session?.pending.delete(entry.frameId);
      this.#attemptFailed(entry, `no answer within ${ACK_TIMEOUT} s`);
    }
    this.#sendOutbox();
  }

  /** The session ended: attempts under way used nothing up, and go again on the next one. */
  #outboxSessionEnded() {
    for (const entry of this.#chat.outbox) {
      entry.frameId = null;
      entry.deadline = null;
      entry.due = null;
    }
    // Syncs under way, and those waiting to go again, end with the session: the next one syncs anyway.
    this.#chat.syncing.clear();
    // What was said on the ended session may not have arrived: said again on the next.
    for (const log of this.#chat.logs.values()) {
      log.deliveredSent = 0;
      log.readSent = 0;
      log.stuckAt = null;
    }
  }

  /**
   * The gateway refused an attempt.
   * @param {string} clientMessageId
   * @param {string} code
   * @param {string} reason
   */
  #messageRefused(clientMessageId, code, reason) {
    const entry = this.#chat.outbox.find((candidate) => candidate.message.clientMessageId === clientMessageId);
    if (!entry) return;
    entry.frameId = null;
    entry.deadline = null;
    if (code === "rate_limited") {
      // Costs no attempt: it waits and goes again.
      entry.due = this.#clock.now() + this.#retryDelay * 1000;
    } else if (FINAL_REFUSALS.includes(code)) {
      this.#fail(entry, `${code}: ${reason}`);
    } else {
      this.#attemptFailed(entry, `${code}: ${reason}`);
    }
    this.#sendOutbox();
  }

  /**
   * @param {Outgoing} entry
   * @param {string} reason
   */
  #attemptFailed(entry, reason) {
    entry.frameId = null;
    entry.deadline = null;
    entry.attempts += 1;
    if (entry.attempts >= MESSAGE_ATTEMPTS) {
      this.#fail(entry, reason);
      return;
    }
    entry.due = this.#clock.now() + ATTEMPT_DELAYS[Math.min(entry.attempts, ATTEMPT_DELAYS.length) - 1] * 1000;
    this.#log("info", "a message attempt failed; trying again", entry.message.clientMessageId, reason);
  }

  /**
   * @param {Outgoing} entry
   * @param {string} reason
   */
  #fail(entry, reason) {
    entry.message = changed(entry.message, { status: "failed", failure: reason });
    entry.due = null;
    this.#log("warn", "a message failed; it stays in the outbox for retry()", entry.message.clientMessageId, reason);
    this.#messageStatusChanged(entry.message);
    this.#saveOutbox();
  }

  /** @param {ChatMessage} message */
  #messageStatusChanged(message) {
    this.#emit([{
      type: "messagestatus",
      detail: Object.freeze({ conversationId: message.conversationId, clientMessageId: message.clientMessageId, status: message.status, failure: message.failure }),
    }]);
  }

  // MARK: Sync and receipts

  /**
   * The session opened: every conversation this device knows is synced at once (from its last
   * seq and epoch, or from the start of what the gateway keeps), then the outbox goes out. Each
   * conversation's `synced` says its cursors.
   */
  #messagesSessionOpened() {
    const conversations = [...new Set([...this.#chat.logs.keys(), ...this.#joined])].sort();
    this.#sync(conversations.map((conversationId) => this.#position(conversationId)));
    this.#sendOutbox();
  }

  /**
   * Where a conversation's next `sync` starts: its last seq and epoch, or the start.
   * @param {string} conversationId
   * @returns {SyncPosition}
   */
  #position(conversationId) {
    const log = this.#chat.logs.get(conversationId);
    return { conversationId, afterSeq: log?.lastSeq ?? 0, epoch: log?.epoch ?? null };
  }

  /** @param {SyncPosition[]} positions */
  #sync(positions) {
    // Nothing to sync: the empty `sync` ends the session's opening hold of live messages.
    if (positions.length === 0) this.#send("sync", { positions: [] }, { kind: "other" });
    for (let start = 0; start < positions.length; start += SYNC_CHUNK) {
      const chunk = positions.slice(start, start + SYNC_CHUNK);
      for (const position of chunk) this.#chat.syncing.add(position.conversationId);
      this.#send("sync", {
        positions: chunk.map((position) => (position.epoch === null
          ? { after_seq: position.afterSeq, conversation_id: position.conversationId }
          : { after_seq: position.afterSeq, conversation_id: position.conversationId, epoch: position.epoch })),
      }, { kind: "sync", waiting: new Set(chunk.map((position) => position.conversationId)) });
    }
  }

  /**
   * A position of a `sync` was answered, by its `synced` or by an `error` naming it; the frame's
   * request is done once every position is.
   * @param {string | null} id
   * @param {string} conversationId
   */
  #syncAnswered(id, conversationId) {
    const session = this.#session;
    const request = id === null ? undefined : session?.pending.get(id);
    if (!session || id === null || request?.kind !== "sync") return;
    request.waiting.delete(conversationId);
    if (request.waiting.size === 0) session.pending.delete(id);
  }

  /**
   * The gateway refused or failed a `sync`: the whole frame (`conversationId` null: every
   * position not answered yet) or one position. What may succeed later (`rate_limited`,
   * `unavailable`, `internal`) goes again after a wait; a position refused for good (not a
   * member, no such conversation) is not synced again.
   * @param {string} id
   * @param {Extract<Request, { kind: "sync" }>} request
   * @param {string} code
   * @param {string} message
   * @param {string | null} conversationId
   * @param {number | null} retryAfter
   */
  #syncFailed(id, request, code, message, conversationId, retryAfter) {
    const conversations = conversationId === null ? [...request.waiting].sort() : [conversationId];
    for (const conversation of conversations) this.#syncAnswered(id, conversation);
    if (SYNC_RETRIED.includes(code)) {
      this.#log("info", "a sync was refused; it goes again", code, message, conversations);
      for (const conversation of conversations) this.#retrySync(conversation, retryAfter);
      return;
    }
    for (const conversation of conversations) {
      if (conversationId !== null) this.#syncRefused(conversation);
      else this.#chat.syncing.delete(conversation);
    }
    this.#emit([{ type: "error", detail: Object.freeze({ code, message }) }]);
  }

  /**
   * Sends a conversation's `sync` again after a wait: the gateway's `retry_after` where it gave
   * one (never before it, and spread up to a fifth after it, so that clients refused together
   * do not come back together), else the backoff, which grows with each failure of this session.
   * Until then the conversation counts as syncing, so live messages start no other sync.
   * @param {string} conversationId
   * @param {number | null} retryAfter seconds
   */
  #retrySync(conversationId, retryAfter) {
    const session = this.#session;
    if (!session) return;
    let backoff = session.syncBackoffs.get(conversationId);
    if (!backoff) {
      backoff = new ReconnectBackoff(SYNC_BACKOFF);
      session.syncBackoffs.set(conversationId, backoff);
    }
    const delay = backoff.nextDelay(this.#random);
    const wait = retryAfter === null ? delay : retryAfter * (1 + SYNC_BACKOFF.jitter * this.#random());
    this.#chat.syncing.add(conversationId);
    session.syncRetries.set(conversationId, this.#clock.now() + wait * 1000);
  }

  /**
   * Sends the `sync`s whose wait is over, from where each conversation is now (live messages may
   * have moved it meanwhile), together.
   * @param {Session} session
   * @param {number} now
   */
  #syncRetriesDue(session, now) {
    const due = [...session.syncRetries].filter(([, at]) => at <= now).map(([conversationId]) => conversationId).sort();
    if (due.length === 0) return;
    for (const conversationId of due) session.syncRetries.delete(conversationId);
    this.#sync(due.map((conversationId) => this.#position(conversationId)));
  }

  /**
   * @param {string} conversationId
   * @param {string} clientMessageId
   * @param {number} seq
   * @param {string} messageId
   * @param {string | null} epoch
   */
  #acknowledged(conversationId, clientMessageId, seq, messageId, epoch) {
    const index = this.#chat.outbox.findIndex((entry) => entry.message.clientMessageId === clientMessageId);
    if (index < 0) return;
    const [entry] = this.#chat.outbox.splice(index, 1);
    // A gateway too old to say the epoch: the conversation's as known here.
    const stored = { seq, id: messageId, epoch: epoch ?? this.#chat.logs.get(conversationId)?.epoch ?? null };
    const message = changed(entry.message, { ...stored, status: "sent", failure: null });
    this.#saveOutbox();
    this.#place(message);
    this.#messageStatusChanged(message);
    this.#refreshStatuses(conversationId);
    this.#sendOutbox();
  }

  /** @param {ChatMessage} received */
  #receivedMessage(received) {
    const conversationId = received.conversationId;
    if (this.#chat.written.has(received.clientMessageId)) this.#chat.ownUserId = received.senderId;
    const own = received.senderId === this.#chat.ownUserId;
    const isNew = !this.#chat.logs.has(conversationId);
    const log = this.#logOf(conversationId);
    if (log.epoch === null && received.epoch !== null) this.#adoptEpoch(log, received.epoch);
    // A gateway too old to say the epoch: the message is of the history as known here.
    const epoch = received.epoch ?? log.epoch;
    const seq = /** @type {number} */ (received.seq);
    // A session gets an epoch's messages in seq order, and is told of every gap: a seq past the
    // next one means something was skipped. It is kept (messages() stays in seq order), but the
    // last seq stays before the gap.
    const gap = epoch === log.epoch && seq > log.lastSeq + 1;
    let message = changed(received, { epoch, status: own ? "sent" : this.#isReadHere(conversationId) ? "read" : "delivered" });
    // The gateway's copy of a message this device wrote may come before its ack.
    const index = own ? this.#chat.outbox.findIndex((entry) => entry.message.clientMessageId === received.clientMessageId) : -1;
    if (index >= 0) {
      const [entry] = this.#chat.outbox.splice(index, 1);
      message = changed(message, { createdAt: entry.message.createdAt });
      this.#saveOutbox();
      this.#place(message);
      this.#messageStatusChanged(message);
    } else if (this.#place(message)) {
      this.#emit([{ type: "message", detail: message }]);
    }
    if (this.#isReadHere(conversationId)) log.readUpTo = log.lastSeq;
    this.#refreshStatuses(conversationId);
    if (this.#chat.syncing.has(conversationId)) {
      // The sync under way answers for it (a conversation joined but not heard of yet included).
    } else if (isNew) {
      // First heard of here: what came before, and every member's cursors.
      this.#sync([{ conversationId, afterSeq: 0, epoch: null }]);
    } else if (epoch !== log.epoch) {
      // Another epoch: Redis lost the history, or went back in time. A sync from where this
      // device is (not from nothing) says which, and what of its history carried over.
      this.#sync([this.#position(conversationId)]);
    } else if (gap && log.stuckAt !== log.lastSeq) {
      // The sync from the last seq gives the gap, or names it in `missing`.
      this.#sync([this.#position(conversationId)]);
    } else {
      this.#sendCursors(conversationId);
    }
    this.#sendOutbox();
  }

  /**
   * @param {string | null} id
   * @param {Extract<ServerMessage, { type: "synced" }>} synced
   */
  #synced(id, synced) {
    const conversationId = synced.conversationId;
    this.#syncAnswered(id, conversationId);
    this.#session?.syncBackoffs.delete(conversationId);
    this.#session?.syncRetries.delete(conversationId);
    this.#chat.syncing.delete(conversationId);
    const log = this.#logOf(conversationId);
    if (log.epoch !== synced.epoch) this.#epochChanged(log, synced);
    for (const range of synced.missing) {
      this.#emit([{ type: "messagegap", detail: Object.freeze({ conversationId, epoch: range.epoch, fromSeq: range.fromSeq, toSeq: range.toSeq }) }]);
      // What Redis cannot give of this epoch no longer holds the last seq (and `delivered`) back.
      if (range.toSeq !== null && (range.epoch ?? synced.epoch) === synced.epoch && range.toSeq > log.lastSeq) {
        log.named.push({ fromSeq: range.fromSeq, toSeq: range.toSeq });
      }
    }
    if (synced.receipts) {
      for (const receipt of synced.receipts) this.#mergeReceipt(log, receipt);
      log.receiptsComplete = true;
    }
    this.#advanceLastSeq(log);
    // A complete answer can leave a gap only where this session was sent seqs this device does
    // not hold (a frame that did not read): the gateway counts them as given and never sends a
    // seq twice on a session, so asking again would be answered the same. The next session's
    // sync starts from here and gets them.
    log.stuckAt = !synced.more && log.lastSeq < synced.lastSeq ? log.lastSeq : null;
    if (this.#isReadHere(conversationId)) log.readUpTo = log.lastSeq;
    this.#refreshStatuses(conversationId);
    if (synced.more) this.#sync([this.#position(conversationId)]);
    else this.#sendCursors(conversationId);
    this.#sendOutbox();
  }

  /**
   * A conversation's log, made if it has none.
   * @param {string} conversationId
   * @returns {ConversationLog}
   */
  #logOf(conversationId) {
    let log = this.#chat.logs.get(conversationId);
    if (!log) {
      log = newLog();
      this.#chat.logs.set(conversationId, log);
    }
    return log;
  }

  /**
   * Moves the last seq over what follows it that is held here or was named as missing.
   * @param {ConversationLog} log
   */
  #advanceLastSeq(log) {
    for (;;) {
      const next = log.lastSeq + 1;
      if (log.above.delete(next)) {
        log.lastSeq = next;
        continue;
      }
      const range = log.named.find((candidate) => candidate.fromSeq <= next && next <= candidate.toSeq);
      if (!range) break;
      log.lastSeq = range.toSeq;
    }
    log.named = log.named.filter((range) => range.toSeq > log.lastSeq);
    for (const seq of log.above) if (seq <= log.lastSeq) log.above.delete(seq);
  }

  /**
   * The seqs of the log's epoch held above its last seq.
   * @param {ConversationLog} log
   */
  #heldAbove(log) {
    return new Set(log.messages.filter((message) => message.epoch === log.epoch && message.seq !== null && message.seq > log.lastSeq)
      .map((message) => /** @type {number} */ (message.seq)));
  }

  /**
   * A `synced` in an epoch other than the one this device knows of the conversation.
   * @param {ConversationLog} log
   * @param {Extract<ServerMessage, { type: "synced" }>} synced
   */
  #epochChanged(log, synced) {
    const old = log.epoch;
    if (old === null) {
      this.#adoptEpoch(log, synced.epoch);
    } else if (synced.missing.some((range) => (range.epoch ?? old) === old && range.toSeq === null)) {
      // `missing` names the rest of this device's epoch, with no end: it was lost as a whole.
      this.#epochLost(log, synced.epoch);
    } else {
      // Not lost: the new epoch forked from it (directly or through earlier forks).
      this.#epochForked(log, synced.conversationId, synced.epoch, synced.truncated.filter((range) => (range.epoch ?? old) === old));
    }
  }

  /**
   * The first epoch heard of a conversation.
   * @param {ConversationLog} log
   * @param {string} epoch
   */
  #adoptEpoch(log, epoch) {
    log.epoch = epoch;
    // Messages stored while it was not known (a gateway too old to say) are of it.
    log.messages = log.messages.map((message) => (message.epoch === null && message.seq !== null ? changed(message, { epoch }) : message));
    log.above = this.#heldAbove(log);
    this.#advanceLastSeq(log);
  }

  /**
   * The history this device knew is gone (lost, expired, or the conversation made again): seqs
   * start again from 1 and every cursor from 0, as docs/API.md says, so the members' cursors
   * heard of it are forgotten (they would mark the new history's messages delivered or read).
   * Its messages stay in messages() with their epoch, and their statuses as they were.
   * @param {ConversationLog} log
   * @param {string} epoch
   */
  #epochLost(log, epoch) {
    log.epoch = epoch;
    log.lastSeq = 0;
    log.named = [];
    log.stuckAt = null;
    log.receipts = new Map();
    log.receiptsComplete = false;
    log.deliveredSent = 0;
    log.readSent = 0;
    log.readUpTo = 0;
    log.above = this.#heldAbove(log);
  }

  /**
   * The history forked (Redis went back in time): what is at or below the fork point carried
   * over unchanged and is the new epoch's now (same seqs and ids), and so are the cursors up to
   * it. What this device holds above it Redis lost: `truncated` names it, from the fork point + 1.
   * Without `truncated`, the position synced was at or below the fork point and everything
   * carried over, unless the new epoch gives a seq held here to another message.
   * @param {ConversationLog} log
   * @param {string} conversationId
   * @param {string} epoch
   * @param {SeqRange[]} truncated
   */
  #epochForked(log, conversationId, epoch, truncated) {
    const old = /** @type {string} */ (log.epoch);
    const forkPoint = truncated.length > 0 ? Math.min(...truncated.map((range) => range.fromSeq)) - 1 : null;
    // The new epoch's messages this sync gave already (they came before its `synced`).
    const given = new Map(log.messages.filter((message) => message.epoch === epoch).map((message) => [message.seq, message.id]));
    /** @type {ChatMessage[]} */
    const lost = [];
    /** @type {ChatMessage[]} */
    const current = [];
    /** @type {ChatMessage[]} */
    const earlier = [];
    for (const message of log.messages) {
      if (message.epoch === epoch) {
        current.push(message);
      } else if (message.epoch !== old || message.seq === null) {
        earlier.push(message);
      } else if ((forkPoint !== null && message.seq > forkPoint) || (given.has(message.seq) && given.get(message.seq) !== message.id)) {
        lost.push(message);
      } else {
        current.push(changed(message, { epoch }));
      }
    }
    // Carried-over messages come before the new epoch's, in seq order (sort is stable).
    log.messages = [...earlier, ...current.sort((a, b) => (a.seq ?? 0) - (b.seq ?? 0))];
    log.epoch = epoch;
    const point = forkPoint ?? log.lastSeq;
    log.lastSeq = Math.min(log.lastSeq, point);
    log.named = log.named.filter((range) => range.fromSeq <= point).map((range) => ({ fromSeq: range.fromSeq, toSeq: Math.min(range.toSeq, point) }));
    log.above = this.#heldAbove(log);
    log.stuckAt = null;
    for (const receipt of [...log.receipts.values()]) {
      log.receipts.set(receipt.userId, Object.freeze({
        userId: receipt.userId, deliveredSeq: Math.min(receipt.deliveredSeq, point), readSeq: Math.min(receipt.readSeq, point),
      }));
    }
    log.deliveredSent = Math.min(log.deliveredSent, point);
    log.readSent = Math.min(log.readSent, point);
    log.readUpTo = Math.min(log.readUpTo, point);
    this.#lose(log, conversationId, old, lost, truncated);
  }

  /**
   * Messages this device holds that Redis lost. Other members' leave messages(); this device's
   * own go back in the outbox and are sent again with the same `client_message_id` (the gateway
   * stores them as new, with a new seq and id). `messagetruncated` names the ranges: those the
   * gateway gave, and alone each lost message outside them.
   * @param {ConversationLog} log
   * @param {string} conversationId
   * @param {string} epoch the epoch they were lost from
   * @param {ChatMessage[]} lost
   * @param {SeqRange[]} ranges
   */
  #lose(log, conversationId, epoch, lost, ranges) {
    const told = ranges.map((range) => ({ epoch: range.epoch ?? epoch, fromSeq: range.fromSeq, toSeq: range.toSeq }));
    for (const message of lost) {
      if (message.id !== null) log.seen.delete(message.id);
      const seq = /** @type {number} */ (message.seq);
      const covered = told.some((range) => range.epoch === message.epoch && range.fromSeq <= seq && (range.toSeq === null || seq <= range.toSeq));
      if (!covered) told.push({ epoch: /** @type {string} */ (message.epoch), fromSeq: seq, toSeq: seq });
    }
    this.#emit(told.map((range) => /** @type {ClientEvent} */ ({ type: "messagetruncated", detail: Object.freeze({ conversationId, ...range }) })));
    this.#requeue(conversationId, lost.filter((message) => this.#isOwn(message)));
  }

  /**
   * Puts this device's own stored messages back in the outbox, as `sending`. They were written
   * before anything of the conversation still in the outbox (which is stored one message at a
   * time, in order), so they go back ahead of it, in their old order; a message already under
   * way is answered first.
   * @param {string} conversationId
   * @param {ChatMessage[]} messages
   */
  #requeue(conversationId, messages) {
    const queued = new Set(this.#chat.outbox.map((entry) => entry.message.clientMessageId));
    /** @type {Outgoing[]} */
    const entries = [...messages].sort((a, b) => (a.seq ?? 0) - (b.seq ?? 0))
      .filter((message) => !queued.has(message.clientMessageId))
      .map((message) => ({
        message: changed(message, { seq: null, id: null, epoch: null, status: "sending", failure: null }), attempts: 0, frameId: null, deadline: null, due: null,
      }));
    if (entries.length === 0) return;
    const first = this.#chat.outbox.findIndex((entry) => entry.message.conversationId === conversationId);
    this.#chat.outbox.splice(first < 0 ? this.#chat.outbox.length : first, 0, ...entries);
    for (const entry of entries) {
      this.#chat.written.add(entry.message.clientMessageId);
      this.#messageStatusChanged(entry.message);
    }
    this.#log("info", "messages Redis lost go again", entries.length);
    this.#saveOutbox();
  }

  /**
   * Whether a message is this user's (written on this device, or by the user elsewhere).
   * @param {ChatMessage} message
   */
  #isOwn(message) {
    return (message.senderId !== null && message.senderId === this.#chat.ownUserId) || this.#chat.written.has(message.clientMessageId);
  }

  /**
   * @param {string} conversationId
   * @param {MemberReceipt} receipt
   */
  #receivedReceipt(conversationId, receipt) {
    const log = this.#chat.logs.get(conversationId);
    if (!log) return;
    this.#mergeReceipt(log, receipt);
    this.#refreshStatuses(conversationId);
  }

  /**
   * @param {ConversationLog} log
   * @param {MemberReceipt} receipt
   */
  #mergeReceipt(log, receipt) {
    const known = log.receipts.get(receipt.userId);
    log.receipts.set(receipt.userId, Object.freeze({
      userId: receipt.userId, deliveredSeq: Math.max(known?.deliveredSeq ?? 0, receipt.deliveredSeq),
      readSeq: Math.max(known?.readSeq ?? 0, receipt.readSeq),
    }));
  }

  /**
   * A `sync` position was refused (not a member, no such conversation): it is not synced again.
   * @param {string} conversationId
   */
  #syncRefused(conversationId) {
    this.#chat.syncing.delete(conversationId);
    const log = this.#chat.logs.get(conversationId);
    if (log && log.messages.length === 0 && !this.#chat.outbox.some((entry) => entry.message.conversationId === conversationId)) {
      this.#chat.logs.delete(conversationId);
    }
  }

  /**
   * Puts a stored message in its conversation's log (once), in history order, and moves the
   * last seq over it when it is the next; returns whether it is new there.
   * @param {ChatMessage} message
   */
  #place(message) {
    if (message.id === null) return false;
    const log = this.#logOf(message.conversationId);
    if (log.seen.has(message.id)) {
      // Already there (the ack and the gateway's copy): the sender's id is learned.
      const index = log.messages.findIndex((candidate) => candidate.id === message.id);
      if (index >= 0 && log.messages[index].senderId === null) log.messages[index] = changed(log.messages[index], { senderId: message.senderId });
      return false;
    }
    if (log.epoch === null && message.epoch !== null) this.#adoptEpoch(log, message.epoch);
    log.seen.add(message.id);
    let position = log.messages.length;
    let taken = -1;
    while (position > 0) {
      const before = log.messages[position - 1];
      if (before.epoch !== message.epoch || (before.seq ?? 0) < (message.seq ?? 0)) break;
      if (before.seq === message.seq) taken = position - 1;
      position -= 1;
    }
    if (taken >= 0) {
      // The same (epoch, seq) with another id: the one held here was carried across a fork
      // whose point was not known, and Redis had lost it.
      const [gone] = log.messages.splice(taken, 1);
      this.#lose(log, message.conversationId, /** @type {string} */ (gone.epoch), [gone], []);
    }
    log.messages.splice(position, 0, message);
    if (message.epoch === log.epoch && message.seq !== null && message.seq > log.lastSeq) {
      log.above.add(message.seq);
      this.#advanceLastSeq(log);
    }
    return true;
  }

  /**
   * Own messages' status from the other members' cursors: delivered (read) once every other
   * member's delivered (read) seq is at or past it.
   * @param {string} conversationId
   */
  #refreshStatuses(conversationId) {
    const log = this.#chat.logs.get(conversationId);
    const own = this.#chat.ownUserId;
    if (!log || !log.receiptsComplete || own === null) return;
    const others = [...log.receipts.values()].filter((receipt) => receipt.userId !== own);
    if (others.length === 0) return;
    const delivered = Math.min(...others.map((receipt) => receipt.deliveredSeq));
    const read = Math.min(...others.map((receipt) => receipt.readSeq));
    log.messages.forEach((message, index) => {
      if (message.senderId !== own && !this.#chat.written.has(message.clientMessageId)) return;
      if (message.seq === null || message.epoch !== log.epoch) return;
      /** @type {MessageStatus} */
      const status = message.seq <= read ? "read" : message.seq <= delivered ? "delivered" : "sent";
      if (STATUS_RANK[status] <= STATUS_RANK[message.status]) return;
      log.messages[index] = changed(message, { status });
      this.#messageStatusChanged(log.messages[index]);
    });
  }

  /**
   * Whether messages arriving in a conversation are read at once: it is on screen in a visible page.
   * @param {string} conversationId
   */
  #isReadHere(conversationId) {
    return this.#chat.onScreen === conversationId && !this.#isHidden();
  }

  /** @param {string} conversationId */
  #markRead(conversationId) {
    const log = this.#chat.logs.get(conversationId);
    if (!log) return;
    log.readUpTo = log.lastSeq;
    log.messages.forEach((message, index) => {
      if (message.senderId === this.#chat.ownUserId || this.#chat.written.has(message.clientMessageId) || message.status === "read") return;
      log.messages[index] = changed(message, { status: "read" });
      this.#messageStatusChanged(log.messages[index]);
    });
    this.#sendCursors(conversationId);
  }

  /**
   * Tells the gateway what this device received and what the page read.
   * @param {string} conversationId
   */
  #sendCursors(conversationId) {
    const session = this.#session;
    const log = this.#chat.logs.get(conversationId);
    if (!session || session.awaitingInitialState || !log || log.lastSeq === 0) return;
    if (log.readUpTo > log.readSent) {
      this.#send("read", { conversation_id: conversationId, seq: log.readUpTo }, { kind: "other" });
      log.readSent = log.readUpTo;
      log.deliveredSent = Math.max(log.deliveredSent, log.readUpTo);
    }
    if (log.lastSeq > log.deliveredSent) {
      this.#send("delivered", { conversation_id: conversationId, seq: log.lastSeq }, { kind: "other" });
      log.deliveredSent = log.lastSeq;
    }
  }

  // MARK: Frames from the gateway

  /**
   * @param {Session} session
   * @param {string} text
   */
  #receive(session, text) {
    if (this.#session !== session) return;
    const message = readServerMessage(text);
    if (!message) {
      this.#log("warn", "an unreadable frame from the gateway", text.slice(0, 200));
      return;
    }
    const id = message.id;
    switch (message.type) {
      case "initial_state": {
        const request = id === null ? undefined : session.pending.get(id);
        if (session.awaitingInitialState && id === null) {
          session.awaitingInitialState = false;
          this.#emit(message.presences.flatMap((presence) => this.#cache.apply(presence)));
          this.#sessionOpened(session);
        } else if (id !== null && request) {
          session.pending.delete(id);
          if (request.kind === "users") this.#emit(this.#cache.applySnapshot(message.presences, request.users));
          else this.#emit(message.presences.flatMap((presence) => this.#cache.apply(presence)));
          this.#answered(id);
        } else {
          this.#emit(message.presences.flatMap((presence) => this.#cache.apply(presence)));
        }
        break;
      }
      case "presence_update":
        this.#emit(this.#cache.apply(message.presence));
        break;
      case "typing_update":
        // Others' typing is not shown while this device appears offline.
        if (!this.#lifecycle.canType && message.isTyping) return;
        this.#emit(this.#cache.setTyping(message.userId, message.conversationId, message.isTyping,
          this.#clock.now() + this.#typingDisplayTimeout * 1000));
        break;
      case "group_presence":
        this.#emit(this.#cache.applyGroup(message.group));
        break;
      case "ack":
        if (id !== null && session.pending.delete(id)) this.#answered(id);
        break;
      case "pong":
        break;
      case "message":
        this.#receivedMessage(message.message);
        break;
      case "message_ack":
        if (id !== null) session.pending.delete(id);
        this.#acknowledged(message.conversationId, message.clientMessageId, message.seq, message.messageId, message.epoch);
        break;
      case "synced":
        this.#synced(id, message);
        break;
      case "receipt":
        this.#receivedReceipt(message.conversationId, message.receipt);
        break;
      case "error":
        this.#refused(session, id, message.code, message.message, message.conversationId, message.retryAfter);
        break;
      default:
        this.#log("debug", "a frame this client does not know", message.name);
    }
  }

  /**
   * The gateway refused a request (or said something went wrong).
   * @param {Session} session
   * @param {string | null} id
   * @param {string} code
   * @param {string} message
   * @param {string | null} conversationId
   * @param {number | null} retryAfter
   */
  #refused(session, id, code, message, conversationId, retryAfter) {
    this.#log("info", "the gateway refused a request", code, message);
    const error = /** @type {ClientEvent} */ ({ type: "error", detail: Object.freeze({ code, message }) });
    const request = id === null ? undefined : session.pending.get(id);
    if (id === null || !request) {
      this.#emit([error]);
      return;
    }
    if (request.kind === "message") {
      session.pending.delete(id);
      this.#messageRefused(request.clientMessageId, code, message);
      return;
    }
    if (request.kind === "sync") {
      this.#syncFailed(id, request, code, message, conversationId, retryAfter);
      return;
    }
    session.pending.delete(id);
    const retryAt = this.#clock.now() + this.#retryDelay * 1000;
    if (request.kind === "status") {
      this.#lifecycle.statusRefused(retryAt);
    } else if (request.kind === "users" && code === "rate_limited") {
      session.retries.push({ due: retryAt, type: "subscribe", data: { user_ids: request.users }, request, catchingUp: session.catchUp.delete(id) });
      return;
    } else if (request.kind === "conversation" && code === "rate_limited") {
      session.retries.push({
        due: retryAt, type: "subscribe", data: { conversation_id: request.conversationId }, request, catchingUp: session.catchUp.delete(id),
      });
      return;
    } else if (request.kind === "conversation") {
      // Not a member (any more), or too large: following it cannot succeed.
      this.#joined.delete(request.conversationId);
      this.#emit(this.#cache.removeConversation(request.conversationId));
    }
    this.#answered(id);
    this.#emit([error]);
  }

  /**
   * The session's first `initial_state` arrived: the device is live. Sync the conversations,
   * ask again for what the page follows, and send a status owed since the session opened.
   * @param {Session} session
   */
  #sessionOpened(session) {
    this.#lifecycle.opened(session.openedWith);
    this.#backoff.reset();
    // The syncs first: the gateway holds live messages until the first one (at most 2 s), and
    // they have a budget of their own, so they never wait behind the subscribes (which, for
    // hundreds of conversations, take a minute of the subscribe budget). Before the outbox is
    // read, its reading does this.
    if (this.#chat.loaded) this.#messagesSessionOpened();
    this.#subscribeUsers([...this.#watched], true);
    for (const conversation of [...this.#joined].sort()) this.#subscribeConversation(conversation, true);
    this.#sendOwedStatus();
    this.#answered(null);
  }

  /**
   * A request of the catch-up was answered; when the last one is, the cache is current.
   * @param {string | null} id
   */
  #answered(id) {
    const session = this.#session;
    if (!session) return;
    if (id !== null) session.catchUp.delete(id);
    if (session.catchUp.size > 0 || session.retries.some((retry) => retry.catchingUp) || session.awaitingInitialState
      || this.#state.state === "connected") return;
    this.#emit(this.#cache.endCatchUp());
    this.#setState({ state: "connected" });
  }
}
