"""Every Python snippet of clients/python/README.md, run as written against a
fresh server: each ```python block must follow a ``<!-- test: NAME -->`` marker (or
``<!-- example:NAME -->``: run by crates/idem/tests/outbox_sql.rs), and what its
``print(...)  # EXPECTED`` lines print must be EXPECTED."""

from __future__ import annotations

import base64
import contextlib
import datetime
import io
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import standardwebhooks

from conftest import ADMIN_KEY, REPO, IdemServer

# The book's pages (README.md, docs/src) are run by crates/idem/tests/docs.rs; the book's
# Python page quotes this README's decorator block, which that test checks line by line.
DOCS = [REPO / "clients/python/README.md"]
BLOCK = re.compile(r"(?:<!-- (test: |example:)([a-z-]+) -->\n)?```python\n(.*?)\n```", re.S)


def snippets() -> list[tuple[str, str, str]]:
    out = []
    for doc in DOCS:
        for m in BLOCK.finditer(doc.read_text(encoding="utf-8")):
            if m.group(1) == "example:":
                continue  # `<!-- example:NAME -->` blocks are run by crates/idem/tests (outbox_sql.rs)
            out.append((doc.relative_to(REPO).as_posix(), m.group(2) or "", m.group(3)))
    return out


def expected_prints(code: str) -> list[str]:
    return [
        line.split("  # ", 1)[1].strip()
        for line in code.splitlines()
        if line.startswith("print(") and "  # " in line
    ]


def webhook_after(ns: dict[str, Any], secret: str) -> None:
    """The webhook snippet defines on_webhook: a signed delivery is applied once, a redelivery
    is a duplicate, a forged one is refused."""
    body = '{"order": 7}'
    at = datetime.datetime.now(tz=datetime.timezone.utc)
    msg_id = f"evt-{secrets.token_hex(4)}"
    headers = {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": standardwebhooks.Webhook(secret).sign(msg_id, at, body),
    }
    assert ns["on_webhook"](body.encode(), headers) == 204
    assert ns["on_webhook"](body.encode(), headers) == 204
    assert ns["on_webhook"](b'{"order": 8}', headers) == 401
    assert ns["on_webhook"](body.encode(), {"webhook-id": msg_id}) == 400


SNIPPETS = snippets()


def test_every_python_snippet_is_marked_to_run() -> None:
    unmarked = [(doc, code[:60]) for doc, name, code in SNIPPETS if not name]
    assert not unmarked, f"python blocks without <!-- test: NAME -->: {unmarked}"
    assert len(SNIPPETS) >= 4


@pytest.mark.parametrize(("doc", "name", "code"), SNIPPETS, ids=[f"{d}:{n}" for d, n, _ in SNIPPETS])
def test_snippet_runs_as_written(
    doc: str, name: str, code: str, tmp_path: Path, app_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = IdemServer(f"sqlite://{tmp_path / 'idem.db'}")
    table_suffix = secrets.token_hex(4)
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    with psycopg.connect(app_db) as conn:  # the snippets' `jobs` table, a schema of its own per run
        conn.execute(f"CREATE SCHEMA s{table_suffix}")
        conn.execute(f"CREATE TABLE s{table_suffix}.jobs (id text PRIMARY KEY, batch text NOT NULL)")
    monkeypatch.setenv("IDEM_URL", server.url)
    monkeypatch.setenv("IDEM_API_KEY", ADMIN_KEY)
    monkeypatch.setenv("DATABASE_URL", f"{app_db}?options=-csearch_path%3Ds{table_suffix},public")
    monkeypatch.setenv("HOOK_SECRET", secret)
    after: dict[str, Callable[[dict[str, Any]], None]] = {"webhook": lambda ns: webhook_after(ns, secret)}
    printed = io.StringIO()
    ns: dict[str, Any] = {"__name__": f"snippet_{name.replace('-', '_')}"}
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"{doc}:{name}", "exec"), ns)
        if name in after:
            after[name](ns)
    finally:
        server.stop()
    assert printed.getvalue().splitlines() == expected_prints(code)


def test_the_decorator_snippet_declares_what_httpx_raises_for_a_refused_connection() -> None:
    """The README's decorator declares retryable what its HTTP library raises when no connection
    was made. It said ConnectionRefusedError, which httpx (ConnectError) and urllib (URLError)
    never raise: they wrap it, and the wrapper's class is what is matched."""
    code = next(code for _, name, code in SNIPPETS if name == "decorator")
    declared = re.search(r"retryable=(\(.*?\)),", code)
    assert declared, "the decorator snippet declares retryable=(...)"
    classes = eval(declared.group(1), {"httpx": httpx})
    with pytest.raises(httpx.TransportError) as e:
        httpx.post("http://127.0.0.1:9/send")  # a refused port
    assert isinstance(e.value, classes), (e.value, classes)
