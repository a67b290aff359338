"""A tenant's limits held across several gateways, with no request waiting on NATS.

Every gateway decides each request alone, from its own buckets (gateway/auth.py TenantQuota),
each sized to this gateway's share of the tenant's rate, burst and token budget. Once a second
each gateway publishes a QuotaReport on `gpumesh.v1.gateway.quota`: for every tenant with
limits in its key file, the tenant's demand on it (requests asked for, admitted or not, per
second) and the share it serves now. From the reports of the last STALE_AFTER_S it moves each
tenant's share here towards

    target = w_self / (w_self + sum of w_other),
    w = min(max(demand, MIN_WEIGHT_RPS), cap),   cap = the tenant's rate_per_s

over the gateways that list that tenant. The cap makes the split equal when the tenant asks
every gateway for more than its whole rate, which is when the limit matters; below its rate the
split follows the demand (90 and 10 requests a second against a rate of 50: 5/6 and 1/6). A
tenant with a token budget and no request rate is capped at TOKEN_ONLY_CAP_RPS: a flood of
refused requests on one gateway must not leave the others nothing.

Every bucket holds one request (or one token) at least, whatever the share: a gateway with a
small share still admits one at a time, at its share of the rate. So N gateways may hold up to
N - 1 more than the burst between them, when shares are small.

A share falls to its target at once; it rises only into what no gateway holds, by at most
`(1 - the shares held, ours and those reported) / the gateways sharing`, so two gateways
rising together never claim the same room, and the shares add up to at most one while the
reports are current: the tenant gets at most its rate, and its burst at once, whichever
gateways its clients use. A share first taken (a tenant first seen, or this gateway new) is
1/N of the limits, N the gateways heard from, itself included; until their first reports
the gateways of a starting fleet may hold more than one between them (about a second). A
gateway that hears no other (alone, or NATS away) serves the whole limits, as one gateway
alone does.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

import msgspec

from events.contract import subjects
from events.contract.messages import QuotaReport, TenantDemand
from runtime.env import Bus, BusError, Clock, Msg

from .auth import KeyRing

REPORT_EVERY_S: Final = 1.0
STALE_AFTER_S: Final = 3.0  # a gateway not heard from for this long is gone
MIN_WEIGHT_RPS: Final = 0.5  # so an idle gateway keeps a little room for its first requests
TOKEN_ONLY_CAP_RPS: Final = 10.0  # the weights' cap for a tenant with no request rate

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(QuotaReport)


class QuotaSharer:
    def __init__(
        self,
        bus: Bus,
        keys: KeyRing,
        clock: Clock,
        gateway_id: str,
        log: Any,
        *,
        every_s: float = REPORT_EVERY_S,
    ) -> None:
        self._bus = bus
        self._keys = keys
        self._clock = clock
        self._gateway_id = gateway_id
        # Told apart from another process given the same id (the operator's mistake): the
        # start of this one, in ns of the wall clock.
        self._instance = f"{clock.wall_ns():x}"
        self._shared_id_said = False
        self._log = log
        self._every_s = every_s
        # gateway -> (when heard, tenant -> what it reported)
        self._peers: dict[str, tuple[float, dict[str, TenantDemand]]] = {}
        self._failing = False
        self._last = clock.monotonic()

    @property
    def peers(self) -> list[str]:
        """The other gateways heard from lately."""
        return sorted(self._peers)

    def heard(self, msg: Msg) -> None:
        """A QuotaReport (ours come back too, and are skipped); garbage is dropped."""
        try:
            report = _DECODER.decode(msg.data)
        except msgspec.DecodeError:
            self._log.warning("quota_report_undecodable", subject=msg.subject)
            return
        peer = report.gateway_id
        if peer == self._gateway_id:
            if not report.instance or report.instance == self._instance:
                return  # our own, back from NATS (or an older gateway's: not told apart)
            # Another process with our id: without this, each would take the other's report
            # for its own and serve the whole limits. Share with it as a peer, and say so.
            peer = f"{peer}#{report.instance}"
            if not self._shared_id_said:
                self._shared_id_said = True
                self._log.error(
                    "gateway_id_shared",
                    gateway=self._gateway_id,
                    why="another gateway runs with this --gateway-id: give each its own "
                    "(quotas are shared with it as with any other gateway meanwhile)",
                )
        known = peer in self._peers
        self._peers[peer] = (self._clock.monotonic(), dict(report.tenants))
        if not known:
            # A tenant first seen before the next tick must not start with a whole burst.
            self._keys.share_new_tenants(1.0 / (1 + len(self._peers)))

    async def run(self) -> None:
        """Publish a report and set the shares every `every_s`; until cancelled."""
        sub = await self._bus.subscribe(subjects.QUOTA, handler=self.heard)
        try:
            while True:
                await asyncio.sleep(self._every_s)
                await self.tick()
        finally:
            await sub.unsubscribe()

    async def tick(self) -> None:
        now = self._clock.monotonic()
        interval = max(now - self._last, 1e-9)
        self._last = now
        self._peers = {g: p for g, p in self._peers.items() if now - p[0] < STALE_AFTER_S}
        self._keys.share_new_tenants(1.0 / (1 + len(self._peers)))
        for tenant in self._keys.limited():
            self._keys.quota(tenant)  # idle ones are reported too, with the share they hold
        demand = self._own_demand(interval)
        self.share(demand)
        report = QuotaReport(
            gateway_id=self._gateway_id,
            instance=self._instance,
            interval_s=round(interval, 3),
            tenants={
                name: TenantDemand(
                    requests_per_s=round(rps, 3),
                    tokens_per_min=round(tpm, 1),
                    share=self._keys.quotas[name].share,
                )
                for name, (rps, tpm) in sorted(demand.items())
            },
        )
        try:
            await self._bus.publish(subjects.QUOTA, _ENCODER.encode(report))
        except BusError as exc:
            if not self._failing:
                self._log.warning("quota_report_failed", error=str(exc))
            self._failing = True
            return
        if self._failing:
            self._log.info("quota_report_resumed")
            self._failing = False

    def _own_demand(self, interval: float) -> dict[str, tuple[float, float]]:
        """Each limited tenant's demand here since the last tick (its counters reset)."""
        own = {}
        for name, quota in self._keys.quotas.items():
            own[name] = (quota.asked / interval, quota.charged * 60.0 / interval)
            quota.asked = 0
            quota.charged = 0.0
        return own

    def share(self, own: dict[str, tuple[float, float]]) -> None:
        """Move each tenant's share here towards its target (module docstring)."""
        for name, quota in self._keys.quotas.items():
            rate = quota.tenant.rate_per_s
            cap = max(rate, MIN_WEIGHT_RPS) if rate > 0 else TOKEN_ONLY_CAP_RPS
            listed = [tenants[name] for _, tenants in self._peers.values() if name in tenants]
            mine = min(max(own.get(name, (0.0, 0.0))[0], MIN_WEIGHT_RPS), cap)
            others = sum(min(max(d.requests_per_s, MIN_WEIGHT_RPS), cap) for d in listed)
            target = mine / (mine + others)
            if target > quota.share:
                room = max(0.0, 1.0 - quota.share - sum(d.share for d in listed))
                target = min(target, quota.share + room / (1 + len(listed)))
            quota.set_share(target)
