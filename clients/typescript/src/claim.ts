/**
 * A claim on an operation (or a workflow step): acquire, hold the lease, complete honestly.
 *
 * `await client.claim(...)` acquires (README "What a trigger gets"):
 *
 * - `201` → `claim.acquired`: you hold the lease; a heartbeat renews it every third of
 *   `leaseMs` until you complete; perform the effect, then report it.
 * - `200` → `claim.replayed`: final already (a replay, or idem's connector performed it): do
 *   not perform it; `claim.operation` has the stored result or error.
 * - `202` → rejects with {@link OutcomeUnknownError} (or {@link OperationPendingError} for a
 *   connector's attempt): there is no claim to act on.
 * - `409` → {@link InProgressError} with `retryAfterMs`, after waiting up to `waitMs`; `422`,
 *   `410` and the other problems → their error.
 *
 * Close it with `await using` (it is `AsyncDisposable`) or `try { … } finally { await
 * claim.close() }`: a claim that holds the lease and reported nothing is completed UNKNOWN (the
 * effect may have started) and `close()` throws {@link ClaimNotCompletedError}. In a `catch`,
 * `await claim.completeWithError(e)` reports an error by what it proves: declared `retryable`,
 * declared `final`, anything else UNKNOWN.
 */

import { randomUUID } from "node:crypto";
import { performance } from "node:perf_hooks";
import { setTimeout as sleep } from "node:timers/promises";

import "./dispose.js";
import {
  ClaimNotCompletedError,
  ConnectorOwnedError,
  InProgressError,
  InvalidInputError,
  InvalidRequestError,
  LateArrivalError,
  LeaseLostError,
  NotExecutingError,
  NotFoundError,
  NotHeldError,
  OperationPendingError,
  OutcomeNotRecordedError,
  OutcomeUnknownError,
  ProblemError,
  RetryNotDueError,
  StaleFencingTokenError,
  TransportError,
} from "./errors.js";
import { type Answer, type Request, type Transport, answerError, checkAnswer, segment } from "./http.js";
import { toJSON } from "./json.js";
import { Lease } from "./lease.js";
import { type JSONValue, type Operation, operationFrom } from "./records.js";

/** Longest `waitMs` idem waits within one request (README "Request fields"). */
export const SERVER_MAX_WAIT_MS = 30_000;
/** Longest completion `message` idem keeps, in bytes of UTF-8 (idem_core::completion). */
export const MAX_MESSAGE_BYTES = 4096;
/** Longest `error_class`, in characters of `[A-Za-z0-9_.-]` (idem_core::completion). */
export const MAX_ERROR_CLASS_LEN = 64;
/** Longest `provider_ref`, in bytes of UTF-8 (idem_core::completion). */
export const MAX_PROVIDER_REF_BYTES = 512;

/**
 * Which thrown values an option (`retryable`, `final`) names: an error class (matched with
 * `instanceof`) or a predicate on the thrown value (`(e) => e instanceof TypeError &&
 * e.cause?.code === "ECONNREFUSED"`, fetch's own refused connection). A function whose
 * `prototype` is an `Error`'s is taken as a class, any other as a predicate. The thrown value
 * itself is judged, never its `cause` chain: the library does not look past it (README "Which
 * errors prove nothing happened").
 */
export type ErrorMatcher = (abstract new (...args: never[]) => Error) | ((error: unknown) => boolean);

/**
 * Whether `error` is one that `matchers` name. A predicate that throws names nothing: an error
 * it cannot judge proves nothing, so the outcome is UNKNOWN.
 */
export function matches(error: unknown, matchers: readonly ErrorMatcher[]): boolean {
  return matchers.some((m) => {
    const proto: unknown = (m as { prototype?: unknown }).prototype;
    if (proto === Error.prototype || proto instanceof Error) return error instanceof (m as abstract new () => Error);
    try {
      return (m as (e: unknown) => boolean)(error) === true;
    } catch {
      return false;
    }
  });
}

/**
 * `retryable` and `final`, checked when a claim or guarded function is made (before the
 * function runs, not when its error is judged). @throws InvalidInputError one that is not an
 * array of error classes and predicates.
 */
export function checkMatchers(options: { readonly retryable?: unknown; readonly final?: unknown }): void {
  for (const name of ["retryable", "final"] as const) {
    const v = options[name];
    if (v !== undefined && !(Array.isArray(v) && v.every((m) => typeof m === "function"))) {
      throw new InvalidInputError(
        `${name} must be an array of error classes and predicates ((error) => boolean), such as [MyError]; got ${typeof v === "function" ? v.name || "a function" : JSON.stringify(v) ?? String(v)}`,
      );
    }
  }
}

/** An error's class as an `error_class`: 1-64 characters of `[A-Za-z0-9_.-]` (its `name` when set, else its constructor's). */
export function errorClassOf(error: unknown): string {
  let name = "thrown";
  if (typeof error === "object" && error !== null) {
    const own = (error as { name?: unknown }).name;
    const ctor = (error as { constructor?: { name?: unknown } }).constructor?.name;
    name = typeof own === "string" && own !== "Error" && own !== "" ? own : typeof ctor === "string" && ctor ? ctor : "Error";
  } else {
    name = `thrown_${typeof error}`;
  }
  return name.replace(/[^A-Za-z0-9_.-]/g, "_").slice(0, MAX_ERROR_CLASS_LEN) || "Error";
}

/** A completion message (`Name: text`), without NUL, at most 4096 bytes of UTF-8. */
export function messageOf(error: unknown): string {
  const text =
    typeof error === "string"
      ? error
      : error instanceof Error
        ? `${errorClassOf(error)}: ${error.message}`
        : `${errorClassOf(error)}: ${String(error)}`;
  const clean = text.replaceAll("\0", "").toWellFormed();
  const bytes = Buffer.from(clean, "utf8");
  if (bytes.length <= MAX_MESSAGE_BYTES) return clean;
  // Cut at a character boundary: decoding a cut sequence would add U+FFFD.
  let end = MAX_MESSAGE_BYTES - 3;
  while (end > 0 && ((bytes[end] ?? 0) & 0xc0) === 0x80) end -= 1;
  return `${bytes.subarray(0, end).toString("utf8")}…`;
}

/** `errorClass` if idem accepts it (1-64 of `[A-Za-z0-9_.-]`, idem_core::completion). @throws InvalidInputError */
function checkedClass(errorClass: unknown): string {
  if (typeof errorClass !== "string" || !/^[A-Za-z0-9_.-]{1,64}$/.test(errorClass)) {
    throw new InvalidInputError(
      `errorClass ${JSON.stringify(errorClass) ?? String(errorClass)} must be 1-${MAX_ERROR_CLASS_LEN} characters of [A-Za-z0-9_.-]`,
    );
  }
  return errorClass;
}

/**
 * The evidence as idem keeps it: a string; a safe integer (`Number.isSafeInteger`) or a
 * `bigint` becomes its decimal string (a provider's numeric id, `12345` → `"12345"`); anything
 * else (a boolean, a fraction, `NaN`) is left for {@link succeededBody} to refuse.
 */
export function evidence(providerRef: unknown): unknown {
  if (typeof providerRef === "bigint") return providerRef.toString(10);
  if (typeof providerRef === "number" && Number.isSafeInteger(providerRef)) return String(providerRef);
  return providerRef;
}

/** The body of a success; the evidence's rules (idem_core::completion) checked here. */
export function succeededBody(rawRef: unknown, result: unknown): Record<string, JSONValue> {
  const providerRef = evidence(rawRef);
  if (typeof providerRef !== "string" || providerRef.trim() === "") {
    throw new InvalidInputError(
      `providerRef must be the provider's evidence, a non-empty string (or an integer); got ${JSON.stringify(providerRef) ?? String(providerRef)}`,
    );
  }
  if (Buffer.byteLength(providerRef.toWellFormed(), "utf8") > MAX_PROVIDER_REF_BYTES) {
    throw new InvalidInputError(`providerRef is longer than ${MAX_PROVIDER_REF_BYTES} bytes`);
  }
  if (/\p{Cc}/u.test(providerRef)) throw new InvalidInputError("providerRef must not contain control characters");
  const body: Record<string, JSONValue> = { outcome: "succeeded", provider_ref: providerRef };
  if (result !== undefined && result !== null) body["result"] = toJSON(result, "result");
  return body;
}

/**
 * What a claim acquires: an operation (`POST /v1/operations`) or a step of a workflow instance
 * your code runs (`POST /v1/workflows/{instance}/steps/{step}`).
 */
export interface Target {
  readonly describe: string;
  /**
   * The operation key an answer must be about: the key, or a step's `{instance}:{step}`
   * (idem_core::flow::step_key; a re-run's `{instance}:{step}:rerun-N` is taken too).
   */
  readonly key: string;
  readonly acquirePath: string;
  readonly acquireBody: Readonly<Record<string, JSONValue>>;
  readonly completePath: string;
  /** Whether idem waits `wait_ms` itself (operations), or the library polls (steps). */
  readonly serverWaits: boolean;
}

/** The key an answer about `target` may carry: `got` when it is one (a step's re-run), else the target's. */
function answerKey(target: Target, got: string): string {
  const rest = got.startsWith(`${target.key}:rerun-`) ? got.slice(target.key.length + ":rerun-".length) : "";
  return !target.serverWaits && /^\d+$/.test(rest) ? got : target.key;
}

/** The options of a claim that are not part of the request's intent. */
export interface ClaimBehaviour {
  readonly leaseMs: number;
  readonly waitMs: number;
  readonly heartbeat: boolean;
  readonly renewEveryMs: number;
  readonly retryable: readonly ErrorMatcher[];
  readonly final: readonly ErrorMatcher[];
  readonly timeoutMs: number;
}

/** A claim (see the module docs). The completion methods resolve to the record idem answers with. */
export class Claim implements AsyncDisposable {
  readonly #transport: Transport;
  readonly #target: Target;
  readonly #b: ClaimBehaviour;
  #operation: Operation;
  #status: number;
  #connector: boolean;
  #lease: Lease | undefined;
  #completionTried = false;
  #completion: Readonly<Record<string, JSONValue>> | null = null;
  #beat: NodeJS.Timeout | undefined;
  #beating = false;

  private constructor(transport: Transport, target: Target, b: ClaimBehaviour, a: Answer, sentAt: number) {
    this.#transport = transport;
    this.#target = target;
    this.#b = b;
    this.#operation = operationFrom(a.body);
    this.#status = a.status;
    this.#connector = a.headers.get("idem-performed-by") === "connector";
    if (a.status === 201) {
      this.#lease = new Lease(this.#operation.key, this.#operation.fencingToken, b.leaseMs, sentAt);
      if (b.heartbeat) {
        this.#beating = true;
        this.#schedule();
      }
    }
  }

  /** @internal acquires `target` (waiting up to `waitMs` for a concurrent holder); see the module docs. */
  static async acquire(transport: Transport, target: Target, b: ClaimBehaviour): Promise<Claim> {
    const deadline = performance.now() + b.waitMs;
    for (;;) {
      const serverWait = target.serverWaits
        ? Math.max(0, Math.min(SERVER_MAX_WAIT_MS, Math.floor(deadline - performance.now())))
        : 0;
      const holder = randomUUID(); // this attempt's own identity (idem_core::holder)
      const body: Record<string, JSONValue> = { ...target.acquireBody, holder };
      if (serverWait > 0) body["wait_ms"] = serverWait;
      const sentAt = performance.now();
      const a = await transport.send({
        method: "POST",
        path: target.acquirePath,
        body,
        timeoutMs: b.timeoutMs + serverWait,
      });
      if (a.status === 200 || a.status === 201 || a.status === 202) {
        // A grant or a replay of another key (or a grant for another holder) must not run or
        // answer this one: the request's own answer went elsewhere.
        const op = operationFrom(a.body);
        checkAnswer(target.describe, "the key", answerKey(target, op.key), op.key);
        if (a.status === 201) checkAnswer(target.describe, "the lease holder", holder, op.leaseHolder);
        if (a.status !== 202) return new Claim(transport, target, b, a, sentAt);
        throw op.state === "UNKNOWN" ? new OutcomeUnknownError(op) : new OperationPendingError(op);
      }
      const err = answerError(a);
      const left = deadline - performance.now();
      if (!(err instanceof InProgressError) || err instanceof RetryNotDueError || left <= 10) throw err;
      // idem waited server-side already when it could; steps are polled.
      if (!target.serverWaits) await sleep(Math.min(left, 100));
    }
  }

  // --- what the claim shows ---------------------------------------------------------

  /** `201`: this claim holds the lease; perform the effect, then report it. */
  get acquired(): boolean {
    return this.#status === 201;
  }

  /** `200`: the operation is final (SUCCEEDED or FAILED): do not perform it. */
  get replayed(): boolean {
    return this.#status === 200;
  }

  /** `200` + `Idem-Performed-By: connector`: idem's connector performed it in this call. */
  get performedByConnector(): boolean {
    return this.#connector;
  }

  /** The operation record as idem last answered it. */
  get operation(): Operation {
    return this.#operation;
  }

  /** The operation's idempotency key (for a step, the step's operation key). */
  get key(): string {
    return this.#operation.key;
  }

  /** The operation's state as idem last answered it. */
  get state(): string {
    return this.#operation.state;
  }

  /** The stored result (a replay), or the one this claim completed with. */
  get result(): JSONValue {
    return this.#operation.result;
  }

  /** The lease's fencing token (the latest one, for a replay). */
  get fencingToken(): number {
    return this.#operation.fencingToken;
  }

  /** The lease this claim holds (only when {@link acquired}). @throws NotHeldError for a replay. */
  get lease(): Lease {
    if (this.#lease === undefined) {
      throw new NotHeldError(`${this.#target.describe} holds no lease here (status ${this.#status})`);
    }
    return this.#lease;
  }

  // --- the heartbeat ----------------------------------------------------------------

  #schedule(): void {
    // #renewOnce handles every answer and error; a bug in it must not become an unhandled
    // rejection in the user's process: the next beat comes anyway.
    this.#beat = setTimeout(() => void this.#renewOnce().catch(() => this.#beating && this.#schedule()), this.#b.renewEveryMs);
    this.#beat.unref();
  }

  async #renewOnce(): Promise<void> {
    const lease = this.#lease;
    if (!this.#beating || lease === undefined) return;
    const sentAt = performance.now();
    let a: Answer | undefined;
    let failure: unknown;
    try {
      a = await this.#transport.send({
        method: "POST",
        path: `/v1/operations/${segment(this.#operation.key)}/renew`,
        body: { fencing_token: lease.fencingToken, lease_ms: this.#b.leaseMs },
        timeoutMs: this.#b.timeoutMs,
      });
    } catch (e) {
      failure = e;
    }
    if (!this.#beating) return; // completed meanwhile: this answer says nothing about the lease
    if (a?.status === 200) {
      const op = operationFrom(a.body);
      // Another request's answer says nothing about this lease: renew again at the next beat.
      if (op.key === this.#operation.key && op.fencingToken === lease.fencingToken) lease.renewed(sentAt);
      this.#schedule();
      return;
    }
    const err = a !== undefined ? answerError(a) : failure;
    const final = [LeaseLostError, NotExecutingError, NotFoundError, LateArrivalError, ConnectorOwnedError];
    if (final.some((c) => err instanceof c) || lease.lost) {
      lease.lose(err);
      this.#beating = false;
      return;
    }
    this.#schedule(); // a passing failure (unreachable, 503): try again at the next beat
  }

  #stopHeartbeat(): void {
    this.#beating = false;
    clearTimeout(this.#beat);
  }

  // --- completions ------------------------------------------------------------------

  async #complete(body: Record<string, JSONValue>): Promise<Operation> {
    const lease = this.#lease;
    if (lease === undefined || !this.acquired) {
      throw new NotHeldError(`${this.#target.describe}: this claim holds no lease (a replay is final)`);
    }
    if (this.#completionTried) throw new NotHeldError(`${this.#target.describe}: this claim was completed already`);
    this.#completionTried = true;
    this.#completion = Object.freeze({ ...body });
    this.#stopHeartbeat();
    lease.release();
    const req: Request = {
      method: "POST",
      path: this.#target.completePath,
      body: { ...body, fencing_token: lease.fencingToken },
      timeoutMs: this.#b.timeoutMs,
    };
    let a: Answer;
    try {
      // The effect happened and resending the same completion is safe: resent until the
      // lease's end, so an idem restart during the effect does not lose its outcome.
      a = await this.#transport.send(req, lease.endsAt);
    } catch (e) {
      // No answer, or a 503 (or another "try again") until the lease's end.
      if (e instanceof TransportError || e instanceof ProblemError) throw this.#notRecorded(e);
      throw e;
    }
    if (a.status === 200 && typeof a.body === "object" && a.body !== null) {
      const op = operationFrom(a.body);
      try {
        checkAnswer(this.#target.describe, "the key", this.#operation.key, op.key);
        checkAnswer(this.#target.describe, "the fencing token", lease.fencingToken, op.fencingToken);
      } catch (e) {
        throw this.#notRecorded(e as Error);
      }
      this.#operation = op;
      return op;
    }
    let err = answerError(a);
    if (err instanceof StaleFencingTokenError) {
      err = new StaleFencingTokenError(
        {
          ...err.problem,
          detail:
            `${this.#target.describe}: the completion was refused because the lease was lost and another attempt ` +
            `was granted since (token ${err.currentFencingToken}); nothing was recorded from this attempt. ${err.detail}`,
        },
        err.status,
        err.requestId,
        err.retryAfterMs,
      );
    }
    if (err instanceof LeaseLostError) lease.lose(err);
    throw err;
  }

  #notRecorded(e: Error): OutcomeNotRecordedError {
    const token = this.#lease?.fencingToken ?? null;
    return new OutcomeNotRecordedError(
      `${this.#target.describe}: the outcome could not be reported to idem until the lease's end (${e.message}); ` +
        "the operation stays EXECUTING until its lease runs out, then it is UNKNOWN: never performed twice. " +
        `Report it later with client.complete(e.key, e.fencingToken, e.completion) (fencing token ${token})`,
      { key: this.#operation.key, recordedState: null, fencingToken: token, completion: this.#completion },
      { cause: e },
    );
  }

  /**
   * Completes SUCCEEDED with the provider's evidence (`providerRef`: a string of at most 512
   * bytes of UTF-8, or an integer — a safe `number` or a `bigint` — kept as its decimal string)
   * and an optional JSON `result` replayed to every later trigger, as JSON.
   *
   * @throws InvalidInputError bad evidence or a result that is not JSON (nothing sent yet).
   * @throws StaleFencingTokenError the lease was lost to another attempt; nothing recorded.
   * @throws OutcomeNotRecordedError idem could not be told until the lease's end (the
   * completion is resent, same token and outcome, for as long as the lease is valid); it
   * carries `fencingToken` and `completion`, for `client.complete(...)` later.
   */
  async succeeded(providerRef: string | number | bigint, result?: unknown): Promise<Operation> {
    return this.#complete(succeededBody(providerRef, result));
  }

  /**
   * Completes a failure that did nothing and may be tried again: PENDING, next attempt after
   * full-jitter backoff (`retryAfterMs` is a floor, 0-86 400 000 ms), FAILED after 8 attempts.
   * `errorClass`: 1-64 of `[A-Za-z0-9_.-]`.
   *
   * @throws InvalidInputError a bad `errorClass` or `retryAfterMs` (nothing sent; the claim can
   * still complete).
   */
  async retryableFailure(errorClass: string, options: { message?: string; retryAfterMs?: number } = {}): Promise<Operation> {
    const body: Record<string, JSONValue> = { outcome: "retryable_failure", error_class: checkedClass(errorClass) };
    if (options.message !== undefined) body["message"] = messageOf(options.message);
    if (options.retryAfterMs !== undefined) {
      const ms = options.retryAfterMs;
      if (!Number.isInteger(ms) || ms < 0 || ms > 86_400_000) {
        throw new InvalidInputError(`retryAfterMs is ${ms}; it must be an integer of 0-86400000 ms`);
      }
      body["retry_after_ms"] = ms;
    }
    return this.#complete(body);
  }

  /**
   * Completes FAILED for good (replayed from now on), with an optional JSON `result`.
   *
   * @throws InvalidInputError a bad `errorClass` or a result that is not JSON (nothing sent).
   */
  async finalFailure(errorClass: string, options: { message?: string; result?: unknown } = {}): Promise<Operation> {
    const body: Record<string, JSONValue> = { outcome: "final_failure", error_class: checkedClass(errorClass) };
    if (options.message !== undefined) body["message"] = messageOf(options.message);
    if (options.result !== undefined && options.result !== null) body["result"] = toJSON(options.result, "result");
    return this.#complete(body);
  }

  /** Completes UNKNOWN: the effect may or may not have happened (a timeout after sending). */
  async unknown(message?: string): Promise<Operation> {
    const body: Record<string, JSONValue> = { outcome: "unknown" };
    if (message !== undefined) body["message"] = messageOf(message);
    return this.#complete(body);
  }

  /**
   * Completes by what `error` proves: a retryable failure when the claim's `retryable` names it
   * (its `retryAfterMs`, when an integer, is the floor of the next attempt), a final failure
   * when `final` names it, else UNKNOWN (it may have come after the effect started).
   */
  async completeWithError(error: unknown): Promise<Operation> {
    return this.#complete(this.#errorBody(error));
  }

  #errorBody(error: unknown): Record<string, JSONValue> {
    if (matches(error, this.#b.retryable)) {
      const body: Record<string, JSONValue> = {
        outcome: "retryable_failure",
        error_class: errorClassOf(error),
        message: messageOf(error),
      };
      const floor = (error as { retryAfterMs?: unknown } | null)?.retryAfterMs; // a provider's Retry-After, in ms
      if (typeof floor === "number" && Number.isInteger(floor) && floor >= 0 && floor <= 86_400_000) {
        body["retry_after_ms"] = floor;
      }
      return body;
    }
    if (matches(error, this.#b.final)) {
      return { outcome: "final_failure", error_class: errorClassOf(error), message: messageOf(error) };
    }
    return { outcome: "unknown", message: messageOf(error) };
  }

  /**
   * @internal Completes SUCCEEDED; if idem refuses that completion as malformed (400 or 413:
   * nothing was recorded), completes UNKNOWN instead (the effect happened) and returns the
   * refusal.
   */
  async succeededOrUnknown(providerRef: string, result: JSONValue): Promise<InvalidRequestError | null> {
    try {
      await this.succeeded(providerRef, result);
      return null;
    } catch (e) {
      if (!(e instanceof InvalidRequestError)) throw e;
      this.#completionTried = false;
      await this.unknown(messageOf(e));
      return e;
    }
  }

  /**
   * Ends the claim: stops the heartbeat; a claim that holds the lease and reported no outcome is
   * completed UNKNOWN (the effect may have started), and then this throws
   * {@link ClaimNotCompletedError}. Safe to call again.
   */
  async close(): Promise<void> {
    this.#stopHeartbeat();
    if (!this.acquired || this.#completionTried) {
      this.#lease?.release();
      return;
    }
    const rec = await this.#complete({
      outcome: "unknown",
      message: "the claim was closed without reporting an outcome",
    });
    throw new ClaimNotCompletedError(
      `${this.#target.describe}: the claim was closed without succeeded(), retryableFailure(), finalFailure(), ` +
        "unknown() or completeWithError(); it was completed UNKNOWN",
      { key: rec.key, recordedState: rec.state },
    );
  }

  /** {@link close}, for `await using` (ECMAScript explicit resource management). */
  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

/** The target of `POST /v1/operations` for `key`. */
export function operationTarget(key: string, body: Record<string, JSONValue>): Target {
  return {
    describe: `operation ${JSON.stringify(key)}`,
    key,
    acquirePath: "/v1/operations",
    acquireBody: body,
    completePath: `/v1/operations/${segment(key)}/complete`,
    serverWaits: true,
  };
}

/** The target of `POST /v1/workflows/{instance}/steps/{step}`. */
export function stepTarget(instanceId: string, step: string, body: Record<string, JSONValue>): Target {
  const base = `/v1/workflows/${segment(instanceId)}/steps/${segment(step)}`;
  return {
    describe: `step ${JSON.stringify(step)} of ${JSON.stringify(instanceId)}`,
    key: `${instanceId}:${step}`,
    acquirePath: base,
    acquireBody: body,
    completePath: `${base}/complete`,
    serverWaits: false,
  };
}
