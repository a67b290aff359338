"""How long a request may take and how often it may be tried again."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.env import RandomSource

from .transport.base import BrokenWhileHeld, Outcome, UpstreamError

# Failures before the response head: nothing reached the client, so another replica may try.
_RETRYABLE: frozenset[Outcome] = frozenset(
    {"connect_error", "reset", "status_5xx", "first_byte_timeout"}
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 3
    backoff_base_s: float = 0.01
    backoff_max_s: float = 0.2
    deadline_s: float = 60.0  # overall: arrival until a response head is in
    first_byte_timeout_s: float = 30.0  # per attempt, capped by what is left of deadline_s
    queue_timeout_s: float = 10.0  # how long a request waits for a cluster with no ready replica

    def __post_init__(self) -> None:
        checks = (
            ("max_attempts", self.max_attempts >= 1, ">= 1"),
            ("backoff_base_s", self.backoff_base_s >= 0, ">= 0"),
            ("backoff_max_s", self.backoff_max_s >= 0, ">= 0"),
            ("deadline_s", self.deadline_s > 0, "> 0"),
            ("first_byte_timeout_s", self.first_byte_timeout_s > 0, "> 0"),
            ("queue_timeout_s", self.queue_timeout_s > 0, "> 0"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"RetryPolicy.{name} must be {rule}, got {getattr(self, name)!r}")

    def retryable(self, failure: UpstreamError | Outcome, *, repeatable: bool = True) -> bool:
        """stream_broken came after the head (the client already has bytes); cancelled means
        nobody is waiting for an answer. A request that is not `repeatable` may have done its
        work on a replica that then reset, timed out or answered 5xx: it is retried only when
        it surely never got there (nginx's rule for non-idempotent methods). A body that broke
        while the proxy held it back (BrokenWhileHeld) never reached the client either."""
        if isinstance(failure, UpstreamError):
            if not repeatable:
                return failure.never_delivered
            if isinstance(failure, BrokenWhileHeld):
                return True
            failure = failure.outcome
        return repeatable and failure in _RETRYABLE

    def backoff(self, failed_attempts: int, rng: RandomSource) -> float:
        """Full jitter (AWS Architecture Blog, "Exponential Backoff and Jitter"): retries from
        many requests that failed together do not arrive together."""
        # The exponent is capped so a huge count cannot overflow a float before min() applies.
        exponent = min(max(failed_attempts, 1) - 1, 60)
        return rng.uniform(0.0, min(self.backoff_max_s, self.backoff_base_s * 2.0**exponent))
