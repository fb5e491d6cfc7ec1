"""idem_client.webhooks: Standard Webhooks signatures, and the relay's deliveries received into
the inbox exactly once (a real ``idem relay`` delivering from a real outbox)."""

from __future__ import annotations

import base64
import datetime
import os
import secrets
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
import standardwebhooks

from idem_client import sql, webhooks

from conftest import idem_bin


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def signed(
    secret: str, body: str, msg_id: str = "evt-1", at: datetime.datetime | None = None
) -> dict[str, str]:
    at = at or datetime.datetime.now(tz=datetime.timezone.utc)
    sig = standardwebhooks.Webhook(secret).sign(msg_id, at, body)
    return {"Webhook-Id": msg_id, "Webhook-Timestamp": str(int(at.timestamp())), "Webhook-Signature": sig}


def test_a_signature_verifies_with_either_secret_during_a_rotation() -> None:
    old, new, body = new_secret(), new_secret(), '{"order": 7}'
    assert webhooks.verify(body, signed(new, body), [old, new]) == {"order": 7}
    assert webhooks.verify(body.encode(), signed(old, body), [old, new]) == {"order": 7}
    both = signed(old, body)["Webhook-Signature"] + " " + signed(new, body)["Webhook-Signature"]
    assert webhooks.verify(body, {**signed(old, body), "webhook-signature": both}, new) == {"order": 7}


@pytest.mark.parametrize(
    "tamper",
    ["other secret", "other body", "other id", "old timestamp", "malformed entry", "missing header"],
)
def test_anything_else_is_refused(tamper: str) -> None:
    secret, body = new_secret(), '{"order": 7}'
    headers = signed(secret, body)
    error: type[Exception] = webhooks.WebhookVerificationError
    if tamper == "other secret":
        headers = signed(new_secret(), body)
    elif tamper == "other body":
        body = '{"order": 8}'
    elif tamper == "other id":
        headers["Webhook-Id"] = "evt-2"
    elif tamper == "old timestamp":
        headers = signed(
            secret, body, at=datetime.datetime.now(tz=datetime.timezone.utc) - datetime.timedelta(minutes=6)
        )
    elif tamper == "malformed entry":
        headers["Webhook-Signature"] = "v1" + headers["Webhook-Signature"][3:]
    else:
        del headers["Webhook-Signature"]
        error = webhooks.WebhookHeaderError
    with pytest.raises(error):
        webhooks.verify(body, headers, secret)


class Receiver:
    """A webhook endpoint that verifies, claims the webhook-id in the inbox and applies the
    event in one transaction, then answers; it answers 503 *after* committing the first
    delivery of the ids in ``fail_after_commit`` (a lost acknowledgement), so the relay
    delivers them again."""

    def __init__(self, db: str, secret: str, table: str) -> None:
        self.log: list[tuple[str, str]] = []
        self.fail_after_commit: set[str] = set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                try:
                    with psycopg.connect(db) as conn:
                        got = webhooks.receive(conn, "orders-receiver", body, dict(self.headers), secret)
                        if got.claim.apply:
                            conn.execute(
                                f"INSERT INTO {table} (id, amount) VALUES (%s, %s)",
                                (got.payload["id"], got.payload["amount"]),
                            )
                            sql.finish_message(conn, "orders-receiver", got.message_id, {"applied": True})
                    outer.log.append((got.message_id, got.claim.decision))
                    status = 503 if got.message_id in outer.fail_after_commit and got.claim.apply else 204
                except webhooks.WebhookVerificationError:
                    status = 401
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/hooks"


@pytest.fixture
def relay_setup(app_db: str, tmp_path: Path) -> Iterator[tuple[str, Receiver, subprocess.Popen[bytes]]]:
    secret, table = new_secret(), f"orders_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(app_db) as conn:
        conn.execute(f"CREATE TABLE {table} (id text PRIMARY KEY, amount integer NOT NULL)")
    receiver = Receiver(app_db, secret, table)
    (tmp_path / "secret").write_text(secret + "\n")
    config = tmp_path / "idem.toml"
    config.write_text(
        f'[outbox]\ndatabase_url = "{app_db}"\npoll_interval_ms = 50\nlease_ms = 5000\n'
        f'[outbox.sinks.hooks]\nkind = "webhook"\nurl = "{receiver.url}"\ntopics = ["orders.*"]\n'
        f'secrets = [{{ file = "{tmp_path / "secret"}" }}]\ntimeout_ms = 2000\n'
        "retry = { base_ms = 10, cap_ms = 50, max_attempts = 5 }\n"
    )
    relay = subprocess.Popen(
        [idem_bin(), "relay", "--config", str(config)],
        env={**os.environ, "RUST_LOG": "warn"},
        stdout=subprocess.DEVNULL,
    )
    yield table, receiver, relay
    relay.send_signal(signal.SIGTERM)
    relay.wait(10)
    receiver.http.shutdown()


def test_relay_deliveries_are_verified_and_applied_once(app_db: str, relay_setup: Any) -> None:
    """Events appended with idem_client.sql are delivered by the relay, verified and applied
    once each; the event whose acknowledgement was lost comes again and is a duplicate."""
    table, receiver, _ = relay_setup
    run = uuid.uuid4().hex[:6]
    ids = [f"{run}-o-1", f"{run}-o-2", f"{run}-o-3"]
    receiver.fail_after_commit.add(ids[1])
    with psycopg.connect(app_db) as conn:
        for i, event_id in enumerate(ids):
            sql.append_event(
                conn, event_id, "order", f"{run}-{i}", "orders.created", {"id": event_id, "amount": 10 * i}
            )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(receiver.log) < 4:
        time.sleep(0.05)
    with psycopg.connect(app_db) as conn:
        rows = conn.execute(f"SELECT id, amount FROM {table} ORDER BY id").fetchall()
        states = conn.execute(
            "SELECT id, state FROM idem.outbox WHERE id = ANY(%s) ORDER BY id", (ids,)
        ).fetchall()
    assert rows == [(ids[0], 0), (ids[1], 10), (ids[2], 20)]
    assert sorted(receiver.log) == sorted(
        [(ids[0], "apply"), (ids[1], "apply"), (ids[1], "duplicate"), (ids[2], "apply")]
    ), receiver.log
    assert states == [(i, "DELIVERED") for i in ids]
