-- idem schema version 1 (SQLite): the tables of the PostgreSQL schema, named idem_* (SQLite
-- has no schemas). There are no SQL functions: on SQLite the Rust library (idem-outbox)
-- does what idem.outbox_append / idem.inbox_claim do on PostgreSQL. One writer at a time
-- (open write transactions with BEGIN IMMEDIATE), so seq order is commit order.

-- idem_inbox holds the claimed idempotency keys too (consumer 'idem.keys').
CREATE TABLE idem_inbox (
  consumer TEXT NOT NULL,
  message_id TEXT NOT NULL,
  fingerprint TEXT NOT NULL,
  outcome TEXT,
  conflicts INTEGER NOT NULL DEFAULT 0,
  last_conflict_fingerprint TEXT,
  last_conflict_at INTEGER,
  claimed_at INTEGER NOT NULL,
  finished_at INTEGER,
  PRIMARY KEY (consumer, message_id)
);

CREATE TABLE idem_outbox (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  aggregate_type TEXT NOT NULL,
  aggregate_id TEXT NOT NULL,
  topic TEXT NOT NULL,
  payload TEXT NOT NULL,
  headers TEXT NOT NULL DEFAULT '{}',
  created_at INTEGER NOT NULL,
  state TEXT NOT NULL DEFAULT 'PENDING' CHECK (state IN ('PENDING', 'DELIVERED', 'DEAD', 'SKIPPED')),
  attempts INTEGER NOT NULL DEFAULT 0,
  next_attempt_at INTEGER,
  manual INTEGER NOT NULL DEFAULT 0,
  lease_owner TEXT,
  lease_expires_at INTEGER,
  fencing_token INTEGER NOT NULL DEFAULT 0,
  sink TEXT,
  evidence TEXT,
  error_class TEXT,
  error_message TEXT,
  delivered_at INTEGER
);
CREATE INDEX idem_outbox_open ON idem_outbox (aggregate_type, aggregate_id, seq) WHERE state IN ('PENDING', 'DEAD');
CREATE INDEX idem_outbox_pending ON idem_outbox (seq) WHERE state = 'PENDING';

CREATE INDEX idem_outbox_done ON idem_outbox (created_at) WHERE state IN ('DELIVERED', 'SKIPPED');

CREATE TABLE idem_relay_idle (
  relay TEXT PRIMARY KEY,
  until_ms INTEGER NOT NULL
);

CREATE TABLE idem_outbox_attempts (
  event_seq INTEGER NOT NULL REFERENCES idem_outbox (seq) ON DELETE CASCADE,
  at INTEGER NOT NULL,
  kind TEXT NOT NULL,
  trigger TEXT,
  relay TEXT,
  fencing_token INTEGER,
  result TEXT,
  sink TEXT,
  error_class TEXT,
  message TEXT,
  evidence TEXT,
  operator TEXT,
  reason TEXT
);
CREATE INDEX idem_outbox_attempts_event ON idem_outbox_attempts (event_seq);
