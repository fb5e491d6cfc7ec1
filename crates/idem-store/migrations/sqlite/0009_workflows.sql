-- Workflows (DESIGN.md §8). A step's state is its operation's state: `workflow_steps` keeps
-- only what the operation record lacks (position, name, the keys of its operation and of
-- its compensation's, the pinned recovery policy), so a checkpoint and its step's state
-- can never disagree.
CREATE TABLE workflow_definitions (
    tenant     TEXT   NOT NULL,
    name       TEXT   NOT NULL,
    version    TEXT   NOT NULL,
    definition TEXT   NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, name, version)
);

CREATE TABLE workflow_instances (
    tenant             TEXT   NOT NULL,
    instance_id        TEXT   NOT NULL,
    workflow           TEXT   NOT NULL,
    definition_version TEXT   NOT NULL,
    source_event       TEXT,
    input              TEXT   NOT NULL,
    input_fingerprint  TEXT   NOT NULL,
    state              TEXT   NOT NULL CHECK (state IN ('RUNNING','SUCCEEDED','FAILED','PAUSED','COMPENSATING','COMPENSATED')),
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
-- The runner's work queue, the list page, and the retention sweep.
CREATE INDEX workflow_instances_due ON workflow_instances (next_run_at) WHERE next_run_at IS NOT NULL;
CREATE INDEX workflow_instances_by_created ON workflow_instances (tenant, created_at, instance_id);
CREATE INDEX workflow_instances_by_expiry ON workflow_instances (expires_at) WHERE expires_at IS NOT NULL;

CREATE TABLE workflow_steps (
    tenant      TEXT   NOT NULL,
    instance_id TEXT   NOT NULL,
    position    BIGINT NOT NULL,
    step        TEXT   NOT NULL,
    op_key      TEXT   NOT NULL,
    comp_key    TEXT   NOT NULL,
    policy      TEXT   NOT NULL CHECK (policy IN ('redo_safe','lookup_before_redo','compensate','manual')),
    PRIMARY KEY (tenant, instance_id, position)
);
-- An operation belongs to at most one step, as its effect or as its compensation (the
-- checkpoints join, the reconciler and the sweeper ask by key).
CREATE UNIQUE INDEX workflow_steps_by_op ON workflow_steps (tenant, op_key);
CREATE UNIQUE INDEX workflow_steps_by_comp ON workflow_steps (tenant, comp_key);

CREATE TABLE workflow_events (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant      TEXT   NOT NULL,
    instance_id TEXT   NOT NULL,
    at          BIGINT NOT NULL,
    kind        TEXT   NOT NULL,
    principal   TEXT   NOT NULL,
    request_id  TEXT,
    from_state  TEXT,
    to_state    TEXT,
    step        TEXT,
    reason      TEXT
);
CREATE INDEX workflow_events_by_instance ON workflow_events (tenant, instance_id, seq);

CREATE TABLE workflow_tombstones (
    tenant            TEXT   NOT NULL,
    id_hash           TEXT   NOT NULL,
    input_fingerprint TEXT   NOT NULL,
    final_state       TEXT   NOT NULL,
    completed_at      BIGINT NOT NULL,
    expires_at        BIGINT NOT NULL,
    PRIMARY KEY (tenant, id_hash)
);
