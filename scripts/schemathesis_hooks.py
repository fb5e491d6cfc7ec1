"""Schemathesis hooks for idem's OpenAPI checks (crates/idem/tests/openapi.rs).

Only rules that JSON Schema cannot state live here; everything it can state is in the
served document (crates/idem-server/src/openapi_contract.rs). Each hook keeps generated
*valid* requests valid in the ways the server must refuse otherwise:

- an idempotency key (or workflow instance id) is bound to its first request: a generated
  key used again with another payload is a correct 422, not a schema violation, so every
  generated request gets a key of its own;
- `fingerprint_fields` must name values inside the payload (a cross-field rule);
- a list `cursor` is one the server issued (`hex("<ms>:<key>")`): a generated string is
  turned into that form, so the position it names is still generated;
- JSON Schema counts `5.0` as an integer; idem reads integers as JSON integers, so a
  generated integral float in a top-level field is sent as the integer it denotes;
- the test server declares no workflow: a start must bring its `steps`, named once each;
  a step's `group` must be consecutive with its siblings, no step's name, and leave
  `{group}:{name}` within 48 characters (a generated group that breaks one is dropped);
  an entry of `groups` must name a group of the steps, once (others are dropped);
- a key in the body and in the `Idempotency-Key` header must be the same, and one of them
  must be there;
- client JSON (`payload`, `result`, `input`) holds I-JSON numbers (within ±2^53);
- a lease `holder` is a UUID made for one attempt: one of a time-based version must be
  recent, and none may be part of the key (idem_core::holder), so a generated holder is
  replaced by a fresh random one.
"""

import itertools
import uuid
from collections.abc import Mapping

import schemathesis


def _keep_groups_valid(steps):
    """Drops each generated `group` that breaks a rule across steps (see the module doc)."""
    names = {s.get("name") for s in steps}
    closed, previous = set(), None
    for step in steps:
        group = step.get("group")
        name = step.get("name") if isinstance(step.get("name"), str) else ""
        if isinstance(group, str) and (
            group in names
            or group in closed
            or len(group) + 1 + len(name) > 48
            or group.startswith(("compensate", "rerun-"))
        ):
            del step["group"]
            group = None
        if previous is not None and previous != group:
            closed.add(previous)
        previous = group if isinstance(group, str) else None


def _keep_settings_valid(body):
    """Keeps the entries of `groups` that name a group of the steps, each once."""
    named = {s.get("group") for s in body.get("steps") or [] if isinstance(s, dict)}
    seen, groups = set(), []
    for g in body["groups"]:
        name = g.get("name") if isinstance(g, dict) else None
        if isinstance(name, str) and name in named and name not in seen:
            seen.add(name)
            groups.append(g)
    body["groups"] = groups


_serial = itertools.count()

# Members whose values are client JSON (kept as sent): never rewritten.
_CLIENT_JSON = {"payload", "result", "input"}


def _unique(value, limit):
    """`value` made unique (across schemathesis' workers and runs on one database), or left
    as it is when the suffix would not fit: a value at its length limit is a boundary
    case schemathesis generated on purpose."""
    suffix = f".{next(_serial)}{uuid.uuid4().hex[:8]}"
    if len(value) + len(suffix) > limit:
        return value
    return value + suffix


def _resolves(document, pointer):
    node = document
    for token in pointer.split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node) and (token == "0" or not token.startswith("0")):
            node = node[int(token)]
        else:
            return False
    return True


_LIMIT = 2**53


def _exact_numbers(value):
    """I-JSON numbers (within ±2^53; what a double carries exactly), which a JSON Schema
    for "any JSON value" cannot state."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and abs(value) > _LIMIT:
        return _LIMIT if value > 0 else -_LIMIT
    if isinstance(value, float) and abs(value) > _LIMIT:
        return float(_LIMIT) if value > 0 else -float(_LIMIT)
    if isinstance(value, list):
        return [_exact_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _exact_numbers(v) for k, v in value.items()}
    return value


def _positive(case, location):
    meta = getattr(case, "_meta", None)
    return meta is None or not meta.is_negative_at(location)


@schemathesis.hook
def before_call(ctx, case, kwargs):
    """Runs in every phase (examples, coverage, fuzzing, stateful) before a request goes out.
    Schemathesis re-validates what a hook changed, so a case stays positive or negative as
    its data is."""
    body = case.body
    if isinstance(body, dict):
        body = dict(body)
        for name, value in body.items():
            if name not in _CLIENT_JSON and isinstance(value, float) and value.is_integer():
                body[name] = int(value)
        if _positive(case, "body"):
            if isinstance(body.get("key"), str) and body["key"].strip():
                body["key"] = _unique(body["key"], 255)
            if isinstance(body.get("instance_id"), str) and body["instance_id"].strip():
                body["instance_id"] = _unique(body["instance_id"], 192)
            if isinstance(body.get("holder"), str):
                body["holder"] = str(uuid.uuid4())
            for name in _CLIENT_JSON & body.keys():
                body[name] = _exact_numbers(body[name])
            if isinstance(body.get("steps"), list):
                seen = set()
                steps = []
                for step in body["steps"]:
                    if isinstance(step, dict) and step.get("name") not in seen:
                        seen.add(step.get("name"))
                        steps.append(step)
                _keep_groups_valid(steps)
                body["steps"] = steps
            is_acquire = "action" in body and "outcome" not in body and "workflow" not in body
            has_header = isinstance(case.headers, Mapping) and case.headers.get("Idempotency-Key")
            if is_acquire and ctx.operation.path == "/v1/operations" and body.get("key") is None and not has_header:
                # The key comes in the body or the Idempotency-Key header (a cross-field rule).
                body["key"] = _unique("generated-key", 255)
            fields = body.get("fingerprint_fields")
            if isinstance(fields, list) and not all(isinstance(f, str) and _resolves(body.get("payload"), f) for f in fields):
                del body["fingerprint_fields"]
            if "workflow" in body and "instance_id" in body and not body.get("steps"):
                body["steps"] = [{"name": "step"}]
            if isinstance(body.get("groups"), list):
                _keep_settings_valid(body)
        case.body = body
    headers = case.headers
    if isinstance(headers, Mapping) and isinstance(headers.get("Idempotency-Key"), str):
        headers = dict(headers)
        key = headers["Idempotency-Key"]
        body_key = case.body.get("key") if isinstance(case.body, dict) else None
        if isinstance(body_key, str) and body_key.isascii() and body_key.isprintable():
            # Both given: they must name the same key (a cross-field rule); the header
            # carries it as an RFC 8941 string.
            if any(c in body_key for c in ' "\\'):
                quoted = body_key.replace("\\", "\\\\").replace('"', '\\"')
                headers["Idempotency-Key"] = f'"{quoted}"'
            else:
                headers["Idempotency-Key"] = body_key
        elif key.strip() and key.isascii() and key.isprintable():
            headers["Idempotency-Key"] = _unique(key, 255)
        case.headers = headers
    query = case.query
    if isinstance(query, Mapping) and isinstance(query.get("cursor"), str):
        query = dict(query)
        query["cursor"] = f"0:{query['cursor']}".encode().hex()
        case.query = query
