/**
 * A worker process of the multi-process tests: calls one guarded function once and prints
 * what happened (`effect` when the function body starts, then `returned REF` or `raised
 * KIND`). Arguments: URL KEY EFFECTS_FILE SLEEP_MS LEASE_MS WAIT_MS.
 */

import { appendFileSync } from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";

import { Client } from "idem-client";

import { kindOf } from "./casefile.js";
import { ADMIN_KEY } from "./server.js";

const [url, key, effects, sleepMs, leaseMs, waitMs] = process.argv.slice(2) as [string, string, string, string, string, string];
const client = new Client({ url, apiKey: ADMIN_KEY });

const sendConfirmation = client.makeIdempotent(
  async (order: string) => {
    appendFileSync(effects, `${process.pid}\n`); // the side effect, counted once per line
    process.stdout.write("effect\n");
    await sleep(Number(sleepMs));
    return { ref: `msg-${process.pid}`, order };
  },
  {
    key: (order) => order,
    payload: (order) => ({ order }),
    action: "send_confirmation",
    providerRef: "ref",
    leaseMs: Number(leaseMs),
    waitMs: Number(waitMs),
  },
);

try {
  process.stdout.write(`returned ${(await sendConfirmation(key)).ref}\n`);
} catch (e) {
  process.stdout.write(`raised ${kindOf(e)}\n`);
}
