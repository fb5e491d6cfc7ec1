-- Fewer index entries written per acquire and completion (each completion is a non-HOT
-- update, so every index of `operations` gets a new entry for it):
-- - `operations.id` was only a surrogate primary key nothing reads: (tenant, op_key) is the
--   primary key now, in place of its unique constraint;
-- - `operations_by_state` served no statement: the list and overview filters are optional
--   (`$n IS NULL OR state = $n`), so their generic plans use `operations_by_created`, and
--   the background queries have their own partial indexes (0005);
-- - the event log's primary key on `seq` was only read by the overview's "recent
--   mismatches", which now has a partial index of its own. `seq` keeps its identity.
-- A pair (acquire + completion) now writes 9 index entries instead of 14.
DROP INDEX operations_by_state;
ALTER TABLE operations DROP COLUMN id;
-- (The unique constraint's index is rebuilt as the primary key's: on a large table this
-- migration takes a while, under an exclusive lock.)
ALTER TABLE operations DROP CONSTRAINT operations_tenant_op_key_key,
    ADD CONSTRAINT operations_pkey PRIMARY KEY (tenant, op_key);
ALTER TABLE operation_events DROP CONSTRAINT operation_events_pkey;
CREATE INDEX operation_events_mismatches ON operation_events (seq) WHERE kind = 'mismatch';
