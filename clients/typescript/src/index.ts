/**
 * idem-client: the Node.js client of idem, which makes side effects safe to retry.
 *
 * `makeIdempotent(fn, options)` guards a function; `client.claim(...)` exposes the claim (for
 * `await using` or `try/finally`); `client.startWorkflow(...)` and `client.step(...)` run a
 * workflow's steps from your code. `idem-client/webhooks` verifies the relay's Standard
 * Webhooks signatures. See clients/typescript/README.md.
 */

import "./dispose.js";

export { Claim, type ErrorMatcher, errorClassOf, messageOf } from "./claim.js";
export {
  type ClaimOptions,
  Client,
  type ClientOptions,
  defaultClient,
  makeIdempotent,
  MAX_LEASE_MS,
  MIN_LEASE_MS,
  type StepDeclaration,
  type StepOptions,
} from "./client.js";
export { ensureDisposeSymbols } from "./dispose.js";
export * from "./errors.js";
export { DEFAULT_RETRY, type RetryPolicy } from "./http.js";
export type { FieldOf, Idempotent, IdempotentOptions } from "./idempotent.js";
export { canonical, fingerprint, MAX_DEPTH, MAX_SAFE_MAGNITUDE, toJSON } from "./json.js";
export { currentLease, Lease } from "./lease.js";
export type { Instance, JSONValue, Operation, OperationEvent, OperationState } from "./records.js";
