/**
 * The browser client of the presence gateway (`/client/presence.js`): the declarations of
 * presence.js. It behaves like the Swift SDK's `PresenceClient`.
 *
 * Durations in options are seconds; the clock works in milliseconds; moments handed out are `Date`s.
 */

/** A presence status, exactly as the API spells it. */
export type PresenceStatus = "online" | "away" | "offline";

/** Why the client stopped reconnecting. */
export type StopReason = "signedOut" | "disconnectedByAdmin" | "replaced";

/** What is known of one user: their aggregate status and when they were last seen live. */
export interface PresenceSnapshot {
  readonly userId: string;
  readonly status: PresenceStatus;
  /** The last moment they were online or away; `null` if never seen. */
  readonly lastSeen: Date | null;
}

/** The counts of a followed conversation, "3 of 5 online". */
export interface GroupPresence {
  readonly conversationId: string;
  readonly total: number;
  readonly online: number;
  readonly away: number;
}

/** The client's link to the gateway. */
export type ConnectionState =
  | { readonly state: "idle" }
  | { readonly state: "connecting" }
  /** The session is open and the cache has caught up. */
  | { readonly state: "connected" }
  /** The session dropped; the next attempt is at `retryAt`. */
  | { readonly state: "waiting"; readonly retryAt: Date }
  /** Stopped for good: no reconnect. */
  | { readonly state: "stopped"; readonly reason: StopReason };

/** A user started or stopped typing in a conversation. */
export interface TypingChange {
  readonly conversationId: string;
  readonly userId: string;
  readonly isTyping: boolean;
}

/** A user is no longer visible (or no longer watched). */
export interface RemovedUser {
  readonly userId: string;
}

/** The gateway answered a request with an error, or the token provider failed (`unauthorized`). */
export interface PresenceErrorDetail {
  /** `unauthorized`, `forbidden`, `not_found`, `invalid_request`, `rate_limited`, `unavailable`, `internal`, ... */
  readonly code: string;
  readonly message: string;
}

/** The events of a `PresenceClient`, each a `CustomEvent` with this `detail`. */
export interface PresenceClientEventMap {
  connection: CustomEvent<ConnectionState>;
  presence: CustomEvent<PresenceSnapshot>;
  removed: CustomEvent<RemovedUser>;
  typing: CustomEvent<TypingChange>;
  group: CustomEvent<GroupPresence>;
  error: CustomEvent<PresenceErrorDetail>;
  /** A message joined `messages()`: written here (`sending`), or delivered and not written here. */
  message: CustomEvent<ChatMessage>;
  /** A message's status changed (this device's: `sent`, `delivered`, `read`, `failed`; others': `read`). */
  messagestatus: CustomEvent<MessageStatusChange>;
  /** A `sync` could not give these messages (trimmed, or a history Redis lost). */
  messagegap: CustomEvent<MessageGap>;
  /**
   * Redis lost these seqs of `epoch`, which this device held (it went back in time: the epoch
   * forked). Other members' messages in the range are out of `messages()`; this device's own are
   * back in the outbox, `sending` again (a `messagestatus` says so), and go again with the same
   * `clientMessageId`.
   */
  messagetruncated: CustomEvent<MessageGap>;
}

/** `sending` (in the outbox), `sent` (stored), `delivered` and `read` (by every other member), `failed` (kept for `retry`). */
export type MessageStatus = "sending" | "sent" | "delivered" | "read" | "failed";

/** A conversation's message on this device. */
export interface ChatMessage {
  readonly conversationId: string;
  /** Made on this device; the same on every attempt. */
  readonly clientMessageId: string;
  /** Null until the gateway stored it. */
  readonly seq: number | null;
  readonly id: string | null;
  /**
   * Null until stored. The frame's `epoch` (never read from `id`); a message kept across a fork
   * takes the new epoch, with the same `seq` and `id`.
   */
  readonly epoch: string | null;
  /** Null for this device's messages until the gateway's copy names the sender. */
  readonly senderId: string | null;
  readonly type: string;
  readonly text: string;
  readonly imageUrl: string | null;
  readonly createdAt: Date;
  readonly status: MessageStatus;
  /** Why it failed, when it did. */
  readonly failure: string | null;
}

export interface MessageStatusChange {
  readonly conversationId: string;
  readonly clientMessageId: string;
  readonly status: MessageStatus;
  readonly failure: string | null;
}

export interface MemberReceipt {
  readonly userId: string;
  readonly deliveredSeq: number;
  readonly readSeq: number;
}

/** Seqs `fromSeq` to `toSeq` of a conversation's `epoch`: what a sync could not give, or what Redis lost. */
export interface MessageGap {
  readonly conversationId: string;
  readonly epoch: string | null;
  readonly fromSeq: number;
  /** Null: the rest of a lost epoch. */
  readonly toSeq: number | null;
}

/** Keeps the outbox across page loads; written whole after every change, one write after another. */
export interface OutboxStore {
  load(): Promise<ChatMessage[]>;
  save(messages: ChatMessage[]): Promise<void>;
}

/** An outbox in memory, for as long as the object lives. */
export declare class MemoryOutboxStore implements OutboxStore {
  load(): Promise<ChatMessage[]>;
  save(messages: ChatMessage[]): Promise<void>;
}

/** An outbox in IndexedDB (database `presence`, object store `outbox`, one record per key). */
export declare class IndexedDBOutboxStore implements OutboxStore {
  constructor(key: string, options?: { databaseName?: string; indexedDB?: IDBFactory });
  load(): Promise<ChatMessage[]>;
  save(messages: ChatMessage[]): Promise<void>;
}

/** Where the client reads the time (milliseconds since 1970) and sets its timers. */
export interface PresenceClock {
  now(): number;
  setTimeout(callback: () => void, milliseconds: number): unknown;
  clearTimeout(handle: unknown): void;
}

/**
 * What a hidden page does: `away` at once (the default), or also `offline` (the session closes
 * with 1000) once hidden for `afterSeconds`; visible again reconnects.
 */
export type BackgroundPolicy = { kind: "away" } | { kind: "offline"; afterSeconds: number };

/** Where the device id is kept (`localStorage` fits). */
export interface DeviceIdStorage {
  getItem(key: string): string | null;
  setItem(key: string, value: string): void;
}

/**
 * What the client uses of the Web Locks API (`navigator.locks` fits). With `ifAvailable` the
 * callback gets `null` at once when the lock is held elsewhere; else the lock once granted, held
 * until the promise the callback returns settles (or the page goes away).
 */
export interface TabLocks {
  request(name: string, options: { ifAvailable?: boolean }, callback: (lock: unknown) => unknown): Promise<unknown>;
}

/** Gets connection detail (`console` fits). */
export interface PresenceLogger {
  debug?(...values: unknown[]): void;
  info?(...values: unknown[]): void;
  warn?(...values: unknown[]): void;
}

/**
 * Returns a token for the gateway; `refresh` is true when the last one was refused or has
 * expired, so a cached token must not be returned again.
 */
export type TokenProvider = (refresh: boolean) => string | Promise<string>;

export interface PresenceClientOptions {
  /** Called before each connection attempt. */
  token: TokenProvider;
  /** Gateway base URLs (http(s) or ws(s)), tried in turn. Default: the gateway that served the module. */
  gatewayURLs?: string | URL | Array<string | URL>;
  /**
   * This device's stable id. Default: one per tab: the first tab of the browser has the id kept
   * in storage under `DEVICE_ID_STORAGE_KEY`, each other open tab that id with `.tab2`, `.tab3`, …
   * (tab slots held through `locks`). An app that passes its own id gives each tab its own.
   */
  deviceId?: string;
  /** Where the device id is kept. Default: `localStorage`. */
  storage?: DeviceIdStorage | null;
  /**
   * The Web Locks through which the tabs of a browser share out the slots of the stored device id
   * (only without `deviceId`). Default: `navigator.locks` where there is one; `null`: no slots,
   * every tab has the stored id (and the gateway keeps only the last tab's session).
   */
  locks?: TabLocks | null;
  /** Default: `{ kind: "away" }`. */
  backgroundPolicy?: BackgroundPolicy;
  /** Default: 1 s doubling up to 16 s, each ±20 % (jitter 0.2). */
  backoff?: { initial?: number; maximum?: number; jitter?: number };
  /** Least seconds between two typing starts sent for one conversation. Default 2. */
  typingRefreshInterval?: number;
  /** Seconds without a keystroke after which typing stops. Default 3. */
  typingIdleTimeout?: number;
  /** Seconds another user's typing shows without an update. Default 8. */
  typingDisplayTimeout?: number;
  /** Seconds before a rate-limited request is sent again. Default 1. */
  retryDelay?: number;
  /** Seconds `signOut()` and `stop()` wait for the clean close. Default 3. */
  closeTimeout?: number;
  /** Seconds from a connection attempt to its `initial_state`. Default 10. */
  openTimeout?: number;
  /** Default: `Date.now` and the global timers. */
  clock?: PresenceClock;
  /** Numbers in [0, 1) for the jitter. Default: `Math.random`. */
  random?: () => number;
  /** Default: `globalThis.WebSocket`. */
  WebSocket?: new (url: string) => WebSocket;
  /** `pagehide`, `pageshow`, `online`, `offline`. Default: `globalThis.window`; `null`: none. */
  window?: (EventTarget & { navigator?: { onLine?: boolean } }) | null;
  /** `visibilitychange`. Default: `globalThis.document`; `null`: none. */
  document?: (EventTarget & { visibilityState?: string }) | null;
  /** Default: none. */
  logger?: PresenceLogger | null;
  /**
   * Where unsent messages are kept, used as is (one store, whatever the tab). Default: IndexedDB
   * keyed by the device id (made once the tab's slot is held), or memory where it is missing.
   */
  outboxStore?: OutboxStore;
}

/** The `localStorage` key of the device id the client makes when none is given: `presence.device_id`. */
export declare const DEVICE_ID_STORAGE_KEY: "presence.device_id";

/** The close codes of the API, and the two this service adds. */
export declare const CloseCode: Readonly<{
  normal: 1000;
  goingAway: 1001;
  policyViolation: 1008;
  messageTooBig: 1009;
  internalError: 1011;
  tryAgainLater: 1013;
  unauthorized: 4001;
  disconnectedByAdmin: 4003;
  replaced: 4009;
  rateLimited: 4029;
}>;

/** An error of the client library: a bad argument or option (`code` is `invalid_request`). */
export declare class PresenceClientError extends Error {
  constructor(code: string, message: string);
  readonly code: string;
}

/** A browser's link to the presence gateway. */
export declare class PresenceClient extends EventTarget {
  constructor(options: PresenceClientOptions);

  /**
   * This client's device id. With tab slots (no `deviceId` option, Web Locks there) `null` until
   * `start()` has claimed the tab's slot (no session opens before), and again once the slot is let
   * go (`signOut()`, or stopped for good).
   */
  readonly deviceId: string | null;
  /** The link to the gateway. */
  readonly connectionState: ConnectionState;
  /** The close code of the last session (`null`: none yet, or it dropped without one). */
  readonly lastCloseCode: number | null;
  /** The status this device is meant to have now. */
  readonly status: PresenceStatus;
  /** Users watched explicitly, sorted. */
  readonly watchedUsers: string[];
  /** Conversations followed, sorted. */
  readonly joinedConversations: string[];
  /** Every known presence, sorted by user id. */
  readonly presences: PresenceSnapshot[];

  /** The presence of a user, if known. */
  presence(userId: string): PresenceSnapshot | undefined;
  /** The counts of a followed conversation, if known. */
  group(conversationId: string): GroupPresence | undefined;
  /** Who is typing in a conversation, sorted; nobody while disconnected or appearing offline. */
  typingUsers(conversationId: string): string[];

  /** Starts keeping a session open and following the page's life; the first start claims the tab's slot. */
  start(): void;
  /** Offline at once with a clean close (1000); `start()` may be called again (the tab keeps its slot). */
  stop(): Promise<void>;
  /** Offline at once with a clean close (1000), and stopped for good (`signedOut`); the tab's slot is let go. */
  signOut(): Promise<void>;

  /** The status shown while the page is visible; the latest wins while disconnected. */
  setStatus(status: PresenceStatus): void;
  /** Watches users besides those the gateway watches for the session. */
  watch(userIds: string[]): void;
  /** Stops watching users. */
  unwatch(userIds: string[]): void;
  /** Follows a conversation: its counts, its typing, and its members' presence. */
  join(conversationId: string): void;
  /** Stops following a conversation, and stops typing in it. */
  leave(conversationId: string): void;
  /** A keystroke in a conversation's composer. */
  userTyped(conversationId: string): void;
  /** The message was sent (or the draft cleared): typing stops now. */
  messageSent(conversationId: string): void;

  /** Writes a message: returned at once as `sending` (not a Promise); it goes out when a session is open. */
  send(conversationId: string, text: string, options?: { type?: "text" | "image"; imageUrl?: string }): ChatMessage;
  /**
   * The conversation's messages: stored ones in seq order (a message that came past a gap is
   * kept in its place), then this device's unsent ones in the order they go out.
   */
  messages(conversationId: string): ChatMessage[];
  /** Every member's cursors, as last heard. */
  receipts(conversationId: string): MemberReceipt[];
  /** Sends a failed message again; false if there is no such failed message. */
  retry(clientMessageId: string): boolean;
  /** Everything received in the conversation counts as read. */
  markRead(conversationId: string): void;
  /** The conversation on screen (null: none): while the page is visible, what arrives in it is read. */
  showConversation(conversationId: string | null): void;
  /** The page's own offline switch (airplane mode for this client). */
  setOffline(offline: boolean): void;
  readonly isOffline: boolean;
  /** Resolves once every outbox change so far is saved. */
  outboxSaved(): Promise<void>;

  addEventListener<K extends keyof PresenceClientEventMap>(
    type: K,
    listener: (this: PresenceClient, event: PresenceClientEventMap[K]) => void,
    options?: boolean | AddEventListenerOptions,
  ): void;
  addEventListener(type: string, listener: EventListenerOrEventListenerObject | null, options?: boolean | AddEventListenerOptions): void;
  removeEventListener<K extends keyof PresenceClientEventMap>(
    type: K,
    listener: (this: PresenceClient, event: PresenceClientEventMap[K]) => void,
    options?: boolean | EventListenerOptions,
  ): void;
  removeEventListener(type: string, listener: EventListenerOrEventListenerObject | null, options?: boolean | EventListenerOptions): void;
}

/** The words apps show for presence, as the Swift SDK's `PresenceText`. */
export declare const PresenceText: Readonly<{
  /** "Online", "Away", "Last seen 5m ago" and its kin, or "Offline" for a user never seen or not known. */
  status(presence: PresenceSnapshot | null | undefined, now: Date | number): string;
  /** "Last seen just now / 5m ago / 3h ago / 2d ago / on 2026-11-01"; "Offline" for `null`. */
  lastSeen(lastSeen: Date | number | null | undefined, now: Date | number): string;
  /** When `lastSeen` next reads differently; `null` when it never will. */
  nextChange(lastSeen: Date | number | null | undefined, now: Date | number): Date | null;
  /** Calls `onLabel` with the label now and each time it changes, until the returned function is called. */
  updatingStatus(
    presence: PresenceSnapshot | null | undefined,
    onLabel: (label: string) => void,
    options?: { clock?: PresenceClock },
  ): () => void;
  /** "3 of 5 online". */
  group(group: { total: number; online: number }): string;
  /** "Alice is typing…", "Alice and Bob are typing…", "Alice, Bob and 2 others are typing…"; "" for nobody. */
  typing(names: readonly string[]): string;
}>;

/** Delays between reconnect attempts (seconds): 1, 2, 4, 8, 16, 16, ... each ±`jitter`. */
export declare class ReconnectBackoff {
  constructor(options?: { initial?: number; maximum?: number; jitter?: number });
  initial: number;
  maximum: number;
  jitter: number;
  /** Failed attempts since the last success. */
  readonly attempts: number;
  /** The delay before the next attempt in seconds, counting this failure. */
  nextDelay(random?: () => number): number;
  /** A connection succeeded: the next failure starts again from `initial`. */
  reset(): void;
}

/** A typing frame to send. */
export interface TypingSend {
  conversationId: string;
  isTyping: boolean;
}

/** Turns keystrokes into typing frames: true at once, at most once per 2 s, false after 3 s idle. Moments in ms. */
export declare class TypingDebouncer {
  constructor(options?: { refreshInterval?: number; idleTimeout?: number });
  refreshInterval: number;
  idleTimeout: number;
  /** Conversations this device is typing in now, sorted. */
  readonly conversations: string[];
  /** When the next `expire` has something to do (ms), or `null`. */
  readonly nextDeadline: number | null;
  keystroke(conversation: string, now: number, canSend: boolean): TypingSend | null;
  stop(conversation: string): TypingSend | null;
  stopAll(): TypingSend[];
  forget(): void;
  expire(now: number): TypingSend[];
}

/** Milliseconds since 1970 for `2026-11-21T12:00:00.123Z` (fraction optional, 1–9 digits); `null` otherwise. */
export declare function parseTimestamp(text: unknown): number | null;

/** The API's text for a moment: ISO 8601 UTC with milliseconds. */
export declare function formatTimestamp(moment: Date | number): string;
