"""Several worker processes, and a worker killed with SIGKILL mid-function."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import idem_client

from conftest import IdemServer

WORKER = Path(__file__).with_name("worker.py")


def worker(
    server: IdemServer, key: str, effects: Path, sleep_s: float, lease_ms: int, wait_ms: int
) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [
            sys.executable,
            str(WORKER),
            server.url,
            key,
            str(effects),
            str(sleep_s),
            str(lease_ms),
            str(wait_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_concurrent_duplicates_from_processes_perform_one_effect(server: IdemServer, tmp_path: Path) -> None:
    key, effects = f"P-{uuid.uuid4().hex[:12]}", tmp_path / "effects"
    procs = [worker(server, key, effects, 0.4, 30_000, 20_000) for _ in range(6)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert len(lines(effects)) == 1, outs
    refs = {line for out in outs for line in out.splitlines() if line.startswith("returned")}
    assert refs == {f"returned msg-{lines(effects)[0]}"}, outs
    assert sum(out.count("effect") for out in outs) == 1


@pytest.mark.parametrize("lease_ms", [600])
def test_a_worker_killed_mid_function_leaves_unknown_never_redone(
    server: IdemServer, tmp_path: Path, lease_ms: int
) -> None:
    key, effects = f"K-{uuid.uuid4().hex[:12]}", tmp_path / "effects"
    p = worker(server, key, effects, 60, lease_ms, 0)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "effect"
    p.kill()  # SIGKILL: no exit handler, no completion
    p.wait()
    assert len(lines(effects)) == 1
    time.sleep(lease_ms / 1000 + 0.3)  # the lease runs out; the sweeper makes it UNKNOWN
    with server.client() as client:
        assert client.get_operation(key).state == "UNKNOWN"
        ran: list[bool] = []

        @client.idempotent(key="{order}", action="send_confirmation", payload=["order"], provider_ref="ref")
        def send_confirmation(order: str) -> dict[str, str]:
            ran.append(True)
            return {"ref": "msg-again"}

        with pytest.raises(idem_client.OutcomeUnknownError) as e:
            send_confirmation(key)
        assert e.value.operation.state == "UNKNOWN"
        assert ran == []
    again = worker(server, key, effects, 0, lease_ms, 0).communicate(timeout=30)[0]
    assert again.strip() == "raised outcome-unknown"
    assert len(lines(effects)) == 1, "never performed again"
