-- idem schema version 1 (PostgreSQL): the one atomic boundary, the outbox and the inbox in
-- the application's own database. Installed by `idem schema install`; {{NAME}} placeholders
-- are idem-core's limits, filled in at install time. Instants are epoch milliseconds on the
-- database's clock (idem.now_ms()).

CREATE FUNCTION idem.now_ms() RETURNS bigint LANGUAGE sql VOLATILE AS $$
  SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint
$$;

-- Messages a consumer claimed (idem.inbox_claim / idem.inbox_finish), and idempotency keys
-- claimed inside the application's transaction (idem.key_claim / idem.key_finish: consumer
-- 'idem.keys', the key as message id, the result as outcome). Consumer names starting with
-- 'idem.' are idem's own.
CREATE TABLE idem.inbox (
  consumer text NOT NULL,
  message_id text NOT NULL,
  fingerprint text NOT NULL,             -- of the content the producer declared, never transport headers
  outcome jsonb,                         -- stored by finish, returned to a redelivery (a key's result)
  conflicts integer NOT NULL DEFAULT 0,
  last_conflict_fingerprint text,
  last_conflict_at bigint,
  claimed_at bigint NOT NULL,
  finished_at bigint,
  PRIMARY KEY (consumer, message_id)
);

-- Events appended in the business transaction; the relay delivers them at least once.
CREATE TABLE idem.outbox (
  seq bigserial PRIMARY KEY,             -- per aggregate: commit order (outbox_append locks the aggregate)
  id text NOT NULL UNIQUE,               -- the receiver's dedupe key: webhook-id, Nats-Msg-Id
  aggregate_type text NOT NULL,
  aggregate_id text NOT NULL,
  topic text NOT NULL,
  payload json NOT NULL,                 -- json, not jsonb: sent exactly as appended
  headers jsonb NOT NULL DEFAULT '{}',
  created_at bigint NOT NULL,
  state text NOT NULL DEFAULT 'PENDING' CHECK (state IN ('PENDING', 'DELIVERED', 'DEAD', 'SKIPPED')),
  attempts integer NOT NULL DEFAULT 0,
  next_attempt_at bigint,
  manual boolean NOT NULL DEFAULT false, -- the next attempt is an operator's redrive
  lease_owner text,                      -- the relay holding the row
  lease_expires_at bigint,
  fencing_token bigint NOT NULL DEFAULT 0,
  sink text,
  evidence text,
  error_class text,
  error_message text,
  delivered_at bigint
);
-- Open events by aggregate, in order: the relay's head-of-line read.
CREATE INDEX outbox_open ON idem.outbox (aggregate_type, aggregate_id, seq) WHERE state IN ('PENDING', 'DEAD');
-- Pending events oldest first: where the relay's claim starts.
CREATE INDEX outbox_pending ON idem.outbox (seq) WHERE state = 'PENDING';

-- Relays waiting for work (until `until_ms`, refreshed while they wait): appenders NOTIFY
-- only while one is.
CREATE TABLE idem.relay_idle (
  relay text PRIMARY KEY,
  until_ms bigint NOT NULL
);

-- Delivered and skipped events by age, for the relay's retention sweep.
CREATE INDEX outbox_done ON idem.outbox (created_at) WHERE state IN ('DELIVERED', 'SKIPPED');

-- Every delivery attempt and every operator action, append-only.
CREATE TABLE idem.outbox_attempts (
  event_seq bigint NOT NULL REFERENCES idem.outbox (seq) ON DELETE CASCADE,
  at bigint NOT NULL,
  kind text NOT NULL,                    -- attempt | redrive | skip
  trigger text,                          -- scheduled | manual (attempts)
  relay text,
  fencing_token bigint,
  result text,                           -- delivered | retry | dead (attempts)
  sink text,
  error_class text,
  message text,
  evidence text,
  operator text,                         -- redrive | skip: who
  reason text                            -- redrive | skip: why (mandatory)
);
CREATE INDEX outbox_attempts_event ON idem.outbox_attempts (event_seq);

CREATE FUNCTION idem.outbox_append(
  p_id text, p_aggregate_type text, p_aggregate_id text, p_topic text, p_payload json,
  p_headers json DEFAULT '{}'
) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
  v_headers jsonb := coalesce(p_headers::jsonb, '{}');
  v_seq bigint;
  v_size integer;
  v_key text;
  v_value jsonb;
BEGIN
  -- The rules and messages of idem_core::outbox::NewEvent::validate.
  IF p_id IS NULL OR p_id = '' THEN
    RAISE EXCEPTION 'idem.outbox_append: event id is missing' USING ERRCODE = '22023';
  END IF;
  IF octet_length(p_id) > {{MAX_EVENT_ID_LEN}} OR p_id !~ '^[!-~]+$' THEN
    RAISE EXCEPTION 'idem.outbox_append: event id must be 1-255 printable ASCII characters without spaces' USING ERRCODE = '22023';
  END IF;
  IF p_aggregate_type IS NULL OR p_aggregate_type = '' THEN
    RAISE EXCEPTION 'idem.outbox_append: aggregate_type is missing' USING ERRCODE = '22023';
  END IF;
  IF p_aggregate_id IS NULL OR p_aggregate_id = '' THEN
    RAISE EXCEPTION 'idem.outbox_append: aggregate_id is missing' USING ERRCODE = '22023';
  END IF;
  IF octet_length(p_aggregate_type) > {{MAX_AGGREGATE_LEN}} OR octet_length(p_aggregate_id) > {{MAX_AGGREGATE_LEN}}
     OR p_aggregate_type ~ '[\x01-\x1f\x7f-\x9f]' OR p_aggregate_id ~ '[\x01-\x1f\x7f-\x9f]' THEN
    RAISE EXCEPTION 'idem.outbox_append: aggregate_type and aggregate_id must be at most 255 bytes without control characters' USING ERRCODE = '22023';
  END IF;
  IF p_topic IS NULL OR p_topic = '' THEN
    RAISE EXCEPTION 'idem.outbox_append: topic is missing' USING ERRCODE = '22023';
  END IF;
  IF octet_length(p_topic) > {{MAX_TOPIC_LEN}} OR p_topic !~ '^[A-Za-z0-9_:-]+(\.[A-Za-z0-9_:-]+)*$' THEN
    RAISE EXCEPTION 'idem.outbox_append: topic must be 1-255 characters of [A-Za-z0-9_:-] in dot-separated tokens' USING ERRCODE = '22023';
  END IF;
  IF p_payload IS NULL THEN
    RAISE EXCEPTION 'idem.outbox_append: payload is missing (use the JSON null for none)' USING ERRCODE = '22023';
  END IF;
  v_size := octet_length(p_payload::text);
  IF v_size > {{MAX_PAYLOAD_BYTES}} THEN
    RAISE EXCEPTION 'idem.outbox_append: payload is % bytes; at most {{MAX_PAYLOAD_BYTES}} are allowed', v_size USING ERRCODE = '22023';
  END IF;
  IF jsonb_typeof(v_headers) <> 'object' OR (SELECT count(*) FROM jsonb_object_keys(v_headers)) > {{MAX_HEADERS}} THEN
    RAISE EXCEPTION 'idem.outbox_append: headers: at most 32, names are HTTP tokens not starting with webhook- or nats- and not a framing or connection header (content-length, transfer-encoding, host, connection, ...), values at most 1024 bytes without control characters' USING ERRCODE = '22023';
  END IF;
  FOR v_key, v_value IN SELECT * FROM jsonb_each(v_headers) LOOP
    IF octet_length(v_key) > {{MAX_HEADER_LEN}} OR v_key !~ '^[A-Za-z0-9!#$%&''*+.^_`|~-]+$'
       OR lower(v_key) LIKE 'webhook-%' OR lower(v_key) LIKE 'nats-%'
       OR lower(v_key) IN ('connection', 'content-length', 'expect', 'host', 'keep-alive',
                           'proxy-connection', 'te', 'trailer', 'transfer-encoding', 'upgrade')
       OR jsonb_typeof(v_value) <> 'string' OR octet_length(v_value #>> '{}') > {{MAX_HEADER_LEN}}
       OR (v_value #>> '{}') ~ '[\x01-\x1f\x7f-\x9f]' THEN
      RAISE EXCEPTION 'idem.outbox_append: headers: at most 32, names are HTTP tokens not starting with webhook- or nats- and not a framing or connection header (content-length, transfer-encoding, host, connection, ...), values at most 1024 bytes without control characters' USING ERRCODE = '22023';
    END IF;
  END LOOP;
  -- One appender per aggregate at a time, until its commit: a later event of the
  -- aggregate gets a larger seq *and* commits later, so seq order is commit order per
  -- aggregate and no relay can deliver past an event still to be committed.
  PERFORM pg_advisory_xact_lock(hashtext('idem.outbox'), hashtext(p_aggregate_type || '/' || p_aggregate_id));
  INSERT INTO idem.outbox (id, aggregate_type, aggregate_id, topic, payload, headers, created_at)
  VALUES (p_id, p_aggregate_type, p_aggregate_id, p_topic, p_payload, v_headers, idem.now_ms())
  RETURNING seq INTO v_seq;
  -- A hint to idle relays, sent at commit (never for a rolled-back append). Only while a
  -- relay says it is idle: NOTIFY serializes committing transactions on the notification
  -- queue, halving the commit rate of busy producers, and a busy relay needs no hint.
  IF EXISTS (SELECT 1 FROM idem.relay_idle WHERE until_ms > idem.now_ms()) THEN
    PERFORM pg_notify('idem_outbox', '');
  END IF;
  RETURN v_seq;
END $$;

-- The decision table of idem_core::inbox::decide_inbox, on idem.inbox: behind
-- idem.inbox_claim and idem.key_claim.
CREATE FUNCTION idem.claim(
  p_consumer text, p_message_id text, p_fingerprint text,
  OUT decision text, OUT outcome jsonb, OUT recorded_fingerprint text
) LANGUAGE plpgsql AS $$
DECLARE
  r idem.inbox;
BEGIN
  PERFORM idem.check_id('fingerprint', p_fingerprint);
  INSERT INTO idem.inbox (consumer, message_id, fingerprint, claimed_at)
  VALUES (p_consumer, p_message_id, p_fingerprint, idem.now_ms())
  ON CONFLICT DO NOTHING;
  IF FOUND THEN
    decision := 'apply';
    RETURN;
  END IF;
  -- Another transaction's claim (committed: ON CONFLICT waited for it).
  SELECT * INTO r FROM idem.inbox WHERE consumer = p_consumer AND message_id = p_message_id FOR UPDATE;
  recorded_fingerprint := r.fingerprint;
  IF r.fingerprint = p_fingerprint THEN
    decision := 'duplicate';
    outcome := r.outcome;
  ELSE
    UPDATE idem.inbox SET conflicts = conflicts + 1, last_conflict_fingerprint = p_fingerprint,
      last_conflict_at = idem.now_ms()
    WHERE consumer = p_consumer AND message_id = p_message_id;
    decision := 'conflict';
  END IF;
END $$;

-- Records the outcome on a claim made in this transaction (or earlier).
CREATE FUNCTION idem.finish(p_consumer text, p_message_id text, p_outcome json) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  UPDATE idem.inbox SET outcome = p_outcome::jsonb, finished_at = idem.now_ms()
  WHERE consumer = p_consumer AND message_id = p_message_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'idem: nothing was claimed as % for %: call idem.inbox_claim or idem.key_claim first',
      p_message_id, p_consumer USING ERRCODE = '22023';
  END IF;
END $$;

CREATE FUNCTION idem.check_consumer(p_consumer text) RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
  PERFORM idem.check_id('consumer', p_consumer);
  IF p_consumer LIKE 'idem.%' THEN
    RAISE EXCEPTION 'consumer names starting with idem. are reserved' USING ERRCODE = '22023';
  END IF;
END $$;

CREATE FUNCTION idem.inbox_claim(
  p_consumer text, p_message_id text, p_fingerprint text,
  OUT decision text, OUT outcome jsonb, OUT recorded_fingerprint text
) LANGUAGE plpgsql AS $$
BEGIN
  PERFORM idem.check_consumer(p_consumer);
  PERFORM idem.check_id('message id', p_message_id);
  SELECT * INTO decision, outcome, recorded_fingerprint FROM idem.claim(p_consumer, p_message_id, p_fingerprint);
END $$;

CREATE FUNCTION idem.inbox_finish(p_consumer text, p_message_id text, p_outcome json) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM idem.check_consumer(p_consumer);
  PERFORM idem.finish(p_consumer, p_message_id, p_outcome);
END $$;

-- The same decision for a key claimed in the application's transaction.
CREATE FUNCTION idem.key_claim(
  p_key text, p_fingerprint text,
  OUT decision text, OUT result jsonb, OUT recorded_fingerprint text
) LANGUAGE plpgsql AS $$
BEGIN
  PERFORM idem.check_id('idempotency key', p_key);
  SELECT * INTO decision, result, recorded_fingerprint FROM idem.claim('idem.keys', p_key, p_fingerprint);
END $$;

CREATE FUNCTION idem.key_finish(p_key text, p_result json) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  PERFORM idem.finish('idem.keys', p_key, p_result);
END $$;

-- idem_core::inbox::check_id.
CREATE FUNCTION idem.check_id(p_what text, p_id text) RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
  IF p_id IS NULL OR p_id = '' OR octet_length(p_id) > {{MAX_MESSAGE_ID_LEN}} OR p_id !~ '^[ -~]+$' THEN
    RAISE EXCEPTION '% must be 1-255 printable ASCII characters', p_what USING ERRCODE = '22023';
  END IF;
END $$;
