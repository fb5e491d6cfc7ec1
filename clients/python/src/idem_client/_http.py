"""idem's own HTTP calls, sync (urllib3) and async (httpx), with bounded retries.

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

Sync calls go over urllib3's connection pool (:class:`Urllib3HTTP`): per request it costs about
a third of the CPU of ``httpx.Client`` (bench/peers, ``idem_py_bench.py --client library``), and a
guarded call makes two. httpx carries the ``async`` calls, and the sync ones when the client was
given an httpx ``transport`` or a proxy is set in the environment (:class:`HttpxHTTP`).
"""

from __future__ import annotations

import asyncio
import email.utils
import http.client
import json
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

import httpx
import urllib3
from urllib3.exceptions import ClosedPoolError, ConnectTimeoutError, EmptyPoolError

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
    #: Case-insensitive (``httpx.Headers`` or urllib3's ``HTTPHeaderDict``).
    headers: Mapping[str, str]
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
                "title": _reason(self.status),
                "status": self.status,
                "detail": f"HTTP {self.status} without a problem document",
            }
        return problem_error(self.status, body, self.request_id, retry_after_s(self.headers))


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def retry_after_s(headers: Mapping[str, str]) -> float | None:
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


class UnansweredTryError(Exception):
    """One try that got no answer. ``cause``: the HTTP library's exception; ``unsent``: no
    connection could be made (refused, unresolvable, connect timeout), so nothing was sent."""

    def __init__(self, cause: Exception, unsent: bool) -> None:
        super().__init__(cause)
        self.cause = cause
        self.unsent = unsent


_HTTPX_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


def _httpx_no_answer(e: httpx.TransportError) -> UnansweredTryError:
    return UnansweredTryError(e, isinstance(e, _HTTPX_UNSENT))


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

    def exc(self, e: UnansweredTryError) -> float | None:
        """Records a try without an answer; the wait before the next try, or None to give up."""
        self.tries += 1
        self.last_exc, self.last_answer = e.cause, None
        if not e.unsent:
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
        if left is not None:
            # A call bounded by ``until`` (a completion, by its lease's end) is tried until
            # then, beyond ``attempts``, and never after it: a completion sent after the
            # lease's end proves nothing the caller can act on, so the error carries what
            # to report later instead (the TypeScript client does the same).
            return None if left <= 0 else min(wait, left)
        too_long = retry_after is not None and retry_after > self.policy.max_retry_after_s
        return wait if self.tries < self.policy.attempts and not too_long else None

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

    def content(self) -> bytes | None:
        """The body's JSON text, or None for a call without one."""
        return dumps(self.body) if self.has_body else None


class SyncHTTP(Protocol):
    """The connections of a client's sync calls: one try of a request, and ``close``."""

    def request(
        self, method: str, path: str, content: bytes | None, read_timeout_s: float, connect_timeout_s: float
    ) -> Answer:
        """One try: the answer, whatever its status. Raises :class:`UnansweredTryError`."""
        ...

    def close(self) -> None:
        """Closes the connections."""
        ...


#: urllib3's own retries and redirects off (``retries=False``, made once, not per request).
_NO_RETRIES = urllib3.Retry(total=False, redirect=False)

#: Idle connections a client keeps per server (more are opened when more threads call at
#: once; those are closed after their request), as httpx's default ``max_keepalive_connections``.
POOL_SIZE = 20


class Urllib3HTTP:
    """Sync calls over a urllib3 connection pool to ``url`` (``http`` or ``https``, optionally
    with a path prefix), with ``headers`` on every request; TLS is verified with httpx's
    default context (certifi, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``), as before. urllib3's
    own retries and redirects are off: :func:`send` retries, and a redirect is never followed
    (httpx's default too). Only for a URL :func:`urllib3_fits` accepts."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        u = urllib3.util.parse_url(url)
        host = u.host or ""  # urllib3_fits: there is one
        self._prefix = (u.path or "").rstrip("/")
        self._headers = {**headers, "accept": "application/json"}
        self._json_headers = {**self._headers, "content-type": "application/json"}
        self._timeouts: dict[tuple[float, float], urllib3.Timeout] = {}
        self._pool: urllib3.HTTPConnectionPool
        if u.scheme == "https":
            self._pool = urllib3.HTTPSConnectionPool(
                host,
                u.port,
                maxsize=POOL_SIZE,
                block=False,
                retries=_NO_RETRIES,
                ssl_context=httpx.create_ssl_context(),
            )
        else:
            self._pool = urllib3.HTTPConnectionPool(
                host, u.port, maxsize=POOL_SIZE, block=False, retries=_NO_RETRIES
            )

    def request(
        self, method: str, path: str, content: bytes | None, read_timeout_s: float, connect_timeout_s: float
    ) -> Answer:
        timeout = self._timeouts.get((read_timeout_s, connect_timeout_s))
        if timeout is None:
            timeout = urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s)
            self._timeouts[(read_timeout_s, connect_timeout_s)] = timeout
        try:
            r = self._pool.urlopen(
                method,
                self._prefix + path,
                body=content,
                headers=self._headers if content is None else self._json_headers,
                retries=_NO_RETRIES,
                redirect=False,
                timeout=timeout,
                preload_content=True,
            )
            data = r.data
        except (ConnectTimeoutError, EmptyPoolError, ClosedPoolError) as e:  # no connection: nothing sent
            raise UnansweredTryError(e, True) from e
        except urllib3.exceptions.SSLError as e:
            # The TLS handshake failed (an untrusted certificate, http:// against https://):
            # no request was sent, as httpx's ConnectError says on the async path.
            raise UnansweredTryError(e, True) from e
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as e:
            raise UnansweredTryError(
                e, False
            ) from e  # sent, maybe: read timeout, reset, closed mid-answer, TLS
        body: Any = None
        if "json" in r.headers.get("content-type", ""):
            try:
                body = json.loads(data)
            except ValueError:
                body = None
        return Answer(r.status, r.headers, body)

    def close(self) -> None:
        self._pool.close()


def urllib3_fits(url: str, environ_proxies: Mapping[str, str]) -> bool:
    """Whether :class:`Urllib3HTTP` reaches ``url`` as httpx would: ``http``/``https`` without
    credentials, query or fragment in the URL, and no proxy in the environment
    (``environ_proxies``: ``urllib.request.getproxies()``; httpx honours ``HTTP_PROXY``,
    ``HTTPS_PROXY``, ``ALL_PROXY``). Otherwise the sync calls keep httpx."""
    try:
        u = urllib3.util.parse_url(url)
    except urllib3.exceptions.LocationParseError:
        return False
    plain = u.scheme in ("http", "https") and bool(u.host) and u.auth is None
    return plain and u.query is None and u.fragment is None and not any(k != "no" for k in environ_proxies)


class HttpxHTTP:
    """Sync calls over an ``httpx.Client`` (a ``transport`` given to the client, or a proxy)."""

    def __init__(self, client: httpx.Client) -> None:
        self._client = client

    def request(
        self, method: str, path: str, content: bytes | None, read_timeout_s: float, connect_timeout_s: float
    ) -> Answer:
        try:
            r = self._client.request(
                method, path, **_httpx_kwargs(content, read_timeout_s, connect_timeout_s)
            )
        except httpx.TransportError as e:
            raise _httpx_no_answer(e) from e
        return _parse(r)

    def close(self) -> None:
        self._client.close()


def _httpx_kwargs(content: bytes | None, read_timeout_s: float, connect_timeout_s: float) -> dict[str, Any]:
    headers = {"accept": "application/json"}
    if content is not None:
        headers["content-type"] = "application/json"
    timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
    return {"headers": headers, "content": content, "timeout": timeout}


def send(
    http: SyncHTTP,
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
    tries: _Tries | None = None
    content = req.content()
    while True:
        try:
            answer = http.request(req.method, req.path, content, req.read_timeout_s, connect_timeout_s)
        except UnansweredTryError as e:
            tries = tries or _Tries(policy, f"{req.method} {req.path}", until)
            wait = tries.exc(e)
        else:
            if not _retryable_status(answer):
                return answer
            tries = tries or _Tries(policy, f"{req.method} {req.path}", until)
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
    """:func:`send` for asyncio (over httpx)."""
    tries: _Tries | None = None
    kwargs = _httpx_kwargs(req.content(), req.read_timeout_s, connect_timeout_s)
    while True:
        try:
            answer = _parse(await client.request(req.method, req.path, **kwargs))
        except httpx.TransportError as e:
            tries = tries or _Tries(policy, f"{req.method} {req.path}", until)
            wait = tries.exc(_httpx_no_answer(e))
        else:
            if not _retryable_status(answer):
                return answer
            tries = tries or _Tries(policy, f"{req.method} {req.path}", until)
            wait = tries.answer(answer)
        if wait is None:
            raise tries.give_up()
        await asyncio.sleep(wait)
