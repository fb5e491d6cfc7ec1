#!/usr/bin/env bash
# Runs every test of idem: unit, property, conformance (SQLite and PostgreSQL) and the
# HTTP integration suite against real `idem serve` processes.
#
# It installs and starts what the tests need and is safe to run again:
#   - PostgreSQL (Debian packages) on 127.0.0.1:5432, started if it is down;
#   - aiosmtpd and Dovecot (Debian python3-aiosmtpd, dovecot-imapd), which the SMTP
#     connector's tests start on free loopback ports;
#   - Chromium and chromedriver (Debian chromium, chromium-driver) for the admin page's
#     browser test (screenshots land in $CARGO_TARGET_DIR/tmp/ui-screenshots);
#   - nats-server with JetStream (Debian nats-server) on 127.0.0.1:4222, started if it is
#     down;
#   - psycopg 3 (Debian python3-psycopg), which runs the book's Python outbox example;
#   - libfaketime (Debian faketime), which runs one `idem serve` node of the clock-skew
#     test with its wall clock 20 s ahead;
#   - pg_auto_failover (Debian postgresql-15-auto-failover, pg-auto-failover-cli), the HA
#     manager of tests/ha_failover.rs: a monitor, a primary and a synchronous standby on
#     free loopback ports, whose primary is SIGKILLed under load; its smoke version (two
#     failovers, both directions) runs here, the long one by ./scripts/ha_failover.sh;
#   - iproute2 (Debian), whose network namespaces cut one `idem serve` node off its
#     database in tests/ha_partition.rs;
#   - curl (Debian), for the walkthroughs of the README and the book, which the tests run
#     as written (crates/idem/tests/docs.rs runs every snippet of both);
#   - Node.js (Debian nodejs) when missing, for the book's Node.js page;
#   - the TypeScript client (clients/typescript) and its MCP example
#     (examples/mcp-tickets-ts): `npm ci` from the npm registry, pinned by their
#     package-lock.json files, when node_modules is missing or older than the lockfile;
#     after the Rust tests, `tsc --noEmit` (strict), the build and `node --test` there,
#     against the `idem` binary built from this tree (IDEM_BIN), on SQLite and PostgreSQL;
#     they need Node.js 20 or later (the machine's);
#   - mdBook (crates.io, pinned below; Debian 12 has no package), installed once with
#     `cargo install` into ${XDG_CACHE_HOME:-~/.cache}/idem/tools, which builds the book
#     (`mdbook build docs`, into docs/book) before the tests check its links and snippets;
#   - openapi-spec-validator, schemathesis and openapi-python-client (PyPI, pinned in
#     scripts/requirements-openapi.txt) in a cached venv, for tests/openapi.rs;
#   - stripe-python (PyPI, pinned in scripts/requirements-stripe.txt) in a cached venv,
#     for tests/proxy_stripe.rs;
#   - the Python client (clients/python) and its pinned tools (pytest, mypy, ruff, httpx,
#     psycopg, standardwebhooks: clients/python/requirements-dev.txt) in a cached venv; after
#     the Rust tests it runs mypy --strict, ruff and pytest there, against the `idem` binary
#     built from this tree (IDEM_BIN), on SQLite and PostgreSQL;
#   - the Rust test runner is plain `cargo test`, then the `otel` feature's test
#     (`cargo test --features idem/otel --test otel`).
# Environment:
#   IDEM_TEST_PG_URL  admin URL of the PostgreSQL server the tests create databases on
#                     (default postgres://postgres@127.0.0.1:5432/postgres, or with a
#                     password this script sets when the server does not trust loopback).
# Arguments are passed to `cargo test` (e.g. `-- --nocapture`); --help prints this text
# and installs nothing.
# Not run here (minutes, not seconds): ./scripts/ha_failover.sh, several PostgreSQL
# failovers in both directions under load (IDEM_HA_FAILOVERS, default 6), printing the
# time idem answered 503 and the time to the first success after each.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi

# The mdBook release the book is built with (docs/book.toml).
MDBOOK_VERSION=0.5.4

log() { printf 'test.sh: %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    log "need root for: $*"; return 1; fi
}

ensure_postgres() {
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    log "installing PostgreSQL (Debian packages)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql postgresql-client >/dev/null
  fi
  if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    local version
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    log "starting PostgreSQL $version"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    for _ in $(seq 1 60); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
  fi
  pg_isready -h 127.0.0.1 -p 5432 >/dev/null || { log "PostgreSQL did not come up on 127.0.0.1:5432"; exit 1; }

  if [ -z "${IDEM_TEST_PG_URL:-}" ]; then
    if psql "postgres://postgres@127.0.0.1:5432/postgres" -Atqc 'select 1' >/dev/null 2>&1; then
      export IDEM_TEST_PG_URL="postgres://postgres@127.0.0.1:5432/postgres"
    else
      # A stock Debian server asks for a password on TCP: give the postgres role one (over
      # the local socket, as the postgres OS user) and use it.
      log "setting a password for the postgres role (loopback is not trusted)"
      as_root su postgres -c "psql -qc \"ALTER USER postgres PASSWORD 'idem-test'\"" >/dev/null
      export IDEM_TEST_PG_URL="postgres://postgres:idem-test@127.0.0.1:5432/postgres"
    fi
  fi
  raise_postgres_connections
  log "PostgreSQL ready"
}

raise_postgres_connections() {
  # The suite runs PostgreSQL tests of several crates side by side, each with its own pools
  # and idem servers; Debian's default of 100 connections was seen exhausted ("sorry, too
  # many clients already"). Raise it on the local server this script manages (a restart,
  # once: the setting persists in postgresql.auto.conf); a server given by URL is left alone.
  case "$IDEM_TEST_PG_URL" in *@127.0.0.1:5432/*) ;; *) return 0 ;; esac
  command -v pg_ctlcluster >/dev/null 2>&1 || return 0
  local max version
  max=$(psql "$IDEM_TEST_PG_URL" -Atqc 'show max_connections' 2>/dev/null || echo 0)
  [ "${max:-0}" -ge 300 ] && return 0
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  log "raising PostgreSQL max_connections from $max to 300 (restarting it once)"
  psql "$IDEM_TEST_PG_URL" -qc "alter system set max_connections = 300" >/dev/null
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main restart || true
  for _ in $(seq 1 60); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
}

drop_old_test_databases() {
  # Each test drops the database it created (idem_store::testing::TestDatabase); a test
  # process that was killed leaves its databases behind. Their names end in a UUIDv7,
  # whose first 48 bits are the creation time in ms: drop only those created more than an
  # hour before this run. A database another run (on a shared server) is using right now
  # is younger than that, so it is never dropped under that run's feet; a run that lasts
  # longer than an hour does not exist here (the suite takes minutes).
  psql "$IDEM_TEST_PG_URL" -Atqc "
    select datname from pg_database
    where datname ~ '^idem_[a-z0-9_]+_[0-9a-f]{32}\$'
      and ('x' || lpad(substr(right(datname, 32), 1, 12), 16, '0'))::bit(64)::bigint
          < (extract(epoch from now()) * 1000)::bigint - 3600 * 1000" 2>/dev/null |
    while read -r db; do psql "$IDEM_TEST_PG_URL" -qc "drop database if exists \"$db\" with (force)" >/dev/null 2>&1 || true; done
}

ensure_mail_servers() {
  # The SMTP connector is tested against a real SMTP server (aiosmtpd) and IMAP server
  # (Dovecot) on loopback; the tests start their own instances, as user nobody.
  local missing=()
  [ -x /usr/sbin/dovecot ] || missing+=(dovecot-imapd)
  /usr/bin/python3 -c 'import aiosmtpd' 2>/dev/null || missing+=(python3-aiosmtpd)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (Debian packages)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

ensure_browser() {
  # The admin page is tested end to end in Debian's headless Chromium through chromedriver.
  local missing=()
  [ -x /usr/bin/chromium ] || missing+=(chromium)
  [ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (Debian packages)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

ensure_faketime() {
  # tests/clock_skew.rs starts one of two nodes under libfaketime (LD_PRELOAD), its wall
  # clock 20 s ahead of the other's and of PostgreSQL's.
  if ! ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1; then
    log "installing faketime (Debian package)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq faketime >/dev/null
  fi
}

ensure_pg_auto_failover() {
  # tests/ha_failover.rs runs a pg_auto_failover cluster of its own (monitor, primary,
  # synchronous standby) on loopback and kills its primary; tests/ha_partition.rs puts a
  # node in a network namespace (ip netns, veth) and cuts its link to the database.
  local missing=()
  [ -x /usr/bin/pg_autoctl ] || missing+=(pg-auto-failover-cli)
  local version
  version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
  [ -e "/usr/lib/postgresql/$version/lib/pgautofailover.so" ] || missing+=("postgresql-$version-auto-failover")
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (Debian packages)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

ensure_cc() {
  # tests/wal_fsync_failure.rs compiles a small LD_PRELOAD library that makes the SQLite
  # write-ahead log's fsync fail under a running server.
  if ! command -v cc >/dev/null 2>&1; then
    log "installing gcc (Debian package)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null
  fi
}

ensure_curl() {
  # tests/docs.rs and first_hour.rs run the curl walkthroughs as written.
  if ! command -v curl >/dev/null 2>&1; then
    log "installing curl (Debian package)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null
  fi
}

python_venv() {
  # A venv with the pinned packages of the requirements file $1, installed from PyPI and
  # kept in the cache as venv-$2<hash of the file> (made anew when the file changes, or
  # when $3, a path in it that the install leaves, is missing). Prints its path.
  local req=$1 prefix=$2 marker=$3 hash venv
  hash=$(sha256sum "$req" | cut -c1-16)
  venv="${XDG_CACHE_HOME:-$HOME/.cache}/idem/venv-$prefix$hash"
  if [ ! -e "$venv/$marker" ]; then
    if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
      log "installing python3-venv (Debian package)"
      as_root apt-get update -qq
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    log "installing $req into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q -r "$req" >&2
    touch "$venv/.installed"
  fi
  printf '%s\n' "$venv"
}

ensure_openapi_tools() {
  # tests/openapi.rs checks the served OpenAPI document with Python tools (pinned in
  # scripts/requirements-openapi.txt).
  IDEM_OPENAPI_VENV=$(python_venv scripts/requirements-openapi.txt "" bin/st)
  export IDEM_OPENAPI_VENV
}

ensure_stripe_python() {
  # tests/proxy_stripe.rs runs the real Stripe SDK, stripe-python (pinned in
  # scripts/requirements-stripe.txt), through `idem proxy`.
  IDEM_STRIPE_VENV=$(python_venv scripts/requirements-stripe.txt stripe- .installed)
  export IDEM_STRIPE_VENV
}

ensure_python_client() {
  # clients/python (idem-client) is checked in a venv of its own, with the tools pinned in
  # clients/python/requirements-dev.txt (made anew when that file changes). The package
  # itself is this tree's code: reinstalled at every run. crates/idem/tests/workflows.rs
  # runs examples/workflow_worker.py with this Python.
  local venv
  venv=$(python_venv clients/python/requirements-dev.txt client- .installed)
  "$venv/bin/pip" install -q --no-deps --no-build-isolation --force-reinstall ./clients/python >&2
  export IDEM_CLIENT_VENV="$venv" IDEM_CLIENT_PYTHON="$venv/bin/python"
}

python_client_checks() {
  # mypy --strict, ruff (lint and format) and pytest of clients/python, against the idem
  # binary of this tree; caches go to the venv, not into the work tree.
  local venv=$IDEM_CLIENT_VENV bin
  cargo build -p idem --locked --quiet || return
  bin="$(realpath "${CARGO_TARGET_DIR:-target}")/debug/idem"
  (
    cd clients/python
    export PYTHONDONTWRITEBYTECODE=1 MYPY_CACHE_DIR="$venv/mypy-cache" RUFF_CACHE_DIR="$venv/ruff-cache"
    "$venv/bin/mypy" --strict &&
      "$venv/bin/ruff" check . &&
      "$venv/bin/ruff" format --check . &&
      IDEM_BIN="$bin" "$venv/bin/pytest" -q -p no:cacheprovider
  )
}

ensure_mcp_sdk() {
  # crates/idem/tests/mcp*.rs run the official MCP Python SDK (pinned in
  # scripts/requirements-mcp.txt) as the agent's client and as the downstream tool server.
  IDEM_MCP_VENV=$(python_venv scripts/requirements-mcp.txt mcp- bin/mcp)
  export IDEM_MCP_VENV
}

npm_ci_if_stale() {
  # `npm ci` in $1 (only packages from the registry, as its package-lock.json pins them) when
  # node_modules was not installed from this very lockfile; the hash of the lockfile it was
  # installed from is kept in node_modules/.idem-lockfile.
  local dir=$1 hash
  hash=$(sha256sum "$dir/package-lock.json" | cut -c1-16)
  if [ "$(cat "$dir/node_modules/.idem-lockfile" 2>/dev/null)" != "$hash" ]; then
    log "npm ci in $dir"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >&2) || return
    printf '%s\n' "$hash" >"$dir/node_modules/.idem-lockfile"
  fi
}

typescript_client_checks() {
  # clients/typescript (idem-client for Node.js): tsc --noEmit (strict, the library and its
  # tests), the build (dist/), then node --test against the idem binary of this tree; then
  # the MCP example that uses it (its npm ci links the library, so it comes second).
  local bin major
  major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
  if [ "$major" -lt 20 ]; then
    log "clients/typescript needs Node.js 20 or later; found $(node --version 2>/dev/null || echo none)"
    return 1
  fi
  cargo build -p idem --locked --quiet || return
  bin="$(realpath "${CARGO_TARGET_DIR:-target}")/debug/idem"
  npm_ci_if_stale clients/typescript || return
  (
    cd clients/typescript &&
      npx tsc -p tsconfig.json &&
      npx tsc --noEmit -p tsconfig.test.json &&
      npx tsc -p tsconfig.test.json &&
      IDEM_BIN="$bin" node --test --test-reporter=tap --test-concurrency=4 build/test/*.test.js
  ) || return
  npm_ci_if_stale examples/mcp-tickets-ts || return
  (
    cd examples/mcp-tickets-ts &&
      npx tsc -p tsconfig.json &&
      IDEM_BIN="$bin" node --test --test-reporter=tap build/test/*.test.js
  )
}

ensure_python_psycopg() {
  # tests/outbox_sql.rs runs the book's Python outbox/inbox example with Debian's
  # psycopg 3 (python3-psycopg) under /usr/bin/python3, and its SQL example with psql.
  if ! /usr/bin/python3 -c 'import psycopg' 2>/dev/null; then
    log "installing python3-psycopg (Debian package)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-psycopg >/dev/null
  fi
}

ensure_node() {
  # The book's Node.js page runs with the runtime's fetch (Node.js 18 or later); the
  # TypeScript client needs 20 or later, which this machine kind has (Debian 12's is 18).
  if ! command -v node >/dev/null 2>&1; then
    log "installing nodejs (Debian package)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs >/dev/null
  fi
}

ensure_mdbook() {
  # Debian 12 has no mdBook: cargo installs the pinned release once into the cache, with
  # only what `mdbook build` needs (no `serve`/`watch`), built outside CARGO_TARGET_DIR.
  local root="${XDG_CACHE_HOME:-$HOME/.cache}/idem/tools"
  MDBOOK="$root/bin/mdbook"
  if [ "$("$MDBOOK" --version 2>/dev/null)" != "mdbook v$MDBOOK_VERSION" ]; then
    log "installing mdBook $MDBOOK_VERSION into $root (cargo install, once: a few minutes)"
    env -u CARGO_TARGET_DIR cargo install mdbook --locked --quiet --version "$MDBOOK_VERSION" \
      --no-default-features --features search --root "$root"
  fi
}

ensure_nats() {
  # The NATS JetStream connector and the relay's NATS sink are tested against a real
  # server on 127.0.0.1:4222 with JetStream; each test makes and deletes its own stream.
  # Left alone when it is already up (this machine kind starts it before the session).
  if ! (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then
    if [ ! -x /usr/sbin/nats-server ]; then
      log "installing nats-server (Debian package)"
      as_root apt-get update -qq
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >/dev/null
    fi
    log "starting nats-server with JetStream on 127.0.0.1:4222"
    as_root mkdir -p /var/lib/nats-server
    as_root start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
      -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
    for _ in $(seq 1 60); do (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null && break; sleep 0.5; done
  fi
  (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null || { log "nats-server did not come up on 127.0.0.1:4222"; exit 1; }
  log "NATS ready"
}

ensure_postgres
ensure_nats
ensure_python_psycopg
ensure_curl
ensure_openapi_tools
ensure_stripe_python
ensure_python_client
ensure_mcp_sdk
ensure_mail_servers
ensure_browser
ensure_faketime
ensure_pg_auto_failover
ensure_cc
ensure_node
ensure_mdbook
drop_old_test_databases
# The book first: a page mdBook cannot build fails the run (tests/docs.rs then checks its
# links, anchors, generated reference pages and every snippet).
log "mdbook build docs"
"$MDBOOK" build docs >/dev/null
log "cargo test --workspace"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
set +e
cargo test --workspace --locked --no-fail-fast "$@" 2>&1 | tee "$out"
status=${PIPESTATUS[0]}
# Before the otel build below, so that `cargo build -p idem` finds the binary cargo test made.
log "clients/python: mypy --strict, ruff, pytest"
python_client_checks 2>&1 | tee -a "$out"
python_status=${PIPESTATUS[0]}
[ "$status" -ne 0 ] || status=$python_status
log "clients/typescript and examples/mcp-tickets-ts: npm ci, tsc, node --test"
typescript_client_checks 2>&1 | tee -a "$out"
typescript_status=${PIPESTATUS[0]}
[ "$status" -ne 0 ] || status=$typescript_status
# The optional OpenTelemetry export (cargo feature idem/otel, off by default) has its own
# test binary; built with --workspace so features unify as above and little is rebuilt.
log "cargo test --features idem/otel --test otel"
cargo test --workspace --features idem/otel --test otel --locked 2>&1 | tee -a "$out"
otel_status=${PIPESTATUS[0]}
[ "$status" -ne 0 ] || status=$otel_status
set -e
# One closing line over all test binaries (cargo prints one "test result" per binary),
# pytest (its closing line: "N passed, M failed in S s") and node --test (TAP's closing
# "# pass N", "# fail N" and "# cancelled N", once per run: a test cancelled because its
# suite's hook failed counts as failed).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     /^=* *[0-9]+ (passed|failed)/ && / in [0-9.]+s/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     /^# pass [0-9]+$/ { p += $3 }
     /^# (fail|cancelled) [0-9]+$/ { f += $3 }
     END { printf "summary: %d passed, %d failed\n", p, f }' "$out"
exit "$status"
