/** The client: where idem is, its API key, and the calls. */

import { Claim, type ErrorMatcher, checkMatchers, operationTarget, stepTarget } from "./claim.js";
import { InvalidInputError } from "./errors.js";
import { DEFAULT_RETRY, type Answer, type RetryPolicy, Transport, USER_AGENT, answerError, checkAnswer, segment } from "./http.js";
import { type Idempotent, type IdempotentOptions, guard } from "./idempotent.js";
import { toJSON } from "./json.js";
import { type Instance, type JSONValue, type Operation, instanceFrom, operationFrom } from "./records.js";

/** Lease lengths idem accepts, in ms (README "Request fields"). */
export const MIN_LEASE_MS = 100;
export const MAX_LEASE_MS = 3_600_000;

/**
 * Where idem is and how to talk to it.
 *
 * `url` defaults to `IDEM_URL` (else `http://127.0.0.1:8080`), `apiKey` to `IDEM_API_KEY`.
 * `timeoutMs`: how long one request may wait for its answer (plus any `waitMs`; default 10 000).
 * `retry`: how idem's own calls are retried ({@link RetryPolicy}; fields left out keep
 * {@link DEFAULT_RETRY}'s). `fetch`: the `fetch` to use (default: the runtime's; pass one bound
 * to an undici `Agent` for a proxy or custom TLS).
 */
export interface ClientOptions {
  readonly url?: string;
  readonly apiKey?: string;
  readonly timeoutMs?: number;
  readonly retry?: Partial<RetryPolicy>;
  readonly fetch?: typeof fetch;
}

/**
 * A claim's options.
 *
 * `action`: the kind of side effect (1-128 of `[A-Za-z0-9_.:-]`). `payload`: the JSON that
 * defines the intent (default `null`). `fingerprintFields`: JSON pointers (RFC 6901) of the
 * payload fields that define the intent. `leaseMs` (100-3 600 000, default 30 000): the lease,
 * renewed every `renewEveryMs` (default a third of it) while `heartbeat` is on (default).
 * `waitMs` (default 0): how long to wait for a concurrent duplicate's outcome (0: reject with
 * `InProgressError` at once). `redoSafe`: doing the action twice is harmless, so an expired
 * lease is granted again instead of becoming UNKNOWN (default false: never redone).
 * `retryable` / `final`: the errors that prove nothing happened, completed by
 * `completeWithError` as a retryable / final failure — error classes (`instanceof`) or
 * predicates. The thrown error itself is judged, never its `cause` chain: an earlier attempt
 * that was refused says nothing about the last one, which may have been sent (README "Which
 * errors prove nothing happened"). Any other error completes UNKNOWN.
 */
export interface ClaimOptions {
  readonly action: string;
  readonly payload?: unknown;
  readonly fingerprintFields?: readonly string[];
  readonly leaseMs?: number;
  readonly waitMs?: number;
  readonly redoSafe?: boolean;
  readonly heartbeat?: boolean;
  readonly renewEveryMs?: number;
  readonly retryable?: readonly ErrorMatcher[];
  readonly final?: readonly ErrorMatcher[];
}

/** A step's options: a claim's, without `action` (the step declares it) and `redoSafe` (its `policy`). */
export type StepOptions = Omit<ClaimOptions, "action" | "redoSafe">;

/** A step of a workflow your code runs: its name, or `{ name, action, policy }` (`manual`, the default, or `redo_safe`). */
export type StepDeclaration = string | { readonly name: string; readonly action?: string; readonly policy?: "manual" | "redo_safe" };

/** The options every claim has, checked before anything is sent. @throws InvalidInputError */
function checkOptions(o: { leaseMs?: number; waitMs?: number; renewEveryMs?: number; retryable?: unknown; final?: unknown }): void {
  checkMatchers(o);
  const lease = o.leaseMs ?? 30_000;
  if (!Number.isInteger(lease) || lease < MIN_LEASE_MS || lease > MAX_LEASE_MS) {
    throw new InvalidInputError(`leaseMs is ${lease}; it must be an integer of ${MIN_LEASE_MS}-${MAX_LEASE_MS} ms`);
  }
  const wait = o.waitMs ?? 0;
  if (!Number.isInteger(wait) || wait < 0) throw new InvalidInputError(`waitMs is ${wait}; it must be 0 or more ms`);
  if (o.renewEveryMs !== undefined && !(Number.isFinite(o.renewEveryMs) && o.renewEveryMs > 0)) {
    throw new InvalidInputError(`renewEveryMs is ${o.renewEveryMs}; it must be more than 0 ms`);
  }
}

/**
 * A client of one idem server. Nothing is sent until a call; one client serves any number of
 * concurrent calls (the runtime's `fetch` keeps the connections).
 *
 * @throws InvalidInputError no API key was given or found in `IDEM_API_KEY`, or the URL is not
 * an http(s) URL.
 */
export class Client {
  /** The server's base URL, without a trailing slash. */
  readonly url: string;
  /** How long one request may wait for its answer, in ms. */
  readonly timeoutMs: number;
  readonly #transport: Transport;

  constructor(options: ClientOptions = {}) {
    this.url = (options.url ?? process.env["IDEM_URL"] ?? "http://127.0.0.1:8080").replace(/\/+$/, "");
    if (!URL.canParse(this.url) || !/^https?:$/.test(new URL(this.url).protocol)) {
      throw new InvalidInputError(`idem's URL ${JSON.stringify(this.url)} is not an http:// or https:// URL`);
    }
    const apiKey = options.apiKey ?? process.env["IDEM_API_KEY"];
    if (!apiKey) {
      throw new InvalidInputError("no API key: pass { apiKey } or set IDEM_API_KEY (idem prints one on first start)");
    }
    this.timeoutMs = options.timeoutMs ?? 10_000;
    const retry: RetryPolicy = { ...DEFAULT_RETRY, ...options.retry };
    if (!Number.isInteger(retry.attempts) || retry.attempts < 1) {
      throw new InvalidInputError(`retry.attempts is ${retry.attempts}; it must be 1 or more`);
    }
    this.#transport = new Transport(
      this.url,
      { authorization: `Bearer ${apiKey}`, "user-agent": USER_AGENT },
      retry,
      options.fetch ?? globalThis.fetch,
    );
  }

  /** How idem's own calls are retried. */
  get retry(): RetryPolicy {
    return this.#transport.policy;
  }

  // --- operations ---------------------------------------------------------------------

  /**
   * Acquires the operation `key` for `options.action` with `options.payload` (the intent) and
   * resolves to a {@link Claim}: `acquired` (perform the effect, then report it) or `replayed`
   * (final already). Use it with `await using`, or close it in a `finally`.
   *
   * @throws InvalidInputError (bad option or payload; nothing sent), OutcomeUnknownError (202),
   * InProgressError (409 after waiting `waitMs`), FingerprintMismatchError (422),
   * LateArrivalError (410), InvalidKeyError (400), ServerUnreachableError, and the other
   * ProblemError classes.
   */
  async claim(key: string, options: ClaimOptions): Promise<Claim> {
    checkOptions(options);
    if (typeof key !== "string") throw new InvalidInputError(`the key must be a string, not ${typeof key}`);
    const leaseMs = options.leaseMs ?? 30_000;
    const body: Record<string, JSONValue> = {
      key,
      action: options.action,
      payload: toJSON(options.payload, "payload"),
      lease_ms: leaseMs,
    };
    if (options.fingerprintFields !== undefined) body["fingerprint_fields"] = [...options.fingerprintFields];
    if (options.redoSafe) body["redo_safe"] = true;
    return Claim.acquire(this.#transport, operationTarget(key, body), this.#behaviour(options));
  }

  #behaviour(o: StepOptions) {
    const leaseMs = o.leaseMs ?? 30_000;
    return {
      leaseMs,
      waitMs: o.waitMs ?? 0,
      heartbeat: o.heartbeat ?? true,
      renewEveryMs: o.renewEveryMs ?? Math.max(50, Math.floor(leaseMs / 3)),
      retryable: o.retryable ?? [],
      final: o.final ?? [],
      timeoutMs: this.timeoutMs,
    };
  }

  /**
   * `fn`, guarded with this client: see {@link makeIdempotent}.
   *
   * @throws InvalidInputError bad options (at once, nothing sent).
   */
  makeIdempotent<F extends (...args: any[]) => unknown>(
    fn: F,
    options: Omit<IdempotentOptions<Parameters<F>, Awaited<ReturnType<F>>>, "client">,
  ): Idempotent<F> {
    checkOptions(options);
    return guard(fn, options, () => this);
  }

  static #record(a: Answer, key: string, fencingToken?: number): Operation {
    if (a.status !== 200 || typeof a.body !== "object" || a.body === null) throw answerError(a);
    const op = operationFrom(a.body);
    checkAnswer(`operation ${JSON.stringify(key)}`, "the key", key, op.key);
    if (fencingToken !== undefined) checkAnswer(`operation ${JSON.stringify(key)}`, "the fencing token", fencingToken, op.fencingToken);
    return op;
  }

  /** `GET /v1/operations/{key}`: the record with its `events`. @throws NotFoundError, InvalidKeyError, ... */
  async getOperation(key: string): Promise<Operation> {
    const a = await this.#transport.send({ method: "GET", path: `/v1/operations/${segment(key)}`, timeoutMs: this.timeoutMs });
    return Client.#record(a, key);
  }

  /**
   * `POST /v1/operations/{key}/complete`: reports an outcome with a lease's fencing token,
   * outside a claim — the one an `OutcomeNotRecordedError` carries, later, once idem is
   * back: `await client.complete(e.key, e.fencingToken, e.completion)`. `completion` is the body
   * without the token, as idem takes it (snake_case): `{ outcome: "succeeded", provider_ref,
   * result }`, `{ outcome: "retryable_failure", error_class, message, retry_after_ms }`,
   * `{ outcome: "final_failure", error_class, message, result }` or `{ outcome: "unknown",
   * message }`. Safe to repeat (an identical repeat is answered with the unchanged record); for
   * a workflow step, `key` is the step's operation key (the error carries it), and the instance
   * advances. idem accepts it while no newer lease was granted.
   *
   * @throws InvalidInputError a token that is not a safe integer, a completion that is not a
   * JSON object (nothing sent).
   * @throws StaleFencingTokenError another lease was granted since: nothing recorded.
   * @throws OperationFinalError another outcome was recorded; InvalidRequestError,
   * LateArrivalError, NotFoundError, ServerUnreachableError, NoAnswerError (and its
   * AnswerMismatchError).
   */
  async complete(key: string, fencingToken: number, completion: Readonly<Record<string, JSONValue>>): Promise<Operation> {
    if (typeof key !== "string") throw new InvalidInputError(`the key must be a string, not ${typeof key}`);
    if (!Number.isSafeInteger(fencingToken)) {
      throw new InvalidInputError(`fencingToken must be an integer, not ${JSON.stringify(fencingToken) ?? String(fencingToken)}`);
    }
    const body = toJSON(completion, "completion");
    if (typeof body !== "object" || body === null || Array.isArray(body)) {
      throw new InvalidInputError("completion must be a JSON object: { outcome, ... } without the fencing token");
    }
    const a = await this.#transport.send({
      method: "POST",
      path: `/v1/operations/${segment(key)}/complete`,
      body: { ...body, fencing_token: fencingToken },
      timeoutMs: this.timeoutMs,
    });
    return Client.#record(a, key, fencingToken);
  }

  // --- workflows your code runs ------------------------------------------------------

  static #instance(a: Answer, instanceId: string): Instance {
    if ((a.status !== 200 && a.status !== 201) || typeof a.body !== "object" || a.body === null) throw answerError(a);
    const instance = instanceFrom(a.body);
    checkAnswer(`instance ${JSON.stringify(instanceId)}`, "the instance id", instanceId, instance.instanceId);
    return instance;
  }

  /**
   * `POST /v1/workflows`: starts the instance `instanceId` (or finds it: the same id and input
   * are the same instance). `steps`: for a workflow your code runs, its steps in order.
   *
   * @throws InstanceMismatchError (422) the same id with another workflow, input or steps;
   * UnknownWorkflowError, InvalidDefinitionError, LateArrivalError.
   */
  async startWorkflow(
    workflow: string,
    instanceId: string,
    options: { input?: unknown; steps?: readonly StepDeclaration[]; sourceEvent?: string; traceId?: string } = {},
  ): Promise<Instance> {
    const body: Record<string, JSONValue> = {
      workflow,
      instance_id: instanceId,
      input: toJSON(options.input, "input"),
    };
    if (options.steps !== undefined) {
      body["steps"] = options.steps.map((s) => (typeof s === "string" ? { name: s } : toJSON(s, "step")));
    }
    if (options.sourceEvent !== undefined) body["source_event"] = options.sourceEvent;
    if (options.traceId !== undefined) body["trace_id"] = options.traceId;
    const a = await this.#transport.send({ method: "POST", path: "/v1/workflows", body, timeoutMs: this.timeoutMs });
    return Client.#instance(a, instanceId);
  }

  /** `GET /v1/workflows/{instance}`: the instance with its steps and events. */
  async getWorkflow(instanceId: string): Promise<Instance> {
    const a = await this.#transport.send({
      method: "GET",
      path: `/v1/workflows/${segment(instanceId)}`,
      timeoutMs: this.timeoutMs,
    });
    return Client.#instance(a, instanceId);
  }

  /**
   * A claim on a step your code performs (`POST /v1/workflows/{instance}/steps/{step}`), used
   * like {@link claim}: `acquired` → perform it and report it (the instance advances);
   * `replayed` → it finished before.
   *
   * @throws also PreviousStepUnfinishedError, InstanceNotRunningError, UnknownStepError; an
   * UNKNOWN step rejects with OutcomeUnknownError (the instance pauses for a person).
   */
  async step(instanceId: string, step: string, options: StepOptions = {}): Promise<Claim> {
    checkOptions(options);
    const body: Record<string, JSONValue> = {
      payload: toJSON(options.payload, "payload"),
      lease_ms: options.leaseMs ?? 30_000,
    };
    if (options.fingerprintFields !== undefined) body["fingerprint_fields"] = [...options.fingerprintFields];
    return Claim.acquire(this.#transport, stepTarget(instanceId, step, body), this.#behaviour(options));
  }
}

let fallback: Client | undefined;

/** The client {@link makeIdempotent} uses when given none: made from `IDEM_URL` and `IDEM_API_KEY` at its first use. */
export function defaultClient(): Client {
  fallback ??= new Client();
  return fallback;
}

/**
 * Makes `fn` run once per idempotency key: the first call acquires the lease, runs `fn` and
 * completes the operation SUCCEEDED with its result and evidence; a repeat resolves to the
 * recorded result without running `fn`. Returns a function with `fn`'s parameters and `this`
 * (always async). Inside `fn`, {@link currentLease} is its lease (`.signal` aborts when it is
 * lost); a heartbeat renews it while `fn` runs.
 *
 * A call rejects before `fn` runs with what {@link Client.claim} rejects with
 * (`OutcomeUnknownError` for an UNKNOWN operation, `InProgressError`, `FingerprintMismatchError`,
 * `InvalidKeyError`, `InvalidInputError`, `ServerUnreachableError`, ...), or with
 * `OperationFailedError` for a replay of a FAILED operation; after `fn` ran, with `fn`'s own
 * error (completed as a retryable or final failure when declared, else UNKNOWN),
 * `ResultNotStorableError`, `StaleFencingTokenError` or `OutcomeNotRecordedError` (idem could
 * not be told until the lease's end: it carries the fencing token and the completion, for
 * {@link Client.complete} later). A replay resolves to the stored result as JSON (through
 * `deserialize` when given), not the value `fn` returned the first time.
 *
 * @throws InvalidInputError bad options (at once, nothing sent).
 */
export function makeIdempotent<F extends (...args: any[]) => unknown>(
  fn: F,
  options: IdempotentOptions<Parameters<F>, Awaited<ReturnType<F>>>,
): Idempotent<F> {
  checkOptions(options);
  const client = options.client;
  return guard(fn, options, () => client ?? defaultClient());
}
