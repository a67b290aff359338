"""The autoscaler: the leader sizes each cluster with an `[autoscale]` section from the load
every gateway reports (`gpumesh.v1.gateway.load`, GatewayLoad), and records each decision as a
`cluster.scaled` event carrying the figures it used and why (docs/autoscaling.md).

Two parts with one job each:
- `LoadBoard` keeps each gateway's latest report and sums the current ones per cluster;
- `ScalingRule` is one cluster's decision memory, a pure function of its policy, its replica
  count, the summed load and the injected clock's time: the simulator checks its invariants
  (never above `max` nor below `min`, no decision reversed within its window) on virtual time.

`Autoscaler` joins them on the controller's loop: it evaluates every cluster each second, and
at once when a gateway holds a request for a cluster at zero replicas (the hold is the signal
to scale up: a cold start must not wait for the next tick).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from events import AutoscaleInputs, AutoscaleSpec, ClusterSpec
from events.contract.messages import ClusterLoad, GatewayLoad
from runtime.env import Clock

# A gateway's report counts for this long after it arrives (gateways report every second): a
# gateway that stopped reporting (gone, cut off) drops out of the sums instead of freezing them.
REPORT_FRESH_S = 3.0
EVALUATE_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class Load:
    """A cluster's load summed over the gateways whose report is current."""

    gateways: int = 0
    in_flight: int = 0
    held: int = 0
    requests_per_s: float = 0.0
    ttft_p50_ms: float = 0.0

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or self.held > 0 or self.requests_per_s > 0


class LoadBoard:
    """Each gateway's latest report, and when it came."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, GatewayLoad]] = {}

    def offer(self, report: GatewayLoad, now: float) -> None:
        self._reports[report.gateway_id] = (now, report)

    def load(self, cluster: str, now: float) -> Load:
        gateways = in_flight = held = 0
        rps = ttft = 0.0
        for gateway_id in sorted(self._reports):  # a fixed order: float sums are order-bound
            at, report = self._reports[gateway_id]
            if now - at > REPORT_FRESH_S:
                continue
            gateways += 1
            seen = report.clusters.get(cluster)
            if seen is None:
                continue
            in_flight += seen.in_flight
            held += seen.held
            rps += seen.requests_per_s
            ttft = max(ttft, seen.ttft_p50_ms)
        return Load(gateways, in_flight, held, rps, ttft)

    def forget_stale(self, now: float) -> None:
        for gateway_id in sorted(self._reports):
            if now - self._reports[gateway_id][0] > REPORT_FRESH_S * 10:
                del self._reports[gateway_id]


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    previous: int
    cause: str
    inputs: AutoscaleInputs


@dataclass(slots=True)
class ScalingRule:
    """One cluster's decision memory. `since` is when the last change was made (or when this
    leader began to watch the cluster: a new leader waits a whole window before its first
    change, so a failover cannot turn into a reversal); `streak_*` the run of evaluations,
    since then, that all wanted more (or all fewer) replicas; `last_busy` the last evaluation
    that saw a request (or saw no gateway: an outage of the reports is not idleness)."""

    since: float
    last_busy: float
    streak_up_since: float | None = None
    streak_up_least: int = 0  # the fewest replicas the growing streak wanted
    streak_down_since: float | None = None
    streak_down_most: int = 0  # the most replicas the shrinking streak wanted
    history: list[Decision] = field(default_factory=list)

    def evaluate(
        self, policy: AutoscaleSpec, current: int, load: Load, now: float
    ) -> Decision | None:
        if load.gateways == 0 or load.busy:
            self.last_busy = now
        idle_s = now - self.last_busy
        lo, hi = policy.min_replicas, policy.max_replicas
        demand = load.in_flight + load.held
        by_load = math.ceil(demand / policy.target_in_flight) if demand else 0
        wanted = max(min(by_load, hi), lo, 1)
        inputs = AutoscaleInputs(
            gateways=load.gateways,
            in_flight=load.in_flight,
            held=load.held,
            requests_per_s=round(load.requests_per_s, 3),
            ttft_p50_ms=round(load.ttft_p50_ms, 3),
            wanted=wanted,
            idle_s=round(idle_s, 3),
        )
        # Bounds first, at once: a hand-made `cluster scale` or a new spec put the count
        # outside them.
        if current > hi:
            return self._made(now, hi, current, f"above autoscale.max ({current} > {hi})", inputs)
        if current < lo:
            return self._made(now, lo, current, f"below autoscale.min ({current} < {lo})", inputs)
        if current == 0:
            if load.held == 0 and load.in_flight == 0:
                return None
            # A cold start: requests are held for a replica right now. No window: waiting
            # is what a held request cannot afford, and 0 -> n reverses no decision of
            # this rule's but a scale to zero, which only idleness made.
            cause = f"{load.held} request(s) held at zero replicas: a cold start"
            return self._made(now, wanted, 0, cause, inputs)
        if lo == 0 and idle_s >= policy.scale_to_zero_after_s:
            if now - self.since >= policy.down_window_s:
                cause = f"no request for {idle_s:.0f} s (autoscale.scale_to_zero_after_s)"
                return self._made(now, 0, current, cause, _windowed(inputs, 0, 0.0))
            return None
        if wanted > current:
            self.streak_down_since = None
            if self.streak_up_since is None:
                self.streak_up_since, self.streak_up_least = now, wanted
            self.streak_up_least = min(self.streak_up_least, wanted)
            held_for = now - max(self.streak_up_since, self.since)
            if held_for >= policy.up_window_s and now - self.since >= policy.up_window_s:
                target = self.streak_up_least
                cause = (
                    f"{demand} request(s) in flight or held for {current} replica(s) "
                    f"(target {policy.target_in_flight:g} each) for {held_for:.0f} s"
                )
                return self._made(now, target, current, cause, _windowed(inputs, target, held_for))
        elif wanted < current:
            self.streak_up_since = None
            if self.streak_down_since is None:
                self.streak_down_since, self.streak_down_most = now, wanted
            self.streak_down_most = max(self.streak_down_most, wanted)
            held_for = now - max(self.streak_down_since, self.since)
            if held_for >= policy.down_window_s and now - self.since >= policy.down_window_s:
                target = self.streak_down_most
                cause = (
                    f"at most {target * policy.target_in_flight:g} request(s) in flight for "
                    f"{current} replica(s) for {held_for:.0f} s"
                )
                return self._made(now, target, current, cause, _windowed(inputs, target, held_for))
        else:
            self.streak_up_since = self.streak_down_since = None
        return None

    def _made(
        self, now: float, replicas: int, previous: int, cause: str, inputs: AutoscaleInputs
    ) -> Decision:
        self.since = now
        self.streak_up_since = self.streak_down_since = None
        return Decision(replicas, previous, f"autoscale: {cause}", inputs)


def _windowed(inputs: AutoscaleInputs, wanted: int, window_s: float) -> AutoscaleInputs:
    return AutoscaleInputs(
        gateways=inputs.gateways,
        in_flight=inputs.in_flight,
        held=inputs.held,
        requests_per_s=inputs.requests_per_s,
        ttft_p50_ms=inputs.ttft_p50_ms,
        wanted=wanted,
        window_s=round(window_s, 3),
        idle_s=inputs.idle_s,
    )


# Records a decision (the controller: a message to the cluster's actor); returns whether it
# was recorded (False: the count changed meanwhile, or the cluster is gone).
Apply = Callable[[str, Decision], Awaitable[bool]]


class Autoscaler:
    """The leader's autoscaler over every cluster that has an `[autoscale]` section."""

    def __init__(self, clock: Clock, specs: Callable[[], dict[str, ClusterSpec]]) -> None:
        self._clock = clock
        self._specs = specs
        self.board = LoadBoard()
        self._rules: dict[str, ScalingRule] = {}

    def offer(self, report: GatewayLoad) -> list[str]:
        """Take a gateway's report; returns the clusters at zero replicas for which it holds
        requests, to be evaluated at once."""
        self.board.offer(report, self._clock.monotonic())
        specs = self._specs()
        cold: list[str] = []
        for name in sorted(report.clusters):
            seen: ClusterLoad = report.clusters[name]
            spec = specs.get(name)
            if seen.held and spec is not None and spec.autoscale and spec.replicas == 0:
                cold.append(name)
        return cold

    def decide(self, names: list[str] | None = None) -> list[tuple[str, Decision]]:
        """One evaluation of the named clusters (all autoscaled ones when None)."""
        now = self._clock.monotonic()
        specs = self._specs()
        decisions: list[tuple[str, Decision]] = []
        for name in sorted(specs) if names is None else names:
            spec = specs.get(name)
            if spec is None or spec.autoscale is None:
                self._rules.pop(name, None)
                continue
            rule = self._rules.get(name)
            if rule is None:
                rule = self._rules[name] = ScalingRule(since=now, last_busy=now)
            decision = rule.evaluate(spec.autoscale, spec.replicas, self.board.load(name, now), now)
            if decision is not None:
                decisions.append((name, decision))
        if names is None:
            for gone in [n for n in self._rules if n not in specs]:
                del self._rules[gone]
            self.board.forget_stale(now)
        return decisions
