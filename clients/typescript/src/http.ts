/**
 * idem's own HTTP calls, on the runtime's `fetch`, with bounded retries.
 *
 * Every call idem-client makes is safe to send again: an acquire is resent with the same
 * `holder` (a resend after a lost answer gets its own grant back, README "Five minutes with
 * curl"), a completion repeated is answered with the unchanged record, a renewal moves the
 * lease end again, a workflow start with the same input is the same instance. So a call is
 * retried, with full jitter (AWS Architecture Blog, "Exponential Backoff And Jitter"), when:
 *
 * - no connection could be made (refused, unknown host, no route): nothing was sent;
 * - the answer was lost (a timeout, a reset, a connection closed mid-answer);
 * - idem (or a gateway in front of it) answered `503`, `502`, `504`, `429`, `408` or
 *   `409 contention`: nothing is known to have been recorded; `Retry-After` (RFC 9110
 *   §10.2.3) is the floor of the wait.
 *
 * A call with `until` (a completion: the effect happened, and its report is idempotent) is
 * resent, with the same capped full-jitter waits, until that instant (the lease's end) however
 * many tries that takes, and no wait runs past it, whatever `Retry-After` asks: an idem restart
 * during the effect does not lose its outcome, and a completion gives up when its lease ends
 * (its error carries what to report later). One sent after `until` is a late completion and
 * gets the policy's tries, as any call.
 */

import { performance } from "node:perf_hooks";
import { setTimeout as sleep } from "node:timers/promises";

import { AnswerMismatchError, NoAnswerError, type ProblemError, ServerUnreachableError, problemError } from "./errors.js";
import type { JSONValue } from "./records.js";

/** The library's name and version, sent as `User-Agent`. */
export const USER_AGENT = "idem-client-node/0.1.0";

/**
 * How idem-client retries its own calls to idem.
 *
 * `attempts`: tries in all for one call (1: no retry). `baseMs` and `capMs`: the n-th retry
 * waits a random time in [0, min(capMs, baseMs · 2^n)] ms (full jitter), at least the
 * `Retry-After` the answer asked for. `maxRetryAfterMs`: a `Retry-After` longer than this is
 * not waited for; the error is thrown at once with `retryAfterMs` set.
 *
 * A completion (the effect happened; resending it is safe) is retried beyond `attempts`, with
 * the same waits, for as long as its lease is valid, and never waits past the lease's end;
 * then it rejects with `OutcomeNotRecordedError`, which carries what to report later.
 */
export interface RetryPolicy {
  readonly attempts: number;
  readonly baseMs: number;
  readonly capMs: number;
  readonly maxRetryAfterMs: number;
}

/** 5 tries, 100 ms base, 2 s cap; a `Retry-After` over 10 s is not waited for. */
export const DEFAULT_RETRY: RetryPolicy = Object.freeze({ attempts: 5, baseMs: 100, capMs: 2000, maxRetryAfterMs: 10_000 });

/** Milliseconds to wait before retry number `retry` (0-based): full jitter, at least `retryAfterMs`. */
export function retryDelayMs(policy: RetryPolicy, retry: number, retryAfterMs: number | null): number {
  const jitter = Math.random() * Math.min(policy.capMs, policy.baseMs * 2 ** Math.min(retry, 32));
  return Math.max(jitter, retryAfterMs ?? 0);
}

/** One HTTP answer of idem: status, headers and the JSON body (`undefined` if not JSON). */
export interface Answer {
  readonly status: number;
  readonly headers: Headers;
  readonly body: unknown;
}

/** `Retry-After` in ms: delay-seconds or an HTTP-date (RFC 9110 §10.2.3); `null` when absent or unreadable. */
export function retryAfterMs(headers: Headers): number | null {
  const raw = headers.get("retry-after")?.trim();
  if (raw === undefined || raw === "") return null;
  if (/^\d+$/.test(raw)) return Number(raw) * 1000;
  const when = Date.parse(raw);
  return Number.isNaN(when) ? null : Math.max(0, when - Date.now());
}

/** The error for an error answer (RFC 9457 problem document, or one made from the status for a gateway's non-problem answer). */
export function answerError(a: Answer): ProblemError {
  const body = a.body;
  const problem =
    typeof body === "object" && body !== null && typeof (body as Record<string, unknown>)["type"] === "string"
      ? (body as Record<string, unknown>)
      : { type: "about:blank", title: `HTTP ${a.status}`, status: a.status, detail: `HTTP ${a.status} without a problem document` };
  return problemError(a.status, problem, a.headers.get("x-request-id"), retryAfterMs(a.headers));
}

/**
 * Throws {@link AnswerMismatchError} when an answer's `field` (`the key`, `the lease
 * holder`, `the fencing token`, `the instance id`) is not the request's.
 */
export function checkAnswer(what: string, field: string, expected: string | number, got: string | number | null): void {
  if (expected === got) return;
  throw new AnswerMismatchError(
    `${what}: idem's answer is about ${field} ${JSON.stringify(got)}, the request was about ` +
      `${JSON.stringify(expected)}; the request's own answer went elsewhere (a proxy or connection pool that ` +
      "mixes answers up). Nothing was done with the stray answer",
    { expected: `${field} ${JSON.stringify(expected)}`, got: `${field} ${JSON.stringify(got)}` },
  );
}

function retryableStatus(a: Answer): boolean {
  if ([408, 429, 502, 503, 504].includes(a.status)) return true;
  const body = a.body as Record<string, unknown> | undefined;
  return a.status === 409 && typeof body === "object" && body !== null && body["type"] === "/problems/contention";
}

/** Error codes (Node's and undici's) that mean no connection was made: nothing was sent. */
const UNSENT_CODES = new Set([
  "ECONNREFUSED",
  "ENOTFOUND",
  "EAI_AGAIN",
  "EHOSTUNREACH",
  "ENETUNREACH",
  "EADDRNOTAVAIL",
  "UND_ERR_CONNECT_TIMEOUT",
]);

/**
 * Whether a `fetch` rejection says that no connection was made (its `cause`, or every error of
 * an AggregateError): a refused connection, or a port `fetch` never connects to (the Fetch
 * standard's "bad port" list: 6000, 5060, ...).
 */
function unsent(e: unknown, depth = 0): boolean {
  if (typeof e !== "object" || e === null || depth > 4) return false;
  const { code, cause, errors, message } = e as { code?: unknown; cause?: unknown; errors?: unknown; message?: unknown };
  if (typeof code === "string" && UNSENT_CODES.has(code)) return true;
  if (message === "bad port") return true;
  if (Array.isArray(errors) && errors.length > 0) return errors.every((x) => unsent(x, depth + 1));
  return unsent(cause, depth + 1);
}

function describe(e: unknown): string {
  if (!(e instanceof Error)) return String(e);
  const cause = e.cause instanceof Error ? `: ${e.cause.message}` : "";
  return `${e.name}: ${e.message}${cause}`;
}

/** One call: method, path (already percent-encoded), JSON body, how long the answer may take (ms). */
export interface Request {
  readonly method: "GET" | "POST";
  readonly path: string;
  readonly body?: JSONValue;
  readonly timeoutMs: number;
}

/** Where idem is and how to ask it: the base URL, the headers of every call, the retry policy. */
export class Transport {
  readonly #base: string;
  readonly #headers: Readonly<Record<string, string>>;
  readonly #fetch: typeof fetch;
  readonly policy: RetryPolicy;

  constructor(base: string, headers: Record<string, string>, policy: RetryPolicy, fetchImpl: typeof fetch) {
    this.#base = base;
    this.#headers = headers;
    this.policy = policy;
    this.#fetch = fetchImpl;
  }

  /**
   * Sends `req` (retried as the module docs say; with `until`, a `performance.now()` instant,
   * resent until then instead of the policy's tries while it is ahead); the final answer,
   * whatever its status.
   *
   * @throws ServerUnreachableError, NoAnswerError the retries are spent without an answer.
   * @throws ProblemError the retries are spent on retryable answers (503, ...).
   */
  async send(req: Request, until?: number): Promise<Answer> {
    const what = `${req.method} ${req.path}`;
    const headers: Record<string, string> = { ...this.#headers, accept: "application/json" };
    let body: string | undefined;
    if (req.body !== undefined) {
      headers["content-type"] = "application/json";
      body = JSON.stringify(req.body); // serialized once: every resend is the same request
    }
    const deadline = until !== undefined && until > performance.now() ? until : undefined;
    let tries = 0;
    let maybeDelivered = false;
    let lastError: unknown;
    let lastAnswer: Answer | undefined;
    for (;;) {
      let wait: number | null;
      tries += 1;
      try {
        const answer = await this.#once(req, headers, body);
        if (!retryableStatus(answer)) return answer;
        maybeDelivered = true;
        lastAnswer = answer;
        lastError = undefined;
        wait = this.#next(tries, retryAfterMs(answer.headers), deadline);
      } catch (e) {
        if (!unsent(e)) maybeDelivered = true;
        lastError = e;
        lastAnswer = undefined;
        wait = this.#next(tries, null, deadline);
      }
      if (wait === null) {
        if (lastAnswer !== undefined) throw answerError(lastAnswer);
        if (maybeDelivered) {
          throw new NoAnswerError(
            `${what}: no answer from idem after ${tries} tries (${describe(lastError)}); it may have been recorded: ` +
              "an acquire that was granted ends UNKNOWN when its lease runs out, never done twice",
            tries,
            { cause: lastError },
          );
        }
        throw new ServerUnreachableError(
          `${what}: idem could not be reached after ${tries} tries (${describe(lastError)}); nothing was sent`,
          tries,
          { cause: lastError },
        );
      }
      await sleep(wait);
    }
  }

  /** Milliseconds to wait before the next try, or `null` to give up (see the module docs). */
  #next(tries: number, retryAfter: number | null, until: number | undefined): number | null {
    const wait = retryDelayMs(this.policy, tries - 1, retryAfter);
    if (until !== undefined) {
      const left = until - performance.now();
      return left > 0 ? Math.min(wait, left) : null; // never past `until`: the last try is at it at the latest
    }
    const tooLong = retryAfter !== null && retryAfter > this.policy.maxRetryAfterMs;
    return tries >= this.policy.attempts || tooLong ? null : wait;
  }

  async #once(req: Request, headers: Record<string, string>, body: string | undefined): Promise<Answer> {
    const init: RequestInit = { method: req.method, headers, signal: AbortSignal.timeout(req.timeoutMs) };
    if (body !== undefined) init.body = body;
    const r = await this.#fetch(this.#base + req.path, init);
    const text = await r.text(); // a body lost mid-answer rejects here: maybe delivered
    let parsed: unknown;
    if ((r.headers.get("content-type") ?? "").includes("json")) {
      try {
        parsed = JSON.parse(text);
      } catch {
        parsed = undefined;
      }
    }
    return { status: r.status, headers: r.headers, body: parsed };
  }
}

/** A path segment percent-encoded (RFC 3986 §3.3), `.` and `..` included, which URL parsing would remove. */
export function segment(s: string): string {
  const e = encodeURIComponent(s);
  return /^\.+$/.test(e) ? e.replaceAll(".", "%2E") : e;
}
