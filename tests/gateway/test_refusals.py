"""Every way a request can get no answer from a replica, and the reply each one earns.

Every DispatchError maps to its reply in one place (gateway/proxy.py, `refuse`); this checks
each kind against docs/gateway.md's table of inference status codes, so that a new kind, or a
changed status, cannot go undocumented.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import pytest

import gateway.dispatch
import gateway.proxy
from gateway.dispatch import (
    AttemptsExhausted,
    ColdStartTimeout,
    DispatchError,
    HoldFull,
    NoReadyReplica,
    UnknownCluster,
)
from gateway.proxy import AnswerTimeout, NotReady, TooLarge, refuse
from gateway.reply import FlowControlled, Headers
from gateway.transport.base import (
    BrokenWhileHeld,
    ConnectFailed,
    FirstByteTimeout,
    ResetBeforeHead,
    UpstreamError,
    UpstreamStatus,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


class RecordingSink:
    """A Sink that keeps the one whole answer a refusal sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, Headers, bytes]] = []

    def send(self, status: int, headers: Headers, body: bytes) -> None:
        self.sent.append((status, headers, body))

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        raise AssertionError("a refusal is one whole answer")

    async def write(self, data: bytes) -> None:
        raise AssertionError("a refusal is one whole answer")

    async def end(self) -> None:
        raise AssertionError("a refusal is one whole answer")

    def abort(self) -> None:
        raise AssertionError("a refusal is one whole answer")

    def client_gone(self) -> bool:
        return False

    def relay_writer(self, source: FlowControlled) -> Callable[[bytes], None] | None:
        return None

    def relay_done(self) -> None:
        pass


def reply(
    error: DispatchError, method: str = "POST", known: Sequence[str] = ("llama", "qwen")
) -> tuple[int, dict[str, str], dict[str, str]]:
    sink = RecordingSink()
    refuse(sink, error, "gw-1-2a", method, lambda: known)
    ((status, headers, body),) = sink.sent
    fields: dict[str, str] = msgspec.json.decode(body)["error"]
    return status, dict(headers), fields


def documented() -> set[tuple[int, str]]:
    """(status, code) pairs of docs/gateway.md's "Status codes of the inference routes"."""
    text = DOCS.read_text()
    section = text.split("### Status codes of the inference routes", 1)[1].split("\n### ", 1)[0]
    pairs = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.fullmatch(r"[\d, ]+", cells[0]):
            continue
        for status in cells[0].split(","):
            for code in re.findall(r"`([a-z_0-9]+)`", cells[1]):
                pairs.add((int(status), code))
    return pairs


def exhausted(last: UpstreamError, *, repeatable: bool = True) -> AttemptsExhausted:
    return AttemptsExhausted(last, 3, "llama", repeatable=repeatable)


# Each kind, with the status and code the docs give it, and its message as the client reads it.
CASES: list[tuple[DispatchError, int, str, str]] = [
    (NotReady(), 503, "not_ready", "the gateway has not received a routing table yet"),
    (
        UnknownCluster("mistral"),
        404,
        "model_not_found",
        "The model `mistral` does not exist (known: llama, qwen)",
    ),
    (
        UnknownCluster("secret", lists_known=False),
        404,
        "model_not_found",
        "The model `secret` does not exist",
    ),
    (
        NoReadyReplica("llama", waited_s=10.0, retry_after_s=3.2),
        503,
        "no_ready_replica",
        "cluster 'llama' has no ready replica",
    ),
    (
        ColdStartTimeout("llama", limit_s=120.0, retry_after_s=2.0),
        503,
        "cold_start_timeout",
        "no replica of cluster 'llama' became ready within 120 s (autoscale.cold_start_timeout_s)",
    ),
    (
        HoldFull("llama", max_held=256, retry_after_s=2.0),
        503,
        "hold_full",
        "cluster 'llama' is starting from zero replicas and already holds 256 requests "
        "(gateway --max-held)",
    ),
    (
        exhausted(ConnectFailed("llama-0", "refused")),
        502,
        "connect_error",
        "no replica of 'llama' answered after 3 attempt(s); last: replica llama-0: refused",
    ),
    (
        exhausted(ResetBeforeHead("llama-0", "reset")),
        502,
        "reset",
        "no replica of 'llama' answered after 3 attempt(s); last: replica llama-0: reset",
    ),
    (
        exhausted(UpstreamStatus("llama-0", 503)),
        502,
        "status_5xx",
        "no replica of 'llama' answered after 3 attempt(s); last: replica llama-0: answered 503",
    ),
    (
        exhausted(FirstByteTimeout("llama-0", "no response head within 30 s")),
        504,
        "first_byte_timeout",
        "no replica of 'llama' answered after 3 attempt(s); "
        "last: replica llama-0: no response head within 30 s",
    ),
    (
        exhausted(BrokenWhileHeld("llama-0", "cut")),
        502,
        "reset",
        "every answer broke off before its end; last: replica llama-0: cut",
    ),
    (
        exhausted(UpstreamStatus("llama-0", 500), repeatable=False),
        502,
        "status_5xx",
        "no replica of 'llama' answered after 3 attempt(s); last: replica llama-0: answered 500"
        "; not retried: a PATCH is repeated only with an Idempotency-Key",
    ),
    (
        exhausted(BrokenWhileHeld("llama-0", "cut"), repeatable=False),
        502,
        "reset",
        "the answer broke off before its end (replica llama-0: cut)"
        "; not retried: a PATCH is repeated only with an Idempotency-Key",
    ),
    (TooLarge("over the overlay's limit"), 413, "too_large", "over the overlay's limit"),
    (AnswerTimeout(600.0), 504, "timeout", "the answer was not complete within 600 s"),
]


@pytest.mark.parametrize(
    ("error", "status", "code", "message"), CASES, ids=[type(c[0]).__name__ for c in CASES]
)
def test_each_refusal_gets_its_documented_status_and_code(
    error: DispatchError, status: int, code: str, message: str
) -> None:
    assert (status, code) in documented()
    got_status, headers, fields = reply(error, method="PATCH")
    assert (got_status, fields["code"], fields["message"]) == (status, code, message)
    assert fields["type"] == ("invalid_request_error" if status < 500 else "upstream_error")
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Request-Id"] == "gw-1-2a"


def test_every_kind_of_refusal_is_checked_here() -> None:
    def kinds(cls: type[DispatchError]) -> set[type[DispatchError]]:
        found = set()
        for sub in cls.__subclasses__():
            found |= {sub} | kinds(sub)
        return found

    ours = {
        k
        for k in kinds(DispatchError)
        if k.__module__ in (gateway.dispatch.__name__, gateway.proxy.__name__)
    }
    assert ours == {type(error) for error, *_ in CASES}


@pytest.mark.parametrize(
    ("error", "retry_after"),
    [
        (NotReady(), "1"),
        (NoReadyReplica("llama", 10.0, 1.0), "1"),
        (NoReadyReplica("llama", 10.0, 3.2), "4"),  # whole seconds, rounded up
        (NoReadyReplica("llama", 10.0, 0.1), "1"),  # never 0: that would invite a tight loop
        (ColdStartTimeout("llama", 120.0, 4.5), "5"),
        (HoldFull("llama", 256, 1.2), "2"),
        (UnknownCluster("mistral"), None),
        (exhausted(ConnectFailed("llama-0", "refused")), None),
    ],
)
def test_retry_after_only_where_coming_back_helps(
    error: DispatchError, retry_after: str | None
) -> None:
    _, headers, _ = reply(error)
    assert headers.get("Retry-After") == retry_after


def test_what_only_the_request_knows_is_added_to_the_message() -> None:
    _, _, fields = reply(UnknownCluster("mistral"), known=())
    assert fields["message"] == "The model `mistral` does not exist (known: none)"
    asked: list[int] = []

    def known() -> Sequence[str]:
        asked.append(1)
        return ["llama"]

    refuse(RecordingSink(), NotReady(), "r", "POST", known)
    assert not asked  # listing the models costs a pass over the table: only when it is said
    surely_not_there = exhausted(ConnectFailed("llama-0", "refused"), repeatable=False)
    _, _, fields = reply(surely_not_there)
    assert "not retried" not in fields["message"]  # it was retried: it never arrived


def test_the_fields_are_kept_not_only_formatted() -> None:
    error = NoReadyReplica("llama", waited_s=9.96, retry_after_s=2.5)
    assert (error.cluster, error.waited_s, error.retry_after_s) == ("llama", 9.96, 2.5)
    assert str(error) == "cluster llama: no ready replica after 10.0 s"  # the log line
    last = UpstreamStatus("llama-1", 502)
    failed = AttemptsExhausted(last, 2, "llama", repeatable=False)
    assert (failed.last, failed.attempts, failed.cluster, failed.not_repeated) == (
        last,
        2,
        "llama",
        True,
    )
    assert UnknownCluster("mistral").cluster == "mistral"
    cold = ColdStartTimeout("llama", 120.0, 3.0)
    assert (cold.cluster, cold.limit_s, cold.retry_after_s) == ("llama", 120.0, 3.0)
    assert str(cold) == "cluster llama: no replica ready after a 120 s cold start"
    full = HoldFull("llama", 256, 3.0)
    assert (full.cluster, full.max_held, full.retry_after_s) == ("llama", 256, 3.0)
    assert str(full) == "cluster llama: 256 requests held for a cold start already"
    # Both are a NoReadyReplica to a caller that handles that one (the simulator's requests).
    assert isinstance(cold, NoReadyReplica) and isinstance(full, NoReadyReplica)
    assert AnswerTimeout(12.5).limit_s == 12.5
    assert AnswerTimeout(1.0).outcome == "first_byte_timeout"  # counted against its replica
    assert TooLarge("x").outcome == "cancelled"  # no replica's fault
