/**
 * `retryable` / `final`: the thrown value itself is judged (a class or a predicate), never its
 * `cause` chain; fetch's own refused connection is declared by the TypeError's direct cause
 * (README "Which errors prove nothing happened"); a predicate that throws names nothing; a
 * declaration that is neither is refused before anything is sent.
 */

import assert from "node:assert/strict";
import { createServer } from "node:net";
import { describe, it } from "node:test";

import { Client, InvalidInputError, makeIdempotent } from "idem-client";

import { ADMIN_KEY, freePort, newKey, useServer } from "./support/server.js";

const NOT_CONNECTED = new Set(["ECONNREFUSED", "ENOTFOUND", "EAI_AGAIN", "UND_ERR_CONNECT_TIMEOUT"]);

/** As the README declares it: the TypeError fetch threw, and that error's direct cause. */
function notConnected(e: unknown): boolean {
  return e instanceof TypeError && NOT_CONNECTED.has(String((e.cause as { code?: unknown })?.code));
}

/** A loopback provider that reads the request, then closes the connection without answering. */
async function closesAfterReading(): Promise<{ url: string; close: () => void }> {
  const server = createServer((c) => c.once("data", () => c.destroy()));
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  const address = server.address();
  if (address === null || typeof address === "string") throw new Error("no address");
  return { url: `http://127.0.0.1:${address.port}`, close: () => server.close() };
}

describe("which errors prove nothing happened", () => {
  const server = useServer("sqlite");

  async function stateAfter(effect: () => Promise<unknown>, retryable: Parameters<typeof makeIdempotent>[1]["retryable"]) {
    const client = server.client();
    const key = newKey();
    const send = client.makeIdempotent(async (_order: string) => ({ ref: String(await effect()) }), {
      key: (order) => order,
      action: "send",
      providerRef: "ref",
      ...(retryable === undefined ? {} : { retryable }),
    });
    const thrown = await send(key).then(
      () => assert.fail("resolved"),
      (e: unknown) => e,
    );
    return { thrown, state: (await client.getOperation(key)).state };
  }

  it("fetch's refused connection, judged by the TypeError's direct cause: PENDING", async () => {
    const url = `http://127.0.0.1:${await freePort()}/send`;
    const { thrown, state } = await stateAfter(() => fetch(url, { method: "POST", body: "x" }), [notConnected]);
    assert.ok(thrown instanceof TypeError && (thrown.cause as { code?: unknown }).code === "ECONNREFUSED", String(thrown));
    assert.equal(state, "PENDING");
  });

  it("a request that was sent (the connection closed after it) is not declared: UNKNOWN", async () => {
    const provider = await closesAfterReading();
    try {
      const { thrown, state } = await stateAfter(() => fetch(provider.url, { method: "POST", body: "x" }), [notConnected]);
      assert.ok(thrown instanceof TypeError, String(thrown));
      assert.equal(state, "UNKNOWN");
    } finally {
      provider.close();
    }
  });

  it("an error is judged itself, never by its cause chain: an earlier refusal proves nothing", async () => {
    // Your own retry loop: the first try was refused, the second timed out after sending.
    const url = `http://127.0.0.1:${await freePort()}/send`;
    const { thrown, state } = await stateAfter(async () => {
      const first = await fetch(url, { method: "POST", body: "x" }).catch((e: unknown) => e);
      assert.ok(notConnected(first));
      throw new Error("the second try timed out after sending", { cause: first });
    }, [notConnected, TypeError]);
    assert.ok(thrown instanceof Error && notConnected(thrown.cause), String(thrown));
    assert.equal(state, "UNKNOWN");
  });

  it("a predicate that throws names nothing: UNKNOWN, and the function's own error is rethrown", async () => {
    const own = new RangeError("the provider said something odd");
    const { thrown, state } = await stateAfter(
      () => Promise.reject(own),
      [
        (e) => {
          throw new Error(`cannot judge ${String(e)}`);
        },
      ],
    );
    assert.equal(thrown, own);
    assert.equal(state, "UNKNOWN");
  });
});

it("retryable or final that are not arrays of classes and predicates are refused before anything is sent", async () => {
  const nowhere = new Client({ url: `http://127.0.0.1:${await freePort()}`, apiKey: ADMIN_KEY, retry: { attempts: 1 } });
  const fn = async () => ({ ref: "r" });
  for (const spec of [TypeError, "ECONNREFUSED", [TypeError, "ECONNREFUSED"], [null]]) {
    const options = { key: () => "K-1", action: "send", providerRef: "ref" as const, retryable: spec as never };
    assert.throws(() => nowhere.makeIdempotent(fn, options), (e) => e instanceof InvalidInputError && /retryable must be an array/.test(e.message));
    assert.throws(() => makeIdempotent(fn, { ...options, client: nowhere }), InvalidInputError);
    await assert.rejects(nowhere.claim("K-1", { action: "send", final: spec as never }), /final must be an array/);
  }
});
