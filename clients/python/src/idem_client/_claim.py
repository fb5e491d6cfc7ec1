"""A claim on an operation (or a workflow step): acquire, hold the lease, complete honestly.

``with client.claim(...) as claim`` / ``async with client.claim(...) as claim`` (README "What
a trigger gets"):

- ``201`` → ``claim.acquired``: you hold the lease; a heartbeat renews it every third of
  ``lease_ms`` until you complete; perform the effect, then report it.
- ``200`` → ``claim.replayed``: final already (a replay, or idem's connector performed it):
  do not perform it; ``claim.operation`` has the stored result or error.
- ``202`` → :class:`OutcomeUnknownError` (or :class:`OperationPendingError` for a connector's
  attempt) on entering: the block does not run.
- ``409`` → :class:`InProgressError` with ``retry_after``, after waiting up to ``wait_ms``;
  ``422``, ``410`` and the other problems → their exception.

Leaving the block without reporting an outcome: an exception declared in ``retryable`` (or
``final``) completes a retryable (final) failure, any other exception completes UNKNOWN (the
effect may have started), and no exception at all completes UNKNOWN and raises
:class:`ClaimNotCompletedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import unicodedata
import uuid
from collections.abc import Callable, Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from ._errors import (
    AnswerMismatchError,
    ClaimNotCompletedError,
    ConnectorOwnedError,
    IdemError,
    InProgressError,
    InvalidInputError,
    InvalidRequestError,
    LateArrivalError,
    LeaseLostError,
    NotExecutingError,
    NotFoundError,
    NotHeldError,
    OperationPendingError,
    OutcomeNotRecordedError,
    OutcomeUnknownError,
    ProblemError,
    RetryNotDueError,
    StaleFencingTokenError,
    TransportError,
    check_answer,
)
from ._heartbeat import Beat
from ._http import Answer, Request, asend, send
from ._json import to_json
from ._records import JSON, Operation

if TYPE_CHECKING:
    from ._client import Client

#: Longest ``wait_ms`` idem waits within one request (README "Request fields").
SERVER_MAX_WAIT_MS = 30_000
#: Longest completion ``message`` idem keeps, in bytes (idem_core::completion).
MAX_MESSAGE_BYTES = 4096
#: Longest ``error_class``, in characters of ``[A-Za-z0-9_.-]`` (idem_core::completion).
MAX_ERROR_CLASS_LEN = 64

#: Which exceptions prove something (``retryable`` / ``final``): an exception class, a tuple of
#: them (matched with ``isinstance``, as ``except`` does), or a predicate on the exception.
ExceptionMatch = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]


def _is_exception_class(x: object) -> bool:
    return isinstance(x, type) and issubclass(x, BaseException)


def exception_matcher(spec: ExceptionMatch, what: str) -> Callable[[BaseException], bool]:
    """``spec`` as a test of one exception: the raised exception itself, never its
    ``__cause__`` or ``__context__`` (an earlier attempt that was refused says nothing about
    the last one, which may have been sent). A predicate that raises matches nothing.

    Raises:
        InvalidInputError: ``spec`` is none of an exception class, a tuple of them, a predicate.
    """
    if _is_exception_class(spec) or (isinstance(spec, tuple) and all(map(_is_exception_class, spec))):
        classes = spec

        def matches(e: BaseException) -> bool:
            return isinstance(e, classes)  # type: ignore[arg-type]

        return matches
    if callable(spec) and not isinstance(spec, (type, tuple)):
        predicate = spec

        def holds(e: BaseException) -> bool:
            try:
                return bool(predicate(e))
            except Exception:
                return False

        return holds
    raise InvalidInputError(
        f"{what} must be an exception class, a tuple of exception classes or a predicate "
        f"(a function of the exception), not {spec!r}"
    )


_current: ContextVar[Lease | None] = ContextVar("idem_client_lease", default=None)


def current_lease() -> Lease:
    """The lease of the claim (or ``@idempotent`` function) running in this context.

    Raises:
        RuntimeError: outside a claim block or a guarded function.
    """
    lease = _current.get()
    if lease is None:
        raise RuntimeError("no idem lease here: call this inside a claim block or an @idempotent function")
    return lease


class Lease:
    """The lease a claim holds while its effect runs.

    ``fencing_token`` is the token to complete with. ``lost`` turns true when idem refused a
    renewal (``lease-expired``, ``stale-fencing-token``: another attempt may act now) or when the
    lease's end passed without a successful renewal (by this process's monotonic clock,
    counted from before the request that granted or renewed it). Long work should check it
    between steps and stop (or, in ``async`` code, race it against :meth:`wait_lost`); its
    completion is then accepted only while no other lease was granted (book: Concepts, Leases, "Completing").
    The heartbeat renews it from the client's own thread, for ``async`` claims too.
    """

    def __init__(self, key: str, fencing_token: int, lease_ms: int, granted_at: float) -> None:
        self.key = key
        self.fencing_token = fencing_token
        self.lease_ms = lease_ms
        self._ends_at = granted_at + lease_ms / 1000
        self._lost = threading.Event()
        self._waiters_lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.lost_reason: BaseException | None = None

    @property
    def lost(self) -> bool:
        """Whether the lease is gone (see the class docs)."""
        return self._lost.is_set() or time.monotonic() >= self._ends_at

    @property
    def lost_event(self) -> threading.Event:
        """Set when idem refused a renewal or the heartbeat saw the lease end (for waiting on it
        in a thread; ``async`` code awaits :meth:`wait_lost`)."""
        return self._lost

    async def wait_lost(self) -> None:
        """Returns once the lease is lost (see :attr:`lost`): idem refused a renewal (the
        heartbeat thread wakes this coroutine with ``loop.call_soon_threadsafe``) or the lease's
        end passed without a renewal. Race it against the work, e.g. with ``asyncio.wait``."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        with self._waiters_lock:
            self._waiters.append((loop, woken))
        try:
            while not self.lost:
                with contextlib.suppress(asyncio.TimeoutError):  # the lease's end, by this clock
                    await asyncio.wait_for(woken.wait(), max(0.001, self._ends_at - time.monotonic()))
        finally:
            with self._waiters_lock:
                self._waiters.remove((loop, woken))

    @property
    def remaining_s(self) -> float:
        """Seconds until the lease ends by this process's clock (0 when lost)."""
        return 0.0 if self._lost.is_set() else max(0.0, self._ends_at - time.monotonic())

    def raise_if_lost(self) -> None:
        """Raises :class:`LeaseLostError` (idem's refusal when there was one) if the lease is lost."""
        if not self.lost:
            return
        if isinstance(self.lost_reason, LeaseLostError):
            raise self.lost_reason
        raise LeaseLostError(
            f"the lease of {self.key!r} (fencing token {self.fencing_token}) ended without a renewal"
        )

    def _renewed(self, sent_at: float) -> None:
        self._ends_at = sent_at + self.lease_ms / 1000

    def _lose(self, reason: BaseException | None) -> None:
        if self._lost.is_set():
            return
        self.lost_reason = reason
        self._lost.set()
        with self._waiters_lock:
            waiters = list(self._waiters)
        for loop, woken in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits there any more
                loop.call_soon_threadsafe(woken.set)


@dataclass(frozen=True)
class Target:
    """What a claim acquires: an operation (``POST /v1/operations``) or a step of a workflow
    instance your code runs (``POST /v1/workflows/{instance}/steps/{step}``)."""

    describe: str
    acquire_path: str
    acquire_body: Mapping[str, JSON]
    complete_path: str
    server_waits: bool
    #: The operation key an answer must be about (a step's: ``{instance}:{step}``, or a
    #: re-run's ``{instance}:{step}:rerun-N``, idem_core::flow::step_key).
    key: str

    @staticmethod
    def operation(key: str, body: Mapping[str, JSON]) -> Target:
        return Target(
            f"operation {key!r}", "/v1/operations", body, f"/v1/operations/{_quote(key)}/complete", True, key
        )

    @staticmethod
    def step(instance_id: str, step: str, body: Mapping[str, JSON]) -> Target:
        base = "/v1/workflows/" + _quote(instance_id) + "/steps/" + _quote(step)
        return Target(
            f"step {step!r} of {instance_id!r}",
            base,
            body,
            base + "/complete",
            False,
            f"{instance_id}:{step}",
        )

    def answer_key(self, got: str) -> str:
        """The key an answer about this target carries (``got`` when it is one), else ours."""
        rerun = got.startswith(self.key + ":rerun-") and got.removeprefix(self.key + ":rerun-").isdigit()
        return got if not self.server_waits and rerun else self.key


def _quote(s: str) -> str:
    return quote(s, safe="")


def error_class_of(exc: BaseException) -> str:
    """An exception's class name as an ``error_class``: 1-64 characters of ``[A-Za-z0-9_.-]``."""
    name = "".join(c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in type(exc).__name__)
    return name[:MAX_ERROR_CLASS_LEN] or "error"


def message_of(exc: BaseException | str) -> str:
    """A completion message (``Class: text``), without NUL, at most 4096 bytes of UTF-8."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    data = text.replace("\0", "").encode("utf-8", "replace")
    if len(data) > MAX_MESSAGE_BYTES:
        data = data[: MAX_MESSAGE_BYTES - 3].decode("utf-8", "ignore").encode("utf-8") + "…".encode()
    return data.decode("utf-8", "replace")


class _ClaimBase:
    """What sync and async claims share: the answers' meaning and the completions' bodies."""

    def __init__(
        self,
        client: Client,
        target: Target,
        *,
        lease_ms: int,
        wait_ms: int,
        heartbeat: bool,
        renew_every_ms: int | None,
        retryable: ExceptionMatch,
        final: ExceptionMatch,
    ) -> None:
        self._client = client
        self._target = target
        self._lease_ms = lease_ms
        self._wait_ms = wait_ms
        self._heartbeat = heartbeat
        self._renew_every_ms = renew_every_ms if renew_every_ms is not None else max(50, lease_ms // 3)
        self._retryable = exception_matcher(retryable, "retryable")
        self._final = exception_matcher(final, "final")
        self._holder = ""
        self._beat: Beat | None = None
        self._completion: dict[str, JSON] | None = None
        self._operation: Operation | None = None
        self._lease: Lease | None = None
        self._status = 0
        self._performed_by_connector = False
        self._completion_tried = False
        self._ctx_token: Token[Lease | None] | None = None

    # --- what the claim shows -------------------------------------------------------

    @property
    def acquired(self) -> bool:
        """``201``: this claim holds the lease; perform the effect, then report it."""
        return self._status == 201

    @property
    def replayed(self) -> bool:
        """``200``: the operation is final (SUCCEEDED or FAILED): do not perform it."""
        return self._status == 200

    @property
    def performed_by_connector(self) -> bool:
        """``200`` + ``Idem-Performed-By: connector``: idem's connector performed it in this call."""
        return self._performed_by_connector

    @property
    def operation(self) -> Operation:
        """The operation record as idem last answered it."""
        if self._operation is None:
            raise NotHeldError("the claim has not been entered")
        return self._operation

    @property
    def key(self) -> str:
        """The operation's idempotency key (for a step, the step's operation key)."""
        return self.operation.key

    @property
    def state(self) -> str:
        """The operation's state as idem last answered it."""
        return self.operation.state

    @property
    def result(self) -> JSON:
        """The stored result (a replay), or the one this claim completed with."""
        return self.operation.result

    @property
    def fencing_token(self) -> int:
        """The lease's fencing token (the latest one, for a replay)."""
        return self.operation.fencing_token

    @property
    def lease(self) -> Lease:
        """The lease this claim holds (only when :attr:`acquired`)."""
        if self._lease is None:
            raise NotHeldError(f"{self._target.describe} holds no lease here (status {self._status})")
        return self._lease

    # --- requests and answers ---------------------------------------------------------

    def _acquire_request(self, server_wait_ms: int) -> Request:
        body = dict(self._target.acquire_body)
        self._holder = str(uuid.uuid4())  # one attempt's own identity (idem_core::holder)
        body["holder"] = self._holder
        if server_wait_ms > 0:
            body["wait_ms"] = server_wait_ms
        return Request(
            "POST", self._target.acquire_path, body, True, self._client.timeout_s + server_wait_ms / 1000
        )

    def _server_wait_ms(self, deadline: float) -> int:
        if not self._target.server_waits:
            return 0
        return max(0, min(SERVER_MAX_WAIT_MS, int((deadline - time.monotonic()) * 1000)))

    def _on_acquire(self, a: Answer, sent_at: float, deadline: float) -> float | None:
        """Interprets an acquire's answer; ``None`` when decided, else seconds to wait and ask again."""
        if a.status in (200, 201, 202):
            op = Operation.from_json(a.body if isinstance(a.body, dict) else {})
            # A grant or a replay of another key must not run (or answer) this one.
            check_answer(self._target.describe, "the key", self._target.answer_key(op.key), op.key)
            if a.status == 201:
                check_answer(self._target.describe, "the lease holder", self._holder, op.lease_holder)
            self._operation = op
            if a.status == 202:
                raise OutcomeUnknownError(op) if op.state == "UNKNOWN" else OperationPendingError(op)
            self._status = a.status
            if a.status == 201:
                self._lease = Lease(op.key, op.fencing_token, self._lease_ms, sent_at)
            else:
                self._performed_by_connector = a.headers.get("idem-performed-by") == "connector"
            return None
        err = a.error()
        left = deadline - time.monotonic()
        if isinstance(err, InProgressError) and not isinstance(err, RetryNotDueError) and left > 0.01:
            # idem waited server-side already when it could; steps are polled.
            return 0.0 if self._target.server_waits else min(left, 0.1)
        raise err

    def _complete_request(self, body: dict[str, JSON]) -> Request:
        if self._lease is None or not self.acquired:
            raise NotHeldError(f"{self._target.describe}: this claim holds no lease (a replay is final)")
        if self._completion_tried:
            raise NotHeldError(f"{self._target.describe}: this claim was completed already")
        self._completion_tried = True
        self._completion = dict(body)
        path = self._target.complete_path
        body["fencing_token"] = self._lease.fencing_token
        return Request("POST", path, body, True, self._client.timeout_s)

    def _complete_until(self) -> float:
        """Until when a completion is resent (monotonic): the lease's end. The effect happened
        and resending the same completion is safe, so an idem restart during the effect does
        not lose its outcome; after the lease's end the caller gets the token to report later."""
        return self.lease._ends_at

    def _on_complete(self, a: Answer) -> Operation:
        if a.status == 200 and isinstance(a.body, dict):
            op = Operation.from_json(a.body)
            try:
                check_answer(self._target.describe, "the key", self.key, op.key)
                check_answer(
                    self._target.describe, "the fencing token", self.lease.fencing_token, op.fencing_token
                )
            except AnswerMismatchError as e:
                raise self._not_recorded(e) from e
            self._operation = op
            return op
        err = a.error()
        if not 400 <= a.status < 500:
            # A 5xx (other than those retried until the lease's end), a redirect, or a 200
            # without a record: no answer about this completion, and the function ran. The
            # caller gets what it needs to report the outcome later, never a bare error that
            # reads as "nothing happened".
            raise self._not_recorded(err)
        if isinstance(err, StaleFencingTokenError):
            err.args = (
                f"{self._target.describe}: the completion was refused because the lease was lost and another "
                f"attempt was granted since (token {err.current_fencing_token}); nothing was recorded from "
                f"this attempt. {err}",
            )
        if self._lease is not None and isinstance(err, LeaseLostError):
            self._lease._lose(err)
        raise err

    def _not_recorded(self, e: Exception) -> OutcomeNotRecordedError:
        token = self._lease.fencing_token if self._lease else None
        err = OutcomeNotRecordedError(
            f"{self._target.describe}: the outcome could not be reported to idem until the lease's end "
            f"({e}); the operation stays EXECUTING until its lease runs out, then it is UNKNOWN: never "
            "performed twice. Report it later with client.complete(e.key, e.fencing_token, e.completion) "
            f"(fencing token {token})",
            key=self._operation.key if self._operation else self._target.key,
            recorded_state=None,
            fencing_token=token,
            completion=self._completion,
        )
        err.__cause__ = e
        return err

    def _renew_request(self) -> Request:
        path = f"/v1/operations/{_quote(self.operation.key)}/renew"
        return Request(
            "POST",
            path,
            {"fencing_token": self.lease.fencing_token, "lease_ms": self._lease_ms},
            True,
            self._client.timeout_s,
        )

    def _on_renew(self, a: Answer | BaseException, sent_at: float) -> bool:
        """Applies a renewal's answer to the lease; False when the heartbeat should stop."""
        lease = self.lease
        if isinstance(a, Answer) and a.status == 200:
            op = Operation.from_json(a.body if isinstance(a.body, dict) else {})
            try:
                check_answer(self._target.describe, "the key", self.key, op.key)
                check_answer(
                    self._target.describe, "the fencing token", lease.fencing_token, op.fencing_token
                )
            except TransportError:
                return True  # another request's answer says nothing about this lease: renew again
            lease._renewed(sent_at)
            return True
        err = a.error() if isinstance(a, Answer) else a
        final = (LeaseLostError, NotExecutingError, NotFoundError, LateArrivalError, ConnectorOwnedError)
        if isinstance(err, final) or lease.lost:
            lease._lose(err)
            return False
        return True  # a passing failure (unreachable, 503): try again at the next beat

    def _exit_body(self, exc: BaseException | None) -> dict[str, JSON]:
        if exc is None:
            return {"outcome": "unknown", "message": "the claim block ended without reporting an outcome"}
        if self._retryable(exc):
            body: dict[str, JSON] = {
                "outcome": "retryable_failure",
                "error_class": error_class_of(exc),
                "message": message_of(exc),
            }
            floor = getattr(exc, "retry_after_ms", None)  # a provider's Retry-After, in ms: a floor
            if isinstance(floor, int) and not isinstance(floor, bool) and 0 <= floor <= 86_400_000:
                body["retry_after_ms"] = floor
            return body
        if self._final(exc):
            return {
                "outcome": "final_failure",
                "error_class": error_class_of(exc),
                "message": message_of(exc),
            }
        return {"outcome": "unknown", "message": message_of(exc)}

    def _not_completed(self, rec: Operation) -> ClaimNotCompletedError:
        return ClaimNotCompletedError(
            f"{self._target.describe}: the claim block ended without claim.succeeded(), "
            "retryable_failure(), final_failure() or unknown(); it was completed UNKNOWN",
            key=rec.key,
            recorded_state=rec.state,
        )

    def _needs_exit_completion(self) -> bool:
        return self.acquired and not self._completion_tried

    # --- the heartbeat: the client's thread, for sync and async claims alike --------------

    def _start_heartbeat(self) -> None:
        if self.acquired and self._heartbeat:
            self._beat = self._client._heartbeats.start(Beat(self._renew_once, self._renew_every_ms / 1000))

    def _renew_once(self) -> bool:
        """One renewal (on the client's heartbeat pool, over the sync connections, whatever
        event loop the claim's code runs on); False: stop renewing."""
        sent_at = time.monotonic()
        try:
            a: Answer | BaseException = send(
                self._client._sync_http(),
                self._renew_request(),
                self._client.retry,
                self._client.connect_timeout_s,
            )
        except (TransportError, ProblemError, InvalidInputError) as e:
            a = e
        if self._beat is None or self._beat.cancelled:
            return False  # completed meanwhile: this answer says nothing about the lease
        return self._on_renew(a, sent_at)

    def _stop_heartbeat(self) -> None:
        if self._beat is not None:
            self._beat.cancel()

    def _enter_context(self) -> None:
        if self._lease is not None:
            self._ctx_token = _current.set(self._lease)

    def _leave_context(self) -> None:
        if self._ctx_token is not None:
            _current.reset(self._ctx_token)
            self._ctx_token = None


#: Longest ``provider_ref``, in bytes of UTF-8 (idem_core::completion).
MAX_PROVIDER_REF_BYTES = 512


def evidence(provider_ref: object) -> object:
    """The evidence as idem keeps it: a string; an integer (not a bool) becomes its decimal
    string (a provider's numeric id, ``12345`` → ``"12345"``); anything else is left for
    :func:`succeeded_body` to refuse."""
    if isinstance(provider_ref, int) and not isinstance(provider_ref, bool):
        return str(provider_ref)
    return provider_ref


def succeeded_body(provider_ref: str | int, result: object) -> dict[str, JSON]:
    """The body of a success; the evidence's rules (idem_core::completion) checked here."""
    ref = evidence(provider_ref)
    if not isinstance(ref, str) or not ref.strip():
        raise InvalidInputError(
            f"provider_ref must be the provider's evidence, a non-empty string (or an integer); got {ref!r}"
        )
    if len(ref.encode("utf-8", "replace")) > MAX_PROVIDER_REF_BYTES:
        raise InvalidInputError(f"provider_ref is longer than {MAX_PROVIDER_REF_BYTES} bytes")
    if any(unicodedata.category(ch) == "Cc" for ch in ref):
        raise InvalidInputError("provider_ref must not contain control characters")
    body: dict[str, JSON] = {"outcome": "succeeded", "provider_ref": ref}
    if result is not None:
        body["result"] = to_json(result, "result")
    return body


def _failure_body(outcome: str, error_class: str, message: str | None, **extra: JSON) -> dict[str, JSON]:
    body: dict[str, JSON] = {"outcome": outcome, "error_class": error_class}
    if message is not None:
        body["message"] = message_of(message)
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


class Claim(_ClaimBase):
    """A claim used with ``with`` (see the module docs). The completion methods return the
    record idem answers with and raise its problem (:class:`StaleFencingTokenError` when the
    lease was lost to another attempt)."""

    def _enter(self) -> Claim:
        deadline = time.monotonic() + self._wait_ms / 1000
        http = self._client._sync_http()
        while True:
            req = self._acquire_request(self._server_wait_ms(deadline))
            sent_at = time.monotonic()
            wait = self._on_acquire(
                send(http, req, self._client.retry, self._client.connect_timeout_s), sent_at, deadline
            )
            if wait is None:
                break
            time.sleep(wait)
        self._start_heartbeat()
        self._enter_context()
        return self

    def _complete(self, body: dict[str, JSON]) -> Operation:
        req = self._complete_request(body)
        self._stop_heartbeat()
        try:
            a = send(
                self._client._sync_http(),
                req,
                self._client.retry,
                self._client.connect_timeout_s,
                until=self._complete_until(),
            )
        except (TransportError, ProblemError) as e:  # a 503 (or no answer) until the lease's end
            raise self._not_recorded(e) from e
        return self._on_complete(a)

    def succeeded(self, provider_ref: str | int, result: object = None) -> Operation:
        """Completes SUCCEEDED with the provider's evidence (``provider_ref``: a string of at most
        512 bytes, or an integer, kept as its decimal string) and an optional JSON ``result``
        replayed to every later trigger — as JSON: a tuple comes back as a list.

        The completion is resent (same token, same outcome: idempotent) until the lease's end
        when idem does not answer; then :class:`OutcomeNotRecordedError` carries the token and
        the completion to report later."""
        return self._complete(succeeded_body(provider_ref, result))

    def retryable_failure(
        self, error_class: str, message: str | None = None, retry_after_ms: int | None = None
    ) -> Operation:
        """Completes a failure that did nothing and may be tried again: PENDING, next attempt after
        full-jitter backoff (``retry_after_ms`` is a floor), FAILED after 8 attempts."""
        return self._complete(
            _failure_body("retryable_failure", error_class, message, retry_after_ms=retry_after_ms)
        )

    def final_failure(self, error_class: str, message: str | None = None, result: object = None) -> Operation:
        """Completes FAILED for good (replayed from now on), with an optional JSON ``result``."""
        extra = {"result": to_json(result, "result")} if result is not None else {}
        return self._complete(_failure_body("final_failure", error_class, message, **extra))

    def unknown(self, message: str | None = None) -> Operation:
        """Completes UNKNOWN: the effect may or may not have happened (a timeout after sending)."""
        body: dict[str, JSON] = {"outcome": "unknown"}
        if message is not None:
            body["message"] = message_of(message)
        return self._complete(body)

    def _succeeded_or_unknown(self, body: dict[str, JSON]) -> InvalidRequestError | None:
        """Completes SUCCEEDED with ``body`` (of :func:`succeeded_body`); if idem refuses that
        completion as malformed (400: nothing was recorded), completes UNKNOWN instead (the
        effect happened) and returns the refusal."""
        try:
            self._complete(body)
            return None
        except InvalidRequestError as e:
            self._completion_tried = False
            self.unknown(message_of(e))
            return e

    def _exit(self, exc: BaseException | None) -> None:
        try:
            if not self._needs_exit_completion():
                return
            body = self._exit_body(exc)
            rec = self._complete(body)
            if exc is None:
                raise self._not_completed(rec)
        finally:
            self._stop_heartbeat()
            self._leave_context()


class AsyncClaim(_ClaimBase):
    """A claim used with ``async with``; as :class:`Claim`, with awaitable completions. Its
    lease is renewed from the client's heartbeat thread, so code that blocks the event loop
    does not stop the renewals."""

    async def _enter(self) -> AsyncClaim:
        deadline = time.monotonic() + self._wait_ms / 1000
        http = self._client._async_http()
        while True:
            req = self._acquire_request(self._server_wait_ms(deadline))
            sent_at = time.monotonic()
            a = await asend(http, req, self._client.retry, self._client.connect_timeout_s)
            wait = self._on_acquire(a, sent_at, deadline)
            if wait is None:
                break
            await asyncio.sleep(wait)
        self._start_heartbeat()
        self._enter_context()
        return self

    async def _complete(self, body: dict[str, JSON]) -> Operation:
        req = self._complete_request(body)
        self._stop_heartbeat()
        try:
            a = await asend(
                self._client._async_http(),
                req,
                self._client.retry,
                self._client.connect_timeout_s,
                until=self._complete_until(),
            )
        except (TransportError, ProblemError) as e:  # a 503 (or no answer) until the lease's end
            raise self._not_recorded(e) from e
        return self._on_complete(a)

    async def succeeded(self, provider_ref: str | int, result: object = None) -> Operation:
        """As :meth:`Claim.succeeded`."""
        return await self._complete(succeeded_body(provider_ref, result))

    async def retryable_failure(
        self, error_class: str, message: str | None = None, retry_after_ms: int | None = None
    ) -> Operation:
        """As :meth:`Claim.retryable_failure`."""
        return await self._complete(
            _failure_body("retryable_failure", error_class, message, retry_after_ms=retry_after_ms)
        )

    async def final_failure(
        self, error_class: str, message: str | None = None, result: object = None
    ) -> Operation:
        """As :meth:`Claim.final_failure`."""
        extra = {"result": to_json(result, "result")} if result is not None else {}
        return await self._complete(_failure_body("final_failure", error_class, message, **extra))

    async def unknown(self, message: str | None = None) -> Operation:
        """As :meth:`Claim.unknown`."""
        body: dict[str, JSON] = {"outcome": "unknown"}
        if message is not None:
            body["message"] = message_of(message)
        return await self._complete(body)

    async def _succeeded_or_unknown(self, body: dict[str, JSON]) -> InvalidRequestError | None:
        """As :meth:`Claim._succeeded_or_unknown`."""
        try:
            await self._complete(body)
            return None
        except InvalidRequestError as e:
            self._completion_tried = False
            await self.unknown(message_of(e))
            return e

    async def _exit(self, exc: BaseException | None) -> None:
        try:
            if not self._needs_exit_completion():
                return
            rec = await self._complete(self._exit_body(exc))
            if exc is None:
                raise self._not_completed(rec)
        finally:
            self._stop_heartbeat()
            self._leave_context()


class ClaimContext:
    """What ``client.claim(...)`` and ``client.step(...)`` return: use it with ``with`` (a
    :class:`Claim`) or ``async with`` (an :class:`AsyncClaim`). Nothing is sent before."""

    def __init__(self, client: Client, target: Target, **options: Any) -> None:
        exception_matcher(options["retryable"], "retryable")  # refused here, before anything is sent
        exception_matcher(options["final"], "final")
        self._client = client
        self._target = target
        self._options = options
        self._sync: Claim | None = None
        self._async: AsyncClaim | None = None

    def __enter__(self) -> Claim:
        self._sync = Claim(self._client, self._target, **self._options)
        return self._sync._enter()

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._sync is not None
        self._sync._exit(exc)

    async def __aenter__(self) -> AsyncClaim:
        self._async = AsyncClaim(self._client, self._target, **self._options)
        return await self._async._enter()

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._async is not None
        await self._async._exit(exc)


__all__ = ["AsyncClaim", "Claim", "ClaimContext", "IdemError", "Lease", "Target", "current_lease"]
