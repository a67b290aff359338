"""The liveness invariant, "every cluster whole": once the faults have stopped and the fleet has
settled, every cluster has as many ready replicas as it asks for, wherever the healthy nodes'
GPUs allow it. The simulator's Checker judges it on the controller's live state, `gpumesh chaos`
on its own fold of the real event log; both with `short_clusters`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from projections import FleetState


@dataclass(frozen=True, slots=True)
class Wanted:
    """What one cluster asks for."""

    replicas: int
    gpus_each: int = 1


@dataclass(frozen=True, slots=True)
class Capacity:
    """The nodes that can take replicas now (healthy, not drained) and their GPUs."""

    nodes: int
    gpus: int


@dataclass(frozen=True, slots=True)
class Short:
    """A cluster with fewer ready replicas than it asks for: one liveness violation."""

    cluster: str
    ready: int
    wanted: int
    detail: str  # the violation's one line


def short_clusters(
    wanted: Mapping[str, Wanted],
    capacity: Capacity,
    ready: Mapping[str, int],
    *,
    settle_s: float,
) -> list[Short]:
    """The clusters short of ready replicas, by name; none when the capacity cannot make every
    cluster whole (nothing can be demanded then). `ready`: ready replicas seen per cluster;
    `settle_s`: how long the fleet has had since the faults stopped (for the detail)."""
    demand = sum(w.replicas * w.gpus_each for w in wanted.values())
    if demand > capacity.gpus:
        return []
    out = []
    for name, want in sorted(wanted.items()):
        have = ready.get(name, 0)
        if have < want.replicas:
            detail = (
                f"{name}: {have}/{want.replicas} ready {settle_s:g} s after the faults stopped, "
                f"with {capacity.nodes} healthy nodes"
            )
            out.append(Short(name, have, want.replicas, detail))
    return out


def short_in(state: FleetState, *, settle_s: float) -> list[Short]:
    """`short_clusters` of the fleet as a fold of its event log shows it."""
    healthy = [n for n in state.nodes.nodes.values() if n.health == "healthy" and not n.drained]
    capacity = Capacity(nodes=len(healthy), gpus=sum(len(n.gpus) for n in healthy))
    wanted = {
        name: Wanted(c.spec.replicas, c.spec.gpu.count)
        for name, c in state.clusters.clusters.items()
    }
    ready: dict[str, int] = {}
    for replica in state.replicas.replicas.values():
        if replica.status == "ready":
            ready[replica.cluster] = ready.get(replica.cluster, 0) + 1
    return short_clusters(wanted, capacity, ready, settle_s=settle_s)
