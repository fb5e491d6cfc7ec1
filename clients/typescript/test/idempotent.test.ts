/**
 * makeIdempotent's own rules: the key and payload come from the arguments (checked before
 * anything is sent), `this` and the parameters are kept, fingerprintFields, results that are
 * not plain JSON, failed replays, and results idem cannot record.
 */

import assert from "node:assert/strict";
import { describe, it } from "node:test";

import {
  Client,
  FingerprintMismatchError,
  InvalidInputError,
  NotJSONError,
  OperationFailedError,
  ResultNotStorableError,
  ServerUnreachableError,
  fingerprint,
  makeIdempotent,
} from "idem-client";

import { ADMIN_KEY, freePort, newKey, useServer } from "./support/server.js";

/** A client whose server never answers: what fails with InvalidInputError failed before sending. */
const NOWHERE = new Client({ url: `http://127.0.0.1:${await freePort()}`, apiKey: ADMIN_KEY, retry: { attempts: 1 } });

it("the key and payload come from the arguments and fail before anything is sent", async () => {
  let ran = 0;
  const send = NOWHERE.makeIdempotent(
    async (orderId: string, to: string, version = 1) => {
      ran += 1;
      return { ref: `r-${orderId}-${to}-${version}` };
    },
    { key: (orderId, _to, version) => `${orderId}:confirm:${version ?? 1}`, action: "send", providerRef: "ref" },
  );
  await assert.rejects(send("ORD-1", "c-1"), ServerUnreachableError); // a valid call: only the server is missing

  const throwingKey = NOWHERE.makeIdempotent(async (_order: { id?: string }) => ({ ref: "r" }), {
    key: (order) => order.id!.toUpperCase(),
    action: "send",
    providerRef: "ref",
  });
  await assert.rejects(throwingKey({}), (e) => e instanceof InvalidInputError && /cannot be made from the arguments/.test(e.message));

  class Mailer {}
  const withObject = NOWHERE.makeIdempotent(async (_orderId: string, _mailer: Mailer) => ({ ref: "r" }), {
    key: (orderId) => orderId,
    action: "send",
    providerRef: "ref",
  });
  await assert.rejects(
    withObject("ORD-1", new Mailer()),
    (e) => e instanceof NotJSONError && /payload \/1: a Mailer is not JSON/.test(e.message) && /payload: \(\.\.\.args\)/.test(e.message),
  );

  const badKey = NOWHERE.makeIdempotent(async (_orderId: string) => ({ ref: "r" }), {
    key: ((orderId: string) => orderId.length) as unknown as (orderId: string) => string,
    action: "send",
    providerRef: "ref",
  });
  await assert.rejects(badKey("ORD-1"), /the key must be a string/);
  assert.throws(() => NOWHERE.makeIdempotent(async () => ({ ref: "r" }), { key: () => "k", action: "send", providerRef: "ref", leaseMs: 50 }), /leaseMs/);
  assert.throws(
    () => makeIdempotent(async () => ({ ref: "r" }), { key: "k" as unknown as () => string, action: "send", providerRef: "ref" }),
    /key must be a function/,
  );
  assert.equal(ran, 0);
});

describe("makeIdempotent against a server", () => {
  const server = useServer("sqlite");

  it("keeps `this` and the parameters, and the default payload is the arguments", async () => {
    const client = server.client();
    class Mailer {
      sent = 0;
      send = makeIdempotent(
        async function (this: Mailer, orderId: string, to: string) {
          this.sent += 1;
          return { messageId: `m-${orderId}`, to };
        },
        { key: (orderId) => orderId, action: "send_confirmation", providerRef: "messageId", client },
      );
    }
    const key = newKey();
    const m = new Mailer();
    assert.deepEqual(await m.send(key, "c-1"), { messageId: `m-${key}`, to: "c-1" });
    assert.deepEqual(await m.send(key, "c-1"), { messageId: `m-${key}`, to: "c-1" });
    assert.equal(m.sent, 1);
    const op = await client.getOperation(key);
    assert.deepEqual(op.payload, [key, "c-1"]);
    assert.equal(op.fingerprint, fingerprint([key, "c-1"]), "the library computes idem's fingerprint");
  });

  it("the default client comes from IDEM_URL and IDEM_API_KEY at the first call", async () => {
    const saved = { url: process.env["IDEM_URL"], key: process.env["IDEM_API_KEY"] };
    process.env["IDEM_URL"] = server.url;
    process.env["IDEM_API_KEY"] = ADMIN_KEY;
    try {
      const send = makeIdempotent(async (n: number) => ({ ref: `r-${n}` }), { key: (n) => `${newKey()}:${n}`, action: "send", providerRef: "ref" });
      assert.deepEqual(await send(7), { ref: "r-7" });
    } finally {
      for (const [name, v] of [["IDEM_URL", saved.url], ["IDEM_API_KEY", saved.key]] as const) {
        if (v === undefined) delete process.env[name];
        else process.env[name] = v;
      }
    }
  });

  it("fingerprintFields name the intent: another trace id is still a replay", async () => {
    const client = server.client();
    const ran: string[] = [];
    const send = client.makeIdempotent(
      async (_inquiry: string, mail: { to: string; template: string; trace: string }) => {
        ran.push(mail.trace);
        return { ref: `msg-${mail.trace}` };
      },
      { key: (inquiry) => inquiry, payload: (_i, mail) => mail, fingerprintFields: ["/to", "/template"], action: "send", providerRef: "ref" },
    );
    const key = newKey();
    const first = await send(key, { to: "c-1", template: "t", trace: "a" });
    assert.deepEqual(await send(key, { to: "c-1", template: "t", trace: "b" }), first);
    await assert.rejects(send(key, { to: "c-2", template: "t", trace: "c" }), FingerprintMismatchError);
    assert.deepEqual(ran, ["a"]);
  });

  it("serialize and deserialize carry results that are not JSON", async () => {
    const client = server.client();
    class Receipt {
      constructor(
        readonly messageId: string,
        readonly sentAt: Date,
      ) {}
    }
    const send = client.makeIdempotent(async (order: string) => new Receipt(`m-${order}`, new Date("2026-12-01T10:00:00Z")), {
      key: (order) => order,
      payload: (order) => ({ order }),
      action: "send",
      providerRef: "messageId",
      serialize: (r) => ({ messageId: r.messageId, sentAt: r.sentAt.toISOString() }),
      deserialize: (s) => {
        const o = s as { messageId: string; sentAt: string };
        return new Receipt(o.messageId, new Date(o.sentAt));
      },
    });
    const key = newKey();
    const first = await send(key);
    const again = await send(key);
    assert.ok(again instanceof Receipt, "the replay is deserialized");
    assert.deepEqual(again, first);
    assert.deepEqual((await client.getOperation(key)).result, { messageId: `m-${key}`, sentAt: "2026-12-01T10:00:00.000Z" });
  });

  it("a replay resolves to the stored JSON, not the value the first call returned", async () => {
    // serialize without deserialize: the first call returns the function's Date, a replay the
    // stored string (README "Results").
    const client = server.client();
    const sentAt = new Date("2026-12-01T10:00:00Z");
    const send = client.makeIdempotent(async (_order: string) => ({ ref: 12345, sentAt }), {
      key: (order) => order,
      action: "send",
      providerRef: "ref",
      serialize: (r) => ({ ref: r.ref, sentAt: r.sentAt.toISOString() }),
    });
    const key = newKey();
    const first = await send(key);
    assert.equal(first.sentAt, sentAt);
    const replay: unknown = await send(key); // typed as the function's result, but JSON
    assert.deepEqual(replay, { ref: 12345, sentAt: "2026-12-01T10:00:00.000Z" });
    assert.equal((await client.getOperation(key)).providerRef, "12345", "integer evidence, as its decimal string");
  });

  it("a failed operation is replayed as its error", async () => {
    const client = server.client();
    class CardDeclinedError extends Error {}
    let ran = 0;
    const charge = client.makeIdempotent(
      async (order: string) => {
        ran += 1;
        throw new CardDeclinedError(`insufficient funds for ${order.slice(0, 1)}`);
      },
      { key: (order) => order, payload: (order) => ({ order }), action: "charge", providerRef: "ref", final: [CardDeclinedError] },
    );
    const key = newKey();
    await assert.rejects(charge(key), CardDeclinedError);
    const e = await charge(key).catch((err: unknown) => err);
    assert.ok(e instanceof OperationFailedError);
    assert.deepEqual([e.errorClass, e.errorMessage, e.operation.state], ["CardDeclinedError", "CardDeclinedError: insufficient funds for T", "FAILED"]);
    assert.equal(ran, 1);
  });

  for (const [result, refusedBy] of [
    [{ ref: "x".repeat(600) }, "the library"],
    [{ ref: "msg-1", body: "x".repeat(1_100_000) }, "idem (413)"],
  ] as const) {
    it(`a result refused by ${refusedBy} ends UNKNOWN, never SUCCEEDED without it`, async () => {
      const client = server.client();
      const send = client.makeIdempotent(async (_order: string) => result, {
        key: (order) => order,
        payload: (order) => ({ order }),
        action: "send",
        providerRef: "ref",
      });
      const key = newKey();
      const e = await send(key).catch((err: unknown) => err);
      assert.ok(e instanceof ResultNotStorableError, String(e));
      assert.equal(e.recordedState, "UNKNOWN", refusedBy);
      assert.equal(e.result, result);
      assert.equal((await client.getOperation(key)).state, "UNKNOWN");
    });
  }
});
