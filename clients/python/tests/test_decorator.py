"""The decorator's own rules: how the key and the payload come from the arguments (checked
before anything is sent), fingerprint_fields, and results that are not plain JSON."""

from __future__ import annotations

import dataclasses

import pytest

import idem_client

from conftest import ADMIN_KEY, IdemServer

#: A client whose server never answers: what fails with InvalidInputError failed before sending.
NOWHERE = idem_client.Client("http://127.0.0.1:9", ADMIN_KEY, retry=idem_client.RetryPolicy(attempts=1))


def test_the_key_and_payload_come_from_the_arguments_and_fail_before_sending() -> None:
    ran: list[int] = []

    @NOWHERE.idempotent(key="{order_id}:confirm:{version}", action="send", provider_ref="ref")
    def send(order_id: str, to: str, version: int = 1) -> dict[str, str]:
        ran.append(1)
        return {"ref": "r"}

    with pytest.raises(idem_client.ServerUnreachableError):
        send("ORD-1", "c-1")  # a valid call: only the server is missing

    @NOWHERE.idempotent(key="{order}:confirm", action="send", provider_ref="ref")
    def typo(order_id: str) -> dict[str, str]:
        return {"ref": "r"}

    with pytest.raises(idem_client.InvalidInputError, match="cannot be made from the arguments"):
        typo("ORD-1")

    @NOWHERE.idempotent(key="{order_id}", action="send", provider_ref="ref", payload=["to"])
    def wrong_fields(order_id: str, recipient: str) -> dict[str, str]:
        return {"ref": "r"}

    with pytest.raises(idem_client.InvalidInputError, match="not arguments"):
        wrong_fields("ORD-1", "c-1")

    class Mailer:
        pass

    @NOWHERE.idempotent(key="{order_id}", action="send", provider_ref="ref")
    def with_object(order_id: str, mailer: Mailer) -> dict[str, str]:
        return {"ref": "r"}

    with pytest.raises(idem_client.NotJSONError, match="payload=") as e:
        with_object("ORD-1", Mailer())
    assert "/mailer" in str(e.value)

    @NOWHERE.idempotent(key=lambda order_id: 7, action="send", provider_ref="ref")  # type: ignore[arg-type,return-value]
    def bad_key(order_id: str) -> dict[str, str]:
        return {"ref": "r"}

    with pytest.raises(idem_client.InvalidInputError, match="must be a string"):
        bad_key("ORD-1")
    with pytest.raises(idem_client.InvalidInputError, match="lease_ms"):
        NOWHERE.idempotent(key="{a}", action="send", provider_ref="ref", lease_ms=50)
    assert ran == []
    assert send.__name__ == "send", "functools.wraps keeps the function's identity"


def test_methods_leave_self_out_of_the_payload(server: IdemServer, key: str) -> None:
    client = server.client()

    class Mailer:
        sent = 0

        @client.idempotent(key="{order_id}", action="send_confirmation", provider_ref="message_id")
        def send(self, order_id: str, to: str) -> dict[str, str]:
            self.sent += 1
            return {"message_id": f"m-{order_id}"}

    m = Mailer()
    assert m.send(key, "c-1") == {"message_id": f"m-{key}"}
    assert m.send(key, "c-1") == {"message_id": f"m-{key}"}
    assert m.sent == 1
    assert client.get_operation(key).payload == {"order_id": key, "to": "c-1"}
    client.close()


def test_fingerprint_fields_name_the_intent(server: IdemServer, key: str) -> None:
    """Only /to and /template are the intent: another trace id is still a replay."""
    ran: list[str] = []
    with server.client() as c:

        @c.idempotent(
            key="{inquiry}",
            action="send",
            provider_ref="ref",
            payload=lambda inquiry, mail: mail,
            fingerprint_fields=["/to", "/template"],
        )
        def send(inquiry: str, mail: dict[str, str]) -> dict[str, str]:
            ran.append(mail["trace"])
            return {"ref": f"msg-{mail['trace']}"}

        first = send(key, {"to": "c-1", "template": "t", "trace": "a"})
        assert send(key, {"to": "c-1", "template": "t", "trace": "b"}) == first
        with pytest.raises(idem_client.FingerprintMismatchError):
            send(key, {"to": "c-2", "template": "t", "trace": "c"})
    assert ran == ["a"]


@dataclasses.dataclass(frozen=True)
class Receipt:
    message_id: str
    pages: int


def test_serialize_and_deserialize_carry_results_that_are_not_json(server: IdemServer, key: str) -> None:
    def receipt(stored: idem_client.JSON) -> Receipt:
        assert isinstance(stored, dict)
        return Receipt(**stored)

    with server.client() as c:

        @c.idempotent(
            key="{order}",
            action="send",
            provider_ref="message_id",
            payload=["order"],
            serialize=dataclasses.asdict,
            deserialize=receipt,
        )
        def send(order: str) -> Receipt:
            return Receipt(f"m-{order}", 2)

        assert send(key) == Receipt(f"m-{key}", 2)
        assert send(key) == Receipt(f"m-{key}", 2), "the replay is deserialized"
        assert c.get_operation(key).result == {"message_id": f"m-{key}", "pages": 2}


def test_a_failed_operation_is_replayed_as_its_error(server: IdemServer, key: str) -> None:
    class CardDeclinedError(Exception):
        pass

    ran: list[int] = []
    with server.client() as c:

        @c.idempotent(key="{order}", action="charge", provider_ref="ref", final=(CardDeclinedError,))
        def charge(order: str) -> dict[str, str]:
            ran.append(1)
            raise CardDeclinedError("insufficient funds")

        with pytest.raises(CardDeclinedError):
            charge(key)
        with pytest.raises(idem_client.OperationFailedError) as e:
            charge(key)
    assert ran == [1]
    assert (e.value.error_class, e.value.error_message) == (
        "CardDeclinedError",
        "CardDeclinedError: insufficient funds",
    )
    assert e.value.operation.state == "FAILED"


@pytest.mark.parametrize(
    ("result", "refused_by"),
    [({"ref": "x" * 600}, "the library"), ({"ref": "msg-1", "body": "x" * 1_100_000}, "idem (413)")],
)
def test_a_result_that_cannot_be_recorded_is_not_recorded_as_success(
    server: IdemServer, key: str, result: dict[str, str], refused_by: str
) -> None:
    """Evidence over 512 bytes (refused by the library) or a result over idem's 1 MiB body
    limit (refused by idem): the effect happened, so the operation ends UNKNOWN and the call
    raises ResultNotStorableError carrying the value."""
    with server.client() as c:

        @c.idempotent(key="{order}", action="send", provider_ref="ref", payload=["order"])
        def send(order: str) -> dict[str, str]:
            return result

        with pytest.raises(idem_client.ResultNotStorableError) as e:
            send(key)
        assert e.value.recorded_state == "UNKNOWN", refused_by
        assert e.value.result == result
        assert c.get_operation(key).state == "UNKNOWN"


@pytest.mark.parametrize(("ref", "kept"), [(12345, "12345"), (-7, "-7")])
def test_an_integer_provider_ref_is_kept_as_its_decimal_string(
    server: IdemServer, key: str, ref: int, kept: str
) -> None:
    """A provider's numeric id is evidence: SUCCEEDED with its decimal string, not UNKNOWN."""
    with server.client() as c:

        @c.idempotent(key="{order}", action="send", provider_ref="ref", payload=["order"])
        def send(order: str) -> dict[str, int]:
            return {"ref": ref}

        assert send(key) == {"ref": ref}
        op = c.get_operation(key)
        assert (op.state, op.provider_ref) == ("SUCCEEDED", kept)
        with c.claim(f"{key}-claim", action="send") as claim:
            assert claim.succeeded(ref).provider_ref == kept


@pytest.mark.parametrize("ref", [True, 1.5, None])
def test_a_bool_or_float_provider_ref_is_no_evidence(server: IdemServer, key: str, ref: object) -> None:
    with server.client() as c:

        @c.idempotent(key="{order}", action="send", provider_ref="ref", payload=["order"])
        def send(order: str) -> dict[str, object]:
            return {"ref": ref}

        with pytest.raises(idem_client.ResultNotStorableError, match="non-empty string or an integer"):
            send(key)
        assert c.get_operation(key).state == "UNKNOWN"


class ProviderDownError(Exception):
    def __init__(self, reason: BaseException) -> None:
        super().__init__(f"the provider: {reason}")
        self.reason = reason


@pytest.mark.parametrize(
    ("raised", "state"),
    [
        (ProviderDownError(ConnectionRefusedError(111, "refused")), "PENDING"),
        (ProviderDownError(TimeoutError("read timed out")), "UNKNOWN"),
        (ValueError("the predicate is not asked about this one's reason"), "UNKNOWN"),
    ],
)
def test_retryable_may_be_a_predicate_on_the_raised_exception(
    server: IdemServer, key: str, raised: Exception, state: str
) -> None:
    """What urllib raises (URLError with .reason) needs a look at the exception itself: a
    predicate. One that raises (here: no .reason) matches nothing, so the outcome is UNKNOWN."""

    def refused(e: BaseException) -> bool:
        return isinstance(e.reason, ConnectionRefusedError)  # type: ignore[attr-defined]

    with server.client() as c:

        @c.idempotent(key="{order}", action="send", provider_ref="ref", payload=["order"], retryable=refused)
        def send(order: str) -> dict[str, str]:
            raise raised

        with pytest.raises(type(raised)):
            send(key)
        assert c.get_operation(key).state == state


def test_an_exception_is_matched_by_its_class_not_by_its_causes(server: IdemServer, key: str) -> None:
    """A refused connection in the chain (an earlier attempt) does not prove the last attempt,
    which raised, sent nothing: UNKNOWN."""
    with server.client() as c:

        @c.idempotent(
            key="{order}",
            action="send",
            provider_ref="ref",
            payload=["order"],
            retryable=(ConnectionRefusedError,),
        )
        def send(order: str) -> dict[str, str]:
            try:
                raise ConnectionRefusedError(111, "refused")  # the first try
            except ConnectionRefusedError as first:
                raise TimeoutError("the second try timed out after sending") from first

        with pytest.raises(TimeoutError):
            send(key)
        assert c.get_operation(key).state == "UNKNOWN"


@pytest.mark.parametrize("spec", [("ConnectionRefusedError",), "ConnectionRefusedError", (ValueError, 3)])
def test_retryable_that_is_no_exception_class_nor_predicate_is_refused_at_once(spec: object) -> None:
    with pytest.raises(idem_client.InvalidInputError, match="retryable must be an exception class"):
        NOWHERE.idempotent(key="{a}", action="send", provider_ref="ref", retryable=spec)  # type: ignore[arg-type]
    with pytest.raises(idem_client.InvalidInputError, match="final must be"):
        NOWHERE.claim("K-1", action="send", final=spec)  # type: ignore[arg-type]


def test_a_replay_is_the_json_form_of_the_result(server: IdemServer, key: str) -> None:
    """JSON has no tuples: the first call returns the function's tuple, a replay the stored list
    (README "Results"; serialize= / deserialize= carry other types)."""
    with server.client() as c:

        @c.idempotent(key="{order}", action="send", provider_ref=lambda r: r[0], payload=["order"])
        def send(order: str) -> tuple[str, int]:
            return ("msg-1", 2)

        assert send(key) == ("msg-1", 2)
        replay: object = send(key)  # typed as the function's return, but JSON
        assert replay == ["msg-1", 2]
