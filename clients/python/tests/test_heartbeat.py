"""The heartbeat scheduler on its own: renewals of live claims come when due, whatever
completed claims sit in its queue, and a completed claim is never renewed."""

from __future__ import annotations

import threading
import time

from idem_client._heartbeat import Beat, Heartbeats


def test_live_beats_are_renewed_when_due_and_completed_ones_never() -> None:
    hb = Heartbeats()
    renewed: list[str] = []
    due = {name: threading.Event() for name in ("slow", "fast")}

    def renew(name: str) -> bool:
        renewed.append(name)
        if name in due:
            due[name].set()
        return False  # once is enough

    try:
        started = time.monotonic()
        hb.start(Beat(lambda: renew("slow"), 1.0))
        time.sleep(0.02)  # the scheduler now sleeps until the slow beat is due
        done = [hb.start(Beat(lambda: renew("done"), 0.5)) for _ in range(1000)]
        for beat in done:
            beat.cancel()  # completed claims, due before the slow one
        hb.start(Beat(lambda: renew("fast"), 0.05))  # due first: must wake the scheduler
        assert due["fast"].wait(5)
        fast_after = time.monotonic() - started
        assert due["slow"].wait(5)
        slow_after = time.monotonic() - started
    finally:
        hb.close()
    assert renewed[:2] == ["fast", "slow"], renewed[:5]
    assert "done" not in renewed
    assert fast_after < 0.8 <= 1.0 <= slow_after, (fast_after, slow_after)
