-- Server-side execution and reconciliation: which connector performs the side effect
-- (NULL = the caller does), and how many lookups were made since it became UNKNOWN.
ALTER TABLE operations ADD COLUMN connector TEXT;
ALTER TABLE operations ADD COLUMN lookup_attempts BIGINT NOT NULL DEFAULT 0;
-- Due work (PENDING retries, UNKNOWN lookups) is found by state and next_attempt_at.
CREATE INDEX operations_due ON operations (state, next_attempt_at);
-- Listing pages through a tenant's records newest first, by (created_at, key).
CREATE INDEX operations_by_created ON operations (tenant, created_at, op_key);
