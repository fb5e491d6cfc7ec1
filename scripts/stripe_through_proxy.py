"""Issue 28 §5: a real Stripe SDK (stripe-python, pinned in requirements-stripe.txt)
through `idem proxy`, in front of an upstream that deduplicates by Idempotency-Key as
Stripe does. Run by crates/idem/tests/proxy_stripe.rs with the venv scripts/test.sh makes:

    IDEM_BIN=target/debug/idem $IDEM_STRIPE_VENV/bin/python scripts/stripe_through_proxy.py

The upstream (below, on 127.0.0.1) keeps every answer per Idempotency-Key and replays it,
answers 409 `idempotency_key_in_use` while a request with the key is executing and 400
`idempotency_error` for a key reused with other parameters (docs.stripe.com/idempotency,
/error-low-level). What it does to the first request of a key is set by the request's
`metadata[test]`: `fails_first` answers 500 without acting, `hangs_first` never answers
and does not act, `acts_then_hangs` acts and never answers, `slow_first` holds the key
(executing) past the proxy's timeout, then acts; `hold` holds every request briefly.

The proxy declares /v1/payment_intents and /v1/charges deduplicating and /v1/refunds not,
and shapes its own errors as Stripe's (`--error-format stripe`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, Dict, List, Optional, Tuple
from urllib.parse import parse_qsl

import requests
import stripe

# The proxy gives up on the upstream after this long (ms); the upstream's hangs outlast it.
PROXY_TIMEOUT_MS = 600
HANG_S = 1.0
# slow_first holds its key past the proxy's 504 and the SDK's first retry (0.5 s later).
SLOW_S = 1.6
HOLD_S = 0.3
IDEM_KEY = "stripe-test-admin-key-0123456789abcdef"
# What idem proxy puts before a client's key (tenant "default" of the bootstrap key, as the
# proxy scopes it, and its principal).
SCOPE = "default.proxy/bootstrap/"


class Entry:
    """What the upstream knows of one Idempotency-Key."""

    def __init__(self, params: List[Tuple[str, str]]) -> None:
        self.params = params
        self.response: Optional[Tuple[int, bytes]] = None


class Upstream:
    """A Stripe-like API: idempotency by key, and counted objects."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Dict[str, int] = {}
        self.entries: Dict[str, Entry] = {}
        self.objects: Dict[str, List[str]] = {}  # key -> ids created under it
        self.received: Dict[str, threading.Event] = {}
        self.busy: Dict[str, int] = {}  # key -> 409 idempotency_key_in_use answered

    def in_use(self, key: str) -> int:
        with self.lock:
            return self.busy.get(key, 0)

    def received_event(self, key: str) -> threading.Event:
        with self.lock:
            return self.received.setdefault(key, threading.Event())

    def made(self, key: str) -> List[str]:
        with self.lock:
            return list(self.objects.get(key, []))

    def seen(self, key: str) -> int:
        with self.lock:
            return self.calls.get(key, 0)


UPSTREAM = Upstream()


def stripe_error(kind: str, message: str, code: Optional[str] = None) -> bytes:
    err: Dict[str, Any] = {"type": kind, "message": message}
    if code:
        err["code"] = code
    return json.dumps({"error": err}).encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass

    def answer(self, status: int, body: bytes, headers: Optional[Dict[str, str]] = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the proxy gave up on this request: its answer is lost

    def drop(self) -> None:
        """Never answers: waits past the proxy's timeout, then closes the connection."""
        time.sleep(HANG_S)
        self.close_connection = True

    def do_POST(self) -> None:
        u = UPSTREAM
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        params = sorted(parse_qsl(body.decode()))
        mode = dict(params).get("metadata[test]", "")
        sent = self.headers.get("Idempotency-Key", "")
        # idem proxy sends the SDK's key scoped by the client's tenant and principal; the
        # upstream's books are kept by the SDK's key, as the tests know it.
        if not sent.startswith(SCOPE):
            return self.answer(400, stripe_error("invalid_request_error", f"unscoped Idempotency-Key {sent!r}"))
        key = sent[len(SCOPE):]
        resource = self.path.split("?")[0].rstrip("/").split("/")[-1]
        with u.lock:
            n = u.calls[key] = u.calls.get(key, 0) + 1
            u.received.setdefault(key, threading.Event()).set()
            entry = u.entries.get(key)
            if entry is not None and entry.params != params:
                return self.answer(400, stripe_error("idempotency_error", "key reused with other parameters"))
            if entry is not None and entry.response is not None:
                status, stored = entry.response
                return self.answer(status, stored, {"Idempotent-Replayed": "true"})
            if entry is not None:
                u.busy[key] = u.busy.get(key, 0) + 1
                busy = stripe_error("invalid_request_error", "this key's request is executing", "idempotency_key_in_use")
                return self.answer(409, busy, {"Stripe-Should-Retry": "true"})
        if n == 1 and mode == "fails_first":
            return self.answer(500, stripe_error("api_error", "something went wrong before anything was done"))
        if n == 1 and mode == "hangs_first":
            return self.drop()
        with u.lock:
            entry = u.entries[key] = Entry(params)
        if (n == 1 and mode == "slow_first") or mode == "hold":
            time.sleep(SLOW_S if mode == "slow_first" else HOLD_S)
        with u.lock:
            made = u.objects.setdefault(key, [])
            made.append(f"{resource[:2]}_{key[:8]}_{len(made) + 1}")
            obj = {"id": made[-1], "object": resource.rstrip("s"), "amount": int(dict(params).get("amount", "0"))}
            entry.response = (200, json.dumps(obj).encode())
        if n == 1 and mode == "acts_then_hangs":
            return self.drop()
        self.answer(200, entry.response[1])


class Sessions(requests.Session):
    """A client's HTTP session: sends the idem API key (the proxy's client identity) and
    counts the requests the SDK makes per Idempotency-Key."""

    attempts: ClassVar[Dict[str, int]] = {}
    lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        self.headers["Idem-Api-Key"] = IDEM_KEY

    def request(  # type: ignore[override]
        self, method: str | bytes, url: str | bytes, *args: Any, **kwargs: Any
    ) -> requests.Response:
        key = (kwargs.get("headers") or {}).get("Idempotency-Key", "")
        with Sessions.lock:
            Sessions.attempts[key] = Sessions.attempts.get(key, 0) + 1
        return super().request(method, url, *args, **kwargs)


def attempts(key: str) -> int:
    with Sessions.lock:
        return Sessions.attempts.get(key, 0)


class StripeThroughProxy(unittest.TestCase):
    proxy: ClassVar["subprocess.Popen[str]"]
    base: ClassVar[str]
    server: ClassVar[ThreadingHTTPServer]
    tmp: ClassVar[tempfile.TemporaryDirectory[str]]

    @classmethod
    def setUpClass(cls) -> None:
        stripe.enable_telemetry = False
        cls.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        cls.server.daemon_threads = True
        threading.Thread(target=cls.server.serve_forever, daemon=True).start()
        upstream = f"http://127.0.0.1:{cls.server.server_address[1]}/"
        cls.tmp = tempfile.TemporaryDirectory()
        cls.proxy = subprocess.Popen(
            [os.environ["IDEM_BIN"], "proxy", "--upstream", upstream, "--listen", "127.0.0.1:0",
             "--database-url", f"sqlite://{cls.tmp.name}/proxy.db", "--timeout-ms", str(PROXY_TIMEOUT_MS),
             "--error-format", "stripe",
             "--provider-deduplicates", "/v1/payment_intents=true", "--provider-deduplicates", "/v1/charges=true"],
            env={**os.environ, "IDEM_BOOTSTRAP_KEY": IDEM_KEY, "RUST_LOG": "warn"},
            stdout=subprocess.PIPE, text=True,
        )
        assert cls.proxy.stdout is not None
        for line in cls.proxy.stdout:
            if line.startswith("idem: listening on "):
                cls.base = line.removeprefix("idem: listening on ").strip()
                break
        else:
            raise RuntimeError("idem proxy did not start")
        # Keep reading its output so it never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in cls.proxy.stdout or []], daemon=True).start()

    @classmethod
    def tearDownClass(cls) -> None:
        cls.proxy.kill()
        cls.proxy.wait()
        cls.server.shutdown()
        cls.tmp.cleanup()

    def client(self) -> stripe.StripeClient:
        return stripe.StripeClient(
            "sk_test_idem",
            base_addresses={"api": self.base},
            http_client=stripe.RequestsClient(session=Sessions(), timeout=30),
            max_network_retries=3,
        )

    def create_intent(self, mode: str, key: Optional[str] = None, amount: int = 2000) -> stripe.PaymentIntent:
        options: stripe.RequestOptions = {"idempotency_key": key} if key else {}
        params: Dict[str, Any] = {"amount": amount, "currency": "eur"}
        if mode:
            params["metadata"] = {"test": mode}
        return self.client().v1.payment_intents.create(params=params, options=options)

    def last_key(self, before: Dict[str, int]) -> str:
        """The Idempotency-Key the SDK generated for the call made since `before`."""
        with Sessions.lock:
            new = [k for k in Sessions.attempts if k not in before]
        self.assertEqual(len(new), 1, new)
        return new[0]

    def test_the_sdk_retries_a_500_with_the_same_key_and_one_charge_is_made(self) -> None:
        # The input: the SDK's own key, the upstream's 500 without acting.
        before = dict(Sessions.attempts)
        pi = self.create_intent("fails_first")
        key = self.last_key(before)
        self.assertIsInstance(pi, stripe.PaymentIntent)
        self.assertEqual(pi.amount, 2000)
        self.assertEqual(UPSTREAM.made(key), [pi.id], "exactly one charge")
        self.assertEqual((attempts(key), UPSTREAM.seen(key)), (2, 2), "the SDK's retry was forwarded")
        # A later call with the same key gets the same object (idem's stored answer).
        again = self.create_intent("fails_first", key=key)
        self.assertEqual((again.id, UPSTREAM.seen(key)), (pi.id, 2))

    def test_a_timeout_before_or_after_the_upstream_acted_ends_in_one_charge(self) -> None:
        for mode in ["hangs_first", "acts_then_hangs", "slow_first"]:
            with self.subTest(mode=mode):
                before = dict(Sessions.attempts)
                pi = self.create_intent(mode)
                key = self.last_key(before)
                self.assertEqual(UPSTREAM.made(key), [pi.id], f"{mode}: exactly one charge")
                if mode == "slow_first":
                    # 504 from the proxy, then the upstream's own 409 (passed on, not
                    # stored) one or more times, then the upstream's replay.
                    self.assertGreaterEqual(UPSTREAM.in_use(key), 1)
                    self.assertEqual(attempts(key), 2 + UPSTREAM.in_use(key))
                else:
                    self.assertEqual(attempts(key), 2, mode)

    def test_a_request_in_progress_at_the_proxy_is_retried_by_the_sdk(self) -> None:
        key = "order-4711-pay"
        results: List[stripe.PaymentIntent] = []
        first = threading.Thread(target=lambda: results.append(self.create_intent("hold", key=key)))
        first.start()
        self.assertTrue(UPSTREAM.received_event(key).wait(10))
        second = self.create_intent("hold", key=key)  # 409 idempotency_key_in_use, retried
        first.join()
        self.assertEqual([r.id for r in results], [second.id])
        self.assertEqual(UPSTREAM.made(key), [second.id])
        self.assertEqual(attempts(key), 3, "the second client retried after the proxy's 409")

    def test_a_route_not_declared_deduplicating_keeps_outcome_unknown_and_the_sdk_stops(self) -> None:
        key = "refund-ch-9-full"
        for status in [500, 409]:
            with self.subTest(status=status):
                n = attempts(key)
                with self.assertRaises(stripe.APIError) as raised:
                    self.client().v1.refunds.create(
                        params={"charge": "ch_9", "metadata": {"test": "fails_first"}}, options={"idempotency_key": key}
                    )
                e = raised.exception
                self.assertEqual(e.http_status, status)
                assert e.error is not None
                self.assertEqual((e.error.type, e.error.code), ("api_error", "outcome_unknown"), e.http_body)
                self.assertIn("will not be forwarded again", str(e.user_message))
                self.assertIsNotNone(e.request_id)
                self.assertEqual(attempts(key), n + 1, "Stripe-Should-Retry: false, so the SDK did not retry")
        self.assertEqual((UPSTREAM.seen(key), UPSTREAM.made(key)), (1, []), "forwarded once, never again")

    def test_a_key_reused_with_other_parameters_raises_the_sdks_idempotency_error(self) -> None:
        key = "order-4712-pay"
        pi = self.create_intent("", key=key, amount=1000)
        with self.assertRaises(stripe.IdempotencyError) as raised:
            self.create_intent("", key=key, amount=1500)
        e = raised.exception
        self.assertEqual(e.http_status, 400)
        assert e.error is not None
        self.assertEqual(e.error.code, "fingerprint_mismatch")
        self.assertEqual((attempts(key), UPSTREAM.seen(key), UPSTREAM.made(key)), (2, 1, [pi.id]))

    def test_a_request_without_the_idem_api_key_is_a_stripe_authentication_error(self) -> None:
        client = stripe.StripeClient("sk_test_idem", base_addresses={"api": self.base}, max_network_retries=3)
        with self.assertRaises(stripe.AuthenticationError) as raised:
            client.v1.payment_intents.create(params={"amount": 1, "currency": "eur"})
        self.assertEqual(raised.exception.http_status, 401)


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)
