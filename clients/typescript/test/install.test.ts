/**
 * The package as a project gets it: `npm install` of this folder (a link), its exports, and its
 * type declarations under a strict consumer's settings (`skipLibCheck` off), including the
 * types `makeIdempotent` infers and the mistakes they must refuse (`@ts-expect-error`).
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { it } from "node:test";
import { promisify } from "node:util";

import { PACKAGE } from "./support/server.js";

const run = promisify(execFile);

const CONSUMER = `
import { Client, makeIdempotent, OutcomeUnknownError, type Claim } from "idem-client";
import { verify } from "idem-client/webhooks";

const send = makeIdempotent(async (order: string, copies: number) => ({ ref: \`r-\${order}\`, copies }), {
  key: (order) => \`\${order}:send:v1\`,
  payload: (order, copies) => ({ order, copies }),
  action: "send",
  providerRef: "ref",
});
const same: (order: string, copies: number) => Promise<{ ref: string; copies: number }> = send;

/** Never called: what the types must refuse. */
function mistakes(): void {
  // @ts-expect-error providerRef names a field of the result
  makeIdempotent(async (order: string) => ({ ref: order }), { key: (o) => o, action: "send", providerRef: "nope" });
  // @ts-expect-error the key function takes the function's arguments
  makeIdempotent(async (order: string) => ({ ref: order }), { key: (o: number) => String(o), action: "send", providerRef: "ref" });
  // @ts-expect-error the guarded function keeps its parameters
  void send("ORD-1");
}

async function claimed(client: Client): Promise<string | undefined> {
  await using claim: Claim = await client.claim("K-1", { action: "send", payload: { n: 1 } });
  return claim.acquired ? String(claim.fencingToken) : undefined;
}

console.log(typeof same, typeof claimed, typeof mistakes, typeof verify, OutcomeUnknownError.name);
`;

it("installs as a link, and its declarations type-check a strict consumer", async (t) => {
  const dir = mkdtempSync(join(tmpdir(), "idem-tsclient-consumer-"));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  writeFileSync(join(dir, "package.json"), JSON.stringify({ name: "consumer", private: true, type: "module" }));
  // --ignore-scripts: the build is this run's (another test file may be importing dist/ now).
  await run("npm", ["install", "--offline", "--ignore-scripts", "--no-audit", "--no-fund", PACKAGE], { cwd: dir });
  writeFileSync(join(dir, "consumer.ts"), CONSUMER);
  const tsc = join(PACKAGE, "node_modules/.bin/tsc");
  const flags = ["--strict", "--target", "ES2022", "--module", "NodeNext", "--moduleResolution", "NodeNext", "--ignoreConfig"];
  const types = ["--lib", "ES2023,ESNext.Disposable", "--types", "node", "--typeRoots", join(PACKAGE, "node_modules/@types")];
  await run(tsc, [...flags, ...types, "consumer.ts"], { cwd: dir }).catch((e: { stdout?: string }) => {
    throw new Error(`the consumer does not compile:\n${e.stdout ?? String(e)}`);
  });
  const { stdout } = await run(process.execPath, ["consumer.js"], { cwd: dir });
  assert.equal(stdout.trim(), "function function function function OutcomeUnknownError");
});
