"""Where the client's requests go: sync calls over urllib3 and async ones over httpx reach the
same URL (a path prefix kept) with the same headers, and a proxy set in the environment (which
httpx honours) still carries the sync calls. A loopback listener records what arrives."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import threading
import warnings
from collections.abc import Iterator

import pytest

import idem_client

from conftest import ADMIN_KEY, IdemServer
from netfault import read_message


class Recorder:
    """An HTTP/1.1 listener on 127.0.0.1 that records each request's head and answers every
    one with the operation record of the key the path ends with (keep-alive)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.heads: list[list[str]] = []
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray()
        with conn:
            while True:
                message = read_message(conn, buf)
                if message is None:
                    return
                lines = message.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
                self.heads.append(lines)
                key = lines[0].split(" ")[1].rsplit("/", 1)[-1]
                body = json.dumps({"key": key, "state": "SUCCEEDED", "fencing_token": 1}).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )

    def header(self, i: int, name: str) -> str | None:
        for h in self.heads[i][1:]:
            n, _, v = h.partition(":")
            if n.strip().lower() == name:
                return v.strip()
        return None

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.close()


@pytest.fixture(autouse=True)
def no_proxy_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


async def test_sync_and_async_calls_reach_the_same_path_with_the_same_headers(recorder: Recorder) -> None:
    with idem_client.Client(recorder.url + "/idem/", ADMIN_KEY) as c:
        assert c.get_operation("K-1").key == "K-1"
        assert (await c.aget_operation("K-2")).key == "K-2"
        await c.aclose()
    assert [h[0] for h in recorder.heads] == [
        "GET /idem/v1/operations/K-1 HTTP/1.1",
        "GET /idem/v1/operations/K-2 HTTP/1.1",
    ]
    for i in (0, 1):
        assert recorder.header(i, "authorization") == f"Bearer {ADMIN_KEY}"
        assert recorder.header(i, "accept") == "application/json"
        assert (recorder.header(i, "user-agent") or "").startswith("idem-client-python/")


def test_sync_calls_reuse_their_connection(recorder: Recorder) -> None:
    with idem_client.Client(recorder.url, ADMIN_KEY) as c:
        for i in range(5):
            assert c.get_operation(f"K-{i}").key == f"K-{i}"
    assert (len(recorder.heads), recorder.connections) == (5, 1)


def test_a_proxy_set_in_the_environment_carries_the_sync_calls(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """httpx honours HTTP_PROXY; the sync calls keep doing so (over httpx, not urllib3)."""
    monkeypatch.setenv("HTTP_PROXY", recorder.url)
    with idem_client.Client("http://idem.invalid:8080", ADMIN_KEY) as c:
        assert c.get_operation("K-3").key == "K-3"
    assert recorder.heads[0][0] == "GET http://idem.invalid:8080/v1/operations/K-3 HTTP/1.1"


def test_an_event_loop_per_call_does_not_keep_a_connection_per_loop(server: IdemServer, key: str) -> None:
    """A script that calls ``asyncio.run`` per request (each run a new event loop) must not
    keep one connection per finished loop: the client's async connections belong to their
    loop, and a closed loop's are let go at the next async call."""
    client = server.client()

    @client.idempotent(key="{n}", action="send", provider_ref="id")
    async def send(n: str) -> dict[str, str]:
        return {"id": n}

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    assert asyncio.run(send(f"{key}-warm")) == {"id": f"{key}-warm"}
    gc.collect()
    before = open_fds()
    with warnings.catch_warnings():
        # asyncio says so of a dead loop's socket it closes on collection: expected here.
        warnings.simplefilter("ignore", ResourceWarning)
        for i in range(30):
            assert asyncio.run(send(f"{key}-{i}")) == {"id": f"{key}-{i}"}
        gc.collect()
    assert open_fds() - before <= 3, f"{open_fds() - before} more descriptors after 30 loops"
    client.close()
