#!/usr/bin/env python3
"""Instructions per hot request of `idem serve`, counted by valgrind's callgrind.

Wall-clock figures on a 2-core machine shared by clients, servers and builds move by
2x from one run to the next; instruction counts do not. This script runs `idem serve`
under `valgrind --tool=callgrind`, drives it from this (uncounted) Python process over
one HTTP/1.1 keep-alive connection, and reads the counters of each phase with
`callgrind_control`:

  idle      nothing sent for IDLE_S seconds: the background work (sweeps, metrics)
            per second, subtracted from every phase in proportion to its duration;
  acquire   N acquires of new keys (POST /v1/operations -> 201);
  complete  N completions of those keys (POST /v1/operations/{key}/complete -> 200);
  replay    N repeats of a finished key (POST /v1/operations -> 200, recorded result);
  workflow  W three-step declared workflows (POST /v1/workflows -> 201, then idem's engine
            performs each step as an HTTP call to a provider double, `idem scenarios
            provider`, in its own uncounted process), counted until all are SUCCEEDED; the
            status polls of the wait are counted too (about 1.5 polls a workflow, each
            reading the instance's checkpoints: ~0.15 M instructions a workflow, ~5 %);
  relay     R outbox events appended at once to the application's database (one
            transaction, R aggregates of 100; SQLite file, or the PostgreSQL database of
            --database-url through `idem.outbox_append`), counted until the relay inside
            `idem serve` has delivered every one to a webhook receiver in this process
            and recorded it DELIVERED: claims in batches, signed POSTs, the recorded
            outcomes;
  trickle   T events appended one at a time, each delivered before the next: a claim,
            a POST and a record per event, what an idle relay pays (on SQLite the relay
            finds each by its poll, every 50 ms here; on PostgreSQL LISTEN/NOTIFY wakes it).

It prints instructions per request (Ir, the count callgrind calls "instructions read")
and per pair (acquire + complete), and keeps the raw dumps in the output directory so
`callgrind_annotate` can show where they go. Used by scripts/callgrind.sh.

Usage: callgrind_requests.py IDEM_BINARY OUT_DIR [--requests N] [--workflows W] [--events R]
                             [--trickle T] [--database-url URL]
Exit status 1 when a request gets an unexpected status.
"""
import argparse
import glob
import http.client
import json
import os
import re
import sqlite3
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import socket
import subprocess
import sys
import tempfile
import time
import uuid

KEY = "callgrind-bench-admin-key-0123456789abcdef"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Client:
    def __init__(self, port):
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.h = {"Authorization": "Bearer " + KEY, "Content-Type": "application/json"}

    def post(self, path, body, want):
        self.c.request("POST", path, json.dumps(body), self.h)
        r = self.c.getresponse()
        data = r.read()
        if r.status != want:
            sys.exit(f"callgrind_requests: POST {path} answered {r.status}, expected {want}: {data[:300]!r}")
        return json.loads(data) if data else None


def acquire(cl, key, want):
    return cl.post("/v1/operations", {"key": key, "action": "send_sms",
                                      "payload": {"scope": "t1", "to": "+15550100", "body": "hello"}}, want)


def complete(cl, key, token):
    cl.post("/v1/operations/" + key + "/complete",
            {"fencing_token": token, "outcome": "succeeded", "provider_ref": "m1",
             "result": {"provider_message_id": "m1", "state": "SENT"}}, 200)


WORKFLOW_CONFIG = """
[connectors.orders]
kind = "http"
url = "http://127.0.0.1:{port}/orders"
timeout_ms = 60000
provider_ref = {{ json_pointer = "/id" }}

[workflows.cg-3]
steps = [
  {{ name = "validate", connector = "orders", policy = "redo_safe", input = {{ key = {{ from = "/input/key" }} }} }},
  {{ name = "render", connector = "orders", policy = "redo_safe", input = {{ key = {{ from = "/input/key" }}, prev = {{ from = "/steps/validate/provider_ref" }} }} }},
  {{ name = "send", connector = "orders", policy = "redo_safe", input = {{ key = {{ from = "/input/key" }}, prev = {{ from = "/steps/render/provider_ref" }} }} }},
]
"""


RELAY_CONFIG = """
[outbox]
database_url = "{url}"
in_serve = true
poll_interval_ms = 50
lease_ms = 30000
batch = 100

[outbox.sinks.hooks]
kind = "webhook"
url = "http://127.0.0.1:{port}/hooks"
topics = ["cg.>"]
secrets = [{{ file = "{secret}" }}]
timeout_ms = 10000
"""
HOOK_SECRET = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"


class Receiver:
    """A webhook receiver on loopback, in this (uncounted) process: answers 204 and counts
    the deliveries it got (signatures are the relay's tests' business, not this count's)."""

    def __init__(self):
        self.count = 0
        self.lock = threading.Lock()
        me = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with me.lock:
                    me.count += 1
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class AppDb:
    """The application's database the relay delivers from: appends events and counts the
    undelivered ones, as a producer and an observer would (SQLite: sqlite3, writing what
    idem-outbox's `append` writes; PostgreSQL: psql and `idem.outbox_append`)."""

    def __init__(self, url):
        self.url = url
        self.pg = url.startswith("postgres")

    def append(self, ids):
        if self.pg:
            values = ", ".join(f"('{i}', '{n % 100}')" for n, i in enumerate(ids))
            sql = ("BEGIN; SELECT idem.outbox_append(v.id, 'order', v.agg, 'cg.order', "
                   "json_build_object('order', v.id), '{}'::json) FROM (VALUES " + values + ") v(id, agg); COMMIT;")
            subprocess.run(["psql", "-q", "-X", "-v", "ON_ERROR_STOP=1", self.url, "-c", sql],
                           check=True, stdout=subprocess.DEVNULL)
            return
        db = sqlite3.connect(self.url[len("sqlite://"):], timeout=60)
        with db:
            db.executemany("INSERT INTO idem_outbox (id, aggregate_type, aggregate_id, topic, payload, headers, "
                           "created_at) VALUES (?, 'order', ?, 'cg.order', ?, '{}', "
                           "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))",
                           [(i, str(n % 100), json.dumps({"order": i})) for n, i in enumerate(ids)])
        db.close()

    def open_events(self):
        sql = "SELECT count(*) FROM {} WHERE state <> 'DELIVERED'"
        if self.pg:
            out = subprocess.run(["psql", "-q", "-X", "-At", self.url, "-c", sql.format("idem.outbox")],
                                 check=True, capture_output=True, text=True).stdout
            return int(out.strip())
        db = sqlite3.connect(self.url[len("sqlite://"):], timeout=60)
        try:
            return db.execute(sql.format("idem_outbox")).fetchone()[0]
        finally:
            db.close()

    def wait_delivered(self, receiver, want, timeout_s=600):
        deadline = time.time() + timeout_s
        while receiver.count < want or self.open_events() > 0:
            if time.time() > deadline:
                sys.exit(f"callgrind_requests: the relay delivered {receiver.count} of {want} events in time")
            time.sleep(0.02)


def start_workflow(cl, instance_id):
    cl.post("/v1/workflows", {"workflow": "cg-3", "instance_id": instance_id, "input": {"key": instance_id}}, 201)


def wait_succeeded(cl, ids, timeout_s=600):
    """Polls the last-started instances until every one is SUCCEEDED (a few GETs)."""
    deadline = time.time() + timeout_s
    pending = list(ids)
    while pending:
        cl.c.request("GET", "/v1/workflows/" + pending[-1], headers=cl.h)
        r = cl.c.getresponse()
        v = json.loads(r.read())
        if v.get("state") == "SUCCEEDED":
            pending.pop()
            continue
        if v.get("state") not in ("RUNNING", None):
            sys.exit(f"callgrind_requests: workflow {pending[-1]} ended {v.get('state')}: {v}")
        if time.time() > deadline:
            sys.exit("callgrind_requests: workflows did not finish in time")
        time.sleep(0.5)


def total_ir(path):
    """The `totals:` (or `summary:`) line of a callgrind dump: instructions read."""
    with open(path) as f:
        for line in f:
            m = re.match(r"^(?:totals|summary):\s+(\d+)", line)
            if m:
                return int(m.group(1))
    sys.exit(f"callgrind_requests: no totals in {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("idem")
    ap.add_argument("out")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    ap.add_argument("--workflows", type=int, default=100)
    ap.add_argument("--events", type=int, default=500)
    ap.add_argument("--trickle", type=int, default=100)
    ap.add_argument("--database-url", default=None)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for old in glob.glob(os.path.join(args.out, "callgrind.out*")):
        os.remove(old)
    tmp = tempfile.mkdtemp(prefix="idem-callgrind-")
    url = args.database_url or f"sqlite://{tmp}/idem.db"
    port = free_port()
    env = dict(os.environ, IDEM_BOOTSTRAP_KEY=KEY, RUST_LOG="warn")
    out_file = os.path.join(args.out, "callgrind.out")
    log = open(os.path.join(args.out, "serve.log"), "w")
    provider_port = free_port()
    provider = subprocess.Popen([args.idem, "scenarios", "provider", "--listen", f"127.0.0.1:{provider_port}"],
                                cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = os.path.join(tmp, "workflows.toml")
    receiver = Receiver()
    app_url = url if url.startswith("postgres") else f"sqlite://{tmp}/app.db"
    secret = os.path.join(tmp, "hook_secret")
    with open(secret, "w") as f:
        f.write(HOOK_SECRET)
    subprocess.run([args.idem, "schema", "install", "--database-url", app_url], check=True, cwd=tmp, env=env,
                   stdout=subprocess.DEVNULL)
    app = AppDb(app_url)
    with open(config, "w") as f:
        f.write(WORKFLOW_CONFIG.format(port=provider_port))
        f.write(RELAY_CONFIG.format(url=app_url, port=receiver.port, secret=secret))
    srv = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}",
                            args.idem, "serve", "--listen", f"127.0.0.1:{port}", "--database-url", url,
                            "--config", config],
                           cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    dumps = []

    def dump(name):
        # `-d` writes the counters since the last dump or zeroing, then zeroes them.
        subprocess.run(["callgrind_control", "-d", name, str(srv.pid)], check=True, stdout=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline:
            files = sorted(f for f in glob.glob(out_file + ".*") if f not in dumps)
            if files:
                dumps.append(files[0])
                time.sleep(0.2)  # let callgrind finish writing
                return total_ir(files[0])
            time.sleep(0.1)
        sys.exit("callgrind_requests: no dump appeared")

    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if srv.poll() is not None:
                    sys.exit("callgrind_requests: idem serve exited; see " + log.name)
                time.sleep(0.2)
        cl = Client(port)
        nonce = uuid.uuid4().hex[:8]
        # Warm-up: code paths, caches and prepared statements of every phase.
        for i in range(50):
            k = f"W-{nonce}-{i}"
            complete(cl, k, acquire(cl, k, 201)["fencing_token"])
            acquire(cl, k, 200)
        warm = [f"WW-{nonce}-{i}" for i in range(10)]
        for w in warm:
            start_workflow(cl, w)
        wait_succeeded(cl, warm)
        app.append([f"EW-{nonce}-{i}" for i in range(20)])
        app.wait_delivered(receiver, 20)
        replay_key = f"W-{nonce}-0"
        n = args.requests
        phases = {}
        dump("warmup")
        t = time.time()
        time.sleep(args.idle_seconds)
        phases["idle"] = (dump("idle"), time.time() - t)
        # The server closed the idle connection (--header-read-timeout-ms): open a new
        # one outside the counted phases.
        cl = Client(port)
        acquire(cl, replay_key, 200)
        dump("reconnect")
        tokens = {}
        t = time.time()
        for i in range(n):
            k = f"K-{nonce}-{i}"
            tokens[k] = acquire(cl, k, 201)["fencing_token"]
        phases["acquire"] = (dump("acquire"), time.time() - t)
        t = time.time()
        for k, tok in tokens.items():
            complete(cl, k, tok)
        phases["complete"] = (dump("complete"), time.time() - t)
        t = time.time()
        for _ in range(n):
            acquire(cl, replay_key, 200)
        phases["replay"] = (dump("replay"), time.time() - t)
        wf = [f"WF-{nonce}-{i}" for i in range(args.workflows)]
        t = time.time()
        for w in wf:
            start_workflow(cl, w)
        wait_succeeded(cl, wf)
        phases["workflow"] = (dump("workflow"), time.time() - t)
        sent = receiver.count
        t = time.time()
        app.append([f"E-{nonce}-{i}" for i in range(args.events)])
        app.wait_delivered(receiver, sent + args.events)
        phases["relay"] = (dump("relay"), time.time() - t)
        sent = receiver.count
        t = time.time()
        for i in range(args.trickle):
            app.append([f"ET-{nonce}-{i}"])
            app.wait_delivered(receiver, sent + i + 1)
        phases["trickle"] = (dump("trickle"), time.time() - t)
    finally:
        provider.terminate()
        srv.terminate()
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            srv.kill()
    idle_ir, idle_s = phases["idle"]
    idle_rate = idle_ir / idle_s
    per = {}
    print(f"idem serve under callgrind ({url.split(':')[0]}), {n} requests a phase, one keep-alive client")
    print(f"  idle background work: {idle_rate:,.0f} instructions/s (subtracted per phase)")
    for name in ("acquire", "complete", "replay"):
        ir, secs = phases[name]
        per[name] = (ir - idle_rate * secs) / n
        print(f"  {name:<9} {per[name]:>12,.0f} instructions/request  ({ir:,} in {secs:.1f} s)")
    print(f"  {'pair':<9} {per['acquire'] + per['complete']:>12,.0f} instructions/pair (acquire + complete)")
    ir, secs = phases["workflow"]
    per_workflow = (ir - idle_rate * secs) / args.workflows
    print(f"  {'workflow':<9} {per_workflow:>12,.0f} instructions/workflow (3 HTTP steps; "
          f"{args.workflows} workflows, {ir:,} in {secs:.1f} s)")
    relayed = {}
    for name, count, what in (("relay", args.events, "appended at once"),
                              ("trickle", args.trickle, "one at a time")):
        ir, secs = phases[name]
        relayed[name] = (ir - idle_rate * secs) / count
        print(f"  {name:<9} {relayed[name]:>12,.0f} instructions/event (webhook; {count} events {what}, "
              f"{ir:,} in {secs:.1f} s)")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"requests": n, "database": url.split(":")[0], "idle_per_s": idle_rate,
                   "per_request": per, "per_pair": per["acquire"] + per["complete"],
                   "workflows": args.workflows, "per_workflow": per_workflow,
                   "events": args.events, "per_event_batched": relayed["relay"],
                   "trickle": args.trickle, "per_event_one_at_a_time": relayed["trickle"]}, f, indent=2)
    print(f"  dumps: {args.out}/callgrind.out.* (callgrind_annotate --inclusive=yes FILE)")


if __name__ == "__main__":
    main()
