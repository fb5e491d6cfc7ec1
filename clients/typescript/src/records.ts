/**
 * The records idem answers with: an operation and a workflow instance (README "What a trigger
 * gets"; `OperationView` and `InstanceView` of the OpenAPI document at `/openapi.json`).
 * Field names are camelCase here; `data` keeps the body as received, snake_case and all.
 */

/** A JSON value as idem stores it (RFC 8259, I-JSON RFC 7493): what `JSON.parse` returns. */
export type JSONValue = null | boolean | number | string | JSONValue[] | { [member: string]: JSONValue };

/** The states of an operation (DESIGN.md §3). */
export type OperationState = "PENDING" | "EXECUTING" | "SUCCEEDED" | "FAILED" | "UNKNOWN";

/** One entry of an operation's event log (`EventView`; only on {@link Client.getOperation}). */
export interface OperationEvent {
  readonly seq: number;
  /** `acquired`, `already_held`, `replayed`, `in_progress`, `lease_renewed`, `completed`, ... */
  readonly kind: string;
  readonly at: string;
  readonly principal: string;
  readonly [field: string]: unknown;
}

/**
 * An operation record. `fencingToken` is the latest lease's token (an integer; the first is the
 * key's creation instant in epoch ms plus one, so it is large but below 2^53). `result` is the
 * stored result, `providerRef` the evidence, `errorClass` / `errorMessage` the last error.
 * Instants are RFC 3339 UTC strings.
 */
export interface Operation {
  readonly key: string;
  readonly action: string;
  readonly state: OperationState;
  readonly fingerprint: string;
  readonly attempt: number;
  readonly fencingToken: number;
  readonly payload: JSONValue;
  readonly result: JSONValue;
  readonly providerRef: string | null;
  readonly errorClass: string | null;
  readonly errorMessage: string | null;
  readonly leaseHolder: string | null;
  readonly leaseExpiresAt: string | null;
  readonly nextAttemptAt: string | null;
  readonly needsReview: boolean;
  readonly redoSafe: boolean;
  readonly connector: string | null;
  /** `caller`, `connector`, `lookup` or `operator`, once there is evidence. */
  readonly evidenceSource: string | null;
  /** The event log, oldest first (only on a record read with {@link Client.getOperation}). */
  readonly events: readonly OperationEvent[];
  /** The whole body as received. */
  readonly data: Readonly<Record<string, unknown>>;
}

/**
 * A workflow instance. `state` is RUNNING, SUCCEEDED, FAILED, PAUSED, COMPENSATING or
 * COMPENSATED; `steps` the checkpoints (one object per step: `step`, `state`,
 * `operation_key`, `provider_ref`, ...) when the server sent them.
 */
export interface Instance {
  readonly instanceId: string;
  readonly workflow: string;
  readonly state: string;
  readonly lastGoodStep: string | null;
  readonly currentStep: string | null;
  readonly stoppedStep: string | null;
  readonly steps: readonly Readonly<Record<string, unknown>>[];
  readonly data: Readonly<Record<string, unknown>>;
}

type Body = Readonly<Record<string, unknown>>;

function isObject(v: unknown): v is Body {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function str(v: unknown): string {
  return typeof v === "string" ? v : "";
}

function optStr(v: unknown): string | null {
  return typeof v === "string" ? v : null;
}

function int(v: unknown): number {
  return typeof v === "number" && Number.isInteger(v) ? v : 0;
}

/** The record of a JSON body (missing fields get empty values; the body is kept in `data`). */
export function operationFrom(body: unknown): Operation {
  const b: Body = isObject(body) ? body : {};
  const error: Body = isObject(b["error"]) ? b["error"] : {};
  const events = Array.isArray(b["events"]) ? (b["events"].filter(isObject) as OperationEvent[]) : [];
  return {
    key: str(b["key"]),
    action: str(b["action"]),
    state: str(b["state"]) as OperationState,
    fingerprint: str(b["fingerprint"]),
    attempt: int(b["attempt"]),
    fencingToken: int(b["fencing_token"]),
    payload: (b["payload"] ?? null) as JSONValue,
    result: (b["result"] ?? null) as JSONValue,
    providerRef: optStr(b["provider_ref"]),
    errorClass: optStr(error["class"]),
    errorMessage: optStr(error["message"]),
    leaseHolder: optStr(b["lease_holder"]),
    leaseExpiresAt: optStr(b["lease_expires_at"]),
    nextAttemptAt: optStr(b["next_attempt_at"]),
    needsReview: b["needs_review"] === true,
    redoSafe: b["redo_safe"] === true,
    connector: optStr(b["connector"]),
    evidenceSource: optStr(b["evidence_source"]),
    events,
    data: b,
  };
}

/** The instance of a JSON body. */
export function instanceFrom(body: unknown): Instance {
  const b: Body = isObject(body) ? body : {};
  return {
    instanceId: str(b["instance_id"]),
    workflow: str(b["workflow"]),
    state: str(b["state"]),
    lastGoodStep: optStr(b["last_good_step"]),
    currentStep: optStr(b["current_step"]),
    stoppedStep: optStr(b["stopped_step"]),
    steps: Array.isArray(b["steps"]) ? b["steps"].filter(isObject) : [],
    data: b,
  };
}
