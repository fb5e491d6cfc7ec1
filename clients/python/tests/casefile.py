"""Reading clients/cases/cases.json: placeholders, the harness's exceptions, matching."""

from __future__ import annotations

import datetime
import json
import uuid
from pathlib import Path
from typing import Any

import idem_client

CASES_PATH = Path(__file__).resolve().parents[2] / "cases" / "cases.json"
CASES: dict[str, Any] = json.loads(CASES_PATH.read_text(encoding="utf-8"))
DEFAULTS: dict[str, Any] = CASES["defaults"]


class RetryableProblem(Exception):  # noqa: N818 - the case file names the harness's exceptions so
    """Declared retryable in every call: proves nothing happened."""

    def __init__(self, retry_after_ms: int | None = None) -> None:
        super().__init__("the provider refused the connection")
        self.retry_after_ms = retry_after_ms


class FinalProblem(Exception):  # noqa: N818
    """Declared final in every call."""


class UndeclaredProblem(Exception):  # noqa: N818
    """Declared nowhere: the effect may have started."""


#: Payloads a language's JSON cannot store, by the case file's name for them.
NOT_JSON: dict[str, object] = {
    "not_json_type": {"when": datetime.date(2026, 11, 30)},
    "nan": {"amount": float("nan")},
    "big_int": {"id": 2**53 + 1},
}


def kind_of(e: BaseException) -> str:
    """The case file's name for an exception (see clients/cases/README.md)."""
    if isinstance(e, idem_client.ProblemError):
        return e.slug
    for cls, kind in (
        (idem_client.OutcomeUnknownError, "outcome-unknown"),
        (idem_client.OperationFailedError, "operation-failed"),
        (idem_client.ResultNotStorableError, "result-not-storable"),
        (idem_client.ClaimNotCompletedError, "claim-not-completed"),
        (idem_client.OutcomeNotRecordedError, "outcome-not-recorded"),
        (idem_client.ServerUnreachableError, "server-unreachable"),
        (idem_client.NoAnswerError, "no-answer"),
        (idem_client.InvalidInputError, "invalid-input"),
        (TimeoutError, "timeout"),
    ):
        if isinstance(e, cls):
            return kind
    return type(e).__name__


class Placeholders:
    """``{run}`` (this run's prefix) and ``{holder:NAME}`` (a UUIDv4 per name) in strings."""

    def __init__(self) -> None:
        self.run = "R" + uuid.uuid4().hex[:12]
        self.holders: dict[str, str] = {}

    def __call__(self, v: Any) -> Any:
        if isinstance(v, str):
            v = v.replace("{run}", self.run)
            while "{holder:" in v:
                start = v.index("{holder:")
                end = v.index("}", start)
                name = v[start + 8 : end]
                holder = self.holders.setdefault(name, str(uuid.uuid4()))
                v = v[:start] + holder + v[end + 1 :]
            return v
        if isinstance(v, list):
            return [self(x) for x in v]
        if isinstance(v, dict):
            return {k: self(x) for k, x in v.items()}
        return v


def subset(expected: Any, actual: Any, path: str = "") -> None:
    """Asserts that ``expected`` is contained in ``actual`` (dicts: by member, recursively)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path or '/'}: expected an object, got {actual!r}"
        for k, v in expected.items():
            assert k in actual, f"{path}/{k}: missing in {actual!r}"
            subset(v, actual[k], f"{path}/{k}")
    else:
        assert expected == actual, f"{path or '/'}: expected {expected!r}, got {actual!r}"
