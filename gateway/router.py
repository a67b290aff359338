"""The gateway's routing table and passive health: which replica a request goes to.

The controller's table says which replicas are ready; this module adds what only the gateway
sees, its own outstanding requests and the failures it met, and ejects a replica that keeps
failing before the controller has noticed. No I/O: the proxy and the simulator drive it alike.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Literal

from events.contract.messages import CanarySplit, RouteEntry, RoutingUpdate
from runtime.env import Clock, RandomSource

from .balancer import HashRing, bounded_affinity, power_of_two
from .transport.base import Outcome

_AFFINITIES = ("off", "prefix", "user")

StatsKey = tuple[str, int]  # (replica_id, epoch)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    eject_after: int = 3  # consecutive failures that eject a replica
    eject_base_s: float = 5.0  # first ejection; doubles with each repeat ejection
    eject_max_s: float = 60.0
    eject_jitter: float = 0.2  # +- fraction, so gateways do not re-admit in lock-step
    affinity: Literal["off", "prefix", "user"] = "off"
    affinity_load_factor: float = 1.25
    vnodes: int = 100

    def __post_init__(self) -> None:
        checks = (
            ("eject_after", self.eject_after >= 1, ">= 1"),
            ("eject_base_s", self.eject_base_s > 0, "> 0"),
            ("eject_max_s", self.eject_max_s >= self.eject_base_s, ">= eject_base_s"),
            ("eject_jitter", 0 <= self.eject_jitter < 1, "in [0, 1)"),
            ("affinity", self.affinity in _AFFINITIES, f"one of {', '.join(_AFFINITIES)}"),
            # Below 1 the capacities sum to less than the load, and no replica may fit.
            ("affinity_load_factor", self.affinity_load_factor >= 1, ">= 1"),
            ("vnodes", self.vnodes >= 1, ">= 1"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"RouterConfig.{name} must be {rule}, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class Ejection:
    """A replica this gateway stopped sending to; the gateway reports it as a suspicion."""

    cluster: str
    replica_id: str
    node_id: str
    epoch: int
    reason: Outcome
    failures: int
    duration_s: float


@dataclass(slots=True)
class ReplicaStats:
    """One replica at one epoch, as this gateway saw it."""

    outstanding: int = 0
    consecutive_failures: int = 0
    ejections: int = 0  # in a row, without a success between: sets the next ejection's length
    ejected_until: float = 0.0
    requests: int = 0
    failures: int = 0


def _normalise(routes: dict[str, tuple[RouteEntry, ...]]) -> dict[str, tuple[RouteEntry, ...]]:
    """Sorted by replica id, one entry per replica id (its highest epoch).

    The order fixes which candidate a seeded draw picks, so it must not depend on how the
    controller happened to list them; a lower epoch of a listed replica is superseded and
    must never be chosen.
    """
    table: dict[str, tuple[RouteEntry, ...]] = {}
    for cluster, entries in routes.items():
        newest: dict[str, RouteEntry] = {}
        for entry in entries:
            held = newest.get(entry.replica_id)
            if held is None or entry.epoch > held.epoch:
                newest[entry.replica_id] = entry
        table[cluster] = tuple(newest[rid] for rid in sorted(newest))
    return table


class Router:
    def __init__(self, clock: Clock, rng: RandomSource, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self._clock = clock
        self._rng = rng
        self._position = 0
        self._changed = 0
        self._routes: dict[str, tuple[RouteEntry, ...]] = {}
        self._known: frozenset[str] = frozenset()
        self._models: dict[str, str] = {}
        self._cold_start: dict[str, float] = {}
        self._splits: dict[str, CanarySplit] = {}
        self._stats: dict[StatsKey, ReplicaStats] = {}
        self._cluster_of: dict[StatsKey, str] = {}
        self._current: dict[str, StatsKey] = {}  # replica_id -> its routed (replica_id, epoch)
        self._rings: dict[str, HashRing] = {}  # built lazily, dropped when a cluster's ids change

    @property
    def position(self) -> int:
        return self._position

    def changed(self) -> int:
        return self._changed

    def apply(self, update: RoutingUpdate) -> bool:
        if update.position < self._position:
            return False  # a late or replayed publish: the table we hold is newer
        self._position = update.position
        routes = _normalise(dict(update.routes))
        known = frozenset(update.clusters) | frozenset(routes)
        models = {m: c for m, c in update.models.items() if c in known}
        cold_start = {c: s for c, s in update.cold_start.items() if c in known}
        splits = {c: s for c, s in update.splits.items() if c in known and s.to in known}
        if (
            routes == self._routes
            and known == self._known
            and models == self._models
            and cold_start == self._cold_start
            and splits == self._splits
        ):
            return False  # the controller's periodic re-send
        for cluster in set(self._rings):
            old_ids = [e.replica_id for e in self._routes.get(cluster, ())]
            if [e.replica_id for e in routes.get(cluster, ())] != old_ids:
                del self._rings[cluster]
        stats: dict[StatsKey, ReplicaStats] = {}
        cluster_of: dict[StatsKey, str] = {}
        current: dict[str, StatsKey] = {}
        for cluster, entries in routes.items():
            for entry in entries:
                key = (entry.replica_id, entry.epoch)
                # A new epoch is a new process, maybe on another node: its history is not ours.
                held = self._stats.get(key)
                stats[key] = held if held is not None else ReplicaStats()
                cluster_of[key] = cluster
                current[entry.replica_id] = key
        self._routes, self._known, self._models = routes, known, models
        self._cold_start, self._splits = cold_start, splits
        self._stats, self._cluster_of, self._current = stats, cluster_of, current
        self._changed += 1
        return True

    def known(self, cluster: str) -> bool:
        return cluster in self._known

    def resolve(self, model: str) -> str:
        """The cluster serving `model`: a spec's `model` name, else the cluster's own name."""
        return self._models.get(model, model)

    def cold_start(self, cluster: str) -> float | None:
        """How long a request may be held while `cluster` starts from zero replicas (seconds),
        or None: it does not scale from zero, and a request waits the usual queue timeout."""
        return self._cold_start.get(cluster)

    def split(self, cluster: str) -> CanarySplit | None:
        """`cluster`'s canary split, while its canary (`to`) has a ready replica to take its
        share; None otherwise: every request of `cluster` stays with it."""
        split = self._splits.get(cluster)
        if split is None or not self._routes.get(split.to):
            return None
        return split

    def clusters(self) -> list[str]:
        return sorted(self._known)

    def models(self) -> list[str]:
        """What /v1/models lists: each cluster's model name (its own name unless it set one)."""
        renamed = {cluster: model for model, cluster in self._models.items()}
        return sorted(renamed.get(cluster, cluster) for cluster in self._known)

    def routes(self, cluster: str) -> tuple[RouteEntry, ...]:
        return self._routes.get(cluster, ())

    def choose(
        self, cluster: str, *, key: str = "", exclude: Collection[str] = ()
    ) -> RouteEntry | None:
        candidates = [e for e in self.routes(cluster) if e.replica_id not in exclude]
        if not candidates:
            return None
        now = self._clock.monotonic()
        healthy = [e for e in candidates if not self._ejected_at(e, now)]
        # Panic mode (Envoy's name): when every candidate is ejected, an ejected replica that
        # may have recovered beats a certain 503.
        pool = healthy or candidates
        outstanding = self._outstanding_in(pool)
        if key and self.config.affinity != "off":
            return bounded_affinity(
                self._ring(cluster), key, pool, outstanding, self.config.affinity_load_factor
            )
        return power_of_two(pool, outstanding, self._rng)

    def started(self, route: RouteEntry) -> None:
        stats = self._stats.get((route.replica_id, route.epoch))
        if stats is not None:
            stats.outstanding += 1
            stats.requests += 1

    def finished(self, route: RouteEntry, outcome: Outcome) -> Ejection | None:
        key = (route.replica_id, route.epoch)
        stats = self._stats.get(key)
        if stats is None:
            return None  # the table moved on while the request ran
        stats.outstanding = max(0, stats.outstanding - 1)
        if outcome == "ok":
            stats.consecutive_failures = 0
            stats.ejections = 0
            return None
        if outcome == "cancelled":
            return None  # the client left: says nothing about the replica
        stats.failures += 1
        stats.consecutive_failures += 1
        now = self._clock.monotonic()
        # Failures met while ejected (stragglers, panic traffic) carry over, so a re-admitted
        # replica that fails again goes straight back out, for twice as long.
        if stats.consecutive_failures < self.config.eject_after or stats.ejected_until > now:
            return None
        cfg = self.config
        stats.ejections += 1
        base = min(cfg.eject_max_s, cfg.eject_base_s * 2.0 ** min(stats.ejections - 1, 60))
        duration = base * self._rng.uniform(1 - cfg.eject_jitter, 1 + cfg.eject_jitter)
        stats.ejected_until = now + duration
        failures, stats.consecutive_failures = stats.consecutive_failures, 0
        return Ejection(
            cluster=self._cluster_of[key],
            replica_id=route.replica_id,
            node_id=route.node_id,
            epoch=route.epoch,
            reason=outcome,
            failures=failures,
            duration_s=duration,
        )

    def is_ejected(self, replica_id: str) -> bool:
        key = self._current.get(replica_id)
        return key is not None and self._stats[key].ejected_until > self._clock.monotonic()

    def stats(self) -> list[tuple[RouteEntry, ReplicaStats]]:
        """Copies, so a metrics scrape cannot change what the router counts."""
        return [
            (entry, replace(self._stats[(entry.replica_id, entry.epoch)]))
            for cluster in sorted(self._routes)
            for entry in self._routes[cluster]
        ]

    def _ejected_at(self, entry: RouteEntry, now: float) -> bool:
        return self._stats[(entry.replica_id, entry.epoch)].ejected_until > now

    def _outstanding_in(self, pool: list[RouteEntry]) -> Callable[[str], int]:
        counts = {e.replica_id: self._stats[(e.replica_id, e.epoch)].outstanding for e in pool}
        return counts.__getitem__

    def _ring(self, cluster: str) -> HashRing:
        ring = self._rings.get(cluster)
        if ring is None:
            # Over every routed replica, not just today's healthy ones, so an ejection moves
            # only the ejected replica's keys and they come home when it is re-admitted.
            ids = [e.replica_id for e in self._routes.get(cluster, ())]
            ring = self._rings[cluster] = HashRing(ids, self.config.vnodes)
        return ring
