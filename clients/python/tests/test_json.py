"""JSON as idem keeps it: RFC 8785 number forms, NFC, UTF-16 member order, and the values
refused before anything is sent."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

import idem_client


@pytest.mark.parametrize(
    ("number", "text"),
    [  # RFC 8785 §3.2.2.3 and appendix B (ECMAScript Number::toString)
        (333333333.33333329, "333333333.3333333"),
        (1e30, "1e+30"),
        (4.50, "4.5"),
        (2e-3, "0.002"),
        (0.000000000000000000000000001, "1e-27"),
        (-0.0, "0"),
        (1e-7, "1e-7"),
        (1.23e-6, "0.00000123"),
        (1e21, "1e+21"),
        (1e20, "100000000000000000000"),
        (5e-324, "5e-324"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
        (9007199254740992.0, "9007199254740992"),
        (-1.5, "-1.5"),
        (100, "100"),
        (1.0, "1"),
    ],
)
def test_numbers_are_written_as_ecmascript_writes_their_double(number: float, text: str) -> None:
    assert idem_client.canonical(number) == text


def test_members_sort_by_utf16_units_and_strings_are_nfc() -> None:
    value = {"\U0001f600": 1, "\ufb01": 2, "z": 3, "Zu\u0308rich": "A\u030a"}
    # U+1F600 is the surrogate pair D83D DE00, which sorts before U+FB01 in UTF-16.
    assert idem_client.canonical(value) == '{"Z\u00fcrich":"\u00c5","z":3,"\U0001f600":1,"\ufb01":2}'
    assert idem_client.canonical({"t": 'a\tb\u0001\u007f"\\'}) == '{"t":"a\\tb\\u0001\u007f\\"\\\\"}'


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"when": datetime.date(2026, 1, 1)}, "payload /when: a date is not JSON"),
        ({"ids": {1, 2}}, "payload /ids: a set is not JSON"),
        ({"x": float("nan")}, "payload /x: nan is not a JSON number"),
        ({"x": float("inf")}, "payload /x: inf is not a JSON number"),
        ({"n": 2**53 + 1}, "payload /n: the integer 9007199254740993 is beyond"),
        ({"n": 1e16}, "payload /n: the number 1e+16 is beyond"),
        ({1: "a"}, "member name 1 is a int"),
        ({"Z\u00fcrich": 1, "Zu\u0308rich": 2}, "after Unicode NFC"),
        ({"s": "\ud800"}, "lone surrogate"),
        ({"a/b~c": [0, {"d": object()}]}, "payload /a~1b~0c/1/d: a object is not JSON"),
    ],
)
def test_values_idem_cannot_store_are_refused_with_their_path(value: Any, words: str) -> None:
    with pytest.raises(idem_client.NotJSONError, match=words.replace("(", r"\(").replace("+", r"\+")):
        idem_client.to_json(value, "payload")


def test_nesting_deeper_than_64_levels_is_refused() -> None:
    ok: Any = 1
    for _ in range(64):
        ok = [ok]
    assert idem_client.to_json(ok) == ok
    with pytest.raises(idem_client.NotJSONError, match="deeper than 64"):
        idem_client.to_json([ok])


def test_tuples_become_lists() -> None:
    assert idem_client.to_json({"pair": (1, "a")}) == {"pair": [1, "a"]}
