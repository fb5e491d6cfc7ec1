"""The outbox and inbox in your own PostgreSQL transaction, over idem's SQL functions (README
"Outbox and inbox: one transaction in your own database"; install them with
``idem schema install --database-url ...``). Needs psycopg 3: ``pip install idem-client[postgres]``.

Each function runs on the connection you pass, inside the transaction you hold; you commit
(``with psycopg.connect(...) as conn`` commits when the block ends, rolls back on an
exception). So the claim of a key or message, your business rows, the stored result and the
outbox event commit together or not at all::

    with psycopg.connect(url) as conn:
        claim = claim_key(conn, "B-8:export:v1", action="export", payload={"source_batch": "B-8"})
        if claim.apply:
            conn.execute("INSERT INTO jobs (id, batch) VALUES (%s, %s)", ("job-43", "B-8"))
            append_event(conn, "export:job-43:created", "export", "job-43", "export.created",
                         {"job": "job-43"})
            finish_key(conn, "B-8:export:v1", {"job": "job-43"})

The fingerprints are idem's (:func:`idem_client.fingerprint`), so Python, Rust (crate
``idem-outbox``) and SQL callers share keys and consumers. A ``conflict`` is returned, not
raised: commit anyway to keep its count (``conflicts`` on the row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

try:
    import psycopg
    from psycopg.types.json import Json
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("idem_client.sql needs psycopg 3: pip install 'idem-client[postgres]'") from e

from ._errors import InvalidInputError
from ._json import fingerprint, to_json
from ._records import JSON

Decision = Literal["apply", "duplicate", "conflict"]


@dataclass(frozen=True)
class SqlClaim:
    """What ``idem.key_claim`` / ``idem.inbox_claim`` answered.

    ``decision``: ``apply`` (new: do the work, then finish), ``duplicate`` (done before:
    ``stored`` is the result or outcome it stored), ``conflict`` (the key or message id was
    used with another fingerprint: nothing is applied; ``recorded_fingerprint`` is the first).
    """

    decision: Decision
    stored: JSON
    recorded_fingerprint: str | None

    @property
    def apply(self) -> bool:
        """New: do the work in this transaction."""
        return self.decision == "apply"

    @property
    def duplicate(self) -> bool:
        """Done before: do nothing; ``stored`` is what it stored."""
        return self.decision == "duplicate"

    @property
    def conflict(self) -> bool:
        """Used with other content: apply nothing (and commit, to keep the count)."""
        return self.decision == "conflict"


def key_fingerprint(action: str, payload: object) -> str:
    """The fingerprint of a key claim: of ``{"action": action, "payload": payload}``
    (``idem_outbox::tx::claim_fingerprint``)."""
    return fingerprint({"action": action, "payload": payload})


def _refused(e: psycopg.Error) -> InvalidInputError:
    """idem's SQL functions refuse bad ids and events with SQLSTATE 22023 and a message that
    names the rule (the same words as the Rust library's)."""
    diag = e.diag.message_primary or str(e)
    return InvalidInputError(diag)


_RULES = ("22023",)  # invalid_parameter_value


def _row(cur: psycopg.Cursor[Any]) -> SqlClaim:
    row = cur.fetchone()
    if row is None:  # pragma: no cover - the functions always answer one row
        raise RuntimeError("idem's claim function answered no row")
    decision, stored, recorded = row
    return SqlClaim(decision, stored, recorded)


def _exec(conn: psycopg.Connection[Any], sql: str, params: tuple[Any, ...]) -> psycopg.Cursor[Any]:
    try:
        return conn.execute(sql, params)
    except psycopg.Error as e:
        if e.sqlstate in _RULES:
            raise _refused(e) from e
        raise


async def _aexec(
    conn: psycopg.AsyncConnection[Any], sql: str, params: tuple[Any, ...]
) -> psycopg.AsyncCursor[Any]:
    try:
        return await conn.execute(sql, params)
    except psycopg.Error as e:
        if e.sqlstate in _RULES:
            raise _refused(e) from e
        raise


_KEY_CLAIM = "SELECT decision, result, recorded_fingerprint FROM idem.key_claim(%s, %s)"
_KEY_FINISH = "SELECT idem.key_finish(%s, %s)"
_INBOX_CLAIM = "SELECT decision, outcome, recorded_fingerprint FROM idem.inbox_claim(%s, %s, %s)"
_INBOX_FINISH = "SELECT idem.inbox_finish(%s, %s, %s)"
_APPEND = "SELECT idem.outbox_append(%s, %s, %s, %s, %s, %s)"


def _append_params(
    event_id: str,
    aggregate_type: str,
    aggregate_id: str,
    topic: str,
    payload: object,
    headers: dict[str, str] | None,
) -> tuple[Any, ...]:
    return (
        event_id,
        aggregate_type,
        aggregate_id,
        topic,
        Json(to_json(payload, "payload")),
        Json(headers or {}),
    )


def claim_key(conn: psycopg.Connection[Any], key: str, *, action: str, payload: object) -> SqlClaim:
    """``idem.key_claim``: claims the idempotency key ``key`` for ``action`` with ``payload``.

    Raises:
        InvalidInputError: a key idem refuses (its rules: 1-255 printable ASCII, no personal
            data), or a payload that is not JSON; psycopg errors as they come.
    """
    fp = key_fingerprint(action, payload)
    return _row(_exec(conn, _KEY_CLAIM, (key, fp)))


def finish_key(conn: psycopg.Connection[Any], key: str, result: object) -> None:
    """``idem.key_finish``: stores the result a retry's ``duplicate`` gets (the key must be claimed
    in this transaction)."""
    _exec(conn, _KEY_FINISH, (key, Json(to_json(result, "result"))))


def claim_message(conn: psycopg.Connection[Any], consumer: str, message_id: str, content: object) -> SqlClaim:
    """``idem.inbox_claim``: claims ``message_id`` for ``consumer`` with the content's fingerprint
    (its JSON, never transport headers that change on redelivery)."""
    return _row(_exec(conn, _INBOX_CLAIM, (consumer, message_id, fingerprint(content))))


def claim_message_fingerprint(
    conn: psycopg.Connection[Any], consumer: str, message_id: str, content_fingerprint: str
) -> SqlClaim:
    """As :func:`claim_message`, with a fingerprint computed already (a webhook's body)."""
    return _row(_exec(conn, _INBOX_CLAIM, (consumer, message_id, content_fingerprint)))


def finish_message(conn: psycopg.Connection[Any], consumer: str, message_id: str, outcome: object) -> None:
    """``idem.inbox_finish``: records the outcome a redelivery's ``duplicate`` gets."""
    _exec(conn, _INBOX_FINISH, (consumer, message_id, Json(to_json(outcome, "outcome"))))


def append_event(
    conn: psycopg.Connection[Any],
    event_id: str,
    aggregate_type: str,
    aggregate_id: str,
    topic: str,
    payload: object,
    headers: dict[str, str] | None = None,
) -> int:
    """``idem.outbox_append``: appends an event that ``idem relay`` delivers (at least once) after
    the commit; returns its ``seq``. ``event_id`` is the receiver's dedupe key (``webhook-id``,
    ``Nats-Msg-Id``); ``topic`` dot-separated tokens of ``[A-Za-z0-9_:-]``.

    Raises:
        InvalidInputError: an event idem refuses (the message names the rule).
    """
    cur = _exec(
        conn, _APPEND, _append_params(event_id, aggregate_type, aggregate_id, topic, payload, headers)
    )
    row = cur.fetchone()
    return int(row[0]) if row else 0


async def aclaim_key(
    conn: psycopg.AsyncConnection[Any], key: str, *, action: str, payload: object
) -> SqlClaim:
    """As :func:`claim_key`, on an ``AsyncConnection``."""
    cur = await _aexec(conn, _KEY_CLAIM, (key, key_fingerprint(action, payload)))
    row = await cur.fetchone()
    assert row is not None
    return SqlClaim(row[0], row[1], row[2])


async def afinish_key(conn: psycopg.AsyncConnection[Any], key: str, result: object) -> None:
    """As :func:`finish_key`."""
    await _aexec(conn, _KEY_FINISH, (key, Json(to_json(result, "result"))))


async def aclaim_message(
    conn: psycopg.AsyncConnection[Any], consumer: str, message_id: str, content: object
) -> SqlClaim:
    """As :func:`claim_message`."""
    cur = await _aexec(conn, _INBOX_CLAIM, (consumer, message_id, fingerprint(content)))
    row = await cur.fetchone()
    assert row is not None
    return SqlClaim(row[0], row[1], row[2])


async def afinish_message(
    conn: psycopg.AsyncConnection[Any], consumer: str, message_id: str, outcome: object
) -> None:
    """As :func:`finish_message`."""
    await _aexec(conn, _INBOX_FINISH, (consumer, message_id, Json(to_json(outcome, "outcome"))))


async def aappend_event(
    conn: psycopg.AsyncConnection[Any],
    event_id: str,
    aggregate_type: str,
    aggregate_id: str,
    topic: str,
    payload: object,
    headers: dict[str, str] | None = None,
) -> int:
    """As :func:`append_event`."""
    params = _append_params(event_id, aggregate_type, aggregate_id, topic, payload, headers)
    cur = await _aexec(conn, _APPEND, params)
    row = await cur.fetchone()
    return int(row[0]) if row else 0
