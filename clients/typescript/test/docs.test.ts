/**
 * Every TypeScript snippet of clients/typescript/README.md, compiled with `tsc --strict` and run
 * as written against a fresh server: each ```ts block must follow a `<!-- test: NAME -->`
 * marker, and what its `console.log(...); // EXPECTED` lines print must be EXPECTED. The book's
 * Node.js page quotes these blocks (crates/idem/tests/docs.rs checks them line by line).
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { before, describe, it } from "node:test";
import { promisify } from "node:util";

import { Webhook } from "standardwebhooks";

import { ADMIN_KEY, PACKAGE, useServer } from "./support/server.js";

const run = promisify(execFile);
const README = join(PACKAGE, "README.md");
const BLOCK = /(?:<!-- test: ([a-z-]+) -->\n)?```ts\n([\s\S]*?)\n```/g;
const SNIPPETS = [...readFileSync(README, "utf8").matchAll(BLOCK)].map((m) => ({ name: m[1] ?? "", code: m[2] ?? "" }));
/** Inside the package, so that `import "idem-client"` is the package itself (and its dist). */
const SRC = join(PACKAGE, "build/snippets");
const OUT = join(PACKAGE, "build/snippets-out");

function expectedPrints(code: string): string[] {
  return code
    .split("\n")
    .filter((l) => l.startsWith("console.log(") && l.includes("// "))
    .map((l) => l.slice(l.lastIndexOf("// ") + 3).trim());
}

it("every ts block of the README is marked to run", () => {
  assert.deepEqual(
    SNIPPETS.filter((s) => !s.name).map((s) => s.code.slice(0, 60)),
    [],
    "ts blocks without <!-- test: NAME -->",
  );
  assert.ok(SNIPPETS.length >= 5);
});

describe("the README's snippets, compiled and run as written", () => {
  const server = useServer("sqlite");
  const secrets = [`whsec_${randomBytes(32).toString("base64")}`, `whsec_${randomBytes(32).toString("base64")}`];
  const env = (): NodeJS.ProcessEnv => ({ ...process.env, IDEM_URL: server.url, IDEM_API_KEY: ADMIN_KEY, HOOK_SECRETS: secrets.join(" ") });

  before(async () => {
    rmSync(SRC, { recursive: true, force: true });
    mkdirSync(SRC, { recursive: true });
    for (const s of SNIPPETS) writeFileSync(join(SRC, `${s.name}.ts`), `${s.code}\n`);
    const tsc = join(PACKAGE, "node_modules/.bin/tsc");
    // The settings a user's project would have: strict, ES modules, Node.js 20.
    const flags = ["--strict", "--target", "ES2022", "--module", "NodeNext", "--moduleResolution", "NodeNext"];
    const lib = ["--lib", "ES2023,ESNext.Disposable", "--types", "node", "--rootDir", SRC, "--outDir", OUT, "--ignoreConfig"];
    await run(tsc, [...flags, ...lib, ...SNIPPETS.map((s) => join(SRC, `${s.name}.ts`))]).catch((e: { stdout?: string }) => {
      throw new Error(`the README's snippets do not compile:\n${e.stdout ?? String(e)}`);
    });
  });

  for (const s of SNIPPETS.filter((x) => x.name && x.name !== "webhook")) {
    it(s.name, async () => {
      const { stdout } = await run(process.execPath, [join(OUT, `${s.name}.js`)], { env: env() });
      assert.deepEqual(stdout.trimEnd().split("\n"), expectedPrints(s.code));
    });
  }

  it("webhook: a signed delivery is applied, a forged one refused", async () => {
    Object.assign(process.env, { HOOK_SECRETS: secrets.join(" ") });
    const { onWebhook } = (await import(join(OUT, "webhook.js"))) as {
      onWebhook: (body: Buffer, headers: Record<string, string>) => number;
    };
    const body = '{"order": 7}';
    const at = new Date();
    const headers = {
      "webhook-id": "evt-1",
      "webhook-timestamp": String(Math.floor(at.getTime() / 1000)),
      "webhook-signature": new Webhook(secrets[1] ?? "").sign("evt-1", at, body),
    };
    const logged: string[] = [];
    const log = console.log;
    console.log = (line: string) => logged.push(line);
    try {
      assert.equal(onWebhook(Buffer.from(body), headers), 204);
      assert.equal(onWebhook(Buffer.from('{"order": 8}'), headers), 401);
      assert.equal(onWebhook(Buffer.from(body), { "webhook-id": "evt-1" }), 400);
    } finally {
      console.log = log;
    }
    assert.deepEqual(logged, ["apply order 7 once, under evt-1"]);
  });
});
