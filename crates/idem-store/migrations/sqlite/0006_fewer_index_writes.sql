-- Fewer index entries written per acquire and completion (the PostgreSQL migration of the
-- same number also drops surrogate keys; here `id` and `seq` are rowids and cost nothing):
-- - `operations_by_state` served no statement: the list and overview filters are optional
--   (`$n IS NULL OR state = $n`), so their plans use `operations_by_created`, and the
--   background queries have their own partial indexes (0005);
-- - the overview's "recent mismatches" gets a partial index instead of scanning the log.
DROP INDEX operations_by_state;
CREATE INDEX operation_events_mismatches ON operation_events (seq) WHERE kind = 'mismatch';
