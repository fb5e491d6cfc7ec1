"""JSON as idem keeps it: what may be stored, and the fingerprint any client can recompute.

idem stores payloads and results as JSON values and refuses what does not interoperate
(I-JSON, RFC 7493): duplicate member names (also names equal after Unicode NFC), numbers an
IEEE 754 double does not carry exactly or beyond ±2^53, more than 64 levels of nesting
(README "Request fields"). :func:`to_json` checks a Python value against those rules before
anything is sent, so a bad value fails early with the path to it.
"""

from __future__ import annotations

import hashlib
import json
import math
import unicodedata
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from ._errors import InvalidInputError
from ._records import JSON

#: Largest integer magnitude I-JSON (RFC 7493 §2.2) carries exactly: 2^53.
MAX_SAFE_INT = 2**53
#: Deepest nesting of arrays and objects idem stores (README "Request fields").
MAX_DEPTH = 64


class NotJSONError(InvalidInputError):
    """A value cannot be stored as JSON by idem; the message names its path (a JSON pointer)."""


#: Where a value sits: the root's text (``"payload "``), or its parent's place and its member
#: name or index. Made into a JSON pointer only for an error, not for every value checked.
_Path = str | tuple["_Path", str | int]


def _pointer(path: _Path) -> str:
    segments: list[str] = []
    while isinstance(path, tuple):
        path, seg = path
        segments.append(str(seg) if isinstance(seg, int) else seg.replace("~", "~0").replace("/", "~1"))
    return path + "".join("/" + s for s in reversed(segments))


def _fail(path: _Path, why: str) -> NotJSONError:
    return NotJSONError(f"{_pointer(path) or '/'}: {why}")


def _check_str(s: str, path: _Path) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail(
            path, "a string with a lone surrogate is not Unicode text; JSON cannot carry it"
        ) from None


def to_json(value: object, what: str = "value") -> JSON:
    """``value`` as the JSON idem would store, checked; tuples become lists.

    Accepted: ``None``, ``bool``, ``str``, ``int`` and finite ``float`` within ±2^53, lists and
    tuples of those, dicts with ``str`` keys (no two equal after NFC), at most 64 levels deep.

    Raises:
        NotJSONError: naming the path of the first value that breaks a rule, and ``what``.
    """
    return _convert(value, f"{what} ", 0)


def _convert(v: object, path: _Path, depth: int) -> JSON:
    # the common exact types first, without the isinstance chain (an ABC's is slow)
    if type(v) is str:
        _check_str(v, path)
        return v
    if type(v) is dict and depth < MAX_DEPTH:
        return _convert_members(v, path, depth)
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str):
        _check_str(v, path)
        return v
    if isinstance(v, int):
        if abs(v) > MAX_SAFE_INT:
            raise _fail(
                path,
                f"the integer {v} is beyond ±2^53, which a double does not carry exactly; "
                "send it as a string",
            )
        return int(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _fail(path, f"{v} is not a JSON number")
        if abs(v) > MAX_SAFE_INT:
            raise _fail(
                path, f"the number {v!r} is beyond ±2^53 (I-JSON, RFC 7493 §2.2); send it as a string"
            )
        return v
    if isinstance(v, (list, tuple)):
        if depth >= MAX_DEPTH:
            raise _fail(path, f"nested deeper than {MAX_DEPTH} levels of arrays and objects")
        return [_convert(x, (path, i), depth + 1) for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        if depth >= MAX_DEPTH:
            raise _fail(path, f"nested deeper than {MAX_DEPTH} levels of arrays and objects")
        return _convert_members(v, path, depth)
    raise _fail(path, f"a {type(v).__name__} is not JSON; use dict, list, str, int, float, bool or None")


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _convert_members(v: Mapping[Any, object], path: _Path, depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seen: set[str] = set()
    for k, x in v.items():
        if not isinstance(k, str):
            raise _fail(path, f"member name {k!r} is a {type(k).__name__}; JSON member names are strings")
        _check_str(k, path)
        nfc = k if k.isascii() else unicodedata.normalize("NFC", k)  # ASCII is NFC already
        if nfc in seen:
            raise _fail(path, f"two member names are {nfc!r} after Unicode NFC (I-JSON duplicate names)")
        seen.add(nfc)
        out[k] = _convert(x, (path, k), depth + 1)
    return out


def dumps(value: JSON) -> bytes:
    """The JSON text of a checked value (UTF-8, no NaN)."""
    return _ENCODER.encode(value).encode("utf-8")


def _es_number(x: float) -> str:
    """A double as ECMAScript's Number::toString writes it (RFC 8785 §3.2.2.3)."""
    if x == 0:
        return "0"
    sign, digits, exp = Decimal(repr(x)).normalize().as_tuple()
    assert isinstance(exp, int)
    ds = "".join(map(str, digits))
    k, n = len(ds), exp + len(ds)  # value = 0.ds x 10^n
    if k <= n <= 21:
        text = ds + "0" * (n - k)
    elif 0 < n <= 21:
        text = ds[:n] + "." + ds[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * -n + ds
    else:
        e = n - 1
        text = (ds[0] + ("." + ds[1:] if k > 1 else "")) + "e" + ("+" if e >= 0 else "-") + str(abs(e))
    return ("-" if sign else "") + text


def canonical(value: JSON) -> str:
    """RFC 8785 canonical JSON of ``value`` with every string (and member name) in Unicode NFC
    (UAX #15): member names sorted by their UTF-16 code units, numbers as ECMAScript prints
    their double, no whitespace. What idem fingerprints (README "Request fields")."""
    if isinstance(value, dict):
        items = sorted(
            ((unicodedata.normalize("NFC", k), canonical(x)) for k, x in value.items()),
            key=lambda kv: kv[0].encode("utf-16-be"),
        )
        return "{" + ",".join(json.dumps(k, ensure_ascii=False) + ":" + x for k, x in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(canonical(x) for x in value) + "]"
    if isinstance(value, str):
        return json.dumps(unicodedata.normalize("NFC", value), ensure_ascii=False)
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return _es_number(float(value)) if abs(value) > MAX_SAFE_INT else str(value)
    return _es_number(float(value))


def fingerprint(content: object) -> str:
    """SHA-256 (64 lowercase hex digits) of the canonical JSON of ``content``: the digest idem
    computes for a payload, and the one idem's SQL functions and relay expect for a message or
    key claim (``idem_outbox::inbox::content_fingerprint``).

    Raises:
        NotJSONError: ``content`` cannot be stored as JSON (see :func:`to_json`).
    """
    return hashlib.sha256(canonical(to_json(content, "content")).encode("utf-8")).hexdigest()
