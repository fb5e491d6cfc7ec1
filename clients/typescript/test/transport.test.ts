/**
 * idem's own calls: retries of unreachable servers and 503s, an acquire resent after its answer
 * was lost (the same holder gets the same grant), and problems as errors.
 */

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { describe, it } from "node:test";

import {
  Client,
  InvalidInputError,
  NoAnswerError,
  OutcomeUnknownError,
  PROBLEM_CLASSES,
  ProblemError,
  ServerError,
  StoreUnavailableError,
  UnauthorizedError,
  problemError,
} from "idem-client";

import { CASES } from "./support/casefile.js";
import { FaultProxy } from "./support/netfault.js";
import { ADMIN_KEY, IdemServer, REPO, freePort, newKey, useServer } from "./support/server.js";

const FAST = { attempts: 4, baseMs: 20, capMs: 100 };

function guarded(client: Client, ran: string[], options: { leaseMs?: number } = {}) {
  return client.makeIdempotent(
    async (order: string) => {
      ran.push(order);
      return { ref: `msg-${order}` };
    },
    { key: (order) => order, payload: (order) => ({ order }), action: "send_confirmation", providerRef: "ref", ...options },
  );
}

describe("idem's own calls", () => {
  const server = useServer("sqlite");

  async function events(key: string): Promise<string[]> {
    return (await server.client().getOperation(key)).events.map((e) => e.kind);
  }

  it("an acquire whose answer was lost is resent and gets its own grant", async () => {
    const proxy = await FaultProxy.for(server.url);
    proxy.rule("POST /v1/operations ", "drop");
    const key = newKey();
    const ran: string[] = [];
    assert.deepEqual(await guarded(server.client({ url: proxy.url, retry: FAST }), ran)(key), { ref: `msg-${key}` });
    assert.deepEqual(ran, [key], "performed once");
    assert.deepEqual((await events(key)).slice(0, 2), ["acquired", "already_held"]);
    const op = await server.client().getOperation(key);
    assert.deepEqual([op.state, op.attempt], ["SUCCEEDED", 1]);
    await proxy.close();
  });

  it("a completion whose answer was lost is resent and accepted", async () => {
    const proxy = await FaultProxy.for(server.url);
    proxy.rule("POST /v1/operations/", "drop"); // the completion (nothing else has a path after /)
    const key = newKey();
    const ran: string[] = [];
    const client = server.client({ url: proxy.url, retry: FAST });
    assert.deepEqual(await guarded(client, ran)(key), { ref: `msg-${key}` });
    assert.equal((await client.getOperation(key)).state, "SUCCEEDED");
    assert.deepEqual(ran, [key]);
    assert.equal(proxy.seen.filter((l) => l.includes("/complete")).length, 2, proxy.seen.join("\n"));
    await proxy.close();
  });

  it("answers lost every time reject with NoAnswerError, never run, and end UNKNOWN", async () => {
    const proxy = await FaultProxy.for(server.url);
    proxy.rule("POST /v1/operations ", "drop", 100);
    const key = newKey();
    const ran: string[] = [];
    await assert.rejects(guarded(server.client({ url: proxy.url, retry: FAST }), ran, { leaseMs: 300 })(key), NoAnswerError);
    assert.deepEqual(ran, []);
    await new Promise((ok) => setTimeout(ok, 500));
    assert.equal((await server.client().getOperation(key)).state, "UNKNOWN");
    await assert.rejects(guarded(server.client(), ran)(key), OutcomeUnknownError);
    assert.deepEqual(ran, []);
    await proxy.close();
  });

  it("a 503 is retried after its Retry-After", async () => {
    const proxy = await FaultProxy.for(server.url);
    proxy.rule("POST /v1/operations ", "unavailable", 1, 1);
    const key = newKey();
    const ran: string[] = [];
    const started = performance.now();
    assert.deepEqual(await guarded(server.client({ url: proxy.url, retry: FAST }), ran)(key), { ref: `msg-${key}` });
    assert.ok(performance.now() - started >= 1000, "Retry-After is the floor of the wait");
    assert.deepEqual(ran, [key]);
    await proxy.close();
  });

  it("a Retry-After beyond the policy rejects with the problem at once", async () => {
    const proxy = await FaultProxy.for(server.url);
    proxy.rule("POST /v1/operations ", "unavailable", 5, 60);
    const ran: string[] = [];
    const e = await guarded(server.client({ url: proxy.url, retry: FAST }), ran)(newKey()).then(
      () => assert.fail("resolved"),
      (err: unknown) => err,
    );
    assert.ok(e instanceof StoreUnavailableError, String(e));
    assert.deepEqual([e.status, e.retryAfterMs, e.requestId, e.problem["type"]], [503, 60_000, "proxy-1", "/problems/unavailable"]);
    assert.equal(proxy.seen.length, 1, "not retried");
    assert.deepEqual(ran, []);
    await proxy.close();
  });

  it("connection refused is retried until the server is up", async () => {
    const port = await freePort();
    const late = new Promise<IdemServer>((ok, fail) =>
      setTimeout(() => IdemServer.start("sqlite", `127.0.0.1:${port}`).then(ok, fail), 500),
    );
    const ran: string[] = [];
    const key = newKey();
    try {
      const client = server.client({ url: `http://127.0.0.1:${port}`, retry: { attempts: 40, baseMs: 100, capMs: 300 } });
      assert.deepEqual(await guarded(client, ran)(key), { ref: `msg-${key}` });
    } finally {
      await (await late).stop();
    }
    assert.deepEqual(ran, [key]);
  });

  it("a bad API key rejects with UnauthorizedError carrying the problem and request id", async () => {
    const ran: string[] = [];
    const client = new Client({ url: server.url, apiKey: "not-a-key-0123456789abcdef0123456789" });
    const e = await guarded(client, ran)(newKey()).catch((err: unknown) => err);
    assert.ok(e instanceof UnauthorizedError, String(e));
    assert.equal(e.status, 401);
    assert.equal(e.problem["type"], "/problems/unauthorized");
    assert.ok(e.requestId);
    assert.deepEqual(ran, []);
  });

  it("a fresh UUIDv4 is sent as the holder of each attempt", async () => {
    const holders = new Set<string>();
    const client = server.client();
    for (let i = 0; i < 3; i++) {
      const key = newKey("H");
      const claim = await client.claim(key, { action: "send", payload: null });
      await claim.succeeded("ref-1");
      const holder = (await client.getOperation(key)).leaseHolder;
      assert.match(holder ?? "", /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
      holders.add(holder ?? "");
    }
    assert.equal(holders.size, 3);
  });
});

it("no API key is refused before anything is sent", () => {
  const saved = process.env["IDEM_API_KEY"];
  delete process.env["IDEM_API_KEY"];
  try {
    assert.throws(() => new Client({ url: "http://127.0.0.1:9" }), (e) => e instanceof InvalidInputError && /IDEM_API_KEY/.test(e.message));
  } finally {
    if (saved !== undefined) process.env["IDEM_API_KEY"] = saved;
  }
  assert.ok(new Client({ url: "http://127.0.0.1:9", apiKey: ADMIN_KEY }));
  assert.throws(() => new Client({ url: "127.0.0.1:8080", apiKey: ADMIN_KEY }), /not an http/);
});

it("every problem type a client meets has its error class", () => {
  // The server's list of problem types (crates/idem-server/src/problem.rs) against the
  // library's: a new client-facing type fails here until it gets its class. The types no
  // client library's calls meet are listed once for every library, in the case file.
  const source = readFileSync(join(REPO, "crates/idem-server/src/problem.rs"), "utf8");
  const start = source.indexOf("pub const PROBLEM_TYPES");
  const table = source.slice(start, source.indexOf("];", start));
  const slugs = new Set([...table.matchAll(/^\s*\(\s*"([a-z-]+)",/gm)].map((m) => m[1] ?? ""));
  assert.ok(slugs.size > 40, [...slugs].join(" "));
  const exempt = new Set<string>(CASES.problems_not_client_facing.types);
  const mine = new Set(Object.keys(PROBLEM_CLASSES));
  const missing = [...slugs].filter((s) => !mine.has(s) && !exempt.has(s));
  assert.deepEqual(missing, [], "problem types without an error class");
  const stale = [...mine, ...exempt].filter((s) => !slugs.has(s));
  assert.deepEqual(stale, [], "classes or exemptions for types the server no longer has");
});

it("each problem class is thrown for its type, with the document, request id and wait", () => {
  for (const [slug, cls] of Object.entries(PROBLEM_CLASSES)) {
    const e = problemError(409, { type: `/problems/${slug}`, detail: "d", request_id: "r-1" }, null, 2000);
    assert.equal(e.constructor, cls);
    assert.ok(e instanceof ProblemError);
    assert.deepEqual([e.slug, e.requestId, e.retryAfterMs, e.name], [slug, "r-1", 2000, cls.name]);
  }
  const precise = problemError(409, { type: "/problems/operation-in-progress", retry_after_ms: 1234 }, "r", 2000);
  assert.equal(precise.retryAfterMs, 1234, "the document's ms, not the header's whole seconds");
  assert.equal(problemError(428, { type: "/problems/plan-hash-required" }, "r").constructor, ProblemError);
  assert.equal(problemError(502, {}, "r").constructor, ServerError);
});
