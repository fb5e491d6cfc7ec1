"""A client made and used before ``os.fork()`` (gunicorn ``--preload``, Celery prefork,
``multiprocessing``): each child talks to idem over connections of its own, and an answer that
is not about the request's key is never acted on."""

from __future__ import annotations

import json
import multiprocessing
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

import idem_client

from casefile import kind_of
from conftest import ADMIN_KEY, IdemServer


class App:
    """What an application module holds: a client and a guarded function, made at import time
    (before the fork)."""

    def __init__(self, client: idem_client.Client, effects: Path) -> None:
        self.client = client

        @client.idempotent(
            key="{order}", action="send_confirmation", payload=["order"], provider_ref="ref", wait_ms=10_000
        )
        def send(order: str) -> dict[str, str]:
            with effects.open("a") as f:  # the side effect, one line each
                f.write(f"{order}\n")
            return {"ref": f"msg-{order}", "order": order}

        self.send = send


APP: App | None = None


def call(order: str) -> tuple[str, object]:
    """One task of the pool: what the guarded function returned or raised, in a child."""
    assert APP is not None
    try:
        return order, APP.send(order)
    except Exception as e:
        return order, f"raised {kind_of(e)}: {e}"


def test_a_client_used_before_fork_gives_each_child_its_own_connections(
    server: IdemServer, tmp_path: Path
) -> None:
    global APP
    effects = tmp_path / "effects"
    APP = App(server.client(timeout_s=3.0), effects)
    run = uuid.uuid4().hex[:8]
    old = [f"F-{run}-old-{i}" for i in range(6)]
    for order in old:  # the parent uses the client: its keep-alive connection is open now
        assert APP.send(order) == {"ref": f"msg-{order}", "order": order}
    new = [f"F-{run}-new-{i}" for i in range(18)]
    orders = (old + new) * 2
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map_async(call, orders, chunksize=1).get(timeout=120)
    wrong = [(order, got) for order, got in results if got != {"ref": f"msg-{order}", "order": order}]
    assert not wrong, wrong
    assert Counter(effects.read_text().splitlines()) == Counter(old + new), "one effect per key"
    with APP.client as c:  # the parent's connections still serve the parent
        assert APP.send(old[0]) == {"ref": f"msg-{old[0]}", "order": old[0]}
        for order in old + new:
            op = c.get_operation(order)
            assert (op.state, op.attempt, op.result) == (
                "SUCCEEDED",
                1,
                {"ref": f"msg-{order}", "order": order},
            )
    APP = None


def test_a_client_that_used_a_transport_of_its_own_refuses_to_run_in_a_child(
    server: IdemServer, tmp_path: Path
) -> None:
    """The client cannot rebuild a transport it was given: in the child it says so before
    sending anything, once the parent used it (unused, it holds no connection)."""
    global APP
    effects = tmp_path / "effects"
    APP = App(idem_client.Client(server.url, ADMIN_KEY, transport=httpx.HTTPTransport()), effects)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        [(unused, fine)] = pool.map_async(call, [f"F-{uuid.uuid4().hex[:8]}"]).get(timeout=60)
    assert fine == {"ref": f"msg-{unused}", "order": unused}
    with pytest.raises(idem_client.NotFoundError):
        APP.client.get_operation(f"F-{uuid.uuid4().hex[:8]}")  # the parent uses it now
    with multiprocessing.get_context("fork").Pool(1) as pool:
        [(_, got)] = pool.map_async(call, ["F-transport"]).get(timeout=60)
    assert isinstance(got, str)
    assert got.startswith("raised invalid-input"), got
    assert "used a transport of its own" in got, got
    assert effects.read_text().splitlines() == [unused], "the refused child did nothing"
    APP.client.close()
    APP = None


def mixed(status: int, body: dict[str, Any]) -> httpx.MockTransport:
    """A transport that answers every request with another key's record (what a shared
    connection delivers)."""
    return httpx.MockTransport(lambda request: httpx.Response(status, json=body))


@pytest.mark.parametrize("status", [200, 201])
def test_an_answer_about_another_key_is_not_acted_on(status: int) -> None:
    """Defence in depth: a grant or a replay of another key does not run the function (a 201
    for another key would perform this one's effect; a 200 would return another's result)."""
    other: dict[str, Any] = {
        "key": "other-key",
        "state": "EXECUTING" if status == 201 else "SUCCEEDED",
        "fencing_token": 7,
        "lease_holder": str(uuid.uuid4()),
        "result": {"ref": "msg-other"},
    }
    ran: list[str] = []
    c = idem_client.Client("http://idem.invalid", ADMIN_KEY, transport=mixed(status, other))

    @c.idempotent(key="{order}", action="send", payload=["order"], provider_ref="ref")
    def send(order: str) -> dict[str, str]:
        ran.append(order)
        return {"ref": "msg-1"}

    with pytest.raises(idem_client.AnswerMismatchError) as e:
        send("my-key")
    assert ran == []
    assert isinstance(e.value, idem_client.NoAnswerError), "the request's own answer was lost"
    assert isinstance(e.value, idem_client.AnswerMismatchError)
    assert "'other-key'" in e.value.got


def test_a_completion_answered_with_another_token_is_not_taken_as_recorded() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/v1/operations":
            grant = {"key": "K-1", "state": "EXECUTING", "fencing_token": 7, "lease_holder": body["holder"]}
            return httpx.Response(201, json=grant)
        # the completion: a record of the same key under another lease (another attempt's answer)
        return httpx.Response(200, json={"key": "K-1", "state": "SUCCEEDED", "fencing_token": 8})

    c = idem_client.Client("http://idem.invalid", ADMIN_KEY, transport=httpx.MockTransport(answer))
    with c.claim("K-1", action="send") as claim:
        assert claim.acquired
        with pytest.raises(idem_client.OutcomeNotRecordedError) as e:
            claim.succeeded("ref-1")
    assert isinstance(e.value.__cause__, idem_client.AnswerMismatchError)
    assert (e.value.key, e.value.fencing_token, e.value.completion) == (
        "K-1",
        7,
        {"outcome": "succeeded", "provider_ref": "ref-1"},
    )
