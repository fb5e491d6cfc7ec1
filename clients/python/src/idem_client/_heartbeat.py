"""The heartbeats of a client's sync claims: one scheduler thread per client, started at its
first claim, renews each lease when it is due; the renewals themselves run on a small pool,
so a renewal that waits on an unreachable server does not hold back the others.

A claim costs a heap entry, not a thread: most effects finish long before their first
renewal (every third of the lease), and a thread per claim cost more CPU than the two HTTP
requests of the claim (scripts measured in bench/peers).

Async claims are renewed here too, not by a task on the caller's event loop: a coroutine that
blocks its loop (``time.sleep``, ``requests.post``) would stop such a task, and the lease
would run out while the effect is still under way.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

#: Renewals in flight at once (each is one HTTP request, retried).
RENEWAL_THREADS = 4


class Beat:
    """One claim's heartbeat: ``renew()`` renews once and says whether to go on."""

    def __init__(self, renew: Callable[[], bool], every_s: float) -> None:
        self.renew = renew
        self.every_s = every_s
        self.cancelled = False

    def cancel(self) -> None:
        """No more renewals; a renewal in flight has its answer ignored by the claim. The claim
        is let go at once (its heap entry stays until it would have been due)."""
        self.cancelled = True
        self.renew = _stop


def _stop() -> bool:
    return False


class Heartbeats:
    """The scheduler (see the module docs)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Beat]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def after_fork_in_child(self) -> None:
        """In a forked child (``os.register_at_fork``): the parent's thread, pool, lock and
        claims are not the child's; start afresh (the next claim starts a thread)."""
        self._cond = threading.Condition()
        self._heap, self._thread, self._pool = [], None, None

    def start(self, beat: Beat) -> Beat:
        """Schedules ``beat``'s first renewal ``every_s`` from now. The scheduler thread is woken
        only when this renewal is due before the one it sleeps until: waking it at every claim
        cost as much CPU as the rest of the library's own work for a claim."""
        due = time.monotonic() + beat.every_s
        with self._cond:
            self._closed = False
            earliest = not self._heap or due < self._heap[0][0]
            heapq.heappush(self._heap, (due, next(self._seq), beat))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="idem-heartbeats", daemon=True)
                self._thread.start()
            elif earliest:
                self._cond.notify()
        return beat

    def close(self) -> None:
        """Stops the scheduler (claims still open get no more renewals)."""
        with self._cond:
            self._closed = True
            thread, pool, self._thread, self._pool = self._thread, self._pool, None, None
            self._heap = []
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)
        if pool is not None:
            pool.shutdown(wait=False)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    heap = self._heap
                    # Claims that completed are dropped in one go, before their renewal is due:
                    # waking up for each of them would cost every claim a wake-up after all.
                    while heap and heap[0][2].cancelled:
                        heapq.heappop(heap)
                    if heap and heap[0][0] <= time.monotonic():
                        break
                    self._cond.wait(heap[0][0] - time.monotonic() if heap else None)
                _, _, beat = heapq.heappop(self._heap)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(RENEWAL_THREADS, thread_name_prefix="idem-renewal")
                pool = self._pool
            pool.submit(self._renew, beat)

    def _renew(self, beat: Beat) -> None:
        if beat.cancelled or not beat.renew() or beat.cancelled:
            return
        with self._cond:
            if not self._closed:
                heapq.heappush(self._heap, (time.monotonic() + beat.every_s, next(self._seq), beat))
                self._cond.notify()
