"""RetryPolicy: what is worth another try, and how long to wait before it."""

from __future__ import annotations

import random
from typing import get_args

import pytest
from hypothesis import given, strategies as st

from gateway.retry import RetryPolicy
from gateway.transport.base import (
    ConnectFailed,
    FirstByteTimeout,
    Outcome,
    ResetBeforeHead,
    UpstreamError,
    UpstreamStatus,
)


def test_defaults_are_valid() -> None:
    policy = RetryPolicy()
    assert policy.max_attempts == 3
    assert policy.first_byte_timeout_s < policy.deadline_s


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_attempts", 0),
        ("backoff_base_s", -0.1),
        ("backoff_max_s", -1.0),
        ("deadline_s", 0.0),
        ("first_byte_timeout_s", -1.0),
        ("queue_timeout_s", 0.0),
    ],
)
def test_nonsense_is_a_one_line_error_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^RetryPolicy.{field} must be [^\n]*$"):
        RetryPolicy(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("outcome", get_args(Outcome))
def test_only_failures_before_the_head_are_retryable(outcome: Outcome) -> None:
    expected = outcome in {"connect_error", "reset", "status_5xx", "first_byte_timeout"}
    assert RetryPolicy().retryable(outcome) is expected


@pytest.mark.parametrize(
    ("failure", "repeated"),
    [
        (ConnectFailed("r", "refused"), True),
        (ConnectFailed("r", "no acknowledgement", maybe_delivered=True), False),
        (ResetBeforeHead("r", "reset"), False),
        (UpstreamStatus("r", 503), False),
        (FirstByteTimeout("r", "slow"), False),
    ],
)
def test_a_request_not_safe_to_repeat_is_retried_only_if_it_surely_never_arrived(
    failure: UpstreamError, repeated: bool
) -> None:
    assert RetryPolicy().retryable(failure, repeatable=False) is repeated
    assert RetryPolicy().retryable(failure) is True  # any of these, for a repeatable request


@given(
    failed=st.integers(-3, 5000),
    base=st.floats(0.0, 1.0),
    cap=st.floats(0.0, 5.0),
    seed=st.integers(0, 2**32),
)
def test_backoff_stays_within_full_jitter_bounds(
    failed: int, base: float, cap: float, seed: int
) -> None:
    policy = RetryPolicy(backoff_base_s=base, backoff_max_s=cap)
    delay = policy.backoff(failed, random.Random(seed))
    n = max(failed, 1)
    assert 0.0 <= delay <= min(cap, base * 2.0 ** min(n - 1, 60))


def test_backoff_grows_exponentially_then_caps() -> None:
    policy = RetryPolicy(backoff_base_s=0.01, backoff_max_s=0.2)
    rng = random.Random(1234)

    def ceiling(n: int) -> float:
        return max(policy.backoff(n, rng) for _ in range(300))

    assert 0.009 < ceiling(1) <= 0.01
    assert 0.019 < ceiling(2) <= 0.02
    assert 0.039 < ceiling(3) <= 0.04
    assert 0.19 < ceiling(10) <= 0.2


def test_backoff_is_jittered_not_fixed() -> None:
    rng = random.Random(1234)
    delays = {RetryPolicy().backoff(3, rng) for _ in range(20)}
    assert len(delays) == 20
