#!/usr/bin/env python3
"""Client CPU per first-time pair as instructions, not time: each client runs under callgrind
(valgrind) twice, with N1 and N2 pairs, and (Ir(N2) - Ir(N1)) / (N2 - N1) is what one pair
costs its process in user-space instructions, start-up and warm-up left out. On a shared,
noisy machine this is the measure that repeats (process CPU time per pair moved 2x between
runs here); kernel time is not in it.

  ~/.cache/idem-peers/venv/bin/python client_instructions.py --idem /path/to/idem [--n1 100 --n2 600]

Clients: Powertools' idempotent_function on Redis (127.0.0.1:$REDIS_PORT, default 6380; start
it with redis_ctl.sh), idem by hand over http.client, idem via idem-client (clients/python as
installed in this venv; PYTHONPATH can point at another copy). idem serve runs on SQLite in a
temp dir. Prints one line per client and its ratio to Powertools. A client process is
`client_instructions.py --pairs MODE N PORT`.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))


def pairs(mode: str, n: int, port: int) -> None:
    """The client process: 30 warm-up pairs and n more, first-time calls (a new key each)."""
    sys.path.insert(0, HERE)
    if mode == "powertools":
        import powertools_bench as p

        fn = p.build_function(argparse.Namespace(layer="fixed", validation="on", lambda_context=False))
        pair = lambda key: fn(request=p.make_request(key))  # noqa: E731
    else:
        import idem_py_bench as b

        if mode == "library":
            lp = b.library_pair(port)
            pair = lambda key: lp(None, key)  # noqa: E731
        else:
            cl = b.Client(port)
            pair = lambda key: b.pair(cl, key)  # noqa: E731
    nonce = uuid.uuid4().hex[:10]
    for i in range(30 + n):
        if not pair(f"I-{nonce}-{i}"):
            sys.exit(f"{mode}: pair {i} failed")


def instructions(mode: str, n: int, port: int) -> int:
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, os.path.abspath(__file__), "--pairs", mode, str(n), str(port)],
        capture_output=True, text=True, check=True,
    ).stderr
    return int(re.search(r"Collected : (\d+)", out).group(1))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--pairs":
        pairs(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idem", required=True)
    ap.add_argument("--n1", type=int, default=100)
    ap.add_argument("--n2", type=int, default=600)
    ap.add_argument("--clients", default="powertools,http,library")
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    from idem_py_bench import KEY, free_port

    tmp = tempfile.mkdtemp(prefix="idem-ir-")
    port = free_port()
    env = dict(os.environ, IDEM_BOOTSTRAP_KEY=KEY, RUST_LOG="warn")
    with open(os.path.join(tmp, "serve.log"), "w") as log:
        srv = subprocess.Popen(
            [args.idem, "serve", "--listen", f"127.0.0.1:{port}", "--database-url", f"sqlite://{tmp}/idem.db"],
            cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        for _ in range(200):  # until idem listens
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        per_pair = {}
        for mode in args.clients.split(","):
            a, b = instructions(mode, args.n1, port), instructions(mode, args.n2, port)
            per_pair[mode] = (b - a) / (args.n2 - args.n1)
            ref = per_pair.get("powertools")
            ratio = f"  {per_pair[mode] / ref:.2f}x Powertools" if ref else ""
            print(f"{mode:10s} {per_pair[mode]:12,.0f} instructions per first-time pair{ratio}", flush=True)
    finally:
        srv.terminate()
        srv.wait(10)


if __name__ == "__main__":
    main()
