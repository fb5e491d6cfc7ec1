"""Receiving the relay's webhooks: verify the Standard Webhooks signature, then claim the
``webhook-id`` in the inbox, in the transaction that applies the event (README "Receiving
webhooks"). Verification uses the ``standardwebhooks`` package (``pip install
'idem-client[webhooks]'``; the inbox claim also needs ``[postgres]``).

The signature is ``base64(HMAC-SHA256(key, "{webhook-id}.{webhook-timestamp}.{body}"))`` with
the key the base64-decoded secret after ``whsec_``, one ``v1,`` entry per secret the sender
signs with; a ``webhook-timestamp`` more than 5 minutes off is refused (Standard Webhooks
specification, https://www.standardwebhooks.com). Answer 2xx only after your commit.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

try:
    import standardwebhooks
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(
        "idem_client.webhooks needs standardwebhooks: pip install 'idem-client[webhooks]'"
    ) from e

from ._errors import IdemError
from ._json import canonical

if TYPE_CHECKING:
    import psycopg

    from .sql import SqlClaim


class WebhookVerificationError(IdemError):
    """No signature matches with any of the secrets, or the timestamp is more than 5 minutes
    off: answer ``401``, apply nothing."""


class WebhookHeaderError(WebhookVerificationError):
    """``webhook-id``, ``webhook-timestamp`` or ``webhook-signature`` is missing: answer ``400``."""


_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")


def verify(body: bytes | str, headers: Mapping[str, str], secrets: str | Sequence[str]) -> Any:
    """Checks the Standard Webhooks signature of ``body`` with each secret (two while rotating:
    either one verifies) and returns the body's JSON.

    ``headers``: the request's headers (any case). ``secrets``: ``whsec_...`` strings.

    Raises:
        WebhookHeaderError: a signature header is missing.
        WebhookVerificationError: no secret verifies the signature, or the timestamp is off.
    """
    lower = {k.lower(): v for k, v in headers.items()}
    missing = [h for h in _HEADERS if not lower.get(h)]
    if missing:
        raise WebhookHeaderError(f"missing {', '.join(missing)}: not a Standard Webhooks request")
    why = "no secret given"
    for secret in [secrets] if isinstance(secrets, str) else list(secrets):
        try:
            return standardwebhooks.Webhook(secret).verify(body, lower)
        except (standardwebhooks.WebhookVerificationError, ValueError) as e:  # ValueError: a malformed entry
            why = str(e) or type(e).__name__
    raise WebhookVerificationError(f"the webhook's signature does not verify: {why}")


def content_fingerprint(body: bytes | str) -> str:
    """The fingerprint of a message's content, as idem's Rust receiver computes it
    (``idem_outbox::receive``): of the body's JSON (RFC 8785 with NFC, so the sender's formatting
    does not matter), or SHA-256 of the bytes when the body is not JSON (or has member names
    equal after NFC)."""
    raw = body.encode("utf-8") if isinstance(body, str) else body

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [unicodedata.normalize("NFC", k) for k, _ in items]
        if len(set(names)) != len(names):
            raise ValueError("member names equal after NFC")
        return dict(items)

    try:
        value = json.loads(raw, object_pairs_hook=pairs)
        text = canonical(value)
    except ValueError:
        return hashlib.sha256(raw).hexdigest()
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Received:
    """A verified webhook and its inbox claim: ``message_id`` (``webhook-id``), ``payload`` (the
    body's JSON) and ``claim`` (``apply``: apply it in this transaction, then
    :func:`idem_client.sql.finish_message`; ``duplicate``: a redelivery, answer 2xx and do
    nothing; ``conflict``: the same id with other content, apply nothing and report it)."""

    message_id: str
    payload: Any
    claim: SqlClaim


def receive(
    conn: psycopg.Connection[Any],
    consumer: str,
    body: bytes | str,
    headers: Mapping[str, str],
    secrets: str | Sequence[str],
) -> Received:
    """Verifies the webhook (:func:`verify`) and claims its ``webhook-id`` for ``consumer`` in the
    transaction of ``conn``, in one step.

    Raises:
        WebhookHeaderError, WebhookVerificationError: as :func:`verify`; nothing is claimed.
    """
    from .sql import claim_message_fingerprint

    payload = verify(body, headers, secrets)
    message_id = {k.lower(): v for k, v in headers.items()}["webhook-id"]
    claim = claim_message_fingerprint(conn, consumer, message_id, content_fingerprint(body))
    return Received(message_id, payload, claim)
