#!/usr/bin/env bash
# Several PostgreSQL primary failovers under load, in both directions (issue 33): the
# `#[ignore]`d test `failover_many` of crates/idem/tests/ha_failover.rs. A pg_auto_failover
# cluster (monitor, primary, synchronous standby) on loopback, two `idem serve` nodes on
# its multi-host URL; the primary is SIGKILLed IDEM_HA_FAILOVERS times (default 6), each
# time the old primary rejoins as the standby. Prints, per failover, when the standby was
# promoted, the first 503 and the first success after it, then the totals checked against
# the database (0 lost acknowledgements, 0 double grants). Takes a minute or two per three
# failovers; not part of ./scripts/test.sh (which runs the two-failover smoke version).
#
# Installs what it needs as ./scripts/test.sh does (PostgreSQL, pg_auto_failover).
# Arguments are passed to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
version=$(ls /usr/lib/postgresql 2>/dev/null | sort -V | tail -n 1)
if [ -z "$version" ] || [ ! -x /usr/bin/pg_autoctl ] || [ ! -e "/usr/lib/postgresql/$version/lib/pgautofailover.so" ]; then
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql postgresql-15-auto-failover pg-auto-failover-cli >/dev/null
fi
exec cargo test -p idem --locked --test ha_failover "$@" -- --ignored --nocapture failover_many
