/**
 * `makeIdempotent(fn, options)`: guard a function with one call.
 *
 * The first call with a key acquires the lease, runs the function and completes SUCCEEDED with
 * its result and evidence; a repeat resolves to the recorded result without running it. What
 * can be known before the function runs is checked before it runs: the key can be made from
 * the arguments, the payload is JSON idem stores, idem accepts the key (no personal data) and
 * answers at all.
 */

import type { Claim, ErrorMatcher } from "./claim.js";
import { evidence, messageOf, succeededBody } from "./claim.js";
import type { Client, ClaimOptions } from "./client.js";
import { InvalidInputError, NotJSONError, OperationFailedError, ResultNotStorableError } from "./errors.js";
import { toJSON } from "./json.js";
import { runWithLease } from "./lease.js";
import type { JSONValue } from "./records.js";

/** The name of a field of `R` (any string when `R` has no known fields). */
export type FieldOf<R> = unknown extends R ? string : [keyof R] extends [never] ? string : keyof R & string;

/**
 * How `makeIdempotent` guards a function `(...args: A) => R`.
 *
 * - `key`: the idempotency key, from the call's arguments (`(order) => \`${order.id}:confirm:v1\``):
 *   derive it from business ids, never from a request id or the time.
 * - `action`: the kind of side effect (1-128 of `[A-Za-z0-9_.:-]`); part of the intent.
 * - `providerRef`: the evidence, read from the result — a field name or a function; a string,
 *   or an integer (a safe `number` or a `bigint`) kept as its decimal string.
 * - `payload`: the intent, from the arguments (default: the arguments as a JSON array); a
 *   repeat with another payload is refused (`FingerprintMismatchError`).
 * - `retryable` / `final`: the errors that prove nothing happened, completed as a retryable /
 *   final failure — error classes or predicates, judging the thrown error itself, never its
 *   `cause` chain (README "Which errors prove nothing happened"); any other error completes
 *   UNKNOWN.
 * - `serialize` / `deserialize`: the result to JSON and back, for replays (default: the value
 *   itself, which must be JSON).
 * - `client`: the client to use (default: one made from `IDEM_URL` and `IDEM_API_KEY` at the
 *   first call). The other options are {@link ClaimOptions}'.
 */
export interface IdempotentOptions<A extends unknown[], R> extends Omit<ClaimOptions, "action" | "payload"> {
  readonly key: (...args: A) => string;
  readonly action: string;
  readonly providerRef: FieldOf<R> | ((result: R) => string | number | bigint);
  readonly payload?: (...args: A) => unknown;
  readonly serialize?: (result: R) => unknown;
  readonly deserialize?: (stored: JSONValue) => R;
  readonly client?: Client;
}

/** The function `makeIdempotent` returns: `fn`'s parameters and `this`, always async. */
export type Idempotent<F extends (...args: any[]) => unknown> = (
  this: ThisParameterType<F>,
  ...args: Parameters<F>
) => Promise<Awaited<ReturnType<F>>>;

/** @internal `makeIdempotent` with the client found by `clientOf` at each call. */
export function guard<F extends (...args: any[]) => unknown>(
  fn: F,
  options: IdempotentOptions<Parameters<F>, Awaited<ReturnType<F>>>,
  clientOf: () => Client,
): Idempotent<F> {
  type A = Parameters<F>;
  type R = Awaited<ReturnType<F>>;
  if (typeof fn !== "function") throw new InvalidInputError("makeIdempotent needs the function to guard");
  if (typeof options.key !== "function") {
    throw new InvalidInputError("key must be a function of the arguments, such as (order) => `${order.id}:confirm:v1`");
  }
  if (typeof options.providerRef !== "string" && typeof options.providerRef !== "function") {
    throw new InvalidInputError("providerRef must name a field of the result or be a function of it");
  }
  if (options.payload !== undefined && typeof options.payload !== "function") {
    throw new InvalidInputError("payload must be a function of the arguments that returns the intent");
  }
  const { key: keyOf, payload: payloadOf, providerRef, serialize, deserialize, client: _client, ...claimOptions } = options;

  function intent(args: A): { key: string; payload: JSONValue } {
    let key: unknown;
    try {
      key = keyOf(...args);
    } catch (e) {
      throw new InvalidInputError(`the key cannot be made from the arguments: ${messageOf(e)}`, { cause: e });
    }
    if (typeof key !== "string") {
      throw new InvalidInputError(`the key must be a string; the key function returned ${typeof key}`);
    }
    const raw = payloadOf === undefined ? args : payloadOf(...args);
    try {
      return { key, payload: toJSON(raw, "payload") };
    } catch (e) {
      if (e instanceof NotJSONError && payloadOf === undefined) {
        throw new NotJSONError(`${e.message} (build the intent with payload: (...args) => ...)`);
      }
      throw e;
    }
  }

  function stored(value: R): { ref: string; result: JSONValue } | Error {
    try {
      let ref: unknown;
      if (typeof providerRef === "function") {
        ref = providerRef(value);
      } else {
        if (typeof value !== "object" || value === null || !(providerRef in value)) {
          throw new InvalidInputError(`the result has no field ${JSON.stringify(providerRef)} to read providerRef from`);
        }
        ref = (value as Record<string, unknown>)[providerRef];
      }
      ref = evidence(ref);
      if (typeof ref !== "string" || ref.trim() === "") {
        throw new InvalidInputError(
          `providerRef read ${JSON.stringify(ref) ?? String(ref)} from the result; the evidence must be a non-empty string or an integer`,
        );
      }
      const result = toJSON(serialize ? serialize(value) : value, "result");
      succeededBody(ref, result); // the evidence's rules, before anything is sent
      return { ref, result };
    } catch (e) {
      // The function ran: whatever fails here must end UNKNOWN, not vanish.
      return e instanceof Error ? e : new InvalidInputError(messageOf(e));
    }
  }

  function notStorable(c: Claim, why: Error, value: unknown): ResultNotStorableError {
    return new ResultNotStorableError(
      `${JSON.stringify(c.key)}: the function returned, but ${why.message}; the effect probably happened, so the ` +
        "operation was completed UNKNOWN for an operator to settle (it is not performed again)",
      { key: c.key, recordedState: c.state, result: value },
      { cause: why },
    );
  }

  return async function guarded(this: ThisParameterType<F>, ...args: A): Promise<R> {
    const { key, payload } = intent(args);
    const c = await clientOf().claim(key, { ...claimOptions, action: options.action, payload });
    if (c.replayed) {
      if (c.operation.state === "FAILED") throw new OperationFailedError(c.operation);
      return deserialize ? deserialize(c.result) : (c.result as R);
    }
    let value: R;
    try {
      value = (await runWithLease(c.lease, () => fn.apply(this, args))) as R;
    } catch (e) {
      await c.completeWithError(e); // throws instead when idem refuses or cannot be told
      throw e;
    }
    const s = stored(value);
    if (s instanceof Error) {
      await c.unknown(messageOf(s));
      throw notStorable(c, s, value);
    }
    const refused = await c.succeededOrUnknown(s.ref, s.result);
    if (refused !== null) throw notStorable(c, refused, value);
    return value;
  };
}

export type { ErrorMatcher };
