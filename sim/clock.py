"""The simulator's Clock: the running loop's virtual time, and a fixed epoch for wall time."""

from __future__ import annotations

import asyncio
from typing import final

from structlog.typing import EventDict, WrappedLogger

SIM_EPOCH_NS = 1_767_225_600 * 1_000_000_000
"""2026-01-01T00:00:00Z: virtual time 0 maps here, so event stamps repeat across runs."""


@final
class SimClock:
    """Implements runtime.env.Clock on the running loop's (virtual) time."""

    def __init__(self, epoch_ns: int = SIM_EPOCH_NS) -> None:
        self._epoch_ns = epoch_ns

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    def wall_ns(self) -> int:
        return self._epoch_ns + round(self.monotonic() * 1_000_000_000)


def stamp_sim_time(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """structlog processor: `sim_t` (virtual seconds) in place of a wall-clock TimeStamper,
    so simulated runs log identically on every replay."""
    try:
        event_dict["sim_t"] = round(asyncio.get_running_loop().time(), 9)
    except RuntimeError:
        pass  # logged outside the loop: nothing to stamp
    return event_dict
