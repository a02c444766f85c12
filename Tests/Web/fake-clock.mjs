// The fake clock the browser client's tests share: time moves only when a test says so.
import assert from "node:assert/strict";

/** Lets promise chains (the token provider) and queued close events run. */
export const settle = () => new Promise((resolve) => setImmediate(resolve));

/** A clock that moves only when told to; `advance` fires due timers in order. */
export class FakeClock {
  /** @param {number} start milliseconds since 1970 */
  constructor(start) {
    this.time = start;
    this.timers = new Map();
    this.nextId = 1;
  }

  now() { return this.time; }

  setTimeout(callback, milliseconds) {
    const id = this.nextId++;
    this.timers.set(id, { id, at: this.time + Math.max(0, milliseconds), callback });
    return id;
  }

  clearTimeout(id) { this.timers.delete(id); }

  /** Moves `seconds` forward, firing each timer at its moment (and what it starts). */
  async advance(seconds) {
    const end = this.time + seconds * 1000;
    for (let fired = 0; ; fired += 1) {
      // A timer that keeps re-arming at a moment already past is a bug: fail, do not hang.
      assert.ok(fired < 10_000, "timers keep firing without time moving");
      const due = [...this.timers.values()].filter((timer) => timer.at <= end).sort((a, b) => a.at - b.at || a.id - b.id)[0];
      if (!due) break;
      this.timers.delete(due.id);
      this.time = Math.max(this.time, due.at);
      due.callback();
      await settle();
    }
    this.time = end;
    await settle();
  }
}
