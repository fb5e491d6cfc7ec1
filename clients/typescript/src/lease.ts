/**
 * The lease a claim holds while its effect runs, and {@link currentLease} for the function a
 * `makeIdempotent` wrapper runs (carried by `AsyncLocalStorage` through every `await`).
 */

import { AsyncLocalStorage } from "node:async_hooks";
import { performance } from "node:perf_hooks";

import { LeaseLostError } from "./errors.js";

const store = new AsyncLocalStorage<Lease>();

/**
 * The lease of the function a `makeIdempotent` wrapper is running, here or in anything it
 * awaits: `currentLease().signal` aborts when the lease is lost (pass it to `fetch`), and
 * `currentLease().throwIfLost()` stops long work between steps.
 *
 * @throws Error outside such a function (for a claim, use `claim.lease`).
 */
export function currentLease(): Lease {
  const lease = store.getStore();
  if (lease === undefined) {
    throw new Error("no idem lease here: call currentLease() inside a function made with makeIdempotent (or use claim.lease)");
  }
  return lease;
}

/** Runs `fn` with `lease` as its {@link currentLease}. */
export function runWithLease<T>(lease: Lease, fn: () => T): T {
  return store.run(lease, fn);
}

/**
 * The lease a claim holds while its effect runs.
 *
 * `fencingToken` is the token to complete with. `lost` turns true, and `signal` aborts with a
 * {@link LeaseLostError} (or idem's refusal, a `LeaseExpiredError` or `StaleFencingTokenError`),
 * when idem refused a renewal (another attempt may act now) or when the lease's end passed
 * without a successful renewal (by this process's monotonic clock, counted from before the
 * request that granted or renewed it). Long work should stop then; its completion is still
 * accepted while no other lease was granted (README "Completing").
 */
export class Lease {
  readonly key: string;
  readonly fencingToken: number;
  /** The lease's length (ms) at each grant or renewal. */
  readonly leaseMs: number;
  readonly #controller = new AbortController();
  #endsAt: number;
  #timer: NodeJS.Timeout | undefined;
  #released = false;

  /** @internal made by a claim when idem grants the lease; `grantedAt` is `performance.now()` before the request. */
  constructor(key: string, fencingToken: number, leaseMs: number, grantedAt: number) {
    this.key = key;
    this.fencingToken = fencingToken;
    this.leaseMs = leaseMs;
    this.#endsAt = grantedAt + leaseMs;
    this.#arm();
  }

  /** Whether the lease is gone (see the class docs). */
  get lost(): boolean {
    return this.#controller.signal.aborted || (!this.#released && performance.now() >= this.#endsAt);
  }

  /** Aborts when the lease is lost; its `reason` says why. Hand it to what the effect awaits. */
  get signal(): AbortSignal {
    return this.#controller.signal;
  }

  /** Why the lease was lost (`signal.reason`), or `undefined`. */
  get lostReason(): unknown {
    return this.#controller.signal.aborted ? this.#controller.signal.reason : undefined;
  }

  /** Milliseconds until the lease ends by this process's clock (0 when lost). */
  get remainingMs(): number {
    return this.#controller.signal.aborted ? 0 : Math.max(0, this.#endsAt - performance.now());
  }

  /** @internal The lease's end: a `performance.now()` instant (the grant's or last renewal's send time plus `leaseMs`). */
  get endsAt(): number {
    return this.#endsAt;
  }

  /** Throws the reason the lease was lost ({@link LeaseLostError} or idem's refusal), if it was. */
  throwIfLost(): void {
    if (!this.lost) return;
    if (!this.#controller.signal.aborted) this.lose(this.#ended());
    throw this.#controller.signal.reason;
  }

  #ended(): LeaseLostError {
    return new LeaseLostError(
      `the lease of ${JSON.stringify(this.key)} (fencing token ${this.fencingToken}) ended without a renewal`,
    );
  }

  #arm(): void {
    clearTimeout(this.#timer);
    if (this.#released || this.#controller.signal.aborted) return;
    const left = this.#endsAt - performance.now();
    this.#timer = setTimeout(() => {
      if (this.#released) return;
      if (performance.now() >= this.#endsAt) this.lose(this.#ended());
      else this.#arm();
    }, Math.max(0, Math.ceil(left)));
    this.#timer.unref();
  }

  /** @internal a renewal sent at `sentAt` (`performance.now()`) succeeded. */
  renewed(sentAt: number): void {
    if (this.#controller.signal.aborted) return;
    this.#endsAt = sentAt + this.leaseMs;
    this.#arm();
  }

  /** @internal the lease is gone: abort the signal with `reason` (once). */
  lose(reason: unknown): void {
    clearTimeout(this.#timer);
    if (!this.#controller.signal.aborted) this.#controller.abort(reason);
  }

  /** @internal the claim completed: no more timers; `lost` stays as it was. */
  release(): void {
    if (!this.#released && !this.#controller.signal.aborted && performance.now() >= this.#endsAt) {
      this.lose(this.#ended());
    }
    this.#released = true;
    clearTimeout(this.#timer);
  }
}
