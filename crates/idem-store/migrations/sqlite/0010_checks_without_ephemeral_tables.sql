-- The hot tables' CHECK constraints without ephemeral tables, and `operations` without
-- AUTOINCREMENT.
--
-- SQLite evaluates `x IN ('A','B','C', ...)` with more than two constants by building an
-- ephemeral B-tree of the list, and in a CHECK constraint it does so for every row
-- written: a B-tree opened, a page zeroed, the list inserted, the B-tree closed — once per
-- acquire and twice per completion in the writer's upsert (scripts/callgrind.sh: with
-- AUTOINCREMENT gone too, 622 300 -> 541 500 instructions per pair). The same rule as an
-- OR of equalities is a few comparisons. `operations.id`'s AUTOINCREMENT updated
-- `sqlite_sequence` on every insert for a column nothing in idem reads (it stays, as a
-- plain rowid alias; `operation_events.seq` keeps AUTOINCREMENT: a seq must never be
-- reused after retention deletes the newest events).
--
-- Neither change touches what is on disk, so the table definitions are edited in place,
-- as https://www.sqlite.org/lang_altertable.html#otheralter describes for such changes,
-- instead of rebuilding the tables: a rebuild would drop triggers a user put on them and
-- rewrite every row. The rows already satisfy the rewritten constraints (they are the same
-- rules). The DDL at the end bumps the schema cookie, so every connection re-reads the
-- schema, and makes SQLite parse the edited definitions inside this transaction: a
-- definition it could not parse fails the migration, and nothing is changed.
-- PostgreSQL evaluates IN lists as arrays, with no such cost, and keeps them.
PRAGMA writable_schema = ON;
UPDATE sqlite_schema
SET sql = replace(replace(sql,
    'CHECK (state IN (''PENDING'',''EXECUTING'',''SUCCEEDED'',''FAILED'',''UNKNOWN''))',
    'CHECK (state = ''PENDING'' OR state = ''EXECUTING'' OR state = ''SUCCEEDED'' OR state = ''FAILED'' OR state = ''UNKNOWN'')'),
    'id               INTEGER PRIMARY KEY AUTOINCREMENT,',
    'id               INTEGER PRIMARY KEY,')
WHERE type = 'table' AND name = 'operations';
UPDATE sqlite_schema
SET sql = replace(sql,
    'CHECK (state IN (''RUNNING'',''SUCCEEDED'',''FAILED'',''PAUSED'',''COMPENSATING'',''COMPENSATED''))',
    'CHECK (state = ''RUNNING'' OR state = ''SUCCEEDED'' OR state = ''FAILED'' OR state = ''PAUSED'' OR state = ''COMPENSATING'' OR state = ''COMPENSATED'')')
WHERE type = 'table' AND name = 'workflow_instances';
UPDATE sqlite_schema
SET sql = replace(sql,
    'CHECK (policy IN (''redo_safe'',''lookup_before_redo'',''compensate'',''manual''))',
    'CHECK (policy = ''redo_safe'' OR policy = ''lookup_before_redo'' OR policy = ''compensate'' OR policy = ''manual'')')
WHERE type = 'table' AND name = 'workflow_steps';
PRAGMA writable_schema = OFF;
DELETE FROM sqlite_sequence WHERE name = 'operations';
CREATE TABLE idem_schema_reload (x);
DROP TABLE idem_schema_reload;
