/**
 * A completion when idem is away: resent (same token, same outcome: idempotent) for as long as
 * the lease is valid, never waiting past its end; after it, `OutcomeNotRecordedError` carries
 * the key, the fencing token and the completion, and `client.complete` reports it later. Made
 * with a real `idem serve` killed (SIGKILL) and started again on the same database.
 */

import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { type Client, OutcomeNotRecordedError, StoreUnavailableError, TransportError } from "idem-client";

import { FaultProxy } from "./support/netfault.js";
import { Restarting, newKey, useServer } from "./support/server.js";

/** A guarded send whose effect is `during()` (here: idem goes away), then `{ ref, n }`. */
function sender(client: Client, leaseMs: number, during: () => Promise<void>, ran: string[]) {
  return client.makeIdempotent(
    async (order: string) => {
      ran.push(order);
      await during();
      return { ref: `msg-${order}`, n: 1 };
    },
    { key: (order) => order, payload: (order) => ({ order }), action: "send", providerRef: "ref", leaseMs },
  );
}

async function rejection(p: Promise<unknown>): Promise<unknown> {
  return p.then(
    (v) => assert.fail(`resolved with ${JSON.stringify(v)}`),
    (e: unknown) => e,
  );
}

for (const backend of ["sqlite", "postgres"] as const) {
  describe(`a completion while idem restarts (${backend})`, () => {
    it("is resent until idem is back within the lease, and recorded", async () => {
      // idem is down for 2 s during the function: the retry policy alone (5 tries, at most
      // 1.5 s of waits) lost the outcome; the completion is resent while the 15 s lease lasts.
      const idem = await Restarting.start(backend);
      const key = newKey();
      const ran: string[] = [];
      try {
        const client = idem.client();
        const send = sender(client, 15_000, () => idem.downFor(2000), ran);
        assert.deepEqual(await send(key), { ref: `msg-${key}`, n: 1 });
        const op = await client.getOperation(key);
        assert.deepEqual([op.state, op.providerRef, op.attempt], ["SUCCEEDED", `msg-${key}`, 1]);
      } finally {
        await idem.stop();
      }
      assert.deepEqual(ran, [key], "performed once");
    });

    it("down past the lease: the error carries the token and completion, and complete() records it later", async () => {
      const idem = await Restarting.start(backend);
      const key = newKey();
      const ran: string[] = [];
      try {
        const client = idem.client();
        const started = performance.now();
        const e = await rejection(sender(client, 800, () => idem.downFor(2500), ran)(key));
        const took = performance.now() - started;
        assert.ok(e instanceof OutcomeNotRecordedError, String(e));
        assert.ok(e.cause instanceof TransportError, String(e.cause));
        assert.ok(took < 2500, `gave up after ${Math.round(took)} ms: it should at the lease's end (800 ms)`);
        assert.equal(e.key, key);
        assert.equal(e.recordedState, null);
        assert.ok(Number.isSafeInteger(e.fencingToken), String(e.fencingToken));
        assert.deepEqual(e.completion, { outcome: "succeeded", provider_ref: `msg-${key}`, result: { ref: `msg-${key}`, n: 1 } });
        assert.match(e.message, /client\.complete\(e\.key, e\.fencingToken, e\.completion\)/);
        await idem.back();
        const op = await client.complete(e.key, e.fencingToken ?? -1, e.completion ?? {});
        assert.deepEqual([op.state, op.providerRef, op.result], ["SUCCEEDED", `msg-${key}`, { ref: `msg-${key}`, n: 1 }]);
        const again = await client.complete(e.key, e.fencingToken ?? -1, e.completion ?? {});
        assert.equal(again.state, "SUCCEEDED", "safe to repeat");
        assert.equal((await client.getOperation(key)).attempt, 1);
      } finally {
        await idem.stop();
      }
      assert.deepEqual(ran, [key], "performed once");
    });
  });
}

it("a step's completion reported later with complete() settles the step, and the instance goes on", async () => {
  const idem = await Restarting.start("sqlite");
  const iid = `${newKey("ORD")}:late`;
  try {
    const client = idem.client();
    await client.startWorkflow("stock-reservation", iid, { steps: ["reserve_stock", "notify"] });
    const e = await (async () => {
      await using s = await client.step(iid, "reserve_stock", { leaseMs: 800 });
      await idem.downFor(2500); // the effect happens; idem is away past the lease
      return rejection(s.succeeded("stock-ref"));
    })();
    assert.ok(e instanceof OutcomeNotRecordedError, String(e));
    assert.equal(e.key, `${iid}:reserve_stock`);
    await idem.back();
    const op = await client.complete(e.key, e.fencingToken ?? -1, e.completion ?? {});
    assert.deepEqual([op.state, op.providerRef], ["SUCCEEDED", "stock-ref"]);
    {
      await using next = await client.step(iid, "notify");
      assert.ok(next.acquired, "the next step is granted: the instance went on");
      await next.succeeded("notify-ref");
    }
    assert.equal((await client.getWorkflow(iid)).state, "SUCCEEDED");
  } finally {
    await idem.stop();
  }
});

describe("a completion answered 503", () => {
  const server = useServer("sqlite");

  it("gives up at the lease's end whatever Retry-After says, with the token to complete later", async () => {
    // Retry-After: 60 s, beyond the policy's 10 s and the 1 s lease: not waited for past the
    // lease's end (before, it was thrown at once, without a token to report with).
    const proxy = await FaultProxy.for(server.url);
    proxy.rule("POST /v1/operations/", "unavailable", 1000, 60); // completions (and renewals)
    const key = newKey();
    const ran: string[] = [];
    const started = performance.now();
    const client = server.client({ url: proxy.url, retry: { attempts: 4, baseMs: 20, capMs: 100 } });
    const e = await rejection(sender(client, 1000, async () => {}, ran)(key));
    const took = performance.now() - started;
    await proxy.close();
    assert.ok(e instanceof OutcomeNotRecordedError, String(e));
    assert.ok(e.cause instanceof StoreUnavailableError, String(e.cause));
    assert.ok(took >= 900 && took < 5000, `gave up after ${Math.round(took)} ms; the lease is 1000 ms`);
    assert.ok(proxy.seen.filter((l) => l.includes("/complete")).length >= 2, "resent within the lease");
    assert.deepEqual(ran, [key]);
    assert.ok(e.fencingToken !== null && e.completion !== null);
    const op = await server.client().complete(e.key, e.fencingToken, e.completion);
    assert.deepEqual([op.state, op.providerRef], ["SUCCEEDED", `msg-${key}`]);
  });

  it("complete() refuses a token that is not an integer before sending anything", async () => {
    const client = server.client();
    await assert.rejects(client.complete("K-1", 1.5, { outcome: "unknown" }), /fencingToken must be an integer/);
    await assert.rejects(client.complete("K-1", 1, [] as never), /completion must be a JSON object/);
  });
});
