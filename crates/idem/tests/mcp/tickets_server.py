"""A downstream MCP server for the `idem mcp` tests, written with the official MCP Python SDK.

It creates "tickets" and counts them in an SQLite file (`--db`), so the tests count side
effects across processes: every `create_ticket` that runs inserts one row, whatever the
guard or the agent later makes of its answer.

Tools:
- `create_ticket(customer, title, body="", request_id="")` (side effect): one row; its
  answer is `{"id": "T-<n>"}`. A title that starts with `hang` makes the call insert its row
  and then never answer (a server that acted and then hung), `slow` answers after 1 s; `crash`
  inserts and then kills the process (the stream drops after the effect); `refuse` answers a
  tool error without a row (a final refusal). It reports progress when the call asks for it.
- `find_ticket(request_id)` (read-only): the ticket a `create_ticket` with that
  `request_id` made, `{"id": "T-<n>"}`, or `{"id": null}` — the lookup the guard settles an
  unknown call with.
- `count_tickets()` (read-only, `readOnlyHint`): how many tickets exist.
A resource `tickets://count` and a prompt `ticket_prompt` show pass-through.

Modes (`--mode`): `normal`; `crash-on-start` (exit 3 before reading anything);
`garbage` (no SDK: a raw loop that answers `initialize` and `tools/list`, prints a line that
is not JSON, and answers `tools/call` with a result that is not a tool result — after
inserting its row, like a server that acted and then broke).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import sys
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations


def db_connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS tickets (n INTEGER PRIMARY KEY AUTOINCREMENT, "
        "customer TEXT, title TEXT, body TEXT, request_id TEXT)"
    )
    return conn


def insert(db: str, customer: str, title: str, body: str, request_id: str) -> str:
    conn = db_connect(db)
    try:
        cur = conn.execute(
            "INSERT INTO tickets (customer, title, body, request_id) VALUES (?, ?, ?, ?)",
            (customer, title, body, request_id),
        )
        return f"T-{cur.lastrowid}"
    finally:
        conn.close()


def run_sdk(db: str, transport: str, port: int) -> None:
    server = MCPServer("tickets", instructions="Creates support tickets.")

    @server.tool(annotations=ToolAnnotations(destructive_hint=False, idempotent_hint=False))
    async def create_ticket(
        customer: str, title: str, ctx: Context, body: str = "", request_id: str = ""
    ) -> dict[str, Any]:
        """Create a support ticket for a customer."""
        await ctx.report_progress(1, 2, "creating")  # sent only when the call asked for progress
        if title.startswith("refuse"):
            raise ValueError("tickets titled 'refuse…' are refused")
        ticket = insert(db, customer, title, body, request_id)
        if title.startswith("hang"):
            await asyncio.sleep(3600)
        if title.startswith("slow"):
            await asyncio.sleep(1)
        if title.startswith("crash"):
            os._exit(9)
        return {"id": ticket}

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def find_ticket(request_id: str) -> dict[str, Any]:
        """The ticket made by the create_ticket call with this request_id, if any."""
        conn = db_connect(db)
        try:
            row = conn.execute("SELECT n FROM tickets WHERE request_id = ? ORDER BY n LIMIT 1", (request_id,)).fetchone()
        finally:
            conn.close()
        return {"id": f"T-{row[0]}" if row else None}

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def count_tickets() -> int:
        """How many tickets exist."""
        conn = db_connect(db)
        try:
            return int(conn.execute("SELECT count(*) FROM tickets").fetchone()[0])
        finally:
            conn.close()

    @server.resource("tickets://count")
    def ticket_count() -> str:
        conn = db_connect(db)
        try:
            return str(conn.execute("SELECT count(*) FROM tickets").fetchone()[0])
        finally:
            conn.close()

    @server.prompt()
    def ticket_prompt(customer: str) -> str:
        return f"Open a ticket for {customer}."

    if transport == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=port)


def run_garbage(db: str) -> None:
    """A broken server without the SDK: valid handshake, then answers that are not results."""
    tool = {
        "name": "create_ticket",
        "inputSchema": {"type": "object", "properties": {"customer": {"type": "string"}, "title": {"type": "string"}}},
    }
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if "id" not in msg:
            continue
        method = msg.get("method")
        if method == "initialize":
            result: Any = {
                "protocolVersion": msg["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "tickets", "version": "0"},
            }
        elif method == "tools/list":
            result = {"tools": [tool]}
        elif method == "tools/call":
            args = msg["params"].get("arguments") or {}
            insert(db, args.get("customer", ""), args.get("title", ""), "", args.get("request_id", ""))
            sys.stdout.write("this line is not JSON\n")
            result = {"content": "not a list of content blocks", "isError": "no"}
        else:
            print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "error": {"code": -32601, "message": "no"}}), flush=True)
            continue
        print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--mode", default="normal", choices=["normal", "crash-on-start", "garbage"])
    p.add_argument("--transport", default="stdio", choices=["stdio", "http"])
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    db_connect(a.db).close()
    if a.mode == "crash-on-start":
        print("tickets: crashing on start as asked", file=sys.stderr)
        sys.exit(3)
    if a.mode == "garbage":
        run_garbage(a.db)
    else:
        run_sdk(a.db, a.transport, a.port)


if __name__ == "__main__":
    main()
