/**
 * Defence in depth: an answer whose record is about another key, lease holder or fencing token
 * than the request's is never acted on (AnswerMismatchError, a NoAnswerError). These are unit
 * tests of that check: a `fetch` that answers with another request's record, which a real
 * server does not do (a proxy or connection pool that mixes answers up would).
 */

import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { it } from "node:test";

import { AnswerMismatchError, Client, NoAnswerError, OutcomeNotRecordedError } from "idem-client";

import { ADMIN_KEY } from "./support/server.js";

/** A client whose every request is answered by `answer(method, path, body)` (status, JSON body). */
function answering(answer: (method: string, path: string, body: any) => [number, unknown]): Client {
  const fetchImpl = async (input: string | URL | Request, init?: RequestInit): Promise<Response> => {
    const url = new URL(String(input));
    const body = typeof init?.body === "string" ? JSON.parse(init.body) : undefined;
    const [status, json] = answer(init?.method ?? "GET", url.pathname, body);
    return new Response(JSON.stringify(json), { status, headers: { "content-type": "application/json" } });
  };
  return new Client({ url: "http://idem.invalid", apiKey: ADMIN_KEY, fetch: fetchImpl as typeof fetch, retry: { attempts: 1 } });
}

function guarded(client: Client, ran: string[]) {
  return client.makeIdempotent(
    async (order: string) => {
      ran.push(order);
      return { ref: "msg-1" };
    },
    { key: (order) => order, action: "send", providerRef: "ref" },
  );
}

for (const status of [200, 201]) {
  it(`a ${status} about another key is not acted on: the function does not run`, async () => {
    const other = {
      key: "other-key",
      state: status === 201 ? "EXECUTING" : "SUCCEEDED",
      fencing_token: 7,
      lease_holder: randomUUID(),
      result: { ref: "msg-other" },
    };
    const ran: string[] = [];
    const e = await guarded(answering(() => [status, other]), ran)("my-key").catch((err: unknown) => err);
    assert.ok(e instanceof AnswerMismatchError, String(e));
    assert.ok(e instanceof NoAnswerError, "the request's own answer was lost");
    assert.deepEqual([e.expected, e.got], ['the key "my-key"', 'the key "other-key"']);
    assert.deepEqual(ran, []);
  });
}

it("a grant for another lease holder is not acted on", async () => {
  const ran: string[] = [];
  const client = answering((_m, _p, body) => [201, { key: body.key, state: "EXECUTING", fencing_token: 7, lease_holder: randomUUID() }]);
  const e = await guarded(client, ran)("K-1").catch((err: unknown) => err);
  assert.ok(e instanceof AnswerMismatchError, String(e));
  assert.match(e.got, /^the lease holder "/);
  assert.deepEqual(ran, []);
});

it("a completion answered with another fencing token is not taken as recorded", async () => {
  const client = answering((_m, path, body) =>
    path === "/v1/operations"
      ? [201, { key: "K-1", state: "EXECUTING", fencing_token: 7, lease_holder: body.holder }]
      : // the completion: the same key under another lease (another attempt's answer)
        [200, { key: "K-1", state: "SUCCEEDED", fencing_token: 8 }],
  );
  const claim = await client.claim("K-1", { action: "send", heartbeat: false });
  assert.ok(claim.acquired);
  const e = await claim.succeeded("ref-1").catch((err: unknown) => err);
  assert.ok(e instanceof OutcomeNotRecordedError, String(e));
  assert.ok(e.cause instanceof AnswerMismatchError, String(e.cause));
  assert.deepEqual([e.key, e.fencingToken, e.completion], ["K-1", 7, { outcome: "succeeded", provider_ref: "ref-1" }]);
  assert.equal(claim.state, "EXECUTING", "the claim keeps the grant's record");
});

it("a step's grant may be about a re-run of the step; about another step it is refused", async () => {
  const grant = (key: string) => (_m: string, _p: string, body: any): [number, unknown] => [
    201,
    { key, state: "EXECUTING", fencing_token: 7, lease_holder: body.holder },
  ];
  const rerun = await answering(grant("I-1:charge:rerun-2")).step("I-1", "charge", { heartbeat: false });
  assert.equal(rerun.key, "I-1:charge:rerun-2");
  await assert.rejects(answering(grant("I-1:refund")).step("I-1", "charge"), AnswerMismatchError);
  await assert.rejects(answering(grant("I-1:charge:rerun-x")).step("I-1", "charge"), AnswerMismatchError);
});

it("reads and complete() check the key, the instance id and the token", async () => {
  const record = { key: "other-key", state: "SUCCEEDED", fencing_token: 7 };
  await assert.rejects(answering(() => [200, record]).getOperation("my-key"), AnswerMismatchError);
  await assert.rejects(answering(() => [200, { instance_id: "I-2" }]).getWorkflow("I-1"), AnswerMismatchError);
  const sameKey = answering(() => [200, { ...record, key: "my-key", fencing_token: 8 }]);
  await assert.rejects(sameKey.complete("my-key", 7, { outcome: "unknown" }), AnswerMismatchError);
  assert.equal((await sameKey.complete("my-key", 8, { outcome: "unknown" })).state, "SUCCEEDED");
});
