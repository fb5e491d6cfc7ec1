/**
 * The lease while the function runs: the heartbeat, a lost lease told through the AbortSignal,
 * and a claim closed by `await using` or `try/finally`.
 */

import assert from "node:assert/strict";
import { once } from "node:events";
import { describe, it } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import {
  ClaimNotCompletedError,
  InvalidInputError,
  LeaseLostError,
  NotHeldError,
  currentLease,
  ensureDisposeSymbols,
} from "idem-client";

import { newKey, useServer } from "./support/server.js";

describe("leases", () => {
  const server = useServer("sqlite");

  it("a renewal refused aborts the signal with idem's problem; a late completion still settles it", async () => {
    // The heartbeat renews too late (every 1 400 ms for a 600 ms lease): the lease's own timer
    // aborts the signal at its end, then idem refuses the renewal (lease-expired). Nobody took
    // the lease since, so the completion is still accepted and settles the UNKNOWN.
    const key = newKey();
    const client = server.client();
    const seen: unknown[] = [];
    const send = client.makeIdempotent(
      async (order: string) => {
        const lease = currentLease();
        assert.equal(lease.lost, false);
        assert.equal(lease.key, order);
        await once(lease.signal, "abort");
        seen.push(lease.signal.reason);
        assert.throws(() => lease.throwIfLost(), LeaseLostError);
        await sleep(1200); // the renewal is refused meanwhile
        return { ref: "msg-1" };
      },
      { key: (order) => order, payload: (order) => ({ order }), action: "send", providerRef: "ref", leaseMs: 600, renewEveryMs: 1400 },
    );
    assert.deepEqual(await send(key), { ref: "msg-1" });
    assert.ok(seen[0] instanceof LeaseLostError, String(seen[0]));
    const op = await client.getOperation(key);
    assert.deepEqual([op.state, op.providerRef], ["SUCCEEDED", "msg-1"]);
    assert.ok(op.events.some((e) => e.kind === "lease_expired"));
  });

  it("a completion after another attempt took over is refused as stale and loses the lease", async () => {
    // redoSafe: the first attempt's lease ran out and a second attempt was granted; the first
    // one's completion is refused (stale-fencing-token) and nothing of it is recorded.
    const key = newKey();
    const client = server.client();
    const first = await client.claim(key, { action: "send", payload: null, redoSafe: true, leaseMs: 200, heartbeat: false });
    await sleep(300);
    const second = await client.claim(key, { action: "send", payload: null, redoSafe: true });
    assert.ok(second.acquired);
    await second.succeeded("ref-2");
    await assert.rejects(first.succeeded("ref-1"), (e) => e instanceof LeaseLostError && e instanceof Error && e.name === "StaleFencingTokenError");
    assert.ok(first.lease.lost);
    assert.equal((await client.getOperation(key)).providerRef, "ref-2");
  });

  it("currentLease outside a guarded function is an error", () => {
    assert.throws(() => currentLease(), /no idem lease/);
  });

  it("await using completes UNKNOWN and throws when the block reported nothing", async () => {
    const key = newKey();
    const client = server.client();
    await assert.rejects(async () => {
      await using claim = await client.claim(key, { action: "send", payload: null });
      assert.ok(claim.acquired);
    }, ClaimNotCompletedError);
    assert.equal((await client.getOperation(key)).state, "UNKNOWN");
  });

  it("await using after an error the block did not report: UNKNOWN, and both errors in a SuppressedError", async () => {
    const key = newKey();
    const client = server.client();
    const boom = new Error("the provider's connection broke");
    const e = await (async () => {
      await using claim = await client.claim(key, { action: "send", payload: null });
      assert.ok(claim.acquired);
      throw boom;
    })().catch((err: unknown) => err as { name: string; error: unknown; suppressed: unknown });
    assert.equal(e.name, "SuppressedError");
    assert.ok(e.error instanceof ClaimNotCompletedError);
    assert.equal(e.suppressed, boom);
    assert.equal((await client.getOperation(key)).state, "UNKNOWN");
  });

  it("await using after an error the block reported keeps the block's own error", async () => {
    const key = newKey();
    const client = server.client();
    class CardDeclined extends Error {}
    await assert.rejects(async () => {
      await using claim = await client.claim(key, { action: "charge", payload: null, final: [CardDeclined] });
      try {
        throw new CardDeclined("insufficient funds");
      } catch (e) {
        await claim.completeWithError(e);
        throw e;
      }
    }, CardDeclined);
    const op = await client.getOperation(key);
    assert.deepEqual([op.state, op.errorClass, op.errorMessage], ["FAILED", "CardDeclined", "CardDeclined: insufficient funds"]);
  });

  it("try/finally with close() is the same as await using", async () => {
    const key = newKey();
    const client = server.client();
    const claim = await client.claim(key, { action: "send", payload: null, retryable: [(e) => (e as { code?: string }).code === "ECONNREFUSED"] });
    try {
      const refused = Object.assign(new Error("connect ECONNREFUSED"), { code: "ECONNREFUSED", retryAfterMs: 5000 });
      await claim.completeWithError(refused);
    } finally {
      await claim.close(); // completed: closing only ends it
    }
    const op = await client.getOperation(key);
    assert.deepEqual([op.state, op.errorClass], ["PENDING", "Error"]);
    assert.ok(op.nextAttemptAt !== null && Date.parse(op.nextAttemptAt) - Date.now() > 3000, op.nextAttemptAt ?? "");
  });

  it("completing twice, completing a replay, or with a bad error class, is refused locally", async () => {
    const key = newKey();
    const client = server.client();
    {
      await using claim = await client.claim(key, { action: "send", payload: null });
      await claim.succeeded("ref-1", { n: 1 });
      await assert.rejects(claim.succeeded("ref-1"), NotHeldError);
    }
    {
      await using bad = await client.claim(newKey(), { action: "send", payload: null });
      await assert.rejects(bad.retryableFailure("not a class!"), InvalidInputError);
      await assert.rejects(bad.retryableFailure("Timeout", { retryAfterMs: 1.5 }), InvalidInputError);
      await bad.finalFailure("Declined"); // nothing was sent before: the claim still completes
    }
    await using again = await client.claim(key, { action: "send", payload: null });
    assert.ok(again.replayed);
    assert.deepEqual(again.result, { n: 1 });
    await assert.rejects(again.unknown(), NotHeldError);
    assert.throws(() => again.lease, NotHeldError);
  });

  it("a function that blocks the event loop past its lease: lost by the clock at once, the signal at the next turn", async () => {
    // The heartbeat is a timer on the blocked loop: no renewal during the 1.5 s block of a
    // 600 ms lease (README "A blocked event loop"). Right after it, before any timer ran, the
    // lease is lost by the clock; the signal aborts at the loop's next turn; nobody took the
    // lease since, so the late completion settles the UNKNOWN.
    const key = newKey();
    const client = server.client();
    const seen: { lost?: boolean; aborted?: boolean; reason?: unknown } = {};
    const send = client.makeIdempotent(
      async (_order: string) => {
        const lease = currentLease();
        Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 1500); // blocks the loop
        seen.lost = lease.lost;
        seen.aborted = lease.signal.aborted;
        if (!lease.signal.aborted) await once(lease.signal, "abort");
        seen.reason = lease.signal.reason;
        return { ref: "msg-1" };
      },
      { key: (order) => order, action: "send", providerRef: "ref", leaseMs: 600 },
    );
    assert.deepEqual(await send(key), { ref: "msg-1" });
    assert.deepEqual([seen.lost, seen.aborted], [true, false]);
    assert.ok(seen.reason instanceof LeaseLostError, String(seen.reason));
    const op = await client.getOperation(key);
    assert.deepEqual([op.state, op.attempt], ["SUCCEEDED", 1]);
    assert.ok(op.events.some((e) => e.kind === "lease_expired"), op.events.map((e) => e.kind).join(" "));
    assert.ok(!op.events.some((e) => e.kind === "lease_renewed"), "no renewal while the loop was blocked");
  });

  it("slow claims side by side are each renewed and none is lost", async () => {
    const client = server.client();
    const keys = [newKey("HB"), newKey("HB"), newKey("HB")];
    await Promise.all(
      keys.map(async (key) => {
        // 900 ms leases renewed every 300 ms, for 2 s: a loaded machine's late timer must
        // not lose a lease that a real heartbeat keeps (300 ms leases failed under load).
        await using claim = await client.claim(key, { action: "send", payload: null, leaseMs: 900 });
        await sleep(2000);
        assert.equal(claim.lease.lost, false);
        await claim.succeeded("ref-1");
      }),
    );
    for (const key of keys) {
      const op = await client.getOperation(key);
      assert.equal(op.state, "SUCCEEDED");
      assert.ok(op.events.some((e) => e.kind === "lease_renewed"));
    }
  });
});

it("Symbol.asyncDispose is defined only where the runtime lacks it", () => {
  assert.equal(typeof Symbol.asyncDispose, "symbol");
  assert.deepEqual(ensureDisposeSymbols(), [], "Node.js 20.4+ has both symbols: nothing is changed");
  const old: { asyncDispose?: symbol; dispose?: symbol } = {};
  assert.deepEqual(ensureDisposeSymbols(old), ["asyncDispose", "dispose"]);
  assert.equal(old.asyncDispose, Symbol.for("Symbol.asyncDispose"));
  assert.equal(old.dispose, Symbol.for("Symbol.dispose"));
  const mine = Symbol("mine");
  const partial = { asyncDispose: mine };
  assert.deepEqual(ensureDisposeSymbols(partial), ["dispose"]);
  assert.equal(partial.asyncDispose, mine);
});
