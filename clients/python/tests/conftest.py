"""Test support: real ``idem serve`` processes (SQLite and PostgreSQL) on loopback.

The binary comes from ``IDEM_BIN`` (scripts/test.sh builds it with ``cargo build -p idem``).
PostgreSQL databases are made on ``IDEM_TEST_PG_URL`` (default
``postgres://postgres@127.0.0.1:5432/postgres``), one per run, named ``idem_pyclient_<UUIDv7>``
so that scripts/test.sh drops those a killed run left behind, and dropped at the end.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import idem_client

ADMIN_KEY = "test-admin-key-0123456789abcdef0123456789"
PG_ADMIN_URL = os.environ.get("IDEM_TEST_PG_URL", "postgres://postgres@127.0.0.1:5432/postgres")
REPO = Path(__file__).resolve().parents[3]


def idem_bin() -> str:
    path = os.environ.get("IDEM_BIN")
    if not path or not os.access(path, os.X_OK):
        pytest.exit(
            f"IDEM_BIN={path!r} is not an idem binary: run ./scripts/test.sh, or "
            "`cargo build -p idem` and set IDEM_BIN=$CARGO_TARGET_DIR/debug/idem",
            returncode=2,
        )
    return path


def uuid7_hex() -> str:
    """A UUIDv7's 32 hex digits (RFC 9562 §5.7): its first 48 bits date it, as scripts/test.sh expects."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(secrets.token_bytes(10), "big")
    value = (ms << 80) | (0x7 << 76) | ((rand >> 68) & 0xFFF) << 64 | (0b10 << 62) | (rand & ((1 << 62) - 1))
    return f"{value:032x}"


class PgDatabase:
    """A database of its own on the test server; :meth:`drop` removes it (also its connections)."""

    def __init__(self, prefix: str) -> None:
        self.name = f"{prefix}_{uuid7_hex()}"
        try:
            with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
                conn.execute(f"CREATE DATABASE {self.name}")
        except psycopg.OperationalError as e:
            pytest.exit(
                f"PostgreSQL at {PG_ADMIN_URL} is not reachable ({e}); run ./scripts/test.sh", returncode=2
            )
        base, _, _ = PG_ADMIN_URL.rpartition("/")
        self.url = f"{base}/{self.name}"

    def drop(self) -> None:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")


class IdemServer:
    """A running ``idem serve`` on a free loopback port (killed with SIGKILL by :meth:`stop`)."""

    def __init__(self, database_url: str, *extra: str, listen: str = "127.0.0.1:0") -> None:
        self.database_url = database_url
        self.proc = subprocess.Popen(
            [
                idem_bin(),
                "serve",
                "--listen",
                listen,
                "--sweep-interval-ms",
                "50",
                "--database-url",
                database_url,
                *extra,
            ],
            env={**os.environ, "IDEM_BOOTSTRAP_KEY": ADMIN_KEY, "RUST_LOG": "warn"},
            stdout=subprocess.PIPE,
            text=True,
        )
        found: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith("idem: listening on "):
                    found.append(line.removeprefix("idem: listening on ").strip())
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(30) or not found:
            self.proc.kill()
            raise RuntimeError(f"idem serve did not start (exit status {self.proc.poll()})")
        self.url = found[0]

    def client(self, **options: object) -> idem_client.Client:
        return idem_client.Client(self.url, ADMIN_KEY, **options)  # type: ignore[arg-type]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="session")
def tmp_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="idem-pyclient-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def pg_database() -> Iterator[PgDatabase]:
    db = PgDatabase("idem_pyclient")
    yield db
    db.drop()


@pytest.fixture(scope="session")
def sqlite_server(tmp_root: Path) -> Iterator[IdemServer]:
    s = IdemServer(f"sqlite://{tmp_root / 'idem.db'}")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def pg_server(pg_database: PgDatabase) -> Iterator[IdemServer]:
    s = IdemServer(pg_database.url)
    yield s
    s.stop()


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def server(request: pytest.FixtureRequest) -> IdemServer:
    """The shared server of each backend (tests use keys of their own)."""
    name = "sqlite_server" if request.param == "sqlite" else "pg_server"
    s: IdemServer = request.getfixturevalue(name)
    return s


@pytest.fixture
def client(server: IdemServer) -> Iterator[idem_client.Client]:
    c = server.client()
    yield c
    c.close()


@pytest.fixture
def key() -> str:
    """A key of this test's own: ``T-<hex>``."""
    return f"T-{uuid.uuid4().hex[:16]}"


@pytest.fixture(scope="session")
def app_db() -> Iterator[str]:
    """An application's database with idem's schema installed (``idem schema install``)."""
    db = PgDatabase("idem_pyclient_app")
    out = subprocess.run(
        [idem_bin(), "schema", "install", "--database-url", db.url],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    yield db.url
    db.drop()
