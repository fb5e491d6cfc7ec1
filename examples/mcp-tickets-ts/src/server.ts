/**
 * An MCP tool server (official TypeScript MCP SDK, stdio transport) whose side-effecting tool
 * is guarded with idem-client: `open_ticket` opens a helpdesk ticket once per order and reason,
 * however often an agent calls it — a model that did not see the result and calls again, a
 * framework that re-runs a step after a timeout, two agents at once. `list_tickets` only
 * reads, so it is not guarded.
 *
 * The "helpdesk" here appends one JSON line per ticket to `TICKETS_FILE`; put your helpdesk's
 * API call in `openTicket`. Environment: `IDEM_URL`, `IDEM_API_KEY` (idem), `TICKETS_FILE`,
 * and for the tests `HELPDESK_DELAY_MS` (how long the helpdesk takes) and
 * `HELPDESK_FAIL_AFTER` (an order whose call fails after the ticket was written, as a
 * connection that breaks after the request was sent).
 *
 * Each answer of idem becomes a tool result the model can act on (MCP 2025-06-18, tool
 * results with `isError`): the ticket (new or recorded), "another call is opening it: call
 * again in N s", or "do not retry: the outcome is UNKNOWN; a person settles it".
 */

import { randomBytes } from "node:crypto";
import { appendFileSync, existsSync, readFileSync } from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";

import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StdioServerTransport } from "@modelcontextprotocol/sdk/server/stdio.js";
import type { CallToolResult } from "@modelcontextprotocol/sdk/types.js";
import {
  IdemError,
  InProgressError,
  OperationFailedError,
  OutcomeUnknownError,
  currentLease,
  makeIdempotent,
} from "idem-client";
import { z } from "zod";

const TICKETS_FILE = process.env["TICKETS_FILE"] ?? "tickets.jsonl";

interface TicketRequest {
  readonly order_id: string;
  readonly reason: "refund" | "damaged" | "late";
  readonly details: string;
}

/** The helpdesk refused the ticket for good (an order it does not know): a final failure. */
class HelpdeskRefused extends Error {
  override name = "HelpdeskRefused";
}

/** The side effect: one ticket at the helpdesk. Guarded, it runs once per order and reason. */
const openTicket = makeIdempotent(
  async (req: TicketRequest) => {
    await sleep(Number(process.env["HELPDESK_DELAY_MS"] ?? 0), undefined, { signal: currentLease().signal });
    if (req.order_id === "ORD-0") throw new HelpdeskRefused("the helpdesk knows no order ORD-0");
    const ticket = `T-${randomBytes(4).toString("hex")}`;
    appendFileSync(TICKETS_FILE, `${JSON.stringify({ ticket, ...req })}\n`);
    if (process.env["HELPDESK_FAIL_AFTER"] === req.order_id) {
      throw new Error("the connection to the helpdesk broke after the request was sent");
    }
    return { ticket, order_id: req.order_id, reason: req.reason };
  },
  {
    key: (req) => `${req.order_id}:ticket:${req.reason}:v1`, // the intent: one ticket per order and reason
    payload: (req) => ({ order_id: req.order_id, reason: req.reason }), // a rephrased `details` is the same intent
    action: "open_ticket",
    providerRef: "ticket", // the evidence: the helpdesk's ticket id
    final: [HelpdeskRefused],
    waitMs: 10_000, // a concurrent duplicate waits for the outcome
  },
);

function text(message: string, isError = false): CallToolResult {
  return { content: [{ type: "text", text: message }], isError };
}

/** The tool's answer for each outcome: the ticket, or what the model should do instead. */
async function openTicketTool(req: TicketRequest): Promise<CallToolResult> {
  try {
    const t = await openTicket(req);
    return text(`Ticket ${t.ticket} is open for ${t.order_id} (${t.reason}).`);
  } catch (e) {
    if (e instanceof OutcomeUnknownError) {
      return text(
        `Not done now, and do not retry: an earlier call may have opened this ticket (its outcome is UNKNOWN). ` +
          `A person checks the helpdesk and settles ${e.operation.key}.`,
        true,
      );
    }
    if (e instanceof InProgressError) {
      return text(`Another call is opening this ticket right now; call again in ${Math.ceil((e.retryAfterMs ?? 1000) / 1000)} s for its result.`, true);
    }
    if (e instanceof OperationFailedError) return text(`The helpdesk refused this ticket for good: ${e.errorMessage}`, true);
    if (e instanceof HelpdeskRefused) return text(`The helpdesk refused this ticket for good: ${e.message}`, true);
    if (e instanceof IdemError) return text(`Not done: ${e.message}`, true);
    // Any other error came while the ticket may have been written: recorded UNKNOWN.
    return text(
      `The helpdesk call failed after it may have opened the ticket (${(e as Error).message}); it is recorded as ` +
        "UNKNOWN: do not retry, a person settles it.",
      true,
    );
  }
}

const server = new McpServer({ name: "tickets", version: "0.1.0" });

server.registerTool(
  "open_ticket",
  {
    description:
      "Opens a helpdesk ticket for an order, once per order and reason: calling it again returns the same ticket.",
    inputSchema: {
      order_id: z.string().regex(/^ORD-[0-9]+$/).describe("The order, e.g. ORD-7"),
      reason: z.enum(["refund", "damaged", "late"]),
      details: z.string().max(2000).describe("What the customer said"),
    },
  },
  (args) => openTicketTool(args),
);

server.registerTool(
  "list_tickets",
  { description: "Lists the helpdesk's tickets (read-only)." },
  () => text(existsSync(TICKETS_FILE) ? readFileSync(TICKETS_FILE, "utf8") || "(none)" : "(none)"),
);

await server.connect(new StdioServerTransport());
