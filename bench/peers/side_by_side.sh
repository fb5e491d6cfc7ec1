#!/usr/bin/env bash
# idem side by side with the peers, interleaved in one run:
#   ROUNDS=2 DURATION=8 bench/peers/side_by_side.sh      (from the project's root)
# IDEM defaults to the release binary (${CARGO_TARGET_DIR:-target}/release/idem), built
# first with `cargo build --release -p idem` when IDEM is not set.
# Per round: pgbench raw claim+complete (c32); Powertools+Redis(AOF always) first/replay
# (32 procs); Powertools+Redis(no AOF) first (32 procs); idem over HTTP from 32 Python
# procs, SQLite and PostgreSQL, first/replay, by hand (http.client) and through idem's Python
# client (clients/python: a decorated function); the same from Node.js (NODE_CLIENTS: fetch by
# hand, clients/typescript's makeIdempotent, node:http by hand if named; NODE_SHAPES: 32 procs
# of 1 call, 2 warm procs of 16; none without `node`); DBOS 3-step workflow (4x8); `idem bench`.
# Results: $PEERS_RESULTS (default ~/.cache/idem-peers/results): *.jsonl, bench-N.txt;
# then summary.py prints the side-by-side table with ratios.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"; cd "$HERE"
if [ -z "${IDEM:-}" ]; then
  ROOT="$(cd "$HERE/../.." && pwd)"
  (cd "$ROOT" && cargo build --release --locked -p idem >&2)
  IDEM="$(cd "$ROOT" && realpath "${CARGO_TARGET_DIR:-target}")/release/idem"
fi
ROUNDS="${ROUNDS:-2}"; D="${DURATION:-8}"
# idem_node_bench.mjs (none without node): its clients (http = fetch by hand, http-module =
# node:http by hand, library = idem-client), each in the shapes PROCS:INFLIGHT:WARMUP: 32
# processes of one call, as the Python benches, and 2 processes (one a core) of 16 calls each,
# warmed up with 1600 calls a process: V8 reaches its steady CPU per call only after ~1000.
NODE_CLIENTS="${NODE_CLIENTS-http library}"; command -v node >/dev/null || NODE_CLIENTS=""
NODE_SHAPES="${NODE_SHAPES-32:1:20 2:16:100}"
PH="${PEERS_HOME:-$HOME/.cache/idem-peers}"; PY="$PH/venv/bin/python"; RES="${PEERS_RESULTS:-$PH/results}"; mkdir -p "$RES"; rm -f "$RES"/*
./setup.sh >/dev/null
for round in $(seq 1 "$ROUNDS"); do
  echo "=== round $round $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  ./pgbench_ref.sh 32 1 "$D" "$RES/pgbench.jsonl" | tail -1
  ./redis_ctl.sh start aof
  for op in first replay; do
    timeout 300 "$PY" powertools_bench.py --runs 1 --duration "$D" --redis-mode aof --mode $op --workers 32 --kind process --out "$RES/powertools.jsonl" 2>>"$RES/stderr.log" | tail -1
  done
  ./redis_ctl.sh start default
  timeout 300 "$PY" powertools_bench.py --runs 1 --duration "$D" --redis-mode default --mode first --workers 32 --kind process --out "$RES/powertools.jsonl" 2>>"$RES/stderr.log" | tail -1
  ./redis_ctl.sh stop
  for be in sqlite postgres; do for op in first replay; do
    for client in http library; do
      timeout 300 "$PY" idem_py_bench.py --idem "$IDEM" --backend $be --mode $op --workers 32 --duration "$D" --client $client --out "$RES/idem_py.jsonl" 2>>"$RES/stderr.log" | tail -1
    done
    for client in $NODE_CLIENTS; do for shape in $NODE_SHAPES; do IFS=: read -r procs inflight warmup <<<"$shape"
      timeout 300 node idem_node_bench.mjs --idem "$IDEM" --backend $be --mode $op --workers $procs --inflight $inflight --warmup $warmup --duration "$D" --client $client --out "$RES/idem_node.jsonl" 2>>"$RES/stderr.log" | tail -1 \
        || echo "node bench failed: $be $op $client $shape (see $RES/stderr.log)"
    done; done
  done; done
  timeout 300 "$PY" dbos_bench.py --runs 1 --duration "$D" --warmup 5 --mode first --threads 8 --procs 4 --out "$RES/dbos.jsonl" 2>>"$RES/stderr.log" | tail -1
  timeout 600 "$IDEM" bench --seconds 5 --concurrency 1,64,256 --http-concurrency 32 --postgres-url postgres://postgres@127.0.0.1:5432/postgres > "$RES/bench-$round.txt" 2>>"$RES/stderr.log" || echo "idem bench failed"
  grep -E '^(embedded|HTTP|SQLite|PostgreSQL|relay|outbox|3-step|MCP)' "$RES/bench-$round.txt" || true
done
"$PY" "$HERE/summary.py" "$RES"
echo "done $(date -u +%T)"
