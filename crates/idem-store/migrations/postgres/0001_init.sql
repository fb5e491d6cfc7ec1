-- idem ledger, PostgreSQL. Instants are epoch milliseconds (BIGINT); JSON is stored as text.
CREATE TABLE operations (
    id               BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant           TEXT    NOT NULL,
    op_key           TEXT    NOT NULL,
    action           TEXT    NOT NULL,
    fingerprint      TEXT    NOT NULL,
    payload          TEXT    NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN ('PENDING','EXECUTING','SUCCEEDED','FAILED','UNKNOWN')),
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
    needs_review     BOOLEAN NOT NULL DEFAULT FALSE,
    redo_safe        BOOLEAN NOT NULL DEFAULT FALSE,
    created_at       BIGINT  NOT NULL,
    updated_at       BIGINT  NOT NULL,
    completed_at     BIGINT,
    expires_at       BIGINT,
    version          BIGINT  NOT NULL,
    UNIQUE (tenant, op_key),
    CHECK (state <> 'SUCCEEDED' OR provider_ref IS NOT NULL OR evidence_source = 'operator')
);
CREATE INDEX operations_by_state ON operations (tenant, state, id);
CREATE INDEX operations_by_lease ON operations (state, lease_expires_at);

CREATE TABLE operation_events (
    seq           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant        TEXT   NOT NULL,
    op_key        TEXT   NOT NULL,
    at            BIGINT NOT NULL,
    kind          TEXT   NOT NULL,
    principal     TEXT   NOT NULL,
    request_id    TEXT,
    from_state    TEXT,
    to_state      TEXT,
    fencing_token BIGINT,
    fingerprint   TEXT,
    reason        TEXT,
    error_class   TEXT,
    wait_ms       BIGINT
);
CREATE INDEX operation_events_by_op ON operation_events (tenant, op_key, seq);

CREATE TABLE api_keys (
    id         TEXT   PRIMARY KEY,
    key_hash   TEXT   NOT NULL UNIQUE,
    tenant     TEXT   NOT NULL,
    principal  TEXT   NOT NULL,
    role       TEXT   NOT NULL CHECK (role IN ('client','operator','admin')),
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);
