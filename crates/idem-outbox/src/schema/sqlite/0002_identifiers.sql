-- idem schema version 2 (SQLite): one rule for every identifier (issue 28 §3). On SQLite
-- the Rust library checks ids (idem_core::ident, key, inbox, outbox) before it writes, as
-- it did before; the tables do not change. This version exists so that both databases
-- number their schema alike.
SELECT 1;
