#!/usr/bin/env bash
# Where a producer's outbox append costs on PostgreSQL: pgbench, 16 clients, a business row
# per transaction, four scripts interleaved (A B C D, ROUNDS times, DURATION s each):
#   plain      the business row alone (what "publish right after commit" commits);
#   append     the row and idem.outbox_append (checks, the aggregate's advisory lock, the insert);
#   rawinsert  the row and the outbox row inserted directly (no checks, no lock);
#   locked     rawinsert with the advisory lock back.
# Prints "round script tps". Needs pgbench (Debian postgresql-client) and PostgreSQL on
# 127.0.0.1:5432; creates and drops database idem_pgb.
#   IDEM=target/release/idem bench/peers/outbox_append.sh
set -euo pipefail
IDEM="${IDEM:-$(cd "$(dirname "$0")/../.." && realpath "${CARGO_TARGET_DIR:-target}")/release/idem}"
U="${PG_ADMIN_URL:-postgres://postgres@127.0.0.1:5432}"
ROUNDS="${ROUNDS:-2}"; D="${DURATION:-8}"; export PGOPTIONS="-c client_min_messages=warning"
dir=$(mktemp -d); trap 'rm -rf "$dir"; psql -q "$U/postgres" -c "DROP DATABASE IF EXISTS idem_pgb" >/dev/null 2>&1 || true' EXIT
row="INSERT INTO orders (id, n) VALUES (:client_id || '-' || :n || '-' || random(), :n) RETURNING id"
outbox="INSERT INTO idem.outbox (id, aggregate_type, aggregate_id, topic, payload, headers, created_at) \
SELECT o.id, 'order', (:agg)::text, 'hooks.order', json_build_object('order', o.id), '{}', idem.now_ms() FROM o;"
head='\set n random(1, 1000000000)
\set agg random(1, 1000)
BEGIN;'
printf '%s\n%s;\nCOMMIT;\n' "$head" "${row% RETURNING id}" > "$dir/plain.sql"
printf '%s\nWITH o AS (%s)\nSELECT idem.outbox_append(o.id, %s, (:agg)::text, %s, json_build_object(%s, o.id)) FROM o;\nCOMMIT;\n' \
  "$head" "$row" "'order'" "'hooks.order'" "'order'" > "$dir/append.sql"
printf '%s\nWITH o AS (%s)\n%s\nCOMMIT;\n' "$head" "$row" "$outbox" > "$dir/rawinsert.sql"
printf '%s\nSELECT pg_advisory_xact_lock(hashtext(%s), hashtext(%s || (:agg)::text));\nWITH o AS (%s)\n%s\nCOMMIT;\n' \
  "$head" "'idem.outbox'" "'order/'" "$row" "$outbox" > "$dir/locked.sql"
psql -q "$U/postgres" -c "DROP DATABASE IF EXISTS idem_pgb" -c "CREATE DATABASE idem_pgb" >/dev/null
"$IDEM" schema install --database-url "$U/idem_pgb" >/dev/null
psql -q "$U/idem_pgb" -c "CREATE TABLE orders (id text PRIMARY KEY, n bigint NOT NULL)"
for r in $(seq 1 "$ROUNDS"); do for s in plain append rawinsert locked; do
  tps=$(pgbench -n -c 16 -j 2 -T "$D" -f "$dir/$s.sql" "$U/idem_pgb" 2>&1 | grep -oP 'tps = \K[0-9.]+' | head -1)
  [ -n "$tps" ] || { echo "outbox_append.sh: pgbench failed on $s" >&2; exit 1; }
  echo "$r $s $tps"
done; done
