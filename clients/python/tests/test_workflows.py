"""Workflow steps your code performs: start, acquire and complete each step in order."""

from __future__ import annotations

import uuid

import pytest

import idem_client

from conftest import IdemServer

STEPS = ["create_ticket", "reserve_stock", "notify"]


def test_steps_run_in_order_once_and_an_unknown_step_pauses_the_instance(server: IdemServer) -> None:
    iid = f"ORD-{uuid.uuid4().hex[:8]}:stock"
    with server.client() as c:
        inst = c.start_workflow("stock-reservation", iid, input={"ticket": "T-40"}, steps=STEPS)
        assert (inst.instance_id, inst.state) == (iid, "RUNNING")
        assert (
            c.start_workflow("stock-reservation", iid, input={"ticket": "T-40"}, steps=STEPS).state
            == "RUNNING"
        )
        with pytest.raises(idem_client.InstanceMismatchError):
            c.start_workflow("stock-reservation", iid, input={"ticket": "T-41"}, steps=STEPS)
        with pytest.raises(idem_client.PreviousStepUnfinishedError), c.step(iid, "reserve_stock"):
            pass
        with pytest.raises(idem_client.UnknownStepError), c.step(iid, "ship"):
            pass

        with c.step(iid, "create_ticket", payload={"ticket": "T-40"}) as s:
            assert s.acquired
            assert s.key == f"{iid}:create_ticket"
            s.succeeded("ticket-9", {"ticket": 9})
        with c.step(iid, "create_ticket", payload={"ticket": "T-40"}) as s:
            assert (s.replayed, s.result) == (True, {"ticket": 9})

        with c.step(iid, "reserve_stock", payload={"sku": "A-1"}) as s:
            s.unknown("the stock service timed out")
        with (
            pytest.raises(idem_client.OutcomeUnknownError),
            c.step(iid, "reserve_stock", payload={"sku": "A-1"}),
        ):
            raise AssertionError("an UNKNOWN step's block never runs")
        inst = c.get_workflow(iid)
        assert (inst.state, inst.stopped_step) == ("PAUSED", "reserve_stock")
        with pytest.raises(idem_client.PreviousStepUnfinishedError) as e, c.step(iid, "notify"):
            pass
        assert e.value.state == "UNKNOWN"


async def test_a_worker_in_asyncio_finishes_the_instance(server: IdemServer) -> None:
    iid = f"ORD-{uuid.uuid4().hex[:8]}:async"
    async with server.client() as c:
        await c.astart_workflow("stock-reservation", iid, input={"ticket": "T-7"}, steps=STEPS)
        for step in STEPS:
            async with c.step(iid, step, payload={"step": step}, lease_ms=2000) as s:
                assert s.acquired
                await s.succeeded(f"{step}-ref")
        inst = await c.aget_workflow(iid)
    assert (inst.state, inst.last_good_step) == ("SUCCEEDED", "notify")
    assert [st["provider_ref"] for st in inst.steps] == [f"{s}-ref" for s in STEPS]


def test_a_step_exception_nobody_declared_ends_unknown(server: IdemServer) -> None:
    iid = f"ORD-{uuid.uuid4().hex[:8]}:boom"
    with server.client() as c:
        c.start_workflow("stock-reservation", iid, steps=["charge"])
        with pytest.raises(ConnectionResetError), c.step(iid, "charge", retryable=(ConnectionRefusedError,)):
            raise ConnectionResetError("reset after the request was sent")
        assert c.get_operation(f"{iid}:charge").state == "UNKNOWN"
