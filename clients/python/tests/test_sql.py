"""idem_client.sql: the outbox and inbox in psycopg 3 transactions, over idem's SQL functions
on a real PostgreSQL database, and the fingerprints they share with idem's server."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

import idem_client
from idem_client import sql

from conftest import IdemServer


@pytest.fixture
def table(app_db: str) -> str:
    name = f"jobs_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(app_db) as conn:
        conn.execute(f"CREATE TABLE {name} (id text PRIMARY KEY, batch text NOT NULL)")
    return name


def export_batch(url: str, table: str, batch: str, payload: dict[str, Any] | None = None) -> tuple[str, Any]:
    """The README's export: claim the key, write the job, append the event, store the result."""
    key = f"{batch}:export:v1"
    with psycopg.connect(url) as conn:
        claim = sql.claim_key(conn, key, action="export", payload=payload or {"source_batch": batch})
        if claim.apply:
            job = f"job-{batch}"
            conn.execute(f"INSERT INTO {table} (id, batch) VALUES (%s, %s)", (job, batch))
            sql.append_event(
                conn, f"export:{job}:{uuid.uuid4().hex[:6]}", "export", job, "export.created", {"job": job}
            )
            sql.finish_key(conn, key, {"job": job})
            return "apply", {"job": job}
        return claim.decision, claim.stored


def test_a_key_is_applied_once_and_replayed_and_a_conflict_applies_nothing(app_db: str, table: str) -> None:
    batch = f"B-{uuid.uuid4().hex[:6]}"
    assert export_batch(app_db, table, batch) == ("apply", {"job": f"job-{batch}"})
    assert export_batch(app_db, table, batch) == ("duplicate", {"job": f"job-{batch}"})
    assert export_batch(app_db, table, batch, {"source_batch": "other"})[0] == "conflict"
    with psycopg.connect(app_db) as conn:
        rows = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        events = conn.execute(
            "SELECT count(*) FROM idem.outbox WHERE aggregate_id = %s", (f"job-{batch}",)
        ).fetchone()
    assert rows == (1,)
    assert events == (1,)


def test_a_rolled_back_claim_leaves_the_key_new(app_db: str, table: str) -> None:
    key = f"RB-{uuid.uuid4().hex[:6]}:export:v1"

    def claim_then_fail() -> None:
        with psycopg.connect(app_db) as conn:
            assert sql.claim_key(conn, key, action="export", payload={"n": 1}).apply
            raise RuntimeError("the business write failed")

    with pytest.raises(RuntimeError):
        claim_then_fail()
    with psycopg.connect(app_db) as conn:
        assert sql.claim_key(conn, key, action="export", payload={"n": 1}).apply


def test_concurrent_claims_of_one_key_apply_once(app_db: str, table: str) -> None:
    """The second transaction waits for the first and then sees a duplicate (README)."""
    batch = f"C-{uuid.uuid4().hex[:6]}"
    results: list[tuple[str, Any]] = []
    threads = [
        threading.Thread(target=lambda: results.append(export_batch(app_db, table, batch))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r[0] for r in results) == ["apply", "duplicate", "duplicate", "duplicate"]
    assert all(r[1] == {"job": f"job-{batch}"} for r in results)


def test_a_message_is_applied_once_per_consumer(app_db: str) -> None:
    mid, content = f"pay-{uuid.uuid4().hex[:6]}", {"account": 7, "amount": 10, "note": "Zu\u0308rich"}
    with psycopg.connect(app_db) as conn:
        assert sql.claim_message(conn, "billing", mid, content).apply
        sql.finish_message(conn, "billing", mid, {"credited": 10})
    with psycopg.connect(app_db) as conn:
        again = sql.claim_message(conn, "billing", mid, {"note": "Z\u00fcrich", "amount": 10.0, "account": 7})
        assert (again.decision, again.stored) == ("duplicate", {"credited": 10}), (
            "same content, other spelling"
        )
        other = sql.claim_message(conn, "billing", mid, {"account": 7, "amount": 99})
        assert other.conflict
        assert other.recorded_fingerprint == idem_client.fingerprint(content)
        assert sql.claim_message(conn, "shipping", mid, content).apply, "another consumer has its own inbox"


def test_ids_and_events_idem_refuses_raise_invalid_input_and_write_nothing(app_db: str) -> None:
    with pytest.raises(idem_client.InvalidInputError, match="e-mail"), psycopg.connect(app_db) as conn:
        sql.claim_key(conn, "welcome:jane@example.com", action="send", payload=None)
    with pytest.raises(idem_client.InvalidInputError, match="topic"), psycopg.connect(app_db) as conn:
        sql.append_event(conn, f"bad-{uuid.uuid4().hex[:6]}", "order", "1", "orders created!", {"id": 1})
    with pytest.raises(idem_client.InvalidInputError, match="idem"), psycopg.connect(app_db) as conn:
        sql.claim_message(conn, "idem.keys", "m-1", {})
    with pytest.raises(idem_client.NotJSONError), psycopg.connect(app_db) as conn:
        sql.append_event(conn, "e-nan", "order", "1", "orders.created", {"amount": float("nan")})


async def test_the_async_functions_do_the_same(app_db: str) -> None:
    key = f"A-{uuid.uuid4().hex[:6]}:export:v1"
    async with await psycopg.AsyncConnection.connect(app_db) as conn:
        assert (await sql.aclaim_key(conn, key, action="export", payload={"b": 1})).apply
        seq = await sql.aappend_event(conn, f"{key}:created", "export", key, "export.created", {"b": 1})
        assert seq > 0
        await sql.afinish_key(conn, key, {"job": 1})
        assert (await sql.aclaim_message(conn, "billing", key, {"b": 1})).apply
        await sql.afinish_message(conn, "billing", key, {"ok": True})
    async with await psycopg.AsyncConnection.connect(app_db) as conn:
        replay = await sql.aclaim_key(conn, key, action="export", payload={"b": 1})
        assert (replay.decision, replay.stored) == ("duplicate", {"job": 1})
        assert (await sql.aclaim_message(conn, "billing", key, {"b": 1})).stored == {"ok": True}


PAYLOADS: list[Any] = [
    {"to": "customer-42", "template": "confirmation"},
    {"city": "Zu\u0308rich", "\U0001f600": 1, "\ufb01": 2, "a": [True, None, -7]},
    {
        "amount": 10.5,
        "tiny": 5e-324,
        "big": 1e15,
        "huge": 9007199254740992.0,
        "small": 1e-7,
        "mid": 123456.789,
        "neg": -0.0,
        "one": 1.0,
    },
    {"t": 'tab\there\u0001\u007f"q"\\', "nested": {"b": {"\u00c5": "A\u030a"}, "a": 1}},
    [9007199254740992, -9007199254740992, 0.1, 100],
    "just a string",
    None,
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_fingerprints_are_the_servers(server: IdemServer, payload: Any) -> None:
    """idem_client.fingerprint (and so the SQL claims) agrees with the fingerprint idem's server
    records for the same payload: NFC, RFC 8785 member order and number forms."""
    with server.client() as c, c.claim(f"FP-{uuid.uuid4().hex[:10]}", action="fp", payload=payload) as claim:
        claim.unknown("a fingerprint probe: nothing was done")
        assert claim.operation.fingerprint == idem_client.fingerprint(payload)
    with (
        server.client() as c,
        c.claim(
            f"FP-{uuid.uuid4().hex[:10]}", action="fp", payload={"action": "export", "payload": payload}
        ) as claim,
    ):
        claim.unknown("a fingerprint probe: nothing was done")
        assert claim.operation.fingerprint == sql.key_fingerprint("export", payload)


def test_a_waiting_claim_sees_the_commit(app_db: str, table: str) -> None:
    """A claim blocked on an open transaction's claim of the same key returns once it commits."""
    key = f"W-{uuid.uuid4().hex[:6]}:export:v1"
    first = psycopg.connect(app_db)
    assert sql.claim_key(first, key, action="export", payload={}).apply
    seen: list[str] = []

    def second() -> None:
        with psycopg.connect(app_db) as conn:
            seen.append(sql.claim_key(conn, key, action="export", payload={}).decision)

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.3)
    assert seen == [], "the second claim waits for the first transaction"
    sql.finish_key(first, key, {"done": True})
    first.commit()
    first.close()
    t.join(5)
    assert seen == ["duplicate"]
