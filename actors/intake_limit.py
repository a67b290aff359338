"""Per-sender token buckets for the controller's intake, on the injected clock.

One node that floods heartbeats must cost the controller a dictionary lookup per excess
message, not an event append, and must not delay anyone else's heartbeats: its excess is
dropped (and counted) before decoding. A bucket holds `burst` tokens and refills at `rate` per
second; a message takes one token or is refused.

Every admitted heartbeat is stored as an event, so its size is capped too: a node that sends
900 KiB heartbeats (nats-server's 1 MiB limit allows it) would otherwise write megabytes a
second into the log from within its rate.
"""

from __future__ import annotations

from runtime.env import Clock

# 16 GPUs and 256 replicas, each with a 100-character detail, encode to 68 KiB: 4x that.
MAX_MESSAGE_BYTES = 256 * 1024


class IntakeLimiter:
    def __init__(
        self,
        clock: Clock,
        *,
        rate_per_s: float,
        burst: float,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        if rate_per_s <= 0 or burst < 1 or max_message_bytes < 1:
            raise ValueError(
                "an intake limit needs rate_per_s > 0, burst >= 1 and max_message_bytes >= 1"
            )
        self._clock = clock
        self.rate = rate_per_s
        self.burst = burst
        self.max_message_bytes = max_message_bytes
        # sender -> (tokens, last refill). Callers admit only registered senders, so this
        # stays as large as the fleet rather than as large as an attacker's imagination.
        self._buckets: dict[str, tuple[float, float]] = {}

    def admit(self, sender: str, now: float | None = None) -> bool:
        """`now`: the clock's time, when the caller has just read it."""
        if now is None:
            now = self._clock.monotonic()
        tokens, then = self._buckets.get(sender, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens < 1.0:
            self._buckets[sender] = (tokens, now)
            return False
        self._buckets[sender] = (tokens - 1.0, now)
        return True

    def forget(self, sender: str) -> None:
        self._buckets.pop(sender, None)

    def oversized(self, data: bytes) -> bool:
        return len(data) > self.max_message_bytes
