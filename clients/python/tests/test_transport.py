"""idem's own calls: retries of unreachable servers and 503s, an acquire resent after its answer
was lost (the same holder gets the same grant), and problems as exceptions."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import idem_client

from casefile import CASES
from conftest import ADMIN_KEY, REPO, IdemServer
from netfault import proxy_for

FAST = idem_client.RetryPolicy(attempts=4, base_s=0.02, cap_s=0.1)


def guarded(client: idem_client.Client, ran: list[str], **options: Any) -> Any:
    @client.idempotent(
        key="{order}", action="send_confirmation", payload=["order"], provider_ref="ref", **options
    )
    def send_confirmation(order: str) -> dict[str, str]:
        ran.append(order)
        return {"ref": f"msg-{order}"}

    return send_confirmation


def events(server: IdemServer, key: str) -> list[str]:
    with server.client() as c:
        return [e["kind"] for e in c.get_operation(key).events]


def test_an_acquire_whose_answer_was_lost_is_resent_and_gets_its_own_grant(
    server: IdemServer, key: str
) -> None:
    proxy = proxy_for(server.url)
    proxy.rule("POST /v1/operations ", "drop")
    ran: list[str] = []
    with idem_client.Client(proxy.url, ADMIN_KEY, retry=FAST) as c:
        assert guarded(c, ran)(key) == {"ref": f"msg-{key}"}
    assert ran == [key], "performed once"
    kinds = events(server, key)
    assert kinds[:2] == ["acquired", "already_held"], kinds
    with server.client() as c:
        op = c.get_operation(key)
    assert (op.state, op.attempt) == ("SUCCEEDED", 1)
    proxy.close()


def test_a_completion_whose_answer_was_lost_is_resent_and_accepted(server: IdemServer, key: str) -> None:
    proxy = proxy_for(server.url)
    proxy.rule("POST /v1/operations/", "drop")  # the completion (and nothing else has a path after /)
    ran: list[str] = []
    with idem_client.Client(proxy.url, ADMIN_KEY, retry=FAST) as c:
        assert guarded(c, ran)(key) == {"ref": f"msg-{key}"}
        assert c.get_operation(key).state == "SUCCEEDED"
    assert ran == [key]
    assert sum(1 for line in proxy.seen if b"/complete" in line) == 2, proxy.seen


def test_answers_lost_every_time_raise_no_answer_and_never_run(server: IdemServer, key: str) -> None:
    """The grant was made but never seen: the function does not run, and the lease runs out
    into UNKNOWN (never done twice)."""
    proxy = proxy_for(server.url)
    proxy.rule("POST /v1/operations ", "drop", times=100)
    ran: list[str] = []
    with idem_client.Client(proxy.url, ADMIN_KEY, retry=FAST) as c, pytest.raises(idem_client.NoAnswerError):
        guarded(c, ran, lease_ms=300)(key)
    assert ran == []
    time.sleep(0.5)
    with server.client() as c:
        assert c.get_operation(key).state == "UNKNOWN"
        with pytest.raises(idem_client.OutcomeUnknownError):
            guarded(c, ran)(key)
    assert ran == []


def test_a_503_is_retried_after_its_retry_after(server: IdemServer, key: str) -> None:
    proxy = proxy_for(server.url)
    proxy.rule("POST /v1/operations ", "unavailable", times=1, retry_after=1)
    ran: list[str] = []
    started = time.monotonic()
    with idem_client.Client(proxy.url, ADMIN_KEY, retry=FAST) as c:
        assert guarded(c, ran)(key) == {"ref": f"msg-{key}"}
    assert time.monotonic() - started >= 1.0, "Retry-After is the floor of the wait"
    assert ran == [key]


def test_a_retry_after_beyond_the_policy_raises_the_problem_at_once(server: IdemServer, key: str) -> None:
    proxy = proxy_for(server.url)
    proxy.rule("POST /v1/operations ", "unavailable", times=5, retry_after=60)
    ran: list[str] = []
    with (
        idem_client.Client(proxy.url, ADMIN_KEY, retry=FAST) as c,
        pytest.raises(idem_client.StoreUnavailableError) as e,
    ):
        guarded(c, ran)(key)
    assert ran == []
    assert (e.value.status, e.value.retry_after, e.value.request_id) == (503, 60.0, "proxy-1")
    assert e.value.problem["type"] == "/problems/unavailable"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def test_connection_refused_is_retried_until_the_server_is_up(tmp_path: Path, key: str) -> None:
    port = free_port()
    servers: list[IdemServer] = []
    starter = threading.Timer(
        0.5,
        lambda: servers.append(IdemServer(f"sqlite://{tmp_path / 'late.db'}", listen=f"127.0.0.1:{port}")),
    )
    starter.start()
    ran: list[str] = []
    try:
        retry = idem_client.RetryPolicy(attempts=40, base_s=0.1, cap_s=0.3)
        with idem_client.Client(f"http://127.0.0.1:{port}", ADMIN_KEY, retry=retry) as c:
            assert guarded(c, ran)(key) == {"ref": f"msg-{key}"}
    finally:
        starter.join()
        for s in servers:
            s.stop()
    assert ran == [key]


def test_a_bad_api_key_raises_unauthorized_with_the_problem_and_request_id(
    server: IdemServer, key: str
) -> None:
    ran: list[str] = []
    with (
        idem_client.Client(server.url, "not-a-key-0123456789abcdef0123456789") as c,
        pytest.raises(idem_client.UnauthorizedError) as e,
    ):
        guarded(c, ran)(key)
    assert ran == []
    assert e.value.status == 401
    assert e.value.problem["type"] == "/problems/unauthorized"
    assert e.value.request_id


def test_no_api_key_is_refused_before_anything_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IDEM_API_KEY", raising=False)
    with pytest.raises(idem_client.InvalidInputError, match="IDEM_API_KEY"):
        idem_client.Client("http://127.0.0.1:9")


@pytest.mark.parametrize("key", ["idem_abc\n", "idem_abc ", " idem_abc", "idem_a\r\nb", "idem_é"])
def test_an_api_key_with_a_space_a_line_break_or_non_ascii_is_refused_at_once(key: str) -> None:
    """Sent as is, such a key failed one HTTP library (a ValueError) and not the other (five
    tries, then "it may have been recorded"): it is refused before anything is sent, and the
    message does not repeat the key."""
    with pytest.raises(idem_client.InvalidInputError, match="newline") as e:
        idem_client.Client("http://127.0.0.1:9", key)
    assert "idem_abc" not in str(e.value)


#: Problem types a client library's calls never meet (raised as the class of their status):
#: listed once for every client library in the case file.
NOT_CLIENT_FACING = set(CASES["problems_not_client_facing"]["types"])


def test_every_problem_type_a_client_meets_has_its_exception_class() -> None:
    """The server's list of problem types (crates/idem-server/src/problem.rs) against the
    library's: a new client-facing type fails here until it gets its class."""
    source = (REPO / "crates/idem-server/src/problem.rs").read_text()
    table = source[source.index("pub const PROBLEM_TYPES") : source.index("];")]
    slugs = set(re.findall(r'^\s*\(\s*"([a-z-]+)",', table, re.M))
    assert len(slugs) > 40, slugs
    missing = slugs - set(idem_client.PROBLEM_CLASSES) - NOT_CLIENT_FACING
    assert not missing, f"problem types without an exception class: {sorted(missing)}"
    stale = (set(idem_client.PROBLEM_CLASSES) | NOT_CLIENT_FACING) - slugs
    assert not stale, f"classes or exemptions for types the server no longer has: {sorted(stale)}"


def test_each_problem_class_is_raised_for_its_type() -> None:
    from idem_client._errors import problem_error

    for slug, cls in idem_client.PROBLEM_CLASSES.items():
        e = problem_error(409, {"type": f"/problems/{slug}", "detail": "d", "request_id": "r-1"}, None, 2.0)
        assert type(e) is cls
        assert (e.slug, e.request_id, e.retry_after) == (slug, "r-1", 2.0)
    assert (
        type(problem_error(428, {"type": "/problems/plan-hash-required"}, "r", None))
        is idem_client.ProblemError
    )
    assert type(problem_error(502, {}, "r", None)) is idem_client.ServerError


def test_a_new_uuid_is_sent_as_holder_per_attempt(server: IdemServer) -> None:
    holders = set()
    with server.client() as c:
        for _ in range(3):
            k = f"H-{uuid.uuid4().hex[:10]}"
            with c.claim(k, action="send", payload=None) as claim:
                claim.succeeded("ref-1")
            holder = c.get_operation(k).lease_holder
            assert holder is not None
            assert uuid.UUID(holder).version == 4
            holders.add(holder)
    assert len(holders) == 3


class Restart:
    """``idem serve`` on a fixed port and SQLite file, killed and started again."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.db = f"sqlite://{tmp_path / 'restart.db'}"
        self.servers = [IdemServer(self.db, listen=f"127.0.0.1:{self.port}")]
        self.timer: threading.Timer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def down_for(self, seconds: float) -> None:
        """Kills the server (SIGKILL) and starts it again ``seconds`` later."""
        self.servers[-1].stop()
        start = lambda: self.servers.append(IdemServer(self.db, listen=f"127.0.0.1:{self.port}"))  # noqa: E731
        self.timer = threading.Timer(seconds, start)
        self.timer.start()

    def back(self) -> None:
        if self.timer is not None:
            self.timer.join()

    def stop(self) -> None:
        self.back()
        for s in self.servers:
            s.stop()


def test_a_completion_is_resent_until_idem_is_back_within_the_lease(tmp_path: Path, key: str) -> None:
    """idem is killed during the function and back 2 s later: with the default RetryPolicy (5
    tries, about 1.5 s at most) the outcome was lost; a completion is resent for as long as the
    lease is valid, so it is recorded."""
    idem = Restart(tmp_path)
    ran: list[str] = []
    try:
        with idem_client.Client(idem.url, ADMIN_KEY) as c:

            @c.idempotent(
                key="{order}", action="send", payload=["order"], provider_ref="ref", lease_ms=15_000
            )
            def send(order: str) -> dict[str, str]:
                ran.append(order)
                idem.down_for(2.0)  # idem restarts during the effect
                return {"ref": "msg-1"}

            assert send(key) == {"ref": "msg-1"}
            op = c.get_operation(key)
    finally:
        idem.stop()
    assert ran == [key]
    assert (op.state, op.provider_ref, op.attempt) == ("SUCCEEDED", "msg-1", 1)


async def test_an_outcome_not_recorded_by_the_lease_end_carries_what_to_report_later(
    tmp_path: Path, key: str
) -> None:
    """idem is down past the lease's end: OutcomeNotRecordedError carries the key, the fencing
    token and the completion, and reporting it once idem is back settles the operation."""
    idem = Restart(tmp_path)
    try:
        async with idem_client.Client(idem.url, ADMIN_KEY) as c:

            @c.idempotent(key="{order}", action="send", payload=["order"], provider_ref="ref", lease_ms=800)
            async def send(order: str) -> dict[str, object]:
                idem.down_for(2.0)
                return {"ref": "msg-1", "n": 1}

            with pytest.raises(idem_client.OutcomeNotRecordedError) as e:
                await send(key)
            err = e.value
            assert (err.key, err.recorded_state) == (key, None)
            assert isinstance(err.fencing_token, int)
            assert err.completion == {
                "outcome": "succeeded",
                "provider_ref": "msg-1",
                "result": {"ref": "msg-1", "n": 1},
            }
            await asyncio.to_thread(idem.back)
            op = await c.acomplete(err.key, err.fencing_token, err.completion)
            assert (op.state, op.provider_ref, op.result) == ("SUCCEEDED", "msg-1", {"ref": "msg-1", "n": 1})
            assert (await c.acomplete(err.key, err.fencing_token, err.completion)).state == "SUCCEEDED", (
                "safe to repeat"
            )
    finally:
        idem.stop()


def test_a_completion_answered_503_gives_up_at_the_lease_end_with_the_token(
    server: IdemServer, key: str
) -> None:
    """A Retry-After (60 s) past the lease's end is not waited for: the completion gives up when
    the lease ends, and the token it carries completes the operation later."""
    proxy = proxy_for(server.url)
    proxy.rule("POST /v1/operations/", "unavailable", times=1000, retry_after=60)
    ran: list[str] = []
    started = time.monotonic()
    with (
        idem_client.Client(proxy.url, ADMIN_KEY, retry=FAST) as c,
        pytest.raises(idem_client.OutcomeNotRecordedError) as e,
    ):
        guarded(c, ran, lease_ms=1000)(key)
    took = time.monotonic() - started
    proxy.close()
    assert ran == [key]
    assert isinstance(e.value.__cause__, idem_client.StoreUnavailableError)
    assert took < 10, f"waited {took:.1f} s: past the lease's end (1 s)"
    with server.client() as c:
        assert e.value.fencing_token is not None
        assert e.value.completion is not None
        op = c.complete(e.value.key, e.value.fencing_token, e.value.completion)
    assert (op.state, op.provider_ref) == ("SUCCEEDED", f"msg-{key}")


def test_a_completion_is_not_retried_after_the_lease_end_within_its_tries(
    server: IdemServer, key: str
) -> None:
    """With the default policy (5 tries) and a Retry-After of 5 s, the completion's second try
    falls at the lease's end (1 s): it gives up there, not after three more 5 s waits."""
    proxy = proxy_for(server.url)
    proxy.rule("POST /v1/operations/", "unavailable", times=1000, retry_after=5)
    ran: list[str] = []
    started = time.monotonic()
    with (
        idem_client.Client(proxy.url, ADMIN_KEY) as c,
        pytest.raises(idem_client.OutcomeNotRecordedError) as e,
    ):
        guarded(c, ran, lease_ms=1000)(key)
    took = time.monotonic() - started
    proxy.close()
    assert ran == [key]
    assert took < 4.5, f"waited {took:.1f} s: past the lease's end (1 s)"
    assert e.value.fencing_token is not None


def test_a_completion_answered_500_is_not_recorded_and_carries_the_token(
    server: IdemServer, key: str
) -> None:
    """A 500 in answer to the completion (the function ran): OutcomeNotRecordedError with the
    key, the token and the completion, never a bare ServerError; reporting it settles it."""
    proxy = proxy_for(server.url)
    proxy.rule("POST /v1/operations/", "internal", times=1)
    ran: list[str] = []
    with (
        idem_client.Client(proxy.url, ADMIN_KEY, retry=FAST) as c,
        pytest.raises(idem_client.OutcomeNotRecordedError) as e,
    ):
        guarded(c, ran)(key)
    proxy.close()
    assert ran == [key]
    assert e.value.fencing_token is not None
    assert e.value.completion is not None
    with server.client() as c:
        op = c.complete(e.value.key, e.value.fencing_token, e.value.completion)
    assert (op.state, op.provider_ref) == ("SUCCEEDED", f"msg-{key}")


async def test_a_failed_tls_handshake_is_unreachable_on_both_paths(server: IdemServer, key: str) -> None:
    """https:// against a plain HTTP server: the handshake fails before any request is sent,
    so sync (urllib3) and async (httpx) both say nothing was sent, and nothing runs."""
    url = server.url.replace("http://", "https://")
    ran: list[str] = []
    with idem_client.Client(url, ADMIN_KEY, retry=FAST) as c:
        with pytest.raises(idem_client.ServerUnreachableError):
            guarded(c, ran)(key)

        @c.idempotent(key="{order}", action="send_confirmation", payload=["order"], provider_ref="ref")
        async def send(order: str) -> dict[str, str]:
            ran.append(order)
            return {"ref": "x"}

        with pytest.raises(idem_client.ServerUnreachableError):
            await send(key)
    assert ran == []
