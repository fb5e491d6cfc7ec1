/**
 * Drives the tickets MCP server with the official SDK's own client over stdio, against a real
 * `idem serve` (IDEM_BIN), and counts the tickets the helpdesk got: one per order and reason,
 * whatever the agents do.
 */

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { after, before, it } from "node:test";
import { fileURLToPath } from "node:url";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const SERVER = join(dirname(fileURLToPath(import.meta.url)), "../src/server.js");
const API_KEY = "test-admin-key-0123456789abcdef0123456789";
const dir = mkdtempSync(join(tmpdir(), "idem-mcp-tickets-"));
const TICKETS = join(dir, "tickets.jsonl");
const idem = spawn(
  process.env["IDEM_BIN"] ?? "idem",
  ["serve", "--listen", "127.0.0.1:0", "--sweep-interval-ms", "50", "--database-url", `sqlite://${join(dir, "idem.db")}`],
  { env: { ...process.env, IDEM_BOOTSTRAP_KEY: API_KEY, RUST_LOG: "error" }, stdio: ["ignore", "pipe", "inherit"] },
);
let idemUrl = "";
const agents: Client[] = [];

/** A new agent: an MCP client that starts its own tickets server (a process of its own). */
async function agent(): Promise<Client> {
  const client = new Client({ name: "test-agent", version: "0.1.0" });
  const env = { ...process.env, IDEM_URL: idemUrl, IDEM_API_KEY: API_KEY, TICKETS_FILE: TICKETS, HELPDESK_DELAY_MS: "300", HELPDESK_FAIL_AFTER: "ORD-10" };
  await client.connect(new StdioClientTransport({ command: process.execPath, args: [SERVER], env: env as Record<string, string> }));
  agents.push(client);
  return client;
}

async function openTicket(client: Client, order: string, details: string): Promise<{ text: string; isError: boolean }> {
  const r = await client.callTool({ name: "open_ticket", arguments: { order_id: order, reason: "refund", details } });
  const content = r.content as { type: string; text: string }[];
  return { text: content.map((c) => c.text).join(""), isError: r.isError === true };
}

function tickets(order: string): string[] {
  if (!existsSync(TICKETS)) return [];
  return readFileSync(TICKETS, "utf8")
    .split("\n")
    .filter(Boolean)
    .map((l) => JSON.parse(l) as { ticket: string; order_id: string })
    .filter((t) => t.order_id === order)
    .map((t) => t.ticket);
}

before(async () => {
  idemUrl = await new Promise<string>((ok, fail) => {
    createInterface({ input: idem.stdout! }).on("line", (l) => l.startsWith("idem: listening on ") && ok(l.slice(19).trim()));
    idem.on("exit", (code) => fail(new Error(`idem serve exited with ${code}`)));
  });
});

after(async () => {
  await Promise.all(agents.map((a) => a.close()));
  const exited = new Promise((ok) => idem.once("exit", ok));
  idem.kill("SIGKILL");
  await exited;
  rmSync(dir, { recursive: true, force: true });
});

it("lists its tools: the guarded one and the read-only one", async () => {
  const names = (await (await agent()).listTools()).tools.map((t) => t.name).sort();
  assert.deepEqual(names, ["list_tickets", "open_ticket"]);
});

it("a repeated call, reworded, gets the same ticket; the helpdesk got one", async () => {
  const a = await agent();
  const first = await openTicket(a, "ORD-7", "The customer wants a refund.");
  assert.match(first.text, /^Ticket T-[0-9a-f]{8} is open for ORD-7 \(refund\)\.$/);
  const again = await openTicket(a, "ORD-7", "Customer asks for their money back (retry).");
  assert.deepEqual(again, first);
  assert.equal(tickets("ORD-7").length, 1);
  assert.ok(first.text.includes(tickets("ORD-7")[0] ?? "?"));
});

it("concurrent calls from two agents (two server processes) open one ticket, and all see it", async () => {
  const [a, b] = await Promise.all([agent(), agent()]);
  const answers = await Promise.all([a, b, a, b].map((c, i) => openTicket(c, "ORD-8", `call ${i}`)));
  assert.equal(tickets("ORD-8").length, 1, JSON.stringify(answers));
  for (const r of answers) assert.deepEqual(r, { text: `Ticket ${tickets("ORD-8")[0]} is open for ORD-8 (refund).`, isError: false });
});

it("a call that failed after writing the ticket is UNKNOWN: the agent is told not to retry, and nothing is redone", async () => {
  const a = await agent();
  const first = await openTicket(a, "ORD-10", "damaged in transit");
  assert.equal(first.isError, true);
  assert.match(first.text, /recorded as UNKNOWN: do not retry/);
  const again = await openTicket(a, "ORD-10", "damaged in transit");
  assert.equal(again.isError, true);
  assert.match(again.text, /^Not done now, and do not retry: .* UNKNOWN/);
  assert.equal(tickets("ORD-10").length, 1, "the ticket was written once, never again");
});

it("a refusal declared final is replayed as the same refusal", async () => {
  const a = await agent();
  const first = await openTicket(a, "ORD-0", "unknown order");
  const again = await openTicket(a, "ORD-0", "unknown order");
  assert.deepEqual([first.isError, again.isError], [true, true]);
  assert.match(first.text, /refused this ticket for good: the helpdesk knows no order ORD-0/);
  assert.match(again.text, /refused this ticket for good: HelpdeskRefused: the helpdesk knows no order ORD-0/);
  assert.deepEqual(tickets("ORD-0"), []);
});
