-- idem schema version 2 (PostgreSQL): one rule for every identifier (issue 28 §3), the
-- same as idem_core::ident, idem_core::key and idem_core::outbox in the Rust library, with
-- the same messages. Version 1 took an id made only of spaces, or with spaces around it:
-- idem.inbox_claim('payments', '    ', …) applied a message, a second message whose id was
-- lost too was a "conflict" and never applied, and ' evt-7' and 'evt-7' were two messages.

-- The characters that pad text invisibly (idem_core::ident::is_padding): Unicode
-- White_Space and U+180E, U+200B-U+200D, U+2060, U+FEFF.
CREATE FUNCTION idem.padding_class() RETURNS text LANGUAGE sql IMMUTABLE AS $$
  SELECT '[\t\n\u000b\f\r \u0085\u00a0\u1680\u2000-\u200d\u2028\u2029\u202f\u205f\u2060\u3000\u180e\ufeff]'
$$;

-- What is wrong with identifier p_id of kind p_what (at most p_max bytes), in the words
-- of idem_core::ident::IdError; NULL when nothing is.
CREATE FUNCTION idem.identifier_error(p_what text, p_id text, p_max integer) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  pad text := idem.padding_class();
BEGIN
  IF p_id IS NULL OR p_id = '' THEN
    RETURN p_what || ' is empty';
  END IF;
  IF octet_length(p_id) > p_max THEN
    RETURN format('%s has %s bytes; at most %s are allowed', p_what, octet_length(p_id), p_max);
  END IF;
  IF p_id ~ ('^' || pad || '+$') THEN
    RETURN p_what || ' is blank: it has only whitespace (a lost or unset id?); send the real id';
  END IF;
  IF p_id ~ ('^' || pad) OR p_id ~ (pad || '$') THEN
    RETURN p_what || ' starts or ends with whitespace; ids are compared exactly, so trim it where it is made (" evt-7" and "evt-7" would be two)';
  END IF;
  IF p_id ~ '[\x01-\x1f\x7f-\x9f]' THEN
    RETURN format('%s has a control character at byte %s', p_what,
                  octet_length(substring(p_id FROM '^[^\x01-\x1f\x7f-\x9f]*')));
  END IF;
  RETURN NULL;
END $$;

-- idem_core::inbox::check_id: the identifier rule, then printable ASCII.
CREATE OR REPLACE FUNCTION idem.check_id(p_what text, p_id text) RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  v_error text := idem.identifier_error(p_what, p_id, {{MAX_MESSAGE_ID_LEN}});
BEGIN
  IF v_error IS NOT NULL THEN
    RAISE EXCEPTION '%', v_error USING ERRCODE = '22023';
  END IF;
  IF p_id !~ '^[ -~]+$' THEN
    RAISE EXCEPTION '% must be 1-255 printable ASCII characters', p_what USING ERRCODE = '22023';
  END IF;
END $$;

-- What is wrong with idempotency key p_key, in the words of idem_core::key::KeyError (the
-- rules of IdempotencyKey::parse, personal-data detector included); NULL when nothing is.
CREATE FUNCTION idem.key_error(p_key text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  v_decoded text;
  v_domain text;
  v_run text;
BEGIN
  IF p_key IS NULL OR p_key = '' THEN
    RETURN 'the idempotency key is empty; it must have 1 to 255 characters';
  END IF;
  IF octet_length(p_key) > 255 THEN
    RETURN format('the idempotency key has %s characters; at most 255 are allowed', char_length(p_key));
  END IF;
  IF p_key !~ '^[ -~]+$' THEN
    RETURN format('the idempotency key has a character outside printable ASCII (0x20-0x7E) at position %s',
                  octet_length(substring(p_key FROM '^[ -~]*')));
  END IF;
  IF p_key LIKE ' %' OR p_key LIKE '% ' THEN
    RETURN 'the idempotency key starts or ends with a space';
  END IF;
  IF p_key IN ('.', '..') THEN
    RETURN 'the idempotency key cannot be "." or "..": URLs treat those as directory steps';
  END IF;
  -- E-mail: local@domain.tld, also with %40; the domain is the run of [A-Za-z0-9.-] after
  -- the @ without trailing dots, with a first label, a dot, and a last label that starts
  -- with two letters.
  v_decoded := replace(p_key, '%40', '@');
  FOR v_domain IN SELECT m[1] FROM regexp_matches(v_decoded, '(?<=[A-Za-z0-9._%+-])@([A-Za-z0-9.-]*)', 'g') AS m LOOP
    v_domain := rtrim(v_domain, '.');
    IF v_domain !~ '^\.' AND v_domain <> '' AND position('.' IN v_domain) > 0
       AND substring(v_domain FROM '[^.]*$') ~ '^[A-Za-z]{2}' THEN
      RETURN 'the idempotency key contains an e-mail address; keys are logged and kept after the payload expires, so derive them from business ids, not personal data';
    END IF;
  END LOOP;
  -- Phone: a + not after a letter, digit or dot, with 8-15 digits among the digits and
  -- separators ( .-()) after it; or the North American grouping standing alone.
  FOR v_run IN SELECT m[1] FROM regexp_matches(p_key, '(?<![A-Za-z0-9.])\+([0-9 .()-]*)', 'g') AS m LOOP
    IF length(regexp_replace(v_run, '[^0-9]', '', 'g')) BETWEEN 8 AND 15 THEN
      RETURN 'the idempotency key contains a phone number; keys are logged and kept after the payload expires, so derive them from business ids, not personal data';
    END IF;
  END LOOP;
  IF p_key ~ '(?<![A-Za-z0-9])(\([0-9]{3}\) ?|[0-9]{3}[-. ])[0-9]{3}[-. ][0-9]{4}(?![A-Za-z0-9])' THEN
    RETURN 'the idempotency key contains a phone number; keys are logged and kept after the payload expires, so derive them from business ids, not personal data';
  END IF;
  RETURN NULL;
END $$;

-- idem.key_claim with the key rules of the Rust claim (idem_outbox::tx::claim), which
-- version 1 did not check beyond printable ASCII.
CREATE OR REPLACE FUNCTION idem.key_claim(
  p_key text, p_fingerprint text,
  OUT decision text, OUT result jsonb, OUT recorded_fingerprint text
) LANGUAGE plpgsql AS $$
DECLARE
  v_error text := idem.key_error(p_key);
BEGIN
  IF v_error IS NOT NULL THEN
    RAISE EXCEPTION '%', v_error USING ERRCODE = '22023';
  END IF;
  SELECT * INTO decision, result, recorded_fingerprint FROM idem.claim('idem.keys', p_key, p_fingerprint);
END $$;

-- The aggregates of an outbox event follow the identifier rule too, checked first, as
-- idem_core::outbox::NewEvent::validate checks them first, so every bad event gets the
-- message Rust gives it. Version 1's function, renamed, does the rest (migrations are
-- kept as they ran).
ALTER FUNCTION idem.outbox_append(text, text, text, text, json, json) RENAME TO outbox_append_v1;

CREATE FUNCTION idem.outbox_append(
  p_id text, p_aggregate_type text, p_aggregate_id text, p_topic text, p_payload json,
  p_headers json DEFAULT '{}'
) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
  pad text := idem.padding_class();
BEGIN
  IF p_aggregate_type ~ ('^' || pad) OR p_aggregate_type ~ (pad || '$')
     OR p_aggregate_id ~ ('^' || pad) OR p_aggregate_id ~ (pad || '$') THEN
    RAISE EXCEPTION 'idem.outbox_append: aggregate_type and aggregate_id must not be blank or start or end with whitespace' USING ERRCODE = '22023';
  END IF;
  RETURN idem.outbox_append_v1(p_id, p_aggregate_type, p_aggregate_id, p_topic, p_payload, p_headers);
END $$;
