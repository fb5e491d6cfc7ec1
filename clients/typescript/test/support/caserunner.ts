/**
 * Runs the language-neutral cases (clients/cases/cases.json) against a real server: a call
 * step is one call of `makeIdempotent`'s function (`via: decorator`) or one `await using`
 * claim (`via: claim`); concurrent calls are promises on one event loop (the processes test
 * has several processes).
 */

import assert from "node:assert/strict";
import { setTimeout as sleep } from "node:timers/promises";

import { type Claim, type Client, currentLease, InProgressError } from "idem-client";

import {
  DEFAULTS,
  FinalProblem,
  type Json,
  NOT_JSON,
  type Placeholders,
  RetryableProblem,
  UndeclaredProblem,
  kindOf,
  subset,
} from "./casefile.js";
import { ADMIN_KEY, type RunningServer, freePort, raw } from "./server.js";

/** What one call did: returned or threw, and what the function saw. */
interface Outcome {
  ran: boolean;
  leaseLost?: boolean;
  acquired?: boolean;
  replayed?: boolean;
  result?: Json;
  value?: Json;
  error?: unknown;
  threw: boolean;
}

/** One case's run: its server, client, placeholders and effect count. */
export interface Ctx {
  server: RunningServer;
  client: Client;
  ph: Placeholders;
  effects: number;
}

function options(call: Json): { leaseMs: number; waitMs: number; heartbeat: boolean; redoSafe: boolean } {
  const c = { ...DEFAULTS, ...call };
  return { leaseMs: c.lease_ms, waitMs: c.wait_ms, heartbeat: c.heartbeat, redoSafe: c.redo_safe };
}

async function clientFor(ctx: Ctx, call: Json): Promise<Client> {
  if (call.server === "unreachable") {
    const port = await freePort();
    return ctx.server.client({ url: `http://127.0.0.1:${port}`, retry: { attempts: 2, baseMs: 10 } });
  }
  return ctx.client;
}

function payloadOf(call: Json): unknown {
  return "payload_not_json" in call ? NOT_JSON[call.payload_not_json] : call.payload;
}

function raiseOrReturn(fn: Json): Json {
  switch (fn.raises) {
    case "RetryableProblem":
      throw new RetryableProblem(fn.retry_after_ms);
    case "FinalProblem":
      throw new FinalProblem("the provider said no for good");
    case "UndeclaredProblem":
      throw new UndeclaredProblem("the connection broke after the request was sent");
    case "timeout":
      throw new DOMException("the provider did not answer within 10 s", "TimeoutError");
    default:
      break;
  }
  if (fn.returns_not_json) return { ref: "msg-1", ids: new Set([1, 2]) };
  return fn.returns;
}

function hasEffect(fn: Json): boolean {
  return Boolean(fn.effect ?? !["RetryableProblem", "FinalProblem"].includes(fn.raises));
}

async function complete(c: Claim, spec: Json): Promise<void> {
  const message: { message?: string } = spec.message === undefined ? {} : { message: spec.message };
  switch (spec.outcome) {
    case "succeeded":
      await c.succeeded(spec.provider_ref, spec.result);
      return;
    case "retryable_failure":
      await c.retryableFailure(spec.error_class, {
        ...message,
        ...(spec.retry_after_ms === undefined ? {} : { retryAfterMs: spec.retry_after_ms }),
      });
      return;
    case "final_failure":
      await c.finalFailure(spec.error_class, { ...message, ...(spec.result === undefined ? {} : { result: spec.result }) });
      return;
    case "unknown":
      await c.unknown(spec.message);
      return;
    default:
      throw new Error(`unknown outcome ${spec.outcome}`);
  }
}

/** One call step: the claim in an `await using` block, or the guarded function. */
async function call(ctx: Ctx, callSpec: Json, fn: Json): Promise<Outcome> {
  const out: Outcome = { ran: false, threw: false };
  const client = await clientFor(ctx, callSpec);
  const key: string = callSpec.key;
  const payload = payloadOf(callSpec);
  const action: string = callSpec.action ?? DEFAULTS.action;
  try {
    if ((callSpec.via ?? DEFAULTS.via) === "claim") {
      let claimed: Claim | undefined;
      {
        await using c = await client.claim(key, {
          action,
          payload,
          retryable: [RetryableProblem],
          final: [FinalProblem],
          ...options(callSpec),
        });
        claimed = c;
        out.acquired = c.acquired;
        out.replayed = c.replayed;
        if (c.acquired) {
          out.ran = true;
          if (hasEffect(fn)) ctx.effects += 1;
          await sleep(fn.sleep_ms ?? 0);
          out.leaseLost = c.lease.lost;
          if (fn.complete) await complete(c, ctx.ph.apply(fn.complete));
        }
      }
      out.result = claimed.result;
      return out;
    }
    const effectful = client.makeIdempotent(
      async (_key: string, _payload: unknown): Promise<Json> => {
        out.ran = true;
        if (hasEffect(fn)) ctx.effects += 1;
        await sleep(fn.sleep_ms ?? 0);
        out.leaseLost = currentLease().lost;
        return raiseOrReturn(fn);
      },
      {
        key: (k) => k,
        payload: (_k, p) => p,
        action,
        providerRef: DEFAULTS.provider_ref_field,
        retryable: [RetryableProblem],
        final: [FinalProblem],
        ...options(callSpec),
      },
    );
    out.value = await effectful(key, payload);
  } catch (e) {
    out.error = e;
    out.threw = true;
  }
  return out;
}

// --- expectations --------------------------------------------------------------------

function checkOutcome(out: Outcome, expect: Json, about: string): void {
  const where = out.threw ? `${about}: ${String(out.error)}` : about;
  if ("raises" in expect) {
    assert.ok(out.threw, `${about}: expected ${expect.raises}, returned ${JSON.stringify(out.value)}`);
    assert.equal(kindOf(out.error), expect.raises, where);
  } else if (out.threw) {
    throw new Error(where, { cause: out.error });
  }
  if ("returns" in expect) assert.deepEqual(out.value ?? null, expect.returns, where);
  for (const [name, field] of [
    ["ran", "ran"],
    ["lease_lost", "leaseLost"],
    ["acquired", "acquired"],
    ["replayed", "replayed"],
    ["result", "result"],
  ] as const) {
    if (name in expect) assert.deepEqual(out[field], expect[name], `${where}: ${name}`);
  }
}

async function checkServer(ctx: Ctx, expect: Json, key: string | undefined, about: string): Promise<void> {
  if ("effects" in expect) assert.equal(ctx.effects, expect.effects, `${about}: effects`);
  if (key === undefined || (!("record" in expect) && !("events_include" in expect))) return;
  const r = await raw(ctx.server.url, "GET", `/v1/operations/${encodeURIComponent(key.trim())}`);
  if (expect.record === null) {
    assert.ok([400, 404].includes(r.status), `${about}: nothing may be recorded, got ${r.status} ${JSON.stringify(r.body)}`);
    return;
  }
  assert.equal(r.status, 200, `${about}: ${JSON.stringify(r.body)}`);
  subset(expect.record ?? {}, r.body, about);
  const kinds = ((r.body as Json).events as Json[]).map((e) => e.kind);
  for (const kind of expect.events_include ?? []) assert.ok(kinds.includes(kind), `${about}: no ${kind} event in ${kinds}`);
}

function checkParallel(outs: Outcome[], expect: Json, about: string): void {
  assert.equal(outs.filter((o) => o.ran).length, expect.ran, `${about}: ran`);
  const counts: Record<string, number> = {};
  for (const o of outs) {
    const k = o.threw ? kindOf(o.error) : "returned";
    counts[k] = (counts[k] ?? 0) + 1;
  }
  assert.deepEqual(counts, expect.outcomes, `${about}: ${outs.map((o) => String(o.error))}`);
  if ("all_return" in expect) for (const o of outs) assert.deepEqual(o.value, expect.all_return, about);
  if (expect.retry_after) {
    for (const o of outs) {
      if (o.error instanceof InProgressError) assert.ok((o.error.retryAfterMs ?? 0) > 0, `${about}: Retry-After`);
    }
  }
}

async function checkHttp(ctx: Ctx, step: Json): Promise<void> {
  const h = step.http;
  const r = await raw(ctx.server.url, h.method, h.path, h.body);
  const exp = step.expect;
  assert.equal(r.status, exp.status, `${step.about}: ${JSON.stringify(r.body)}`);
  subset(exp.body ?? {}, r.body, step.about);
  for (const name of exp.headers ?? []) assert.ok(r.headers.has(name), `${step.about}: no ${name} header`);
}

/** Runs one case's steps (placeholders applied) in order. */
export async function runSteps(ctx: Ctx, steps: Json[]): Promise<void> {
  const background: [Promise<Outcome>, Json][] = [];
  let lastKey: string | undefined;
  for (const step of steps) {
    const about: string = step.about;
    if ("sleep_ms" in step) {
      await sleep(step.sleep_ms);
    } else if ("http" in step) {
      await checkHttp(ctx, step);
    } else if ("join" in step) {
      for (const [pending, s] of background) checkOutcome(await pending, s.expect, s.about);
      await checkServer(ctx, step.expect, lastKey, about);
    } else if ("parallel" in step) {
      const p = step.parallel;
      lastKey = p.call.key;
      const outs = await Promise.all(
        Array.from({ length: p.times }, async (_, i) => {
          await sleep(i * (p.stagger_ms ?? 0));
          return call(ctx, p.call, p.function);
        }),
      );
      checkParallel(outs, step.expect, about);
      await checkServer(ctx, step.expect, lastKey, about);
    } else if (step.background) {
      background.push([call(ctx, step.call, step.function), step]);
      lastKey = step.call.key;
    } else {
      lastKey = step.call.key;
      checkOutcome(await call(ctx, step.call, step.function), step.expect, about);
      await checkServer(ctx, step.expect, lastKey, about);
    }
  }
}

export { ADMIN_KEY };
