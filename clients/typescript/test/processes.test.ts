/** Several worker processes, and a worker killed with SIGKILL mid-function. */

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { after, describe, it } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";

import { OutcomeUnknownError } from "idem-client";

import { type RunningServer, newKey, useServer } from "./support/server.js";

const WORKER = join(dirname(fileURLToPath(import.meta.url)), "support/worker.js");

interface Worker {
  readonly pid: number;
  /** Resolves to the first line the worker prints. */
  readonly firstLine: Promise<string>;
  /** Resolves to all it printed once it exits. */
  readonly output: Promise<string>;
  kill(): void;
}

function worker(server: RunningServer, key: string, effects: string, sleepMs: number, leaseMs: number, waitMs: number): Worker {
  const p = spawn(process.execPath, [WORKER, server.url, key, effects, String(sleepMs), String(leaseMs), String(waitMs)], {
    stdio: ["ignore", "pipe", "inherit"],
  });
  const lines: string[] = [];
  let first: (line: string) => void = () => undefined;
  const firstLine = new Promise<string>((ok) => {
    first = ok;
  });
  createInterface({ input: p.stdout }).on("line", (line) => {
    if (lines.length === 0) first(line);
    lines.push(line);
  });
  const output = new Promise<string>((ok) => p.on("close", () => ok(lines.join("\n"))));
  return { pid: p.pid ?? 0, firstLine, output, kill: () => p.kill("SIGKILL") };
}

function effectLines(path: string): string[] {
  return existsSync(path) ? readFileSync(path, "utf8").split("\n").filter(Boolean) : [];
}

for (const backend of ["sqlite", "postgres"] as const) {
  describe(`worker processes on ${backend}`, { concurrency: true }, () => {
    const server = useServer(backend);
    const dir = mkdtempSync(join(tmpdir(), "idem-tsclient-proc-"));
    after(() => rmSync(dir, { recursive: true, force: true }));

    it("concurrent duplicates from six processes perform one effect and all get its result", async () => {
      const key = newKey("P");
      const effects = join(dir, `${key}.effects`);
      const outs = await Promise.all(
        Array.from({ length: 6 }, () => worker(server, key, effects, 400, 30_000, 20_000).output),
      );
      const done = effectLines(effects);
      assert.equal(done.length, 1, outs.join("\n---\n"));
      const returned = new Set(outs.flatMap((o) => o.split("\n").filter((l) => l.startsWith("returned"))));
      assert.deepEqual([...returned], [`returned msg-${done[0]}`], outs.join("\n---\n"));
      assert.equal(outs.filter((o) => o.includes("effect")).length, 1);
    });

    it("a worker killed with SIGKILL mid-function leaves UNKNOWN after its lease, never redone", async () => {
      const key = newKey("K");
      const effects = join(dir, `${key}.effects`);
      const leaseMs = 600;
      const w = worker(server, key, effects, 60_000, leaseMs, 0);
      assert.equal(await w.firstLine, "effect");
      w.kill(); // SIGKILL: no exit handler, no completion
      await w.output;
      assert.equal(effectLines(effects).length, 1);
      await sleep(leaseMs + 300); // the lease runs out; the sweeper makes it UNKNOWN
      const client = server.client();
      assert.equal((await client.getOperation(key)).state, "UNKNOWN");
      let ran = 0;
      const send = client.makeIdempotent(
        async (order: string) => {
          ran += 1;
          return { ref: `msg-again-${order}` };
        },
        { key: (order) => order, payload: (order) => ({ order }), action: "send_confirmation", providerRef: "ref" },
      );
      await assert.rejects(send(key), (e) => e instanceof OutcomeUnknownError && e.operation.state === "UNKNOWN");
      assert.equal(ran, 0);
      const again = await worker(server, key, effects, 0, leaseMs, 0).output;
      assert.equal(again.trim(), "raised outcome-unknown");
      assert.equal(effectLines(effects).length, 1, "never performed again");
    });
  });
}
