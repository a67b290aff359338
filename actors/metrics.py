"""The controller's Prometheus metrics (`gpumesh controller --metrics-listen HOST:PORT`).

Two kinds, so that the controller's hot path stays as it was:

- **Counted as the log is folded** (`LogMetrics`): the controller's live state hands each
  committed batch to `LogMetrics.observe` after folding it (`LiveState.run`'s `observe`), the
  one hook in the controller. Events by type, heartbeats recorded and their lag (the agent's
  `sent_at_ns` to the fold just after the commit), placements and their latency. Plain ints
  and bucket counts, no lock: a few hundred nanoseconds per event.
- **Read at scrape time** (`ControllerCollector`): nodes by health, replicas by status, the
  leadership, the log position, dropped messages, a standby's lag: read from the live state
  (`projections.FleetState`) and the process when Prometheus asks, and nowhere else.

The names are in docs/metrics.md. `LogMetrics` is made once per process and given to every
term's Controller through `ControllerConfig.metrics`, so its counters run across terms.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from events import HEARTBEAT_TYPE, NodeHeartbeat
from events.cluster import ClusterCreated, ClusterScaled, ClusterSpecChanged
from events.envelope import Envelope
from events.replica import ReplicaFailed, ReplicaPlaced
from projections import FleetState
from runtime.env import Clock
from wire.metrics_http import start_metrics

from .errors import ControllerError

if TYPE_CHECKING:
    from .controller_process import ControllerProcess


HEALTH_STATES = ("healthy", "suspect", "degraded", "unhealthy", "offline")
REPLICA_STATUSES = ("pending", "placed", "starting", "ready", "failed", "stopping", "stopped")

# Seconds from the agent's send to the fold after the commit: milliseconds when all is well,
# seconds when the store falls behind (or the clocks of the two hosts disagree).
HEARTBEAT_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Seconds from what made a placement necessary to the placement: a reconcile pass when a node
# fits, minutes while none does.
PLACEMENT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

_PLACED = "replica.placed.v1"
_FAILED = "replica.failed.v1"
_WANTED = frozenset({"cluster.created.v1", "cluster.spec_changed.v1", "cluster.scaled.v1"})
_PLACEMENT_INPUTS = _WANTED | {_PLACED, _FAILED}
_UNSCHEDULABLE = "cluster.unschedulable.v1"


class Buckets:
    """A histogram's counts, kept plainly: `counts[i]` fell in bucket i alone, the last +Inf."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def add_to(self, family: HistogramMetricFamily, labels: Sequence[str] = ()) -> None:
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family.add_metric(list(labels), buckets, self.sum)


class LogMetrics:
    """What the controller folds, counted as it folds it (`observe`, once per commit)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.events: dict[str, int] = {}  # event type (with its version) -> committed
        self.heartbeat_lag = Buckets(HEARTBEAT_LAG_BUCKETS)
        self.placements = {"new": 0, "replacement": 0}
        self.placement_latency = {
            "new": Buckets(PLACEMENT_BUCKETS),
            "replacement": Buckets(PLACEMENT_BUCKETS),
        }
        self._failed_at: dict[str, int] = {}  # replica id -> recorded_at of its last failure
        self._wanted_at: dict[str, int] = {}  # cluster -> recorded_at of its last spec or scale
        self._placed: set[str] = set()  # replica ids placed at least once while we watched

    @property
    def heartbeats(self) -> int:
        return self.events.get(HEARTBEAT_TYPE, 0)

    def observe(self, batch: list[Envelope]) -> None:
        """One committed batch, just folded (LiveState.run's `observe`)."""
        now_ns = self._clock.wall_ns()
        events = self.events
        lag = self.heartbeat_lag
        for envelope in batch:
            kind = envelope.type
            events[kind] = events.get(kind, 0) + 1
            if kind == HEARTBEAT_TYPE:
                payload = envelope.payload
                if isinstance(payload, NodeHeartbeat) and payload.sent_at_ns > 0:
                    lag.observe(max(0.0, (now_ns - payload.sent_at_ns) / 1e9))
            elif kind in _PLACEMENT_INPUTS:
                self._placement_event(envelope)

    def _placement_event(self, envelope: Envelope) -> None:
        payload = envelope.payload
        at = envelope.recorded_at
        if isinstance(payload, ReplicaFailed):
            self._failed_at[payload.replica_id] = at
        elif isinstance(payload, ClusterCreated | ClusterSpecChanged):
            self._wanted_at[payload.spec.name] = at
        elif isinstance(payload, ClusterScaled):
            self._wanted_at[payload.name] = at
        elif isinstance(payload, ReplicaPlaced):
            replica = payload.replica_id
            failed_at = self._failed_at.pop(replica, None)
            if failed_at is not None or replica in self._placed or payload.epoch > 1:
                kind, since = "replacement", failed_at
            else:
                kind, since = "new", self._wanted_at.get(payload.cluster)
            self._placed.add(replica)
            self.placements[kind] += 1
            if since is not None:
                self.placement_latency[kind].observe(max(0.0, (at - since) / 1e9))


class MetricsSource(Protocol):
    """What the collector reads at scrape time; `ProcessSource` for a `gpumesh controller`."""

    def fleet(self) -> FleetState | None: ...
    def leading(self) -> bool: ...
    def term(self) -> int: ...
    def log_metrics(self) -> LogMetrics | None: ...
    def dropped(self) -> Mapping[str, int]: ...
    def standby_lag(self) -> int | None: ...


@dataclass
class StaticSource:
    """A source that is just values: tests, and anything that has a FleetState at hand."""

    state: FleetState | None = None
    is_leader: bool = False
    leader_term: int = 0
    log: LogMetrics | None = None
    drops: Mapping[str, int] = field(default_factory=dict)
    lag: int | None = None

    def fleet(self) -> FleetState | None:
        return self.state

    def leading(self) -> bool:
        return self.is_leader

    def term(self) -> int:
        return self.leader_term

    def log_metrics(self) -> LogMetrics | None:
        return self.log

    def dropped(self) -> Mapping[str, int]:
        return self.drops

    def standby_lag(self) -> int | None:
        return self.lag


class ControllerCollector:
    """Every controller metric, as prometheus_client families, read from `source` at scrape."""

    def __init__(self, source: MetricsSource) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return list(self._collect(StaticSource()))

    def collect(self) -> Iterator[Metric]:
        return self._collect(self._source)

    def _collect(self, source: MetricsSource) -> Iterator[Metric]:
        yield from _role(source)
        yield from _fleet(source.fleet())
        yield from _log(source.log_metrics())
        dropped = CounterMetricFamily(
            "gpumesh_controller_messages_dropped",
            "Messages from nodes and gateways dropped at the controller's edge, by why "
            "(garbage, unregistered, rate_limited, ...), during this term.",
            labels=["kind"],
        )
        for kind, count in sorted(source.dropped().items()):
            dropped.add_metric([kind], count)
        yield dropped


def _role(source: MetricsSource) -> Iterator[Metric]:
    leading = source.leading()
    yield GaugeMetricFamily(
        "gpumesh_controller_leader",
        "1 while this controller holds the leader lease, 0 while it stands by.",
        value=1.0 if leading else 0.0,
    )
    yield GaugeMetricFamily(
        "gpumesh_controller_term",
        "The leadership term this controller leads in; 0 while it stands by.",
        value=source.term() if leading else 0,
    )
    lag = GaugeMetricFamily(
        "gpumesh_controller_standby_lag_events",
        "A standby's lag: log positions the leader had applied that this one has not "
        "(from the roster, at the scrape). Absent on the leader.",
    )
    behind = source.standby_lag()
    if not leading and behind is not None:
        lag.add_metric([], behind)
    yield lag


def _fleet(state: FleetState | None) -> Iterator[Metric]:
    position = GaugeMetricFamily(
        "gpumesh_controller_log_position",
        "The log position this controller's state has folded in.",
    )
    nodes = GaugeMetricFamily(
        "gpumesh_controller_nodes", "Registered nodes, by health.", labels=["health"]
    )
    drained = GaugeMetricFamily(
        "gpumesh_controller_nodes_drained", "Nodes drained (no new replicas go there)."
    )
    replicas = GaugeMetricFamily(
        "gpumesh_controller_replicas",
        "Replica slots, by cluster and status (each at its newest epoch).",
        labels=["cluster", "status"],
    )
    clusters = GaugeMetricFamily("gpumesh_controller_clusters", "Clusters that exist.")
    routes = GaugeMetricFamily(
        "gpumesh_controller_routable_replicas",
        "Replicas in the routing table (ready, on a routable node), by cluster.",
        labels=["cluster"],
    )
    if state is not None:
        position.add_metric([], state.position)
        by_health = dict.fromkeys(HEALTH_STATES, 0)
        n_drained = 0
        for node in state.nodes.nodes.values():
            by_health[node.health] = by_health.get(node.health, 0) + 1
            n_drained += node.drained
        for health, count in by_health.items():
            nodes.add_metric([health], count)
        drained.add_metric([], n_drained)
        names = set(state.clusters.clusters)
        counts: dict[tuple[str, str], int] = {}
        for view in state.replicas.replicas.values():
            names.add(view.cluster)
            counts[view.cluster, view.status] = counts.get((view.cluster, view.status), 0) + 1
        for name in sorted(names):
            for status in REPLICA_STATUSES:
                replicas.add_metric([name, status], counts.get((name, status), 0))
        clusters.add_metric([], len(state.clusters.clusters))
        for name, entries in sorted(state.routing.routes.items()):
            routes.add_metric([name], len(entries))
    yield from (position, nodes, drained, replicas, clusters, routes)


def _log(log: LogMetrics | None) -> Iterator[Metric]:
    events = CounterMetricFamily(
        "gpumesh_controller_events",
        "Events committed to the log while this controller led, by family (node, cluster, "
        "replica, controller) and type (without its version).",
        labels=["family", "type"],
    )
    heartbeats = CounterMetricFamily(
        "gpumesh_controller_heartbeats_recorded",
        "Heartbeats recorded in the log while this controller led.",
    )
    lag = HistogramMetricFamily(
        "gpumesh_controller_heartbeat_lag_seconds",
        "From the agent's send (its wall clock, Heartbeat.sent_at_ns) to the controller's fold "
        "of the commit that recorded it.",
    )
    placements = CounterMetricFamily(
        "gpumesh_controller_placements",
        "Replicas placed on a node: new (a slot's first placement) or replacement (a slot "
        "placed again after a failure, at a higher epoch).",
        labels=["kind"],
    )
    latency = HistogramMetricFamily(
        "gpumesh_controller_placement_latency_seconds",
        "From what made a placement necessary to the placement's record: a replacement from "
        "the replica's failure, a new replica from its cluster's creation, scale or spec change.",
        labels=["kind"],
    )
    unschedulable = CounterMetricFamily(
        "gpumesh_controller_unschedulable",
        "Times a cluster was recorded unschedulable (no node fits; once per new reason).",
    )
    if log is not None:
        for kind, count in sorted(log.events.items()):
            name = kind.rsplit(".v", 1)[0]
            events.add_metric([name.partition(".")[0], name], count)
        heartbeats.add_metric([], log.heartbeats)
        log.heartbeat_lag.add_to(lag)
        for kind in ("new", "replacement"):
            placements.add_metric([kind], log.placements[kind])
            log.placement_latency[kind].add_to(latency, [kind])
        unschedulable.add_metric([], log.events.get(_UNSCHEDULABLE, 0))
    yield from (events, heartbeats, lag, placements, latency, unschedulable)


class ProcessSource:
    """A `gpumesh controller` process (actors/controller_process.py): the leading term's
    controller when there is one, else the standby's fold."""

    def __init__(self, process: ControllerProcess, log: LogMetrics) -> None:
        self._process = process
        self._log = log
        self._lag: int | None = None

    def fleet(self) -> FleetState | None:
        controller = self._process.controller
        live = controller.live if controller is not None else self._process.live
        return live.state if live is not None else None

    def leading(self) -> bool:
        return self._process.leadership.holds_lease()

    def term(self) -> int:
        return self._process.leadership.term

    def log_metrics(self) -> LogMetrics:
        return self._log

    def dropped(self) -> Mapping[str, int]:
        controller = self._process.controller
        return controller.dropped if controller is not None else {}

    def standby_lag(self) -> int | None:
        return self._lag

    async def refresh(self) -> None:
        """Before a scrape: a standby's lag, from the roster (one NATS read, at most 1 s)."""
        from runtime.errors import BusError

        from .roster import lag

        self._lag = None
        if self.leading():
            return
        try:
            async with asyncio.timeout(1.0):
                entries = await self._process.roster.entries()
        except (TimeoutError, ControllerError, BusError):
            return
        leaders = [e for e in entries if e.role == "leader"]
        leader = max(leaders, key=lambda e: e.term) if leaders else None
        me = self._process.entry(0)  # only its applied position is read
        self._lag = lag(me, leader)


def new_registry(collector: ControllerCollector) -> CollectorRegistry:
    disable_created_metrics()  # type: ignore[no-untyped-call]  # the library's, process-wide
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


async def run_process(process: ControllerProcess, listen: str | None) -> None:
    """`process.run()`, with its metrics served on `listen` while it runs (None: none)."""
    log = process.config.controller.metrics
    if listen is None or log is None:
        await process.run()
        return
    source = ProcessSource(process, log)
    try:
        runner = await start_metrics(
            new_registry(ControllerCollector(source)),
            listen,
            name="controller",
            before=source.refresh,
        )
    except ValueError as exc:
        raise ControllerError(str(exc)) from None
    try:
        await process.run()
    finally:
        await runner.cleanup()
