-- The hot tables' CHECK constraints without ephemeral tables, and `operations` without
-- AUTOINCREMENT. SQLite evaluates `x IN ('A','B','C', ...)` with more than two constants
-- by building an ephemeral B-tree of the list — in a CHECK constraint, every time a row is
-- written: a B-tree opened, a page zeroed, the list inserted and the B-tree closed, per
-- insert and again per upsert that updates (about 12 000 instructions an acquire and
-- 24 000 a completion under scripts/callgrind.sh). The same rule as an OR of equalities is
-- a few comparisons. SQLite cannot alter a CHECK, so each table is rebuilt as
-- https://www.sqlite.org/lang_altertable.html#otheralter describes (no foreign keys,
-- views or triggers refer to them; every index is recreated). `operations.id` was a
-- surrogate key nothing reads (PostgreSQL dropped it in 0006); its AUTOINCREMENT updated
-- `sqlite_sequence` on every insert. `operation_events` keeps AUTOINCREMENT: its `seq`
-- must never be reused after retention deletes the newest events. PostgreSQL evaluates
-- the same IN lists as arrays, with no such cost, and keeps them.

CREATE TABLE operations_rebuilt (
    tenant           TEXT    NOT NULL,
    op_key           TEXT    NOT NULL,
    action           TEXT    NOT NULL,
    fingerprint      TEXT    NOT NULL,
    payload          TEXT    NOT NULL,
    state            TEXT    NOT NULL CHECK (state = 'PENDING' OR state = 'EXECUTING' OR state = 'SUCCEEDED'
                                             OR state = 'FAILED' OR state = 'UNKNOWN'),
    attempt_count    BIGINT  NOT NULL,
    lease_owner      TEXT,
    lease_expires_at BIGINT,
    fencing_token    BIGINT  NOT NULL,
    next_attempt_at  BIGINT,
    provider_ref     TEXT,
    result           TEXT,
    error_class      TEXT,
    error_message    TEXT,
    verified_at      BIGINT,
    evidence_source  TEXT,
    needs_review     BOOLEAN NOT NULL DEFAULT 0,
    redo_safe        BOOLEAN NOT NULL DEFAULT 0,
    created_at       BIGINT  NOT NULL,
    updated_at       BIGINT  NOT NULL,
    completed_at     BIGINT,
    expires_at       BIGINT,
    version          BIGINT  NOT NULL,
    connector        TEXT,
    lookup_attempts  BIGINT  NOT NULL DEFAULT 0,
    lease_holder     TEXT,
    UNIQUE (tenant, op_key),
    CHECK (state <> 'SUCCEEDED' OR provider_ref IS NOT NULL OR evidence_source = 'operator')
);
INSERT INTO operations_rebuilt (
    tenant, op_key, action, fingerprint, payload, state, attempt_count, lease_owner,
    lease_expires_at, fencing_token, next_attempt_at, provider_ref, result, error_class,
    error_message, verified_at, evidence_source, needs_review, redo_safe, created_at,
    updated_at, completed_at, expires_at, version, connector, lookup_attempts,
    lease_holder)
SELECT
    tenant, op_key, action, fingerprint, payload, state, attempt_count, lease_owner,
    lease_expires_at, fencing_token, next_attempt_at, provider_ref, result, error_class,
    error_message, verified_at, evidence_source, needs_review, redo_safe, created_at,
    updated_at, completed_at, expires_at, version, connector, lookup_attempts,
    lease_holder
FROM operations;
DROP TABLE operations;
ALTER TABLE operations_rebuilt RENAME TO operations;
CREATE INDEX operations_by_created ON operations (tenant, created_at, op_key);
CREATE INDEX operations_executing ON operations (lease_expires_at) WHERE state = 'EXECUTING';
CREATE INDEX operations_pending ON operations (next_attempt_at) WHERE state = 'PENDING';
CREATE INDEX operations_unknown ON operations (next_attempt_at) WHERE state = 'UNKNOWN';
CREATE INDEX operations_by_expiry ON operations (expires_at) WHERE expires_at IS NOT NULL;

CREATE TABLE workflow_instances_rebuilt (
    tenant             TEXT   NOT NULL,
    instance_id        TEXT   NOT NULL,
    workflow           TEXT   NOT NULL,
    definition_version TEXT   NOT NULL,
    source_event       TEXT,
    input              TEXT   NOT NULL,
    input_fingerprint  TEXT   NOT NULL,
    state              TEXT   NOT NULL CHECK (state = 'RUNNING' OR state = 'SUCCEEDED' OR state = 'FAILED'
                                              OR state = 'PAUSED' OR state = 'COMPENSATING'
                                              OR state = 'COMPENSATED'),
    stopped_step       TEXT,
    error_class        TEXT,
    error_message      TEXT,
    trace_id           TEXT,
    next_run_at        BIGINT,
    created_at         BIGINT NOT NULL,
    updated_at         BIGINT NOT NULL,
    completed_at       BIGINT,
    expires_at         BIGINT,
    version            BIGINT NOT NULL,
    PRIMARY KEY (tenant, instance_id)
);
INSERT INTO workflow_instances_rebuilt (
    tenant, instance_id, workflow, definition_version, source_event, input,
    input_fingerprint, state, stopped_step, error_class, error_message, trace_id,
    next_run_at, created_at, updated_at, completed_at, expires_at, version)
SELECT
    tenant, instance_id, workflow, definition_version, source_event, input,
    input_fingerprint, state, stopped_step, error_class, error_message, trace_id,
    next_run_at, created_at, updated_at, completed_at, expires_at, version
FROM workflow_instances;
DROP TABLE workflow_instances;
ALTER TABLE workflow_instances_rebuilt RENAME TO workflow_instances;
CREATE INDEX workflow_instances_due ON workflow_instances (next_run_at) WHERE next_run_at IS NOT NULL;
CREATE INDEX workflow_instances_by_created ON workflow_instances (tenant, created_at, instance_id);
CREATE INDEX workflow_instances_by_expiry ON workflow_instances (expires_at) WHERE expires_at IS NOT NULL;

CREATE TABLE workflow_steps_rebuilt (
    tenant      TEXT   NOT NULL,
    instance_id TEXT   NOT NULL,
    position    BIGINT NOT NULL,
    step        TEXT   NOT NULL,
    op_key      TEXT   NOT NULL,
    comp_key    TEXT   NOT NULL,
    policy      TEXT   NOT NULL CHECK (policy = 'redo_safe' OR policy = 'lookup_before_redo'
                                       OR policy = 'compensate' OR policy = 'manual'),
    PRIMARY KEY (tenant, instance_id, position)
);
INSERT INTO workflow_steps_rebuilt (tenant, instance_id, position, step, op_key, comp_key, policy)
SELECT tenant, instance_id, position, step, op_key, comp_key, policy FROM workflow_steps;
DROP TABLE workflow_steps;
ALTER TABLE workflow_steps_rebuilt RENAME TO workflow_steps;
CREATE UNIQUE INDEX workflow_steps_by_op ON workflow_steps (tenant, op_key);
CREATE UNIQUE INDEX workflow_steps_by_comp ON workflow_steps (tenant, comp_key);
