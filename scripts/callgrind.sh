#!/usr/bin/env bash
# Instruction counts per hot request (acquire, complete, replay), per three-step workflow
# and per outbox event relayed to a webhook (appended at once, and one at a time) of `idem
# serve` on the embedded SQLite store, under valgrind's callgrind:
# deterministic where wall-clock benchmarks on a shared 2-core machine are not, so a
# regression shows up as a number.
#
#   ./scripts/callgrind.sh                 # 500 requests a phase, SQLite
#   REQUESTS=200 WORKFLOWS=50 EVENTS=500 TRICKLE=100 ./scripts/callgrind.sh
#   DATABASE_URL=postgres://postgres@127.0.0.1:5432/idem_cg ./scripts/callgrind.sh
#                                          # the idem process on PostgreSQL (database must exist;
#                                          # the relay's outbox then lives there too, schema idem)
#
# Installs valgrind (Debian package) when missing, builds the release binary, and writes
# the dumps and summary.json to $OUT (default $CARGO_TARGET_DIR/callgrind or
# target/callgrind). See scripts/callgrind_requests.py for what each phase counts.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"
if ! command -v valgrind >/dev/null 2>&1; then
  echo "callgrind.sh: installing valgrind (Debian package)" >&2
  if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null
fi
cargo build --release --locked -p idem >&2
args=("$target/release/idem" "${OUT:-$target/callgrind}" --requests "${REQUESTS:-500}" --workflows "${WORKFLOWS:-100}"
  --events "${EVENTS:-500}" --trickle "${TRICKLE:-100}")
if [ -n "${DATABASE_URL:-}" ]; then args+=(--database-url "$DATABASE_URL"); fi
exec python3 scripts/callgrind_requests.py "${args[@]}"
