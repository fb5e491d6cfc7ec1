/**
 * idem-client/webhooks: Standard Webhooks signatures, and the deliveries of a real `idem relay`
 * (from a real outbox in PostgreSQL) verified and applied once each through the inbox.
 */

import assert from "node:assert/strict";
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { once } from "node:events";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { type Server, createServer } from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import { InvalidInputError } from "idem-client";
import { WebhookHeaderError, WebhookVerificationError, contentFingerprint, verify } from "idem-client/webhooks";
import { Webhook } from "standardwebhooks";

import { PgDatabase, idemBin } from "./support/server.js";

function newSecret(): string {
  return `whsec_${randomBytes(32).toString("base64")}`;
}

function signed(secret: string, body: string, msgId = "evt-1", at = new Date()): Record<string, string> {
  return {
    "Webhook-Id": msgId,
    "Webhook-Timestamp": String(Math.floor(at.getTime() / 1000)),
    "Webhook-Signature": new Webhook(secret).sign(msgId, at, body),
  };
}

it("a signature verifies with either secret during a rotation", () => {
  const [old, fresh, body] = [newSecret(), newSecret(), '{"order": 7}'];
  assert.deepEqual(verify(body, signed(fresh, body), [old, fresh]), { order: 7 });
  assert.deepEqual(verify(Buffer.from(body), signed(old, body), [old, fresh]), { order: 7 });
  const both = `${signed(old, body)["Webhook-Signature"]} ${signed(fresh, body)["Webhook-Signature"]}`;
  assert.deepEqual(verify(body, new Headers({ ...signed(old, body), "webhook-signature": both }), fresh), { order: 7 });
});

for (const tamper of ["other secret", "other body", "other id", "old timestamp", "malformed entry", "missing header"]) {
  it(`anything else is refused: ${tamper}`, () => {
    const secret = newSecret();
    let body = '{"order": 7}';
    let headers = signed(secret, body);
    let error: typeof WebhookVerificationError = WebhookVerificationError;
    if (tamper === "other secret") headers = signed(newSecret(), body);
    else if (tamper === "other body") body = '{"order": 8}';
    else if (tamper === "other id") headers["Webhook-Id"] = "evt-2";
    else if (tamper === "old timestamp") headers = signed(secret, body, "evt-1", new Date(Date.now() - 6 * 60_000));
    else if (tamper === "malformed entry") headers["Webhook-Signature"] = `v1${(headers["Webhook-Signature"] ?? "").slice(3)}`;
    else {
      delete headers["Webhook-Signature"];
      error = WebhookHeaderError;
    }
    assert.throws(() => verify(body, headers, secret), error);
  });
}

it("a secret that is not a key is a configuration error, not a bad signature", () => {
  assert.throws(() => verify("{}", signed(newSecret(), "{}"), "whsec_"), InvalidInputError);
});

it("the content fingerprint ignores the sender's formatting", () => {
  assert.equal(contentFingerprint('{"b": 1, "a": "Zu\u0308rich"}'), contentFingerprint('{"a":"Z\u00fcrich","b":1}'));
  assert.notEqual(contentFingerprint('{"a": 1}'), contentFingerprint('{"a": 2}'));
  assert.match(contentFingerprint("not json"), /^[0-9a-f]{64}$/);
});

describe("the relay's deliveries", () => {
  let db: PgDatabase;
  const dir = mkdtempSync(join(tmpdir(), "idem-tsclient-relay-"));
  let relay: ChildProcess;
  let receiver: Server;
  const secret = newSecret();
  const log: [string, string][] = [];
  const failAfterCommit = new Set<string>();

  /** Runs `query` with psql (from stdin, where psql interpolates `:'p1'`... with `params`). */
  async function sql(query: string, ...params: string[]): Promise<string> {
    const vars = params.flatMap((p, i) => ["-v", `p${i + 1}=${p}`]);
    const p = spawn("psql", ["-X", "-Atq", "-v", "ON_ERROR_STOP=1", ...vars, db.url], { stdio: ["pipe", "pipe", "pipe"] });
    p.stdin.end(query);
    const out: Buffer[] = [];
    const err: Buffer[] = [];
    p.stdout.on("data", (c: Buffer) => out.push(c));
    p.stderr.on("data", (c: Buffer) => err.push(c));
    const [code] = (await once(p, "close")) as [number];
    if (code !== 0) throw new Error(`psql: ${Buffer.concat(err).toString()}`);
    return Buffer.concat(out).toString().trim();
  }

  before(async () => {
    db = new PgDatabase("idem_tsclient_app");
    execFileSync(idemBin(), ["schema", "install", "--database-url", db.url], { stdio: "ignore" });
    await sql("CREATE TABLE orders (id text PRIMARY KEY, amount integer NOT NULL)");
    // The receiver: verify, claim the webhook-id in the inbox and apply, in one transaction;
    // it answers 503 *after* committing the first delivery of the ids in failAfterCommit (a
    // lost acknowledgement), so the relay delivers them again.
    receiver = createServer((req, res) => {
      const chunks: Buffer[] = [];
      req.on("data", (c: Buffer) => chunks.push(c));
      req.on("end", async () => {
        const body = Buffer.concat(chunks);
        let status = 204;
        try {
          const event = verify(body, req.headers, secret) as { id: string; amount: number };
          const id = String(req.headers["webhook-id"]);
          const decision = await sql(
            "BEGIN; SELECT decision FROM idem.inbox_claim('orders-receiver', :'p1', :'p2') \\gset\n" +
              "INSERT INTO orders SELECT :'p1', :'p3' WHERE :'decision' = 'apply';\n" +
              "SELECT idem.inbox_finish('orders-receiver', :'p1', '{\"applied\": true}') WHERE :'decision' = 'apply';\n" +
              "COMMIT; SELECT :'decision'",
            id,
            contentFingerprint(body),
            String(event.amount),
          );
          log.push([id, decision.split("\n").pop() ?? ""]);
          if (failAfterCommit.has(id) && decision.endsWith("apply")) status = 503;
        } catch (e) {
          status = e instanceof WebhookVerificationError ? 401 : 500;
        }
        res.writeHead(status).end();
      });
    });
    await new Promise<void>((ok) => receiver.listen(0, "127.0.0.1", ok));
    const port = (receiver.address() as { port: number }).port;
    writeFileSync(join(dir, "secret"), `${secret}\n`);
    writeFileSync(
      join(dir, "idem.toml"),
      `[outbox]\ndatabase_url = "${db.url}"\npoll_interval_ms = 50\nlease_ms = 5000\n` +
        `[outbox.sinks.hooks]\nkind = "webhook"\nurl = "http://127.0.0.1:${port}/hooks"\ntopics = ["orders.*"]\n` +
        `secrets = [{ file = "${join(dir, "secret")}" }]\ntimeout_ms = 2000\n` +
        "retry = { base_ms = 10, cap_ms = 50, max_attempts = 5 }\n",
    );
    relay = spawn(idemBin(), ["relay", "--config", join(dir, "idem.toml")], {
      env: { ...process.env, RUST_LOG: "error" },
      stdio: "ignore",
    });
  });

  after(async () => {
    relay.kill("SIGTERM");
    await new Promise((ok) => relay.once("exit", ok));
    receiver.close();
    db.drop();
    rmSync(dir, { recursive: true, force: true });
  });

  it("each event is verified and applied once; the one whose acknowledgement was lost comes again as a duplicate", async () => {
    const run = randomBytes(3).toString("hex");
    const ids = [`${run}-o-1`, `${run}-o-2`, `${run}-o-3`];
    failAfterCommit.add(ids[1] ?? "");
    for (const [i, id] of ids.entries()) {
      await sql(
        "SELECT idem.outbox_append(:'p1', 'order', :'p2', 'orders.created', json_build_object('id', :'p1', 'amount', (:'p3')::int))",
        id,
        `${run}-${i}`,
        String(10 * i),
      );
    }
    const deadline = Date.now() + 20_000;
    while (Date.now() < deadline && log.length < 4) await sleep(50);
    assert.deepEqual(await sql("SELECT string_agg(id || '=' || amount, ',' ORDER BY id) FROM orders"), ids.map((id, i) => `${id}=${10 * i}`).join(","));
    assert.deepEqual(
      log.map((l) => l.join(":")).sort(),
      [`${ids[0]}:apply`, `${ids[1]}:apply`, `${ids[1]}:duplicate`, `${ids[2]}:apply`].sort(),
    );
    assert.equal(await sql("SELECT string_agg(state, ',') FROM idem.outbox WHERE id LIKE :'p1'", `${run}-%`), "DELIVERED,DELIVERED,DELIVERED");
  });
});
