"""The lease while the function runs: the heartbeat, a lease lost and the function told, and
exceptions that are not Exceptions (KeyboardInterrupt, task cancellation)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest

import idem_client

from conftest import IdemServer


def test_a_renewal_refused_tells_the_function_and_a_late_completion_settles_it(
    server: IdemServer, key: str
) -> None:
    """The heartbeat renews too late (every 700 ms for a 300 ms lease): idem refuses, the lease's
    lost_event is set with idem's problem, and raise_if_lost raises it. Nobody took the lease
    since, so the completion is still accepted and settles the UNKNOWN."""
    seen: list[object] = []
    with server.client() as c:

        @c.idempotent(
            key="{order}",
            action="send",
            payload=["order"],
            provider_ref="ref",
            lease_ms=300,
            renew_every_ms=700,
        )
        def send(order: str) -> dict[str, str]:
            lease = idem_client.current_lease()
            assert not lease.lost
            assert lease.lost_event.wait(5), "the heartbeat saw the lease end"
            seen.append(lease.lost_reason)
            with pytest.raises(idem_client.LeaseLostError):
                lease.raise_if_lost()
            return {"ref": "msg-1"}

        assert send(key) == {"ref": "msg-1"}
        op = c.get_operation(key)
    assert isinstance(seen[0], idem_client.LeaseExpiredError), seen[0]
    assert (op.state, op.provider_ref) == ("SUCCEEDED", "msg-1")


def test_current_lease_outside_a_claim_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no idem lease"):
        idem_client.current_lease()


def test_a_keyboard_interrupt_mid_function_ends_unknown(server: IdemServer, key: str) -> None:
    with server.client() as c:

        @c.idempotent(key="{order}", action="send", payload=["order"], provider_ref="ref")
        def send(order: str) -> dict[str, str]:
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            send(key)
        op = c.get_operation(key)
    assert op.state == "UNKNOWN"
    assert op.error_message == "KeyboardInterrupt: "


async def test_a_cancelled_task_ends_unknown_and_stays_cancelled(server: IdemServer, key: str) -> None:
    started = asyncio.Event()
    async with server.client() as c:

        @c.idempotent(key="{order}", action="send", payload=["order"], provider_ref="ref")
        async def send(order: str) -> dict[str, str]:
            started.set()
            await asyncio.sleep(30)
            return {"ref": "never"}

        task = asyncio.create_task(send(key))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        op = await c.aget_operation(key)
    assert op.state == "UNKNOWN"
    assert op.error_message is not None
    assert "CancelledError" in op.error_message


def test_one_heartbeat_thread_renews_every_claim_of_a_client_and_ends_with_it(server: IdemServer) -> None:
    """Slow claims side by side: each lease is renewed (lease_renewed events), none is lost, and
    the client's heartbeat threads end when it is closed."""
    before = {t.name for t in threading.enumerate()}
    keys = [f"HB-{uuid.uuid4().hex[:10]}" for _ in range(3)]
    c = server.client()

    def slow(key: str) -> None:
        with c.claim(key, action="send", payload=None, lease_ms=300) as claim:
            time.sleep(0.7)
            assert not claim.lease.lost
            claim.succeeded("ref-1")

    threads = [threading.Thread(target=slow, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in keys:
        op = c.get_operation(k)
        assert op.state == "SUCCEEDED"
        assert "lease_renewed" in [e["kind"] for e in op.events]
    assert sum(t.name == "idem-heartbeats" for t in threading.enumerate()) == 1
    c.close()
    time.sleep(0.1)
    assert {t.name for t in threading.enumerate()} - before == set()


def test_completing_twice_or_completing_a_replay_is_refused_locally(server: IdemServer, key: str) -> None:
    with server.client() as c:
        with c.claim(key, action="send", payload=None) as claim:
            claim.succeeded("ref-1", {"n": 1})
            with pytest.raises(idem_client.NotHeldError):
                claim.succeeded("ref-1")
        with c.claim(key, action="send", payload=None) as again:
            assert again.replayed
            assert again.result == {"n": 1}
            with pytest.raises(idem_client.NotHeldError):
                again.unknown()
            with pytest.raises(idem_client.NotHeldError):
                _ = again.lease


async def test_an_async_function_that_blocks_its_loop_keeps_its_lease(server: IdemServer, key: str) -> None:
    """time.sleep in an ``async def`` stops its event loop for 2.5 lease periods; the lease is
    renewed from the client's heartbeat thread all the same, so a redo_safe duplicate polling
    from another thread never gets a second grant: one effect, SUCCEEDED at attempt 1."""
    effects: list[str] = []
    seen_lost: list[bool] = []
    answers: list[str] = []
    started = threading.Event()
    options: dict[str, Any] = {
        "key": "{order}",
        "action": "send",
        "payload": ["order"],
        "provider_ref": "ref",
        "lease_ms": 600,
        "redo_safe": True,
    }

    def duplicates() -> None:
        assert started.wait(10)
        with server.client() as other:

            @other.idempotent(**options)
            def send_again(order: str) -> dict[str, str]:
                effects.append(order)
                return {"ref": "msg-2"}

            for _ in range(12):  # over the 1.5 s the first call blocks its loop
                try:
                    answers.append(send_again(key)["ref"])
                except idem_client.InProgressError:
                    answers.append("in-progress")
                time.sleep(0.12)

    async with server.client() as c:

        @c.idempotent(**options)
        async def send(order: str) -> dict[str, str]:
            effects.append(order)
            started.set()
            time.sleep(1.5)  # noqa: ASYNC251 - the point: blocking code inside an async def
            seen_lost.append(idem_client.current_lease().lost)
            return {"ref": "msg-1"}

        thread = threading.Thread(target=duplicates)
        thread.start()
        assert await send(key) == {"ref": "msg-1"}
        await asyncio.to_thread(thread.join)
        op = await c.aget_operation(key)
    kinds = [e["kind"] for e in op.events]
    assert effects == [key], (effects, answers, kinds)
    assert seen_lost == [False]
    assert (op.state, op.attempt, op.provider_ref) == ("SUCCEEDED", 1, "msg-1")
    assert kinds.count("acquired") == 1, kinds
    assert "lease_renewed" in kinds, kinds
    assert "in-progress" in answers, answers
    assert set(answers) <= {"in-progress", "msg-1"}, answers


async def test_wait_lost_wakes_async_code_when_idem_refuses_a_renewal(server: IdemServer, key: str) -> None:
    """An operator settles the operation while its 30 s lease is valid; the heartbeat thread's
    next renewal is refused, and that news wakes the coroutine (loop.call_soon_threadsafe)
    long before the lease's end by the clock. The late evidence then settles the UNKNOWN."""
    async with (
        server.client() as c,
        c.claim(key, action="send", lease_ms=30_000, renew_every_ms=100) as claim,
    ):
        settled = await c.acomplete(key, claim.fencing_token, {"outcome": "unknown", "message": "by hand"})
        assert settled.state == "UNKNOWN"
        await asyncio.wait_for(claim.lease.wait_lost(), 5)
        assert claim.lease.remaining_s == 0
        assert isinstance(claim.lease.lost_reason, idem_client.ProblemError), claim.lease.lost_reason
        assert claim.lease.lost_reason.status == 409
        assert (await claim.succeeded("msg-1")).state == "SUCCEEDED"
