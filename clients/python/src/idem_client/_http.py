"""idem's own HTTP calls, sync and async (httpx), with bounded retries.

Every call idem_client makes is safe to send again: an acquire is resent with the same
``holder`` (a resend after a lost answer gets its own grant back, README "Five minutes with
curl"), a completion repeated is answered with the unchanged record, a renewal moves the
lease end again, a workflow start with the same input is the same instance. So a call is
retried, with full jitter (AWS Architecture Blog, "Exponential Backoff And Jitter"), when:

- no connection could be made (refused, connect timeout): nothing was sent;
- the answer was lost (read timeout, reset, a connection closed mid-answer);
- idem (or a gateway in front of it) answered ``503``, ``502``, ``504``, ``429``, ``408`` or
  ``409 contention``: the request may or may not have been recorded, and the resend (the
  same request, an acquire with the same holder) reads which; ``Retry-After`` (RFC 9110
  §10.2.3) is the floor of the wait.

A call with ``until`` (a completion: the effect happened, and its report is idempotent) goes on
after the policy's tries, with the same capped full-jitter waits, until that monotonic instant
(the lease's end), so a restart of idem during the effect does not lose its outcome.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from ._errors import NoAnswerError, ProblemError, ServerUnreachableError, problem_error
from ._json import dumps
from ._records import JSON

USER_AGENT = "idem-client-python/0.1.0"


@dataclass(frozen=True)
class RetryPolicy:
    """How idem_client retries its own calls to idem.

    ``attempts``: tries in all for one call (1: no retry). ``base_s`` and ``cap_s``: the n-th
    retry waits a random time in [0, min(cap_s, base_s * 2^n)] seconds (full jitter), at least
    the ``Retry-After`` the answer asked for. ``max_retry_after_s``: a ``Retry-After`` longer
    than this is not waited for; the error is raised at once with ``retry_after`` set.

    A completion (the effect happened; resending it is safe) is retried beyond ``attempts``,
    with the same waits, for as long as its lease is valid, then raises
    :class:`OutcomeNotRecordedError` with what to report later.
    """

    attempts: int = 5
    base_s: float = 0.1
    cap_s: float = 2.0
    max_retry_after_s: float = 10.0

    def delay(self, retry: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        jitter = random.uniform(0, min(self.cap_s, self.base_s * (2 ** min(retry, 32))))
        return max(jitter, retry_after or 0.0)


@dataclass(frozen=True)
class Answer:
    """One HTTP answer of idem: status, headers and the JSON body (``None`` if not JSON)."""

    status: int
    headers: httpx.Headers
    body: Any

    @property
    def request_id(self) -> str | None:
        """The ``x-request-id`` idem gave the request."""
        rid: str | None = self.headers.get("x-request-id")
        return rid

    def error(self) -> ProblemError:
        """The exception for an error answer (RFC 9457 problem document, or one made from the
        status for a gateway's non-problem answer)."""
        body = self.body
        if not (isinstance(body, dict) and isinstance(body.get("type"), str)):
            body = {
                "type": "about:blank",
                "title": httpx.codes.get_reason_phrase(self.status),
                "status": self.status,
                "detail": f"HTTP {self.status} without a problem document",
            }
        return problem_error(self.status, body, self.request_id, retry_after_s(self.headers))


def retry_after_s(headers: httpx.Headers) -> float | None:
    """``Retry-After`` in seconds: delay-seconds or an HTTP-date (RFC 9110 §10.2.3)."""
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    if raw.isdigit():
        return float(raw)
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _retryable_status(answer: Answer) -> bool:
    if answer.status in (408, 429, 502, 503, 504):
        return True
    return (
        answer.status == 409
        and isinstance(answer.body, dict)
        and answer.body.get("type") == "/problems/contention"
    )


def _parse(r: httpx.Response) -> Answer:
    ctype = r.headers.get("content-type", "")
    body: Any = None
    if "json" in ctype:
        try:
            body = r.json()
        except ValueError:
            body = None
    return Answer(r.status_code, r.headers, body)


_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


class _Tries:
    """The bookkeeping of one call's tries: what happened, and what to raise at the end."""

    def __init__(self, policy: RetryPolicy, what: str, until: float | None) -> None:
        self.policy = policy
        self.what = what
        self.until = until
        self.tries = 0
        self.maybe_delivered = False
        self.last_exc: Exception | None = None
        self.last_answer: Answer | None = None

    def exc(self, e: httpx.TransportError) -> float | None:
        """Records a transport error; the wait before the next try, or None to give up."""
        self.tries += 1
        self.last_exc, self.last_answer = e, None
        if not isinstance(e, _UNSENT):
            self.maybe_delivered = True
        return self._next(None)

    def answer(self, a: Answer) -> float | None:
        """Records a retryable answer; the wait before the next try, or None to give up."""
        self.tries += 1
        self.last_exc, self.last_answer = None, a
        self.maybe_delivered = True
        return self._next(retry_after_s(a.headers))

    def _next(self, retry_after: float | None) -> float | None:
        wait = self.policy.delay(self.tries - 1, retry_after)
        left = None if self.until is None else self.until - time.monotonic()
        too_long = retry_after is not None and retry_after > self.policy.max_retry_after_s
        if self.tries < self.policy.attempts and not too_long:
            return wait if left is None or left <= 0 else min(wait, left)
        if left is None or left <= 0:
            return None
        return min(wait, left)  # never past ``until``: the last try is at it at the latest

    def give_up(self) -> Exception:
        if self.last_answer is not None:
            return self.last_answer.error()
        cause = self.last_exc
        if self.maybe_delivered:
            err: Exception = NoAnswerError(
                f"{self.what}: no answer from idem after {self.tries} tries ({cause!r}); it may have "
                "been recorded: an acquire that was granted ends UNKNOWN when its lease runs out, never "
                "done twice",
                attempts=self.tries,
            )
        else:
            err = ServerUnreachableError(
                f"{self.what}: idem could not be reached after {self.tries} tries ({cause!r}); "
                "nothing was sent",
                attempts=self.tries,
            )
        err.__cause__ = cause
        return err


@dataclass(frozen=True)
class Request:
    """One call: method, path (already percent-encoded), JSON body, read timeout (s)."""

    method: str
    path: str
    body: JSON = None
    has_body: bool = False
    read_timeout_s: float = 10.0

    def kwargs(self, connect_timeout_s: float) -> dict[str, Any]:
        headers = {"accept": "application/json"}
        content = None
        if self.has_body:
            headers["content-type"] = "application/json"
            content = dumps(self.body)
        timeout = httpx.Timeout(self.read_timeout_s, connect=connect_timeout_s)
        return {"headers": headers, "content": content, "timeout": timeout}


def send(
    client: httpx.Client,
    req: Request,
    policy: RetryPolicy,
    connect_timeout_s: float,
    until: float | None = None,
) -> Answer:
    """Sends ``req`` (retried as the module docs say; past the policy's tries until the
    ``time.monotonic()`` instant ``until`` when given); the final answer, whatever its status.

    Raises:
        ServerUnreachableError, NoAnswerError: the retries are spent without an answer.
        ProblemError: the retries are spent on retryable answers (503, ...).
    """
    tries = _Tries(policy, f"{req.method} {req.path}", until)
    kwargs = req.kwargs(connect_timeout_s)
    while True:
        try:
            answer = _parse(client.request(req.method, req.path, **kwargs))
        except httpx.TransportError as e:
            wait = tries.exc(e)
        else:
            if not _retryable_status(answer):
                return answer
            wait = tries.answer(answer)
        if wait is None:
            raise tries.give_up()
        time.sleep(wait)


async def asend(
    client: httpx.AsyncClient,
    req: Request,
    policy: RetryPolicy,
    connect_timeout_s: float,
    until: float | None = None,
) -> Answer:
    """:func:`send` for asyncio."""
    tries = _Tries(policy, f"{req.method} {req.path}", until)
    kwargs = req.kwargs(connect_timeout_s)
    while True:
        try:
            answer = _parse(await client.request(req.method, req.path, **kwargs))
        except httpx.TransportError as e:
            wait = tries.exc(e)
        else:
            if not _retryable_status(answer):
                return answer
            wait = tries.answer(answer)
        if wait is None:
            raise tries.give_up()
        await asyncio.sleep(wait)
