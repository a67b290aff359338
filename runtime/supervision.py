"""Restart policy: how often an actor may crash, and how long to wait before restarting it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import final

from .env import RandomSource


@final
@dataclass(frozen=True, slots=True)
class SupervisionPolicy:
    """Restart a crashed actor after an exponential, jittered back-off; give up after more than
    `max_restarts` crashes within `window` seconds (the crash is then escalated to the system).

    The n-th crash inside the window waits `min(backoff_max, backoff_initial * backoff_factor
    ** (n - 1))`, shortened by up to `jitter` of itself so that actors crashed by one cause do
    not restart in lockstep.
    """

    max_restarts: int = 3
    window: float = 60.0
    backoff_initial: float = 0.1
    backoff_max: float = 30.0
    backoff_factor: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window <= 0:
            raise ValueError(f"window must be > 0 seconds, got {self.window}")
        if not 0 <= self.backoff_initial <= self.backoff_max:
            raise ValueError(
                f"need 0 <= backoff_initial <= backoff_max, got {self.backoff_initial} "
                f"and {self.backoff_max}"
            )
        if self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be >= 1, got {self.backoff_factor}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be within [0, 1], got {self.jitter}")

    def backoff(self, crashes: int, rng: RandomSource) -> float:
        """Seconds to wait before the restart that follows the `crashes`-th recent crash."""
        exponent = max(crashes - 1, 0)
        # Capping the exponent keeps the float finite for long crash streaks.
        base = min(
            self.backoff_max, self.backoff_initial * self.backoff_factor ** min(exponent, 64)
        )
        return base * (1.0 - self.jitter * rng.random())


DEFAULT_POLICY = SupervisionPolicy()


@final
class CrashWindow:
    """Crash times within the policy's sliding window."""

    def __init__(self, window: float) -> None:
        self._window = window
        self._times: deque[float] = deque()

    def record(self, now: float) -> int:
        """Add a crash at `now`; return how many crashes lie within the window."""
        self._times.append(now)
        while self._times and now - self._times[0] > self._window:
            self._times.popleft()
        return len(self._times)
