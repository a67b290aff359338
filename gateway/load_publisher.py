"""This gateway's load, told to the controllers: a GatewayLoad on `gpumesh.v1.gateway.load`
every second (empty too: the autoscaler reads a gateway that says nothing as one that is gone,
not as one that is idle), and at once when a request is held for a cluster with no route at
all, because a cold start must not wait for the next tick.

It is also what the dispatcher tells of its holds (dispatch.HoldObserver): the held-requests
gauge and the cold-start histogram, and that signal.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from events.contract import subjects
from runtime.env import Bus, BusError, Clock

from .instruments import Instruments
from .load import LoadMeter

REPORT_EVERY_S = 1.0
# A burst of requests held for one cluster at zero is one signal, not one report each.
SIGNAL_EVERY_S = 0.25

_ENCODER = msgspec.json.Encoder()


class LoadPublisher:
    def __init__(
        self,
        bus: Bus,
        meter: LoadMeter,
        clock: Clock,
        instruments: Instruments,
        gateway_id: str,
        log: Any,
        *,
        report_every_s: float = REPORT_EVERY_S,
        signal_every_s: float = SIGNAL_EVERY_S,
    ) -> None:
        self._bus = bus
        self._meter = meter
        self._clock = clock
        self._instruments = instruments
        self._gateway_id = gateway_id
        self._log = log
        self._report_every_s = report_every_s
        self._signal_every_s = signal_every_s
        self._signalled: dict[str, float] = {}  # cluster -> when its last signal was sent
        self._due = asyncio.Event()  # a report is due before the next tick
        self._failing = False  # the last publish failed (logged once per outage)

    # -- dispatch.HoldObserver -----------------------------------------------------------

    def held(self, cluster: str, count: int) -> None:
        self._instruments.held(cluster, count)

    def held_at_zero(self, cluster: str) -> None:
        now = self._clock.monotonic()
        last = self._signalled.get(cluster)
        if last is not None and now - last < self._signal_every_s:
            return
        self._signalled[cluster] = now
        self._due.set()

    def cold_start(self, cluster: str, seconds: float) -> None:
        self._instruments.cold_start(cluster, seconds)

    # -- the reports ---------------------------------------------------------------------

    async def run(self) -> None:
        """Every report_every_s, and at once when a signal is due; until cancelled."""
        while True:
            try:
                async with asyncio.timeout(self._report_every_s):
                    await self._due.wait()
            except TimeoutError:
                pass
            self._due.clear()
            await self.publish()

    async def publish(self) -> None:
        """One report of the interval since the last; a NATS outage is logged once, and the
        reports of its intervals are lost (the next one says how things stand)."""
        now = self._clock.monotonic()
        self._signalled = {
            c: at for c, at in self._signalled.items() if now - at < self._signal_every_s
        }
        report = self._meter.report(self._gateway_id)
        try:
            await self._bus.publish(subjects.LOAD, _ENCODER.encode(report))
        except BusError as exc:
            if not self._failing:
                self._log.warning("load_publish_failed", error=str(exc))
            self._failing = True
            return
        if self._failing:
            self._log.info("load_publish_resumed")
            self._failing = False
