"""Runs the language-neutral cases (clients/cases/cases.json) against real servers, with sync
functions (threads for concurrency) and with ``async def`` functions (tasks)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

import idem_client

from casefile import (
    CASES,
    DEFAULTS,
    NOT_JSON,
    FinalProblem,
    Placeholders,
    RetryableProblem,
    UndeclaredProblem,
    kind_of,
    subset,
)
from conftest import ADMIN_KEY, IdemServer


@dataclass
class Outcome:
    """What one call did: returned or raised, and what the function saw."""

    ran: bool = False
    lease_lost: bool | None = None
    acquired: bool | None = None
    replayed: bool | None = None
    result: Any = None
    value: Any = None
    error: BaseException | None = None


@dataclass
class Ctx:
    server: IdemServer
    client: idem_client.Client
    ph: Placeholders
    effects: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def effect(self) -> None:
        with self.lock:
            self.effects += 1


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def options(call: dict[str, Any]) -> dict[str, Any]:
    c = {**DEFAULTS, **call}
    return {k: c[k] for k in ("lease_ms", "wait_ms", "heartbeat", "redo_safe")}


def client_for(ctx: Ctx, call: dict[str, Any]) -> idem_client.Client:
    if call.get("server") == "unreachable":
        return idem_client.Client(
            closed_port_url(), ADMIN_KEY, retry=idem_client.RetryPolicy(attempts=2, base_s=0.01)
        )
    return ctx.client


def payload_of(call: dict[str, Any]) -> object:
    return NOT_JSON[call["payload_not_json"]] if "payload_not_json" in call else call.get("payload")


def raise_or_return(fn: dict[str, Any]) -> Any:
    kind = fn.get("raises")
    if kind == "RetryableProblem":
        raise RetryableProblem(fn.get("retry_after_ms"))
    if kind == "FinalProblem":
        raise FinalProblem("the provider said no for good")
    if kind == "UndeclaredProblem":
        raise UndeclaredProblem("the connection broke after the request was sent")
    if kind == "timeout":
        raise TimeoutError("the provider did not answer within 10 s")
    if fn.get("returns_not_json"):
        return {"ref": "msg-1", "ids": {1, 2}}
    return fn.get("returns")


def has_effect(fn: dict[str, Any]) -> bool:
    return bool(fn.get("effect", fn.get("raises") not in ("RetryableProblem", "FinalProblem")))


def decorator_options(call: dict[str, Any]) -> dict[str, Any]:
    c = {**DEFAULTS, **call}
    return {
        "key": lambda key, payload: key,
        "payload": lambda key, payload: payload,
        "action": c["action"],
        "provider_ref": c["provider_ref_field"],
        "retryable": (RetryableProblem,),
        "final": (FinalProblem,),
        **options(call),
    }


def complete_sync(c: idem_client.Claim, spec: dict[str, Any]) -> None:
    args = {k: v for k, v in spec.items() if k != "outcome"}
    getattr(c, spec["outcome"])(**args)


async def complete_async(c: idem_client.AsyncClaim, spec: dict[str, Any]) -> None:
    args = {k: v for k, v in spec.items() if k != "outcome"}
    await getattr(c, spec["outcome"])(**args)


# --- one call, sync and async ----------------------------------------------------------


def call_sync(ctx: Ctx, call: dict[str, Any], fn: dict[str, Any]) -> Outcome:
    out = Outcome()
    client, key, payload = client_for(ctx, call), call["key"], payload_of(call)
    try:
        if call.get("via", DEFAULTS["via"]) == "claim":
            c_opts = {k: v for k, v in options(call).items()}
            with client.claim(
                key,
                action=call.get("action", DEFAULTS["action"]),
                payload=payload,
                retryable=(RetryableProblem,),
                final=(FinalProblem,),
                **c_opts,
            ) as c:
                out.acquired, out.replayed = c.acquired, c.replayed
                if c.acquired:
                    out.ran = True
                    if has_effect(fn):
                        ctx.effect()
                    time.sleep(fn.get("sleep_ms", 0) / 1000)
                    out.lease_lost = c.lease.lost
                    if "complete" in fn:
                        complete_sync(c, ctx.ph(fn["complete"]))
            out.result = c.result
            return out

        @client.idempotent(**decorator_options(call))
        def effectful(key: str, payload: object) -> object:
            out.ran = True
            if has_effect(fn):
                ctx.effect()
            time.sleep(fn.get("sleep_ms", 0) / 1000)
            out.lease_lost = idem_client.current_lease().lost
            return raise_or_return(fn)

        out.value = effectful(key, payload)
    except Exception as e:
        out.error = e
    return out


async def call_async(ctx: Ctx, call: dict[str, Any], fn: dict[str, Any]) -> Outcome:
    out = Outcome()
    client, key, payload = client_for(ctx, call), call["key"], payload_of(call)
    try:
        if call.get("via", DEFAULTS["via"]) == "claim":
            async with client.claim(
                key,
                action=call.get("action", DEFAULTS["action"]),
                payload=payload,
                retryable=(RetryableProblem,),
                final=(FinalProblem,),
                **options(call),
            ) as c:
                out.acquired, out.replayed = c.acquired, c.replayed
                if c.acquired:
                    out.ran = True
                    if has_effect(fn):
                        ctx.effect()
                    await asyncio.sleep(fn.get("sleep_ms", 0) / 1000)
                    out.lease_lost = c.lease.lost
                    if "complete" in fn:
                        await complete_async(c, ctx.ph(fn["complete"]))
            out.result = c.result
            return out

        @client.idempotent(**decorator_options(call))
        async def effectful(key: str, payload: object) -> object:
            out.ran = True
            if has_effect(fn):
                ctx.effect()
            await asyncio.sleep(fn.get("sleep_ms", 0) / 1000)
            out.lease_lost = idem_client.current_lease().lost
            return raise_or_return(fn)

        out.value = await effectful(key, payload)
    except Exception as e:
        out.error = e
    return out


# --- expectations ------------------------------------------------------------------------


def check_outcome(out: Outcome, expect: dict[str, Any], about: str) -> None:
    where = f"{about}: {out.error!r}" if out.error else about
    if "raises" in expect:
        assert out.error is not None, f"{about}: expected {expect['raises']}, returned {out.value!r}"
        assert kind_of(out.error) == expect["raises"], where
    elif out.error is not None:
        raise AssertionError(where) from out.error
    if "returns" in expect:
        assert out.value == expect["returns"], where
    for name in ("ran", "lease_lost", "acquired", "replayed", "result"):
        if name in expect:
            assert getattr(out, name) == expect[name], f"{where}: {name} is {getattr(out, name)!r}"


def check_server(ctx: Ctx, expect: dict[str, Any], key: str | None, about: str) -> None:
    if "effects" in expect:
        assert ctx.effects == expect["effects"], f"{about}: {ctx.effects} effects"
    if key is None or ("record" not in expect and "events_include" not in expect):
        return
    r = httpx.get(
        f"{ctx.server.url}/v1/operations/{key.strip()}", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    if expect.get("record", {}) is None:
        assert r.status_code in (400, 404), f"{about}: nothing may be recorded, got {r.status_code} {r.text}"
        return
    assert r.status_code == 200, f"{about}: {r.status_code} {r.text}"
    subset(expect.get("record", {}), r.json(), about)
    kinds = [e["kind"] for e in r.json()["events"]]
    for kind in expect.get("events_include", []):
        assert kind in kinds, f"{about}: no {kind} event in {kinds}"


def check_parallel(outs: list[Outcome], expect: dict[str, Any], about: str) -> None:
    assert sum(o.ran for o in outs) == expect["ran"], f"{about}: {[o.ran for o in outs]}"
    counts: dict[str, int] = {}
    for o in outs:
        k = "returned" if o.error is None else kind_of(o.error)
        counts[k] = counts.get(k, 0) + 1
    assert counts == expect["outcomes"], f"{about}: {counts} {[o.error for o in outs]}"
    if "all_return" in expect:
        assert all(o.value == expect["all_return"] for o in outs), about
    if expect.get("retry_after"):
        for o in outs:
            if isinstance(o.error, idem_client.InProgressError):
                assert o.error.retry_after is not None, about
                assert o.error.retry_after > 0, about


def check_http(ctx: Ctx, step: dict[str, Any]) -> None:
    h = step["http"]
    r = httpx.request(
        h["method"],
        ctx.server.url + h["path"],
        json=h.get("body"),
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    exp = step["expect"]
    assert r.status_code == exp["status"], f"{step['about']}: {r.status_code} {r.text}"
    subset(exp.get("body", {}), r.json(), step["about"])
    for name in exp.get("headers", []):
        assert name in r.headers, f"{step['about']}: no {name} header"


# --- the runners -------------------------------------------------------------------------


def key_of(step: dict[str, Any]) -> str | None:
    call = step.get("call") or step.get("parallel", {}).get("call")
    return call["key"] if call else None


def run_sync(ctx: Ctx, steps: list[dict[str, Any]]) -> None:
    background: list[tuple[threading.Thread, list[Outcome], dict[str, Any]]] = []
    last_key: str | None = None
    for step in steps:
        about = step["about"]
        if "sleep_ms" in step:
            time.sleep(step["sleep_ms"] / 1000)
        elif "http" in step:
            check_http(ctx, step)
        elif "join" in step:
            for t, done, s in background:
                t.join()
                check_outcome(done[0], s["expect"], s["about"])
            check_server(ctx, step["expect"], last_key, about)
        elif "parallel" in step:
            p = step["parallel"]
            last_key = p["call"]["key"]

            def one(i: int, p: dict[str, Any] = p) -> Outcome:
                time.sleep(i * p.get("stagger_ms", 0) / 1000)
                return call_sync(ctx, p["call"], p["function"])

            with ThreadPoolExecutor(p["times"]) as pool:
                outs = list(pool.map(one, range(p["times"])))
            check_parallel(outs, step["expect"], about)
            check_server(ctx, step["expect"], last_key, about)
        elif step.get("background"):
            box: list[Outcome] = []
            s = step
            t = threading.Thread(
                target=lambda s=s, box=box: box.append(call_sync(ctx, s["call"], s["function"]))
            )
            t.start()
            background.append((t, box, step))
            last_key = step["call"]["key"]
        else:
            last_key = step["call"]["key"]
            check_outcome(call_sync(ctx, step["call"], step["function"]), step["expect"], about)
            check_server(ctx, step["expect"], last_key, about)


async def run_async(ctx: Ctx, steps: list[dict[str, Any]]) -> None:
    try:
        await run_async_steps(ctx, steps)
    finally:
        await ctx.client.aclose()


async def run_async_steps(ctx: Ctx, steps: list[dict[str, Any]]) -> None:
    background: list[tuple[asyncio.Task[Outcome], dict[str, Any]]] = []
    last_key: str | None = None
    for step in steps:
        about = step["about"]
        if "sleep_ms" in step:
            await asyncio.sleep(step["sleep_ms"] / 1000)
        elif "http" in step:
            await asyncio.to_thread(check_http, ctx, step)
        elif "join" in step:
            for task, s in background:
                check_outcome(await task, s["expect"], s["about"])
            check_server(ctx, step["expect"], last_key, about)
        elif "parallel" in step:
            p = step["parallel"]
            last_key = p["call"]["key"]

            async def one(i: int, p: dict[str, Any] = p) -> Outcome:
                await asyncio.sleep(i * p.get("stagger_ms", 0) / 1000)
                return await call_async(ctx, p["call"], p["function"])

            outs = await asyncio.gather(*(one(i) for i in range(p["times"])))
            check_parallel(list(outs), step["expect"], about)
            check_server(ctx, step["expect"], last_key, about)
        elif step.get("background"):
            background.append((asyncio.create_task(call_async(ctx, step["call"], step["function"])), step))
            last_key = step["call"]["key"]
        else:
            last_key = step["call"]["key"]
            check_outcome(await call_async(ctx, step["call"], step["function"]), step["expect"], about)
            check_server(ctx, step["expect"], last_key, about)


RUNNERS: dict[str, Callable[[Ctx, list[dict[str, Any]]], None]] = {
    "sync": run_sync,
    "async": lambda ctx, steps: asyncio.run(run_async(ctx, steps)),
}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("case", CASES["cases"], ids=[c["name"] for c in CASES["cases"]])
def test_case(case: dict[str, Any], mode: str, server: IdemServer) -> None:
    ph = Placeholders()
    with server.client() as client:
        ctx = Ctx(server, client, ph)
        RUNNERS[mode](ctx, ph(case["steps"]))
