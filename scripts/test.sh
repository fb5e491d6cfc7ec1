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
#   - psycopg 3 (Debian python3-psycopg), which runs the README's Python outbox example;
#   - libfaketime (Debian faketime), which runs one `idem serve` node of the clock-skew
#     test with its wall clock 20 s ahead;
#   - curl (Debian), for the README walkthrough the tests run as written;
#   - openapi-spec-validator, schemathesis and openapi-python-client (PyPI, pinned in
#     scripts/requirements-openapi.txt) in a cached venv, for tests/openapi.rs;
#   - the Rust test runner is plain `cargo test`, then the `otel` feature's test
#     (`cargo test --features idem/otel --test otel`).
# Environment:
#   IDEM_TEST_PG_URL  admin URL of the PostgreSQL server the tests create databases on
#                     (default postgres://postgres@127.0.0.1:5432/postgres, or with a
#                     password this script sets when the server does not trust loopback).
set -euo pipefail
cd "$(dirname "$0")/.."

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
  log "PostgreSQL ready"
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
  # tests/first_hour.rs runs the README's curl walkthrough as written.
  if ! command -v curl >/dev/null 2>&1; then
    log "installing curl (Debian package)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null
  fi
}

ensure_venv() {
  # A venv of the pinned requirements file $1 under ${XDG_CACHE_HOME:-~/.cache}/idem/$2-<hash
  # of the file>, made anew when the file changes; $3 is a file the finished install has.
  # Prints the venv's path.
  local req=$1 name=$2 check=$3 hash venv
  hash=$(sha256sum "$req" | cut -c1-16)
  venv="${XDG_CACHE_HOME:-$HOME/.cache}/idem/$name-$hash"
  if [ ! -x "$venv/$check" ]; then
    if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
      log "installing python3-venv (Debian package)"
      as_root apt-get update -qq
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    log "installing $req into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q -r "$req" >&2
  fi
  printf '%s' "$venv"
}

ensure_openapi_tools() {
  # tests/openapi.rs checks the served OpenAPI document with Python tools (pinned in
  # scripts/requirements-openapi.txt).
  IDEM_OPENAPI_VENV=$(ensure_venv scripts/requirements-openapi.txt venv bin/st)
  export IDEM_OPENAPI_VENV
}

ensure_mcp_sdk() {
  # crates/idem/tests/mcp*.rs run the official MCP Python SDK (pinned in
  # scripts/requirements-mcp.txt) as the agent's client and as the downstream tool server.
  IDEM_MCP_VENV=$(ensure_venv scripts/requirements-mcp.txt venv-mcp bin/mcp)
  export IDEM_MCP_VENV
}

ensure_python_psycopg() {
  # tests/outbox_sql.rs runs the README's Python outbox/inbox example with Debian's
  # psycopg 3 (python3-psycopg) under /usr/bin/python3, and its SQL example with psql.
  if ! /usr/bin/python3 -c 'import psycopg' 2>/dev/null; then
    log "installing python3-psycopg (Debian package)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-psycopg >/dev/null
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
ensure_mcp_sdk
ensure_mail_servers
ensure_browser
ensure_faketime
ensure_cc
drop_old_test_databases
log "cargo test --workspace"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
set +e
cargo test --workspace --locked --no-fail-fast "$@" 2>&1 | tee "$out"
status=${PIPESTATUS[0]}
# The optional OpenTelemetry export (cargo feature idem/otel, off by default) has its own
# test binary; built with --workspace so features unify as above and little is rebuilt.
log "cargo test --features idem/otel --test otel"
cargo test --workspace --features idem/otel --test otel --locked 2>&1 | tee -a "$out"
otel_status=${PIPESTATUS[0]}
[ "$status" -ne 0 ] || status=$otel_status
set -e
# One closing line over all test binaries (cargo prints one "test result" per binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "summary: %d passed, %d failed\n", p, f }' "$out"
exit "$status"
