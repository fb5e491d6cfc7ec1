-- Every node caches API keys (src/key_cache.rs) and empties its cache when
-- this channel is notified. A statement trigger, so that any change other than an insert
-- (idem's own revocation, or an UPDATE or DELETE made by hand) reaches every node.
-- NOTIFY is delivered at commit, and not at all if the transaction rolls back.
CREATE FUNCTION idem_api_keys_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_api_keys', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER api_keys_changed
    AFTER UPDATE OR DELETE OR TRUNCATE ON api_keys
    FOR EACH STATEMENT EXECUTE FUNCTION idem_api_keys_changed();
