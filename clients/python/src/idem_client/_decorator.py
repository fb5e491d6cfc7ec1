"""``@client.idempotent(...)``: guard a function (sync or ``async def``) with one decorator.

The first call with a key acquires the lease, runs the function, and completes SUCCEEDED with
its return value and evidence; a repeat returns the recorded result without running it. What
can be known before the function runs is checked before it runs: the key can be made from
the arguments, the payload is JSON idem stores, idem accepts the key (no personal data) and
answers at all.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from ._claim import AsyncClaim, Claim, ExceptionMatch, evidence, exception_matcher, message_of, succeeded_body
from ._errors import InvalidInputError, OperationFailedError, ResultNotStorableError
from ._json import NotJSONError, to_json
from ._records import JSON

if TYPE_CHECKING:
    from ._client import Client

P = ParamSpec("P")
R = TypeVar("R")

KeySpec = str | Callable[..., str]
PayloadSpec = Sequence[str] | Callable[..., object] | None
EvidenceSpec = str | Callable[[Any], str | int]


class Idempotent:
    """The decorator ``client.idempotent(...)`` returns (see :meth:`Client.idempotent`)."""

    def __init__(
        self,
        client: Client,
        *,
        key: KeySpec,
        action: str,
        provider_ref: EvidenceSpec,
        payload: PayloadSpec,
        fingerprint_fields: Sequence[str] | None,
        lease_ms: int,
        wait_ms: int,
        redo_safe: bool,
        heartbeat: bool,
        renew_every_ms: int | None,
        retryable: ExceptionMatch,
        final: ExceptionMatch,
        serialize: Callable[[Any], object] | None,
        deserialize: Callable[[JSON], Any] | None,
    ) -> None:
        if not isinstance(key, str) and not callable(key):
            raise InvalidInputError(
                "key must be a format string such as '{order_id}:confirm:v1' or a callable"
            )
        if not isinstance(provider_ref, str) and not callable(provider_ref):
            raise InvalidInputError("provider_ref must name a field of the result or be a callable")
        exception_matcher(retryable, "retryable")  # refused at decoration, not after the function ran
        exception_matcher(final, "final")
        self._client = client
        self._key = key
        self._action = action
        self._provider_ref = provider_ref
        self._payload = payload
        self._claim_options: dict[str, Any] = {
            "fingerprint_fields": fingerprint_fields,
            "lease_ms": lease_ms,
            "wait_ms": wait_ms,
            "redo_safe": redo_safe,
            "heartbeat": heartbeat,
            "renew_every_ms": renew_every_ms,
            "retryable": retryable,
            "final": final,
        }
        self._serialize = serialize
        self._deserialize = deserialize

    @overload
    def __call__(self, fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]: ...

    def __call__(self, fn: Callable[P, Any]) -> Callable[P, Any]:
        sig = inspect.signature(fn)
        if inspect.iscoroutinefunction(fn):
            afn: Callable[P, Awaitable[Any]] = fn

            @functools.wraps(fn)
            async def aguarded(*args: P.args, **kwargs: P.kwargs) -> Any:
                key, payload = self._intent(sig, args, kwargs)
                async with self._client.claim(
                    key, action=self._action, payload=payload, **self._claim_options
                ) as c:
                    if c.replayed:
                        return self._replay(c)
                    value = await afn(*args, **kwargs)
                    body = self._stored(c, value)
                    if isinstance(body, Exception):
                        await c.unknown(message_of(body))
                        raise self._not_storable(c, body, value) from body
                    refused = await c._succeeded_or_unknown(body)
                    if refused is not None:
                        raise self._not_storable(c, refused, value) from refused
                    return value

            return aguarded

        @functools.wraps(fn)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> Any:
            key, payload = self._intent(sig, args, kwargs)
            with self._client.claim(key, action=self._action, payload=payload, **self._claim_options) as c:
                if c.replayed:
                    return self._replay(c)
                value = fn(*args, **kwargs)
                body = self._stored(c, value)
                if isinstance(body, Exception):
                    c.unknown(message_of(body))
                    raise self._not_storable(c, body, value) from body
                refused = c._succeeded_or_unknown(body)
                if refused is not None:
                    raise self._not_storable(c, refused, value) from refused
                return value

        return guarded

    # --- before the function runs ---------------------------------------------------

    def _intent(
        self, sig: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[str, JSON]:
        """The key and payload of one call, checked (raises :class:`InvalidInputError`)."""
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise InvalidInputError(f"the call does not fit the function's signature: {e}") from e
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if isinstance(self._key, str):
            try:
                key = self._key.format(**arguments)
            except (KeyError, IndexError, AttributeError, ValueError) as e:
                raise InvalidInputError(
                    f"the key {self._key!r} cannot be made from the arguments: {e!r}"
                ) from e
        else:
            key = self._key(*args, **kwargs)
        if not isinstance(key, str):
            raise InvalidInputError(
                f"the key must be a string; the key function returned {type(key).__name__}"
            )
        if self._payload is None:
            params = list(sig.parameters)
            skip = {params[0]} if params and params[0] in ("self", "cls") else set()
            raw: object = {k: v for k, v in arguments.items() if k not in skip}
            hint = " (name the intent's fields with payload=[...] or build it with payload=callable)"
        elif callable(self._payload):
            raw, hint = self._payload(*args, **kwargs), ""
        else:
            missing = [n for n in self._payload if n not in arguments]
            if missing:
                raise InvalidInputError(f"payload names {missing}, which are not arguments of the function")
            raw, hint = {n: arguments[n] for n in self._payload}, ""
        try:
            return key, to_json(raw, "payload")
        except NotJSONError as e:
            raise NotJSONError(f"{e}{hint}") from None

    # --- after it ran ----------------------------------------------------------------

    def _replay(self, c: Claim | AsyncClaim) -> Any:
        op = c.operation
        if op.state == "FAILED":
            raise OperationFailedError(op)
        return self._deserialize(op.result) if self._deserialize else op.result

    def _stored(self, c: Claim | AsyncClaim, value: object) -> dict[str, JSON] | Exception:
        """The success to complete with (the evidence and the result to store), or why it cannot
        be stored."""
        try:
            if isinstance(self._provider_ref, str):
                ref = _field(value, self._provider_ref)
            else:
                ref = self._provider_ref(value)
            ref = evidence(ref)
            if not isinstance(ref, str) or not ref.strip():
                raise InvalidInputError(
                    f"provider_ref read {ref!r} from the result; the evidence must be a non-empty string "
                    "or an integer"
                )
            # the evidence's rules and the result's JSON, checked before anything is sent
            return succeeded_body(ref, self._serialize(value) if self._serialize else value)
        except Exception as e:  # the function ran: whatever fails here must end UNKNOWN, not vanish
            return e

    def _not_storable(self, c: Claim | AsyncClaim, why: Exception, value: object) -> ResultNotStorableError:
        return ResultNotStorableError(
            f"{c.key!r}: the function returned, but {why}; the effect probably happened, so the operation "
            "was completed UNKNOWN for an operator to settle (it is not performed again)",
            key=c.key,
            recorded_state=c.state,
            result=value,
        )


def _field(value: object, name: str) -> object:
    if isinstance(value, Mapping):
        if name not in value:
            raise InvalidInputError(f"the result has no field {name!r} to read provider_ref from")
        return value[name]
    if not hasattr(value, name):
        raise InvalidInputError(
            f"the result ({type(value).__name__}) has no attribute {name!r} for provider_ref"
        )
    return getattr(value, name)
