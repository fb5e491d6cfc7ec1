"""The client: where idem is, its API key, and the calls (sync, and async with an ``a`` prefix,
as Django names them)."""

from __future__ import annotations

import asyncio
import os
import threading
import urllib.request
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from ._claim import ClaimContext, ExceptionMatch, Target
from ._decorator import EvidenceSpec, Idempotent, KeySpec, PayloadSpec
from ._errors import InvalidInputError, check_answer
from ._heartbeat import Heartbeats
from ._http import (
    USER_AGENT,
    Answer,
    HttpxHTTP,
    Request,
    RetryPolicy,
    SyncHTTP,
    Urllib3HTTP,
    asend,
    send,
    urllib3_fits,
)
from ._json import to_json
from ._records import JSON, Instance, Operation

#: Lease lengths idem accepts, in ms (README "Request fields").
MIN_LEASE_MS, MAX_LEASE_MS = 100, 3_600_000


#: Every live client, for the fork hook below.
_CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_CLIENTS):
        client._after_fork_in_child()


# A forked child (gunicorn --preload, Celery prefork, multiprocessing) inherits the parent's
# open connections: were both to use one, each would read answers meant for the other.
if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _check_lease(lease_ms: int, wait_ms: int) -> None:
    if not isinstance(lease_ms, int) or not MIN_LEASE_MS <= lease_ms <= MAX_LEASE_MS:
        raise InvalidInputError(f"lease_ms is {lease_ms!r}; it must be {MIN_LEASE_MS}-{MAX_LEASE_MS} ms")
    if not isinstance(wait_ms, int) or wait_ms < 0:
        raise InvalidInputError(f"wait_ms is {wait_ms!r}; it must be 0 or more ms")


class Client:
    """A client of one idem server.

    ``url`` defaults to ``IDEM_URL`` (else ``http://127.0.0.1:8080``), ``api_key`` to
    ``IDEM_API_KEY``. ``timeout_s``: how long one request may wait for its answer (plus any
    ``wait_ms``); ``connect_timeout_s``: for the connection; ``retry``: how idem's own calls are
    retried (:class:`RetryPolicy`). Sync calls go over a urllib3 connection pool (a third of
    httpx's CPU per request), ``async`` ones over httpx; TLS is verified alike (httpx's default
    context: certifi, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``). ``transport`` /
    ``async_transport``: httpx transports (for a custom proxy or TLS, or a test double); given
    ``transport``, the sync calls go through an ``httpx.Client`` with it, as they also do when a
    proxy is set in the environment (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, which httpx
    honours). With ``async_transport`` give ``transport`` too, configured alike: the leases of
    ``async`` claims are renewed from the library's heartbeat thread, over the sync connections.
    One client serves threads and every event loop (an ``httpx.AsyncClient`` per loop, let go
    once its loop is closed); close it
    with :meth:`close` / :meth:`aclose` or ``with``.

    Fork-safe: in a child process (``os.fork``, gunicorn ``--preload``, Celery prefork,
    ``multiprocessing``) the client drops the connections and heartbeat thread it inherited
    and makes its own. A ``transport`` of your own holds connections the client cannot
    rebuild: a client that used one before the fork raises :class:`InvalidInputError` in the
    child; make it after the fork.

    Raises:
        InvalidInputError: no API key was given or found in ``IDEM_API_KEY``; an
            ``async_transport`` without a ``transport``.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = 10.0,
        connect_timeout_s: float = 2.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = (url or os.environ.get("IDEM_URL") or "http://127.0.0.1:8080").rstrip("/")
        key = api_key or os.environ.get("IDEM_API_KEY")
        if not key:
            raise InvalidInputError(
                "no API key: pass api_key= or set IDEM_API_KEY (idem prints one on first start)"
            )
        if any(not 33 <= ord(ch) <= 126 for ch in key):
            # Sent as is, a line break or a space would fail one HTTP library and not the other.
            raise InvalidInputError(
                "the API key holds a space, a line break or a non-ASCII character: idem's keys are "
                "visible ASCII (idem_ and hex digits); a key read from a file often ends in a newline"
            )
        if async_transport is not None and transport is None:
            raise InvalidInputError(
                "async_transport= needs transport= too, configured alike: async claims renew their "
                "leases from the library's heartbeat thread, over the sync transport"
            )
        self._headers = {"authorization": f"Bearer {key}", "user-agent": USER_AGENT}
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry = retry or RetryPolicy()
        self._transport = transport
        self._async_transport = async_transport
        self._lock = threading.Lock()
        self._http: SyncHTTP | None = None
        self._heartbeats = Heartbeats()
        self._ahttp: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        self._forked_with_own_transport = False
        _CLIENTS.add(self)

    # --- connections -------------------------------------------------------------------

    def _after_fork_in_child(self) -> None:
        """The fork hook: forget (never close, never use) the parent's connections, lock and
        heartbeat thread. Closing would not help: the sockets are shared with the parent."""
        used = self._http is not None or len(self._ahttp) > 0  # a transport never used holds nothing
        own = self._transport is not None or self._async_transport is not None
        self._forked_with_own_transport = self._forked_with_own_transport or (used and own)
        self._lock = threading.Lock()
        self._http = None
        self._ahttp = weakref.WeakKeyDictionary()
        self._heartbeats.after_fork_in_child()

    def _check_not_forked(self) -> None:
        if self._forked_with_own_transport:
            raise InvalidInputError(
                "this Client used a transport of its own before os.fork(): its connections are the "
                "parent's, and the client cannot rebuild them. Make the Client in the child (gunicorn "
                "post_fork, Celery worker_process_init); nothing was sent"
            )

    def _sync_http(self) -> SyncHTTP:
        self._check_not_forked()
        with self._lock:
            if self._http is None:
                if self._transport is None and urllib3_fits(self.url, urllib.request.getproxies()):
                    self._http = Urllib3HTTP(self.url, self._headers)
                else:
                    self._http = HttpxHTTP(
                        httpx.Client(base_url=self.url, headers=self._headers, transport=self._transport)
                    )
            return self._http

    def _async_http(self) -> httpx.AsyncClient:
        self._check_not_forked()
        loop = asyncio.get_running_loop()
        with self._lock:
            http = self._ahttp.get(loop)
            if http is None:
                # Let go of the connections of loops that are closed (a script that calls
                # asyncio.run per request makes a loop per call): they can never be used or
                # awaited again, and an AsyncClient keeps its loop alive, so the weak key alone
                # would keep one socket per finished loop. Dropped, its sockets are closed when
                # collected (asyncio's transports close on collection).
                for old in [old for old in self._ahttp if old.is_closed()]:
                    del self._ahttp[old]
                http = httpx.AsyncClient(
                    base_url=self.url, headers=self._headers, transport=self._async_transport
                )
                self._ahttp[loop] = http
            return http

    def close(self) -> None:
        """Closes the sync connections and stops the heartbeat thread."""
        self._heartbeats.close()
        with self._lock:
            http, self._http = self._http, None
        if http is not None:
            http.close()

    async def aclose(self) -> None:
        """Closes the connections of the running event loop (and the sync ones)."""
        self.close()
        with self._lock:
            http = self._ahttp.pop(asyncio.get_running_loop(), None)
        if http is not None:
            await http.aclose()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _call(self, req: Request) -> Answer:
        return send(self._sync_http(), req, self.retry, self.connect_timeout_s)

    async def _acall(self, req: Request) -> Answer:
        return await asend(self._async_http(), req, self.retry, self.connect_timeout_s)

    # --- operations ----------------------------------------------------------------------

    def claim(
        self,
        key: str,
        *,
        action: str,
        payload: object = None,
        fingerprint_fields: Sequence[str] | None = None,
        lease_ms: int = 30_000,
        wait_ms: int = 0,
        redo_safe: bool = False,
        heartbeat: bool = True,
        renew_every_ms: int | None = None,
        retryable: ExceptionMatch = (),
        final: ExceptionMatch = (),
    ) -> ClaimContext:
        """A claim on the operation ``key`` for ``action`` with ``payload`` (the intent), to use
        with ``with`` or ``async with`` (see :mod:`idem_client._claim` and the README).

        ``fingerprint_fields``: JSON pointers of the payload fields that define the intent.
        ``lease_ms`` (100-3 600 000): the lease, renewed every ``renew_every_ms`` (default a third
        of it) while ``heartbeat`` is on. ``wait_ms``: how long to wait for a concurrent
        duplicate's outcome (0: raise :class:`InProgressError` at once). ``redo_safe``: doing the
        action twice is harmless, so an expired lease is granted again instead of becoming
        UNKNOWN (default False: never redone). ``retryable`` / ``final``: the exceptions that prove
        nothing happened, completed as a retryable / final failure when they leave the block —
        an exception class, a tuple of them, or a predicate on the exception; the raised
        exception itself is matched, never its ``__cause__`` / ``__context__`` (an earlier refused
        attempt says nothing about the last one). Any other exception completes UNKNOWN.

        Raises (on entering, before the block runs): :class:`InvalidInputError` (bad option or
        payload), :class:`OutcomeUnknownError`, :class:`InProgressError`,
        :class:`FingerprintMismatchError`, :class:`LateArrivalError`, :class:`InvalidKeyError`,
        :class:`ServerUnreachableError`, and the other :class:`ProblemError` classes.
        """
        _check_lease(lease_ms, wait_ms)
        if not isinstance(key, str):
            raise InvalidInputError(f"the key must be a string, not {type(key).__name__}")
        body: dict[str, JSON] = {
            "key": key,
            "action": action,
            "payload": to_json(payload, "payload"),
            "lease_ms": lease_ms,
        }
        if fingerprint_fields is not None:
            body["fingerprint_fields"] = list(fingerprint_fields)
        if redo_safe:
            body["redo_safe"] = True
        return ClaimContext(
            self,
            Target.operation(key, body),
            lease_ms=lease_ms,
            wait_ms=wait_ms,
            heartbeat=heartbeat,
            renew_every_ms=renew_every_ms,
            retryable=retryable,
            final=final,
        )

    def idempotent(
        self,
        *,
        key: KeySpec,
        action: str,
        provider_ref: EvidenceSpec,
        payload: PayloadSpec = None,
        fingerprint_fields: Sequence[str] | None = None,
        lease_ms: int = 30_000,
        wait_ms: int = 0,
        redo_safe: bool = False,
        heartbeat: bool = True,
        renew_every_ms: int | None = None,
        retryable: ExceptionMatch = (),
        final: ExceptionMatch = (),
        serialize: Callable[[Any], object] | None = None,
        deserialize: Callable[[JSON], Any] | None = None,
    ) -> Idempotent:
        """A decorator that makes a function (``def`` or ``async def``) run once per key.

        ``key``: a format string filled from the call's arguments by name
        (``"{order_id}:confirmation:v1"``) or a callable taking the function's arguments.
        ``action``: the kind of side effect (1-128 of ``[A-Za-z0-9_.:-]``). ``provider_ref``: the
        evidence, read from the return value — a field (dict key or attribute) name or a callable;
        a non-empty string, or an integer (kept as its decimal string).
        ``payload``: the intent — the names of the arguments that define it, a callable taking
        the function's arguments, or (default) all arguments but ``self``/``cls``.
        ``serialize`` / ``deserialize``: the return value to JSON and back, for replays (default:
        the value itself, which must be JSON). The other options are :meth:`claim`'s.

        A call raises what :meth:`claim` raises before the function runs; after it ran, the
        function's own exception (completed as a retryable or final failure when declared, else
        UNKNOWN), :class:`ResultNotStorableError`, :class:`StaleFencingTokenError`, or
        :class:`OutcomeNotRecordedError`. A replay returns the stored result as JSON (a tuple
        comes back as a list; ``deserialize`` makes it your type again), or raises
        :class:`OperationFailedError` for a FAILED operation.
        """
        _check_lease(lease_ms, wait_ms)
        return Idempotent(
            self,
            key=key,
            action=action,
            provider_ref=provider_ref,
            payload=payload,
            fingerprint_fields=fingerprint_fields,
            lease_ms=lease_ms,
            wait_ms=wait_ms,
            redo_safe=redo_safe,
            heartbeat=heartbeat,
            renew_every_ms=renew_every_ms,
            retryable=retryable,
            final=final,
            serialize=serialize,
            deserialize=deserialize,
        )

    @staticmethod
    def _record(a: Answer, key: str, fencing_token: int | None = None) -> Operation:
        if a.status != 200 or not isinstance(a.body, dict):
            raise a.error()
        op = Operation.from_json(a.body)
        check_answer(f"operation {key!r}", "the key", key, op.key)
        if fencing_token is not None:
            check_answer(f"operation {key!r}", "the fencing token", fencing_token, op.fencing_token)
        return op

    def get_operation(self, key: str) -> Operation:
        """``GET /v1/operations/{key}``: the record with its ``events``.

        Raises: :class:`NotFoundError`, :class:`InvalidKeyError`, ..."""
        return self._record(self._call(Request("GET", f"/v1/operations/{quote(key, safe='')}")), key)

    async def aget_operation(self, key: str) -> Operation:
        """As :meth:`get_operation`."""
        return self._record(await self._acall(Request("GET", f"/v1/operations/{quote(key, safe='')}")), key)

    @staticmethod
    def _complete_request(key: str, fencing_token: int, completion: Mapping[str, Any]) -> Request:
        if not isinstance(fencing_token, int) or isinstance(fencing_token, bool):
            raise InvalidInputError(f"fencing_token must be an integer, not {fencing_token!r}")
        body = to_json(dict(completion), "completion")
        assert isinstance(body, dict)
        body["fencing_token"] = fencing_token
        return Request("POST", f"/v1/operations/{quote(key, safe='')}/complete", body, True)

    def complete(self, key: str, fencing_token: int, completion: Mapping[str, Any]) -> Operation:
        """``POST /v1/operations/{key}/complete``: reports an outcome with a lease's fencing token,
        outside a claim — the one an :class:`OutcomeNotRecordedError` carries
        (``client.complete(e.key, e.fencing_token, e.completion)``), later, once idem is back.
        ``completion`` is the body without the token: ``{"outcome": "succeeded", "provider_ref":
        ..., "result": ...}`` and the other outcomes' fields (book: Concepts, Leases,
        "Completing"). Safe to repeat.
        For a workflow step, ``key`` is the step's operation key (the error carries it).

        Raises: :class:`StaleFencingTokenError` (another lease was granted since: nothing
        recorded), :class:`OperationFinalError` (another outcome was recorded),
        :class:`InvalidRequestError`, :class:`LateArrivalError`, :class:`NotFoundError`,
        :class:`ServerUnreachableError`, :class:`NoAnswerError`."""
        return self._record(
            self._call(self._complete_request(key, fencing_token, completion)), key, fencing_token
        )

    async def acomplete(self, key: str, fencing_token: int, completion: Mapping[str, Any]) -> Operation:
        """As :meth:`complete`."""
        req = self._complete_request(key, fencing_token, completion)
        return self._record(await self._acall(req), key, fencing_token)

    # --- workflows your code runs ----------------------------------------------------------

    @staticmethod
    def _start_request(
        workflow: str,
        instance_id: str,
        input: object,
        steps: Sequence[str | Mapping[str, Any]] | None,
        source_event: str | None,
        trace_id: str | None,
    ) -> Request:
        body: dict[str, JSON] = {
            "workflow": workflow,
            "instance_id": instance_id,
            "input": to_json(input, "input"),
        }
        if steps is not None:
            body["steps"] = [{"name": s} if isinstance(s, str) else to_json(dict(s), "step") for s in steps]
        if source_event is not None:
            body["source_event"] = source_event
        if trace_id is not None:
            body["trace_id"] = trace_id
        return Request("POST", "/v1/workflows", body, True)

    @staticmethod
    def _instance(a: Answer, instance_id: str) -> Instance:
        if a.status not in (200, 201) or not isinstance(a.body, dict):
            raise a.error()
        instance = Instance.from_json(a.body)
        check_answer(f"instance {instance_id!r}", "the instance id", instance_id, instance.instance_id)
        return instance

    def start_workflow(
        self,
        workflow: str,
        instance_id: str,
        *,
        input: object = None,
        steps: Sequence[str | Mapping[str, Any]] | None = None,
        source_event: str | None = None,
        trace_id: str | None = None,
    ) -> Instance:
        """``POST /v1/workflows``: starts the instance ``instance_id`` (or finds it: the same id
        and input are the same instance). ``steps``: for a workflow your code runs, its steps in
        order — names, or ``{"name", "action", "policy"}`` (``manual``, default, or
        ``redo_safe``). Raises :class:`InstanceMismatchError` (422) for the same id with another
        workflow, input or steps, :class:`UnknownWorkflowError`, :class:`InvalidDefinitionError`,
        :class:`LateArrivalError`."""
        return self._instance(
            self._call(self._start_request(workflow, instance_id, input, steps, source_event, trace_id)),
            instance_id,
        )

    async def astart_workflow(
        self,
        workflow: str,
        instance_id: str,
        *,
        input: object = None,
        steps: Sequence[str | Mapping[str, Any]] | None = None,
        source_event: str | None = None,
        trace_id: str | None = None,
    ) -> Instance:
        """As :meth:`start_workflow`."""
        return self._instance(
            await self._acall(
                self._start_request(workflow, instance_id, input, steps, source_event, trace_id)
            ),
            instance_id,
        )

    def get_workflow(self, instance_id: str) -> Instance:
        """``GET /v1/workflows/{instance}``: the instance with its steps and events."""
        return self._instance(
            self._call(Request("GET", f"/v1/workflows/{quote(instance_id, safe='')}")), instance_id
        )

    async def aget_workflow(self, instance_id: str) -> Instance:
        """As :meth:`get_workflow`."""
        return self._instance(
            await self._acall(Request("GET", f"/v1/workflows/{quote(instance_id, safe='')}")), instance_id
        )

    def step(
        self,
        instance_id: str,
        step: str,
        *,
        payload: object = None,
        fingerprint_fields: Sequence[str] | None = None,
        lease_ms: int = 30_000,
        wait_ms: int = 0,
        heartbeat: bool = True,
        renew_every_ms: int | None = None,
        retryable: ExceptionMatch = (),
        final: ExceptionMatch = (),
    ) -> ClaimContext:
        """A claim on a step your code performs (``POST /v1/workflows/{instance}/steps/{step}``),
        used like :meth:`claim`: ``acquired`` → perform it and report it (the instance advances);
        ``replayed`` → it finished before. Also raises :class:`PreviousStepUnfinishedError`,
        :class:`InstanceNotRunningError`, :class:`UnknownStepError`; an UNKNOWN step raises
        :class:`OutcomeUnknownError` (the instance pauses for a person)."""
        _check_lease(lease_ms, wait_ms)
        body: dict[str, JSON] = {"payload": to_json(payload, "payload"), "lease_ms": lease_ms}
        if fingerprint_fields is not None:
            body["fingerprint_fields"] = list(fingerprint_fields)
        return ClaimContext(
            self,
            Target.step(instance_id, step, body),
            lease_ms=lease_ms,
            wait_ms=wait_ms,
            heartbeat=heartbeat,
            renew_every_ms=renew_every_ms,
            retryable=retryable,
            final=final,
        )
