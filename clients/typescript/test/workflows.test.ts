/** Workflow steps your code performs: start, acquire and complete each step in order. */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import {
  InstanceMismatchError,
  OutcomeUnknownError,
  PreviousStepUnfinishedError,
  UnknownStepError,
} from "idem-client";

import { newKey, useServer } from "./support/server.js";

const STEPS = ["create_ticket", "reserve_stock", "notify"];

describe("workflow steps", () => {
  const server = useServer("sqlite");

  it("steps run in order once, and an UNKNOWN step pauses the instance", async () => {
    const c = server.client();
    const iid = `${newKey("ORD")}:stock`;
    const inst = await c.startWorkflow("stock-reservation", iid, { input: { ticket: "T-40" }, steps: STEPS });
    assert.deepEqual([inst.instanceId, inst.state], [iid, "RUNNING"]);
    assert.equal((await c.startWorkflow("stock-reservation", iid, { input: { ticket: "T-40" }, steps: STEPS })).state, "RUNNING");
    await assert.rejects(c.startWorkflow("stock-reservation", iid, { input: { ticket: "T-41" }, steps: STEPS }), InstanceMismatchError);
    await assert.rejects(c.step(iid, "reserve_stock"), PreviousStepUnfinishedError);
    await assert.rejects(c.step(iid, "ship"), UnknownStepError);

    {
      await using s = await c.step(iid, "create_ticket", { payload: { ticket: "T-40" } });
      assert.ok(s.acquired);
      assert.equal(s.key, `${iid}:create_ticket`);
      await s.succeeded("ticket-9", { ticket: 9 });
    }
    {
      await using s = await c.step(iid, "create_ticket", { payload: { ticket: "T-40" } });
      assert.deepEqual([s.replayed, s.result], [true, { ticket: 9 }]);
    }
    {
      await using s = await c.step(iid, "reserve_stock", { payload: { sku: "A-1" } });
      await s.unknown("the stock service timed out");
    }
    await assert.rejects(c.step(iid, "reserve_stock", { payload: { sku: "A-1" } }), OutcomeUnknownError);
    const paused = await c.getWorkflow(iid);
    assert.deepEqual([paused.state, paused.stoppedStep], ["PAUSED", "reserve_stock"]);
    const e = await c.step(iid, "notify").catch((err: unknown) => err);
    assert.ok(e instanceof PreviousStepUnfinishedError);
    assert.equal(e.state, "UNKNOWN");
  });

  it("a worker finishes the instance; a step's undeclared error ends UNKNOWN", async () => {
    const c = server.client();
    const iid = `${newKey("ORD")}:all`;
    await c.startWorkflow("stock-reservation", iid, { input: { ticket: "T-7" }, steps: STEPS });
    for (const step of STEPS) {
      await using s = await c.step(iid, step, { payload: { step }, leaseMs: 2000 });
      assert.ok(s.acquired);
      await s.succeeded(`${step}-ref`);
    }
    const inst = await c.getWorkflow(iid);
    assert.deepEqual([inst.state, inst.lastGoodStep], ["SUCCEEDED", "notify"]);
    assert.deepEqual(
      inst.steps.map((st) => st["provider_ref"]),
      STEPS.map((s) => `${s}-ref`),
    );

    const slow = `${newKey("ORD")}:slow`;
    await c.startWorkflow("stock-reservation", slow, { steps: ["pack"] });
    {
      await using s = await c.step(slow, "pack", { leaseMs: 900 });
      await sleep(2000); // longer than the lease: the heartbeat renews the step's operation
      assert.equal(s.lease.lost, false);
      await s.succeeded("pack-ref");
    }
    const packed = await c.getOperation(`${slow}:pack`);
    assert.ok(packed.events.some((e) => e.kind === "lease_renewed"), packed.events.map((e) => e.kind).join(" "));

    const boom = `${newKey("ORD")}:boom`;
    await c.startWorkflow("stock-reservation", boom, { steps: [{ name: "charge", action: "charge_card" }] });
    const reset = Object.assign(new Error("reset after the request was sent"), { code: "ECONNRESET" });
    {
      await using s = await c.step(boom, "charge", { retryable: [(e) => (e as { code?: string }).code === "ECONNREFUSED"] });
      await s.completeWithError(reset);
    }
    const op = await c.getOperation(`${boom}:charge`);
    assert.deepEqual([op.state, op.action], ["UNKNOWN", "charge_card"]);
  });
});
