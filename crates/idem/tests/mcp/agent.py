"""The agent's side of the `idem mcp` tests: the official MCP Python SDK's ClientSession.

    agent.py STEPS_JSON --stdio COMMAND ARG...   (starts the guard as its server, as a host does)
    agent.py STEPS_JSON --url http://127.0.0.1:PORT/mcp

STEPS_JSON is a list of steps, run in order; each prints one JSON line:
- {"call": TOOL, "args": {...}, "meta": {...}, "repeat": N, "timeout_s": S, "progress": true}
  -> the CallToolResult as sent (camelCase, without nulls); with "repeat", N lines; with
  "progress", the progress notifications received are added as "progress": [[p, total, msg]];
- {"list_tools": true} -> {"tools": [...]}; {"read_resource": URI}; {"get_prompt": NAME, "args": {...}};
- {"sleep_s": S}.
A request that fails prints {"error": "..."}.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client


def emit(obj: Any) -> None:
    print(json.dumps(obj), flush=True)


def dump(model: Any) -> Any:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


async def run_steps(session: ClientSession, steps: list[dict[str, Any]]) -> None:
    await session.initialize()
    for step in steps:
        try:
            if "call" in step:
                for _ in range(int(step.get("repeat", 1))):
                    seen: list[list[Any]] = []

                    async def on_progress(p: float, total: float | None, message: str | None) -> None:
                        seen.append([p, total, message])

                    r = await session.call_tool(
                        step["call"],
                        step.get("args", {}),
                        read_timeout_seconds=step.get("timeout_s", 60),
                        progress_callback=on_progress if step.get("progress") else None,
                        meta=step.get("meta"),
                    )
                    out = dump(r)
                    if step.get("progress"):
                        out["progress"] = seen
                    emit(out)
                continue
            if "list_tools" in step:
                r = await session.list_tools()
            elif "read_resource" in step:
                r = await session.read_resource(step["read_resource"])
            elif "get_prompt" in step:
                r = await session.get_prompt(step["get_prompt"], step.get("args", {}))
            elif "sleep_s" in step:
                await asyncio.sleep(step["sleep_s"])
                continue
            else:
                raise ValueError(f"unknown step {step}")
            emit(dump(r))
        except Exception as e:  # noqa: BLE001 - the test reads what failed
            emit({"error": f"{type(e).__name__}: {e}"})


async def main() -> None:
    steps = json.loads(sys.argv[1])
    if sys.argv[2] == "--stdio":
        params = StdioServerParameters(command=sys.argv[3], args=sys.argv[4:])
        async with stdio_client(params) as (r, w), ClientSession(r, w) as session:
            await run_steps(session, steps)
    else:
        async with streamable_http_client(sys.argv[3]) as (r, w), ClientSession(r, w) as session:
            await run_steps(session, steps)


if __name__ == "__main__":
    asyncio.run(main())
