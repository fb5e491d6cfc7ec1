/** Reading clients/cases/cases.json: placeholders, the harness's errors, matching. */

import { randomBytes, randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import { join } from "node:path";

import {
  ClaimNotCompletedError,
  InvalidInputError,
  NoAnswerError,
  OperationFailedError,
  OutcomeNotRecordedError,
  OutcomeUnknownError,
  ProblemError,
  ResultNotStorableError,
  ServerUnreachableError,
} from "idem-client";

import { REPO } from "./server.js";

/** The case file's JSON, read as it comes. */
export type Json = any;

export const CASES_PATH = join(REPO, "clients/cases/cases.json");
export const CASES: Json = JSON.parse(readFileSync(CASES_PATH, "utf8"));
export const DEFAULTS: Json = CASES.defaults;

/** Declared retryable in every call: proves nothing happened. */
export class RetryableProblem extends Error {
  override name = "RetryableProblem";
  readonly retryAfterMs: number | undefined;

  constructor(retryAfterMs?: number) {
    super("the provider refused the connection");
    this.retryAfterMs = retryAfterMs;
  }
}

/** Declared final in every call. */
export class FinalProblem extends Error {
  override name = "FinalProblem";
}

/** Declared nowhere: the effect may have started. */
export class UndeclaredProblem extends Error {
  override name = "UndeclaredProblem";
}

/** Payloads JavaScript's JSON cannot store, by the case file's name for them. */
export const NOT_JSON: Record<string, unknown> = {
  not_json_type: { when: new Date("2026-11-30T00:00:00Z") },
  nan: { amount: Number.NaN },
  big_int: { id: 2n ** 53n + 1n },
};

/** The case file's name for an error (see clients/cases/README.md). */
export function kindOf(e: unknown): string {
  if (e instanceof ProblemError) return e.slug;
  const kinds: [abstract new (...a: never[]) => Error, string][] = [
    [OutcomeUnknownError, "outcome-unknown"],
    [OperationFailedError, "operation-failed"],
    [ResultNotStorableError, "result-not-storable"],
    [ClaimNotCompletedError, "claim-not-completed"],
    [OutcomeNotRecordedError, "outcome-not-recorded"],
    [ServerUnreachableError, "server-unreachable"],
    [NoAnswerError, "no-answer"],
    [InvalidInputError, "invalid-input"],
  ];
  for (const [cls, kind] of kinds) if (e instanceof cls) return kind;
  if (e instanceof DOMException && e.name === "TimeoutError") return "timeout";
  if (e instanceof Error) return e.name;
  return typeof e;
}

/** `{run}` (this run's prefix) and `{holder:NAME}` (a UUIDv4 per name) in strings. */
export class Placeholders {
  readonly run = `R${randomBytes(6).toString("hex")}`;
  readonly #holders = new Map<string, string>();

  apply(v: Json): Json {
    if (typeof v === "string") {
      return v
        .replaceAll("{run}", this.run)
        .replace(/\{holder:([^}]*)\}/g, (_m, name: string) => {
          const holder = this.#holders.get(name) ?? randomUUID();
          this.#holders.set(name, holder);
          return holder;
        });
    }
    if (Array.isArray(v)) return v.map((x) => this.apply(x));
    if (typeof v === "object" && v !== null) {
      return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, this.apply(x)]));
    }
    return v;
  }
}

/** Asserts that `expected` is contained in `actual` (objects: by member, recursively; else deep equality). */
export function subset(expected: Json, actual: Json, path = ""): void {
  if (typeof expected === "object" && expected !== null && !Array.isArray(expected)) {
    if (typeof actual !== "object" || actual === null || Array.isArray(actual)) {
      throw new Error(`${path || "/"}: expected an object, got ${JSON.stringify(actual)}`);
    }
    for (const [k, v] of Object.entries(expected)) {
      if (!(k in actual)) throw new Error(`${path}/${k}: missing in ${JSON.stringify(actual)}`);
      subset(v, actual[k], `${path}/${k}`);
    }
    return;
  }
  if (JSON.stringify(expected) !== JSON.stringify(actual)) {
    throw new Error(`${path || "/"}: expected ${JSON.stringify(expected)}, got ${JSON.stringify(actual)}`);
  }
}
