-- Retention: what is left of a removed final record, so a late retry is answered 410
-- instead of executing again. The key itself is not kept, only its SHA-256.
CREATE TABLE tombstones (
    tenant       TEXT   NOT NULL,
    key_hash     TEXT   NOT NULL,
    fingerprint  TEXT   NOT NULL,
    final_state  TEXT   NOT NULL CHECK (final_state IN ('SUCCEEDED','FAILED')),
    completed_at BIGINT NOT NULL,
    expires_at   BIGINT NOT NULL,
    PRIMARY KEY (tenant, key_hash)
);
CREATE INDEX tombstones_by_expiry ON tombstones (expires_at);
-- The sweeper finds expired final records by expires_at (set only on final records).
CREATE INDEX operations_by_expiry ON operations (expires_at);
