/**
 * The errors of idem-client: one class per problem type idem answers with (RFC 9457
 * `application/problem+json`, branched on `type` as the README says), and the client's own.
 *
 * Every error is an {@link IdemError}. Answers of the server are {@link ProblemError}s carrying
 * the problem document and the request id.
 */

import type { JSONValue, Operation } from "./records.js";

/** Base class of every error idem-client throws. */
export class IdemError extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = new.target.name;
  }
}

// --- answers of idem that are not problems -------------------------------------------

/**
 * The operation's outcome is UNKNOWN (a `202`): a worker's lease ended while it may have
 * acted, or its attempt ended without a known result. The function is **not** run again until
 * the reconciler's lookup or an operator settles the operation (`idem ops resolve KEY ...`);
 * `operation` is the record (`needsReview`, `errorMessage` say why). README "What a trigger
 * gets".
 */
export class OutcomeUnknownError extends IdemError {
  readonly operation: Operation;

  constructor(operation: Operation, message?: string) {
    super(
      message ??
        `the outcome of ${JSON.stringify(operation.key)} is UNKNOWN: it may have taken effect, so it is not ` +
          "performed again until it is reconciled or an operator resolves it" +
          (operation.errorMessage ? ` (${operation.errorMessage})` : ""),
    );
    this.operation = operation;
  }
}

/**
 * A `202` for an operation idem's connector performs: its attempt runs or a retry is
 * scheduled. Not yours to perform; `operation` is the record (poll it with `getOperation`).
 */
export class OperationPendingError extends IdemError {
  readonly operation: Operation;

  constructor(operation: Operation) {
    super(`${JSON.stringify(operation.key)} is ${operation.state} at idem (a connector performs it): do not perform it`);
    this.operation = operation;
  }
}

/**
 * The operation is FAILED (a final failure, or its retries ran out): a replay of the stored
 * error. `errorClass`, `errorMessage` and `result` (the stored result of a final failure) come
 * from `operation`.
 */
export class OperationFailedError extends IdemError {
  readonly operation: Operation;
  readonly errorClass: string | null;
  readonly errorMessage: string | null;
  readonly result: JSONValue;

  constructor(operation: Operation) {
    super(
      `${JSON.stringify(operation.key)} FAILED before (${operation.errorClass}: ${operation.errorMessage}); ` +
        "a failed operation is replayed, never performed again under its key",
    );
    this.operation = operation;
    this.errorClass = operation.errorClass;
    this.errorMessage = operation.errorMessage;
    this.result = operation.result;
  }
}

// --- the client's own ----------------------------------------------------------------

/**
 * Bad input found before anything was sent (a key that could not be made from the arguments,
 * a payload that is not JSON idem stores, an option out of range). Nothing was sent, nothing
 * recorded.
 */
export class InvalidInputError extends IdemError {}

/** A value cannot be stored as JSON by idem; the message names its path (a JSON pointer). */
export class NotJSONError extends InvalidInputError {}

/** idem could not be asked: see {@link ServerUnreachableError} and {@link NoAnswerError}. */
export class TransportError extends IdemError {
  /** How many times the request was tried. */
  readonly attempts: number;

  constructor(message: string, attempts: number, options?: ErrorOptions) {
    super(message, options);
    this.attempts = attempts;
  }
}

/**
 * No connection to idem could be made (refused, no route, unknown host) after the retries:
 * nothing was sent, so nothing was recorded; calling again is safe.
 */
export class ServerUnreachableError extends TransportError {}

/**
 * A request reached idem (or may have) but its answer was lost every time it was resent (a
 * timeout, a reset). What it did is unknown: an acquire that was granted ends UNKNOWN when
 * its lease runs out, and is not performed twice.
 */
export class NoAnswerError extends TransportError {}

/**
 * An answer of idem is about another key, lease holder or fencing token than the request it
 * came back for: the request's own answer went elsewhere (a proxy or a connection pool that
 * mixes answers up), so this request counts as one whose answer was lost ({@link
 * NoAnswerError}). Nothing is done with the stray answer: the function does not run on another
 * key's grant, a replay does not return another key's result, and a completion is not taken as
 * recorded (it rejects with {@link OutcomeNotRecordedError}, this error as its `cause`).
 * `expected` and `got` name what differed (`the key "K-1"`).
 */
export class AnswerMismatchError extends NoAnswerError {
  readonly expected: string;
  readonly got: string;

  constructor(message: string, fields: { expected: string; got: string }) {
    super(message, 1);
    this.expected = fields.expected;
    this.got = fields.got;
  }
}

/**
 * The function ran (the effect may have happened) but idem did not record the outcome the
 * library wanted to report. `recordedState` is what idem holds now when known (`UNKNOWN` after
 * the library reported it so; `null` when idem could not be told: then the lease runs out into
 * UNKNOWN). `result` is what the function returned, if it returned; `cause` the reason.
 *
 * `fencingToken` and `completion` (the completion's JSON body without the token: `outcome` and
 * its fields, snake_case as idem takes them) are set when idem could not be told until the
 * lease's end: keep them (a table, a durable queue) and report the outcome later with
 * `client.complete(e.key, e.fencingToken, e.completion)`. idem accepts a late completion with
 * the token while no newer lease was granted (README "Leases"; a `redoSafe` action may have
 * been granted again, then it rejects with `StaleFencingTokenError`), and its evidence settles
 * the UNKNOWN the lease ran out into. Both are `null` otherwise.
 */
export class OutcomeNotRecordedError extends IdemError {
  readonly key: string;
  readonly recordedState: string | null;
  readonly result: unknown;
  readonly fencingToken: number | null;
  readonly completion: Readonly<Record<string, JSONValue>> | null;

  constructor(
    message: string,
    fields: {
      key: string;
      recordedState: string | null;
      result?: unknown;
      fencingToken?: number | null;
      completion?: Readonly<Record<string, JSONValue>> | null;
    },
    options?: ErrorOptions,
  ) {
    super(message, options);
    this.key = fields.key;
    this.recordedState = fields.recordedState;
    this.result = fields.result;
    this.fencingToken = fields.fencingToken ?? null;
    this.completion = fields.completion ?? null;
  }
}

/**
 * The function returned, but its value (or the evidence read from it) cannot be stored: not
 * JSON as idem keeps it (RFC 8259 / I-JSON RFC 7493: finite numbers within ±2^53, plain
 * objects and arrays, at most 64 levels), or no `providerRef`. The effect probably happened,
 * so the operation was completed UNKNOWN (never SUCCEEDED without a stored result, never
 * FAILED): an operator settles it.
 */
export class ResultNotStorableError extends OutcomeNotRecordedError {}

/**
 * A claim was closed (`await using` scope ended, or `close()`) without an outcome
 * (`succeeded`, `retryableFailure`, `finalFailure`, `unknown` or `completeWithError`): the
 * library cannot tell whether the effect happened, so it completed the operation UNKNOWN.
 */
export class ClaimNotCompletedError extends OutcomeNotRecordedError {}

/**
 * A completion or renewal on a claim that holds no lease: a replay (the operation was final
 * already) or a claim completed before.
 */
export class NotHeldError extends IdemError {}

// --- problems (RFC 9457) -------------------------------------------------------------

/** The RFC 9457 problem document of an error answer (`type`, `title`, `status`, `detail`, ...). */
export type Problem = Readonly<Record<string, unknown>>;

/**
 * An error answer of idem: an RFC 9457 problem document.
 *
 * `problem` is the document (`type`, `title`, `status`, `detail`, `request_id` and the type's
 * extra members such as `retry_after_ms`, `current_fencing_token`, `state`); `slug` the last
 * segment of `type` (`/problems/<slug>`; `GET /problems/<slug>` on the server describes it);
 * `requestId` the request's id (also in the server's logs); `retryAfterMs` the wait it asks
 * for, in ms (the document's `retry_after_ms`, else the `Retry-After` header, RFC 9110
 * §10.2.3), when it asks for one.
 */
export class ProblemError extends IdemError {
  /** The problem type's slug this class stands for ("" for a base class). */
  static readonly slug: string = "";

  readonly problem: Problem;
  readonly status: number;
  readonly type: string;
  readonly slug: string;
  readonly title: string;
  readonly detail: string;
  readonly requestId: string | null;
  readonly retryAfterMs: number | null;
  /** The operation's state, for `operation-final`, `operation-not-executing`, ... */
  readonly state: string | null;

  constructor(problem: Problem, status: number, requestId?: string | null, retryAfterMs?: number | null) {
    const type = typeof problem["type"] === "string" ? problem["type"] : "";
    const slug = type.split("/").pop() ?? "";
    const title = typeof problem["title"] === "string" ? problem["title"] : "";
    const detail = typeof problem["detail"] === "string" ? problem["detail"] : "";
    const rid = typeof problem["request_id"] === "string" ? problem["request_id"] : (requestId ?? null);
    super(`${status} ${slug || "error"}: ${detail || title}${rid ? ` (request ${rid})` : ""}`);
    this.problem = problem;
    this.status = status;
    this.type = type;
    this.slug = slug;
    this.title = title;
    this.detail = detail;
    this.requestId = rid;
    const ms = problem["retry_after_ms"]; // precise; the header has whole seconds
    this.retryAfterMs = (typeof ms === "number" && Number.isInteger(ms) ? ms : null) ?? retryAfterMs ?? null;
    this.state = typeof problem["state"] === "string" ? problem["state"] : null;
  }
}

/** `400 invalid-request`: malformed input; nothing was recorded. */
export class InvalidRequestError extends ProblemError {
  static override readonly slug: string = "invalid-request";
}

/** `400 missing-idempotency-key` (IETF httpapi Idempotency-Key draft §2.7). */
export class MissingIdempotencyKeyError extends InvalidRequestError {
  static override readonly slug: string = "missing-idempotency-key";
}

/**
 * `400 invalid-idempotency-key`: 1-255 printable ASCII characters, no surrounding spaces, not
 * `.`/`..`, no personal data (an e-mail address or a phone number): keys are logged and kept
 * after the payload (idem_core::key). Derive keys from business ids. Thrown before the
 * function runs.
 */
export class InvalidKeyError extends InvalidRequestError {
  static override readonly slug: string = "invalid-idempotency-key";
}

/**
 * `400 invalid-holder`: the lease holder is not one attempt's fresh UUID (DESIGN.md §3
 * "Holders"). The library makes one per attempt (`crypto.randomUUID()`), so this means a
 * holder passed by hand.
 */
export class InvalidHolderError extends InvalidRequestError {
  static override readonly slug: string = "invalid-holder";
}

/** `413 payload-too-large`: the body exceeds the server's `--max-body-bytes`. */
export class PayloadTooLargeError extends InvalidRequestError {
  static override readonly slug: string = "payload-too-large";
}

/** `400 unknown-workflow`: not declared on the server and no `steps` given. */
export class UnknownWorkflowError extends InvalidRequestError {
  static override readonly slug: string = "unknown-workflow";
}

/** `400 invalid-definition`: the steps cannot run (the detail names the field). */
export class InvalidDefinitionError extends InvalidRequestError {
  static override readonly slug: string = "invalid-definition";
}

/** `401 unauthorized`: the API key is missing, malformed, unknown or revoked. */
export class UnauthorizedError extends ProblemError {
  static override readonly slug: string = "unauthorized";
}

/** `403 forbidden`: the API key's role does not allow this call. */
export class ForbiddenError extends ProblemError {
  static override readonly slug: string = "forbidden";
}

/** `403 connector-not-allowed`: the connector does not serve the caller's tenant. */
export class ConnectorNotAllowedError extends ForbiddenError {
  static override readonly slug: string = "connector-not-allowed";
}

/** `403 workflow-not-allowed`: the declared workflow does not serve the caller's tenant. */
export class WorkflowNotAllowedError extends ForbiddenError {
  static override readonly slug: string = "workflow-not-allowed";
}

/** `404 not-found`: no such operation or instance in the caller's tenant. */
export class NotFoundError extends ProblemError {
  static override readonly slug: string = "not-found";
}

/** `404 unknown-step`: the instance's definition has no step of that name. */
export class UnknownStepError extends NotFoundError {
  static override readonly slug: string = "unknown-step";
}

/** `408 request-timeout`: the body did not arrive within the server's limit. */
export class RequestTimeoutError extends ProblemError {
  static override readonly slug: string = "request-timeout";
}

/** A `409`: refused now, nothing changed. See the subclasses. */
export class ConflictError extends ProblemError {}

/**
 * `409 operation-in-progress`: another worker holds the lease. `retryAfterMs` says when to try
 * again; or pass `waitMs` to wait for its outcome (IETF httpapi Idempotency-Key draft §2.7).
 */
export class InProgressError extends ConflictError {
  static override readonly slug: string = "operation-in-progress";
}

/** `409 retry-not-due`: the operation failed retryably; its next attempt is due in `retryAfterMs`. */
export class RetryNotDueError extends InProgressError {
  static override readonly slug: string = "retry-not-due";
}

/** `409 contention`: too many concurrent writers on the key; retried by the library, thrown once its retries are spent. */
export class ContentionError extends ConflictError {
  static override readonly slug: string = "contention";
}

/**
 * `409 stale-fencing-token`: another lease was granted since this token's; the completion or
 * renewal was ignored. For a completion: the function finished after losing its lease and
 * another attempt took over (`redoSafe`) — the library says so instead of recording it.
 * `currentFencingToken` is the operation's token now. An `instanceof LeaseLostError` too.
 */
export class StaleFencingTokenError extends ConflictError {
  static override readonly slug: string = "stale-fencing-token";

  /** The operation's current token, from the problem document. */
  get currentFencingToken(): number | null {
    const v = this.problem["current_fencing_token"];
    return typeof v === "number" ? v : null;
  }
}

/**
 * `409 lease-expired`: a renewal came after the lease ran out (a renewal never revives a
 * lease). Stop if you can and complete with the token to report what happened. An
 * `instanceof LeaseLostError` too.
 */
export class LeaseExpiredError extends ConflictError {
  static override readonly slug: string = "lease-expired";
}

/**
 * The lease is gone: idem answered `stale-fencing-token` or `lease-expired`
 * ({@link StaleFencingTokenError} and {@link LeaseExpiredError} are `instanceof
 * LeaseLostError`), or no renewal succeeded before the lease's end (thrown by
 * `Lease.throwIfLost()`, and the reason of `Lease.signal`).
 */
export class LeaseLostError extends IdemError {
  static override [Symbol.hasInstance](value: unknown): boolean {
    if (this === LeaseLostError && (value instanceof StaleFencingTokenError || value instanceof LeaseExpiredError)) {
      return true;
    }
    return Function.prototype[Symbol.hasInstance].call(this, value);
  }
}

/**
 * `409 operation-final`: SUCCEEDED or FAILED already; only an identical repeat of the
 * completion that made it final is accepted.
 */
export class OperationFinalError extends ConflictError {
  static override readonly slug: string = "operation-final";
}

/** `409 operation-not-executing`: nothing to renew or complete (`state` says why). */
export class NotExecutingError extends ConflictError {
  static override readonly slug: string = "operation-not-executing";
}

/** `409 connector-owned`: idem's connector performs this operation; callers never complete it. */
export class ConnectorOwnedError extends ConflictError {
  static override readonly slug: string = "connector-owned";
}

/** `409 previous-step-unfinished`: steps run in order; `state` is the earlier step's. */
export class PreviousStepUnfinishedError extends ConflictError {
  static override readonly slug: string = "previous-step-unfinished";
}

/**
 * `409 instance-not-running`: the instance is PAUSED, FAILED, SUCCEEDED, COMPENSATING or
 * COMPENSATED (`state`); no step may start.
 */
export class InstanceNotRunningError extends ConflictError {
  static override readonly slug: string = "instance-not-running";
}

/** `409 step-performed-by-idem`: the step runs on a connector; idem performs it. */
export class StepPerformedByIdemError extends ConflictError {
  static override readonly slug: string = "step-performed-by-idem";
}

/** `409 step-key-conflict`: the step's key holds an operation not made for it. */
export class StepKeyConflictError extends ConflictError {
  static override readonly slug: string = "step-key-conflict";
}

/**
 * `410 late-arrival`: the key's operation finished and was removed after its retention
 * window; only its tombstone is left. Nothing executes; never retry (README "Retention").
 */
export class LateArrivalError extends ProblemError {
  static override readonly slug: string = "late-arrival";
}

/**
 * `422 fingerprint-mismatch`: the key was first used with another payload or action; a new
 * intent needs a new key (IETF httpapi Idempotency-Key draft §2.7). Nothing changed.
 */
export class FingerprintMismatchError extends ProblemError {
  static override readonly slug: string = "fingerprint-mismatch";
}

/** `422 instance-mismatch`: the instance id was started with another workflow, input or steps. */
export class InstanceMismatchError extends FingerprintMismatchError {
  static override readonly slug: string = "instance-mismatch";
}

/** A `5xx` from idem (`internal`, `write-refused`, `write-not-stored`, ...). */
export class ServerError extends ProblemError {}

/**
 * `503`: idem cannot take the request now (`unavailable`, `overloaded`, `not-durable`);
 * retried by the library after `Retry-After`, thrown once the retries are spent. Nothing is
 * known to have been recorded.
 */
export class UnavailableError extends ServerError {}

/** `503 unavailable`: the database did not answer. */
export class StoreUnavailableError extends UnavailableError {
  static override readonly slug: string = "unavailable";
}

/** `503 overloaded`: too many request bodies in flight on that node. */
export class OverloadedError extends UnavailableError {
  static override readonly slug: string = "overloaded";
}

/** `503 not-durable`: the node cannot make writes durable until it is restarted. */
export class NotDurableError extends UnavailableError {
  static override readonly slug: string = "not-durable";
}

/**
 * `503 schema-missing`: idem's tables are gone from its database (it was dropped or replaced
 * under the node); nothing was recorded. An operator restores the database.
 */
export class SchemaMissingError extends UnavailableError {
  static override readonly slug: string = "schema-missing";
}

/** A problem class: constructed from the document, the status, the request id and the wait (ms). */
export type ProblemClass = (new (
  problem: Problem,
  status: number,
  requestId?: string | null,
  retryAfterMs?: number | null,
) => ProblemError) & { readonly slug: string };

const CLASSES: readonly ProblemClass[] = [
  InvalidRequestError,
  MissingIdempotencyKeyError,
  InvalidKeyError,
  InvalidHolderError,
  PayloadTooLargeError,
  UnknownWorkflowError,
  InvalidDefinitionError,
  UnauthorizedError,
  ForbiddenError,
  ConnectorNotAllowedError,
  WorkflowNotAllowedError,
  NotFoundError,
  UnknownStepError,
  RequestTimeoutError,
  InProgressError,
  RetryNotDueError,
  ContentionError,
  StaleFencingTokenError,
  LeaseExpiredError,
  OperationFinalError,
  NotExecutingError,
  ConnectorOwnedError,
  PreviousStepUnfinishedError,
  InstanceNotRunningError,
  StepPerformedByIdemError,
  StepKeyConflictError,
  LateArrivalError,
  FingerprintMismatchError,
  InstanceMismatchError,
  StoreUnavailableError,
  OverloadedError,
  NotDurableError,
  SchemaMissingError,
];

/**
 * Problem type slug → error class. Types not listed (the operators' re-run and resolution
 * answers, idem proxy's own) are thrown as the class for their status.
 */
export const PROBLEM_CLASSES: Readonly<Record<string, ProblemClass>> = Object.freeze(
  Object.fromEntries(CLASSES.map((c) => [c.slug, c])),
);

const BY_STATUS: Readonly<Record<number, ProblemClass>> = {
  400: InvalidRequestError,
  401: UnauthorizedError,
  403: ForbiddenError,
  404: NotFoundError,
  408: RequestTimeoutError,
  409: ConflictError as ProblemClass,
  410: LateArrivalError,
  413: PayloadTooLargeError,
  422: FingerprintMismatchError,
  503: UnavailableError as ProblemClass,
};

/** The error for an error answer: by the problem's `type`, else by `status`. */
export function problemError(
  status: number,
  problem: Problem,
  requestId?: string | null,
  retryAfterMs?: number | null,
): ProblemError {
  const type = typeof problem["type"] === "string" ? problem["type"] : "";
  const slug = type.split("/").pop() ?? "";
  const cls: ProblemClass =
    (Object.hasOwn(PROBLEM_CLASSES, slug) ? PROBLEM_CLASSES[slug] : undefined) ??
    BY_STATUS[status] ??
    ((status >= 500 ? ServerError : ProblemError) as ProblemClass);
  return new cls(problem, status, requestId, retryAfterMs);
}
