"""The exceptions of idem_client: one class per problem type idem answers with (RFC 9457
``application/problem+json``, branched on ``type`` as the README says), and the client's own.

Every exception derives from :class:`IdemError`. Answers of the server derive from
:class:`ProblemError` and carry the problem document and the request id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._records import JSON, Operation


class IdemError(Exception):
    """Base class of every exception idem_client raises."""


# --- answers of idem that are not problems --------------------------------------------


class OutcomeUnknownError(IdemError):
    """The operation's outcome is UNKNOWN (a ``202``): a worker's lease ended while it may have
    acted, or its attempt ended without a known result. The function is **not** run again
    until the reconciler's lookup or an operator settles the operation
    (``idem ops resolve KEY ...``); ``operation`` is the record (``needs_review``,
    ``error_message`` say why). Book: Concepts, States, "What a trigger gets".
    """

    def __init__(self, operation: Operation, message: str | None = None) -> None:
        self.operation = operation
        super().__init__(
            message
            or f"the outcome of {operation.key!r} is UNKNOWN: it may have taken effect, so it is not "
            "performed again until it is reconciled or an operator resolves it"
            + (f" ({operation.error_message})" if operation.error_message else "")
        )


class OperationPendingError(IdemError):
    """A ``202`` for an operation idem's connector performs: its attempt runs or a retry is
    scheduled. Not yours to perform; ``operation`` is the record (poll it with
    ``get_operation``)."""

    def __init__(self, operation: Operation) -> None:
        self.operation = operation
        super().__init__(
            f"{operation.key!r} is {operation.state} at idem (a connector performs it): do not perform it"
        )


class OperationFailedError(IdemError):
    """The operation is FAILED (a final failure, or its retries ran out): a replay of the stored
    error. ``operation`` is the record; ``error_class``, ``error_message`` and ``result`` (the
    stored result of a final failure) come from it."""

    def __init__(self, operation: Operation) -> None:
        self.operation = operation
        self.error_class = operation.error_class
        self.error_message = operation.error_message
        self.result: JSON = operation.result
        super().__init__(
            f"{operation.key!r} FAILED before ({operation.error_class}: {operation.error_message}); "
            "a failed operation is replayed, never performed again under its key"
        )


# --- the client's own -----------------------------------------------------------------


class InvalidInputError(IdemError, ValueError):
    """Bad input found before anything was sent (a key that could not be made from the
    arguments, a payload that is not JSON idem stores, an option out of range). Nothing was
    sent, nothing recorded."""


class TransportError(IdemError):
    """idem could not be asked: see :class:`ServerUnreachableError` and
    :class:`NoAnswerError`."""

    def __init__(self, message: str, *, attempts: int) -> None:
        self.attempts = attempts
        super().__init__(message)


class ServerUnreachableError(TransportError):
    """No connection to idem could be made (refused, no route, connect timeout) after the
    retries: nothing was sent, so nothing was recorded; calling again is safe."""


class NoAnswerError(TransportError):
    """A request reached idem (or may have) but its answer was lost every time it was resent
    (read timeout, reset). What it did is unknown: an acquire that was granted ends UNKNOWN
    when its lease runs out, and is not performed twice."""


class AnswerMismatchError(NoAnswerError):
    """An answer of idem is about another key, lease holder or fencing token than the request
    it came back for: the request's own answer went elsewhere (a connection shared by two
    processes, or a proxy that mixes answers up), so this request counts as one whose answer
    was lost (:class:`NoAnswerError`). Nothing is done with the stray answer: the function
    does not run on another key's grant, and a completion is not taken as recorded. ``expected``
    and ``got`` name what differed."""

    def __init__(self, message: str, *, expected: str, got: str) -> None:
        self.expected = expected
        self.got = got
        super().__init__(message, attempts=1)


class OutcomeNotRecordedError(IdemError):
    """The function ran (the effect may have happened) but idem did not record the outcome
    the library wanted to report. ``recorded_state`` is what idem holds now when known
    (``UNKNOWN`` after the library reported it so; ``None`` when idem could not be told:
    then the lease runs out into UNKNOWN). ``result`` is what the function returned, if it
    returned; ``__cause__`` the reason.

    ``fencing_token`` and ``completion`` (the completion's JSON body without the token:
    ``outcome`` and its fields) are set when idem could not be told: keep them and report the
    outcome later with ``client.complete(e.key, e.fencing_token, e.completion)``. idem accepts a
    late completion with the token while no newer lease was granted (README "Leases"; a
    ``redo_safe`` action may have been granted again, then it raises
    :class:`StaleFencingTokenError`); its evidence settles the UNKNOWN the lease ran out into."""

    def __init__(
        self,
        message: str,
        *,
        key: str,
        recorded_state: str | None,
        result: object = None,
        fencing_token: int | None = None,
        completion: dict[str, JSON] | None = None,
    ) -> None:
        self.key = key
        self.recorded_state = recorded_state
        self.result = result
        self.fencing_token = fencing_token
        self.completion = completion
        super().__init__(message)


class ResultNotStorableError(OutcomeNotRecordedError):
    """The function returned, but its value (or the evidence read from it) cannot be stored:
    not JSON as idem keeps it (RFC 8259 / I-JSON RFC 7493: finite numbers within ±2^53, string
    member names, at most 64 levels), or no ``provider_ref``. The effect probably happened, so
    the operation was completed UNKNOWN (never SUCCEEDED without a stored result, never
    FAILED): an operator settles it."""


class ClaimNotCompletedError(OutcomeNotRecordedError):
    """A claim's ``with`` block ended without reporting an outcome (``succeeded``,
    ``retryable_failure``, ``final_failure`` or ``unknown``) and without an exception: the
    library cannot tell whether the effect happened, so it completed the operation UNKNOWN."""


class NotHeldError(IdemError, RuntimeError):
    """A completion or renewal on a claim that holds no lease: a replay (the operation was
    final already) or a claim completed before."""


# --- problems (RFC 9457) -------------------------------------------------------------


class ProblemError(IdemError):
    """An error answer of idem: an RFC 9457 problem document.

    ``problem`` is the document (``type``, ``title``, ``status``, ``detail``, ``request_id`` and
    the type's extra members such as ``retry_after_ms``, ``current_fencing_token``, ``state``);
    ``slug`` the last segment of ``type`` (``/problems/<slug>``; ``GET /problems/<slug>`` on the
    server describes it); ``request_id`` the request's id (also in the server's logs);
    ``retry_after`` the wait it asks for, in seconds (``Retry-After`` header, RFC 9110 §10.2.3),
    when it asks for one.
    """

    #: The problem type's slug this class stands for ("" for a base class).
    slug_of_class = ""

    def __init__(
        self,
        problem: Mapping[str, Any],
        *,
        status: int,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.problem = dict(problem)
        self.status = status
        self.type = str(problem.get("type", ""))
        self.slug = self.type.rsplit("/", 1)[-1]
        self.title = str(problem.get("title", ""))
        self.detail = str(problem.get("detail", ""))
        rid = problem.get("request_id")
        self.request_id = rid if isinstance(rid, str) else request_id
        ms = problem.get("retry_after_ms")
        if retry_after is None and isinstance(ms, int) and not isinstance(ms, bool):
            retry_after = ms / 1000
        self.retry_after = retry_after
        state = problem.get("state")
        self.state = state if isinstance(state, str) else None
        super().__init__(
            f"{status} {self.slug or 'error'}: {self.detail or self.title}"
            + (f" (request {self.request_id})" if self.request_id else "")
        )


class InvalidRequestError(ProblemError):
    """``400 invalid-request``: malformed input; nothing was recorded."""

    slug_of_class = "invalid-request"


class MissingIdempotencyKeyError(InvalidRequestError):
    """``400 missing-idempotency-key`` (IETF httpapi Idempotency-Key draft §2.7)."""

    slug_of_class = "missing-idempotency-key"


class InvalidKeyError(InvalidRequestError):
    """``400 invalid-idempotency-key``: 1-255 printable ASCII characters, no surrounding
    spaces, not ``.``/``..``, no personal data (an e-mail address or a phone number):
    keys are logged and kept after the payload (idem_core::key). Derive keys from business
    ids. Raised before the function runs."""

    slug_of_class = "invalid-idempotency-key"


class InvalidHolderError(InvalidRequestError):
    """``400 invalid-holder``: the lease holder is not one attempt's fresh UUID (DESIGN.md §3
    "Holders"). The library makes one per attempt, so this means a holder passed by hand."""

    slug_of_class = "invalid-holder"


class PayloadTooLargeError(InvalidRequestError):
    """``413 payload-too-large``: the body exceeds the server's ``--max-body-bytes``."""

    slug_of_class = "payload-too-large"


class UnknownWorkflowError(InvalidRequestError):
    """``400 unknown-workflow``: not declared on the server and no ``steps`` given."""

    slug_of_class = "unknown-workflow"


class InvalidDefinitionError(InvalidRequestError):
    """``400 invalid-definition``: the steps cannot run (the detail names the field)."""

    slug_of_class = "invalid-definition"


class UnauthorizedError(ProblemError):
    """``401 unauthorized``: the API key is missing, malformed, unknown or revoked."""

    slug_of_class = "unauthorized"


class ForbiddenError(ProblemError):
    """``403 forbidden``: the API key's role does not allow this call."""

    slug_of_class = "forbidden"


class ConnectorNotAllowedError(ForbiddenError):
    """``403 connector-not-allowed``: the connector does not serve the caller's tenant."""

    slug_of_class = "connector-not-allowed"


class WorkflowNotAllowedError(ForbiddenError):
    """``403 workflow-not-allowed``: the declared workflow does not serve the caller's tenant."""

    slug_of_class = "workflow-not-allowed"


class NotFoundError(ProblemError):
    """``404 not-found``: no such operation or instance in the caller's tenant."""

    slug_of_class = "not-found"


class UnknownStepError(NotFoundError):
    """``unknown-step``: the instance's definition has no step of that name."""

    slug_of_class = "unknown-step"


class RequestTimeoutError(ProblemError):
    """``408 request-timeout``: the body did not arrive within the server's limit."""

    slug_of_class = "request-timeout"


class ConflictError(ProblemError):
    """A ``409``: refused now, nothing changed. See the subclasses."""


class InProgressError(ConflictError):
    """``409 operation-in-progress``: another worker holds the lease. ``retry_after`` (s) says
    when to try again; or pass ``wait_ms`` to wait for its outcome (IETF httpapi
    Idempotency-Key draft §2.7)."""

    slug_of_class = "operation-in-progress"


class RetryNotDueError(InProgressError):
    """``409 retry-not-due``: the operation failed retryably and its next attempt is due in
    ``retry_after`` seconds."""

    slug_of_class = "retry-not-due"


class ContentionError(ConflictError):
    """``409 contention``: too many concurrent writers on the key; retried by the library,
    raised once its retries are spent."""

    slug_of_class = "contention"


class LeaseLostError(IdemError):
    """The lease is gone: idem answered ``stale-fencing-token`` or ``lease-expired``
    (:class:`StaleFencingTokenError`, :class:`LeaseExpiredError`), or no renewal succeeded
    before the lease's end (raised by :meth:`Lease.raise_if_lost`)."""


class StaleFencingTokenError(ConflictError, LeaseLostError):
    """``409 stale-fencing-token``: another lease was granted since this token's; the
    completion or renewal was ignored. For a completion: the function finished after losing its
    lease, and another attempt took over (``redo_safe``) — the library says so instead of
    recording it. ``current_fencing_token`` is the operation's token now."""

    slug_of_class = "stale-fencing-token"

    @property
    def current_fencing_token(self) -> int | None:
        """The operation's current token, from the problem document."""
        v = self.problem.get("current_fencing_token")
        return v if isinstance(v, int) else None


class LeaseExpiredError(ConflictError, LeaseLostError):
    """``409 lease-expired``: a renewal came after the lease ran out (a renewal never revives a
    lease). Stop if you can and complete with the token to report what happened."""

    slug_of_class = "lease-expired"


class OperationFinalError(ConflictError):
    """``409 operation-final``: SUCCEEDED or FAILED already; only an identical repeat of the
    completion that made it final is accepted."""

    slug_of_class = "operation-final"


class NotExecutingError(ConflictError):
    """``409 operation-not-executing``: nothing to renew or complete (``state`` says why)."""

    slug_of_class = "operation-not-executing"


class ConnectorOwnedError(ConflictError):
    """``409 connector-owned``: idem's connector performs this operation; callers never
    complete it."""

    slug_of_class = "connector-owned"


class PreviousStepUnfinishedError(ConflictError):
    """``409 previous-step-unfinished``: steps run in order; ``state`` is the earlier step's."""

    slug_of_class = "previous-step-unfinished"


class InstanceNotRunningError(ConflictError):
    """``409 instance-not-running``: the instance is PAUSED, FAILED, SUCCEEDED, COMPENSATING
    or COMPENSATED (``state``); no step may start."""

    slug_of_class = "instance-not-running"


class StepPerformedByIdemError(ConflictError):
    """``409 step-performed-by-idem``: the step runs on a connector; idem performs it."""

    slug_of_class = "step-performed-by-idem"


class StepKeyConflictError(ConflictError):
    """``409 step-key-conflict``: the step's key holds an operation not made for it."""

    slug_of_class = "step-key-conflict"


class LateArrivalError(ProblemError):
    """``410 late-arrival``: the key's operation finished and was removed after its retention
    window; only its tombstone is left. Nothing executes; never retry (README "Retention")."""

    slug_of_class = "late-arrival"


class FingerprintMismatchError(ProblemError):
    """``422 fingerprint-mismatch``: the key was first used with another payload or action; a
    new intent needs a new key (IETF httpapi Idempotency-Key draft §2.7). Nothing changed."""

    slug_of_class = "fingerprint-mismatch"


class InstanceMismatchError(FingerprintMismatchError):
    """``422 instance-mismatch``: the instance id was started with another workflow, input or
    steps."""

    slug_of_class = "instance-mismatch"


class ServerError(ProblemError):
    """A ``5xx`` from idem (``internal``, ``write-refused``, ``write-not-stored``, ...)."""


class UnavailableError(ServerError):
    """``503``: idem cannot take the request now (``unavailable``, ``overloaded``,
    ``not-durable``); retried by the library after ``Retry-After``, raised once the retries
    are spent. Nothing is known to have been recorded."""


class StoreUnavailableError(UnavailableError):
    """``503 unavailable``: the database did not answer."""

    slug_of_class = "unavailable"


class OverloadedError(UnavailableError):
    """``503 overloaded``: too many request bodies in flight on that node."""

    slug_of_class = "overloaded"


class NotDurableError(UnavailableError):
    """``503 not-durable``: the node cannot make writes durable until it is restarted."""

    slug_of_class = "not-durable"


class SchemaMissingError(UnavailableError):
    """``503 schema-missing``: idem's tables are gone from its database (it was dropped or
    replaced under the node); nothing was recorded. An operator restores the database."""

    slug_of_class = "schema-missing"


def _all_subclasses(cls: type[ProblemError]) -> list[type[ProblemError]]:
    out: list[type[ProblemError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


#: Problem type slug -> exception class. Types not listed (the operator's re-run and
#: resolution answers) are raised as the class for their status.
PROBLEM_CLASSES: dict[str, type[ProblemError]] = {
    c.slug_of_class: c for c in _all_subclasses(ProblemError) if c.slug_of_class
}

_BY_STATUS: dict[int, type[ProblemError]] = {
    400: InvalidRequestError,
    401: UnauthorizedError,
    403: ForbiddenError,
    404: NotFoundError,
    408: RequestTimeoutError,
    409: ConflictError,
    410: LateArrivalError,
    413: PayloadTooLargeError,
    422: FingerprintMismatchError,
    503: UnavailableError,
}


def problem_error(
    status: int, problem: Mapping[str, Any], request_id: str | None, retry_after: float | None
) -> ProblemError:
    """The exception for an error answer: by the problem's ``type``, else by ``status``."""
    slug = str(problem.get("type", "")).rsplit("/", 1)[-1]
    cls = (
        PROBLEM_CLASSES.get(slug)
        or _BY_STATUS.get(status)
        or (ServerError if status >= 500 else ProblemError)
    )
    return cls(problem, status=status, request_id=request_id, retry_after=retry_after)


def check_answer(what: str, field: str, expected: object, got: object) -> None:
    """Raises :class:`AnswerMismatchError` when an answer's ``field`` is not the request's."""
    if expected != got:
        raise AnswerMismatchError(
            f"{what}: idem's answer is about {field} {got!r}, the request was about {expected!r}; the "
            "request's own answer went elsewhere (a connection shared across os.fork(), or a proxy "
            "that mixes answers up). Nothing was done with the stray answer",
            expected=f"{field} {expected!r}",
            got=f"{field} {got!r}",
        )
