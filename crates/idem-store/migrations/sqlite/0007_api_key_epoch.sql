-- The server caches API keys (src/key_cache.rs) and empties its cache when this counter
-- changes; it reads it every 100 ms. Triggers bump it on any change to api_keys other
-- than an insert, so a revocation made by another process on the same file (`idem keys
-- revoke`) or by hand reaches a running server too.
CREATE TABLE api_key_epoch (
    id    INTEGER PRIMARY KEY CHECK (id = 1),
    epoch INTEGER NOT NULL
);
INSERT INTO api_key_epoch (id, epoch) VALUES (1, 0);

CREATE TRIGGER api_keys_updated AFTER UPDATE ON api_keys
BEGIN
    UPDATE api_key_epoch SET epoch = epoch + 1 WHERE id = 1;
END;

CREATE TRIGGER api_keys_deleted AFTER DELETE ON api_keys
BEGIN
    UPDATE api_key_epoch SET epoch = epoch + 1 WHERE id = 1;
END;
