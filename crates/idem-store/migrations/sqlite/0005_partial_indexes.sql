-- (SQLite has no migration 0004: that one is PostgreSQL's API key NOTIFY trigger.)
-- Partial indexes for the background queries, so that a record is in them only while it
-- is what they look for. Every acquire and completion writes the indexes of the rows it
-- touches; a finished record (most of the table) now sits in none of these three, and a
-- new one only in `operations_executing`. Same queries, same plans (EXPLAIN checked in
-- the store's tests, `background_queries_use_the_partial_indexes`).
DROP INDEX operations_by_lease;
DROP INDEX operations_due;
DROP INDEX operations_by_expiry;
-- expire_leases, and due_executions' expired redo-safe leases.
CREATE INDEX operations_executing ON operations (lease_expires_at) WHERE state = 'EXECUTING';
-- due_executions.
CREATE INDEX operations_pending ON operations (next_attempt_at) WHERE state = 'PENDING';
-- due_reconciliations.
CREATE INDEX operations_unknown ON operations (next_attempt_at) WHERE state = 'UNKNOWN';
-- sweep: only final records have an expiry.
CREATE INDEX operations_by_expiry ON operations (expires_at) WHERE expires_at IS NOT NULL;
