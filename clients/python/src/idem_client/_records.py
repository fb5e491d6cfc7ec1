"""The records idem answers with: an operation, a workflow instance (book: Concepts, States,
"What a trigger gets")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: A JSON value as idem stores it: what ``json.loads`` returns.
JSON = None | bool | int | float | str | list[Any] | dict[str, Any]

#: The states of an operation (DESIGN.md §3).
STATES = ("PENDING", "EXECUTING", "SUCCEEDED", "FAILED", "UNKNOWN")


def _opt_str(v: object) -> str | None:
    return v if isinstance(v, str) else None


def _int(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


@dataclass(frozen=True)
class Operation:
    """An operation record (``OperationView`` of the OpenAPI document at ``/openapi.json``).

    ``state`` is one of PENDING, EXECUTING, SUCCEEDED, FAILED, UNKNOWN. ``fencing_token`` is the
    latest lease's token (an integer; the first is the key's creation instant in epoch ms plus
    one). ``result`` is the stored result (any JSON), ``provider_ref`` the evidence, ``error_class``
    and ``error_message`` the last error. Instants are RFC 3339 UTC strings. ``data`` is the whole
    body as received, for fields this class does not name (``events`` on a GET, for instance).
    """

    key: str
    action: str
    state: str
    fingerprint: str
    attempt: int
    fencing_token: int
    payload: JSON = None
    result: JSON = None
    provider_ref: str | None = None
    error_class: str | None = None
    error_message: str | None = None
    lease_holder: str | None = None
    lease_expires_at: str | None = None
    next_attempt_at: str | None = None
    needs_review: bool = False
    redo_safe: bool = False
    connector: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Operation:
        """The record of a JSON body (unknown fields are kept in ``data``, missing ones default)."""
        error = body.get("error")
        error = error if isinstance(error, Mapping) else {}
        return cls(
            key=str(body.get("key", "")),
            action=str(body.get("action", "")),
            state=str(body.get("state", "")),
            fingerprint=str(body.get("fingerprint", "")),
            attempt=_int(body.get("attempt")),
            fencing_token=_int(body.get("fencing_token")),
            payload=body.get("payload"),
            result=body.get("result"),
            provider_ref=_opt_str(body.get("provider_ref")),
            error_class=_opt_str(error.get("class")),
            error_message=_opt_str(error.get("message")),
            lease_holder=_opt_str(body.get("lease_holder")),
            lease_expires_at=_opt_str(body.get("lease_expires_at")),
            next_attempt_at=_opt_str(body.get("next_attempt_at")),
            needs_review=body.get("needs_review") is True,
            redo_safe=body.get("redo_safe") is True,
            connector=_opt_str(body.get("connector")),
            data=dict(body),
        )

    @property
    def events(self) -> list[dict[str, Any]]:
        """The event log, oldest first (only on a record read with ``get_operation``)."""
        ev = self.data.get("events")
        return list(ev) if isinstance(ev, list) else []


@dataclass(frozen=True)
class Instance:
    """A workflow instance (``InstanceView`` of the OpenAPI document).

    ``state`` is RUNNING, SUCCEEDED, FAILED, PAUSED, COMPENSATING or COMPENSATED; ``steps`` the
    checkpoints (one dict per step: ``step``, ``state``, ``operation_key``, ``provider_ref``, ...)
    when the server sent them; ``data`` the whole body.
    """

    instance_id: str
    workflow: str
    state: str
    last_good_step: str | None = None
    current_step: str | None = None
    stopped_step: str | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    data: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Instance:
        """The instance of a JSON body."""
        steps = body.get("steps")
        return cls(
            instance_id=str(body.get("instance_id", "")),
            workflow=str(body.get("workflow", "")),
            state=str(body.get("state", "")),
            last_good_step=_opt_str(body.get("last_good_step")),
            current_step=_opt_str(body.get("current_step")),
            stopped_step=_opt_str(body.get("stopped_step")),
            steps=[dict(s) for s in steps] if isinstance(steps, list) else [],
            data=dict(body),
        )
