"""The liveness invariant, "every cluster whole": once the faults have stopped and the fleet has
settled, every cluster has as many ready replicas as it asks for, wherever the healthy nodes'
GPUs allow it. The simulator's Checker judges it on the controller's live state, `gpumesh chaos`
on its own fold of the real event log; both with `short_clusters`. A sharded cluster (a spec
with `[sharding]`) is judged by `unplaced_groups` instead: its replicas ready, or the reason
they cannot be recorded and still true.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from actors.scheduler import RELEASED
from actors.sharding import NoPlan, plan
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
    """`short_clusters` of the fleet as a fold of its event log shows it. A sharded cluster's
    GPUs are its plan's, not `gpu.count`: it is judged by `unplaced_groups` instead, and the
    GPUs its live replicas hold on healthy nodes are no capacity for the others."""
    healthy = [n for n in state.nodes.nodes.values() if n.health == "healthy" and not n.drained]
    sharded = {name for name, c in state.clusters.clusters.items() if c.spec.sharding}
    usable = {n.node_id for n in healthy}
    held = sum(
        len(indices)
        for r in state.replicas.replicas.values()
        if r.cluster in sharded and r.status not in RELEASED
        for node_id, indices in r.holds()
        if node_id in usable
    )
    capacity = Capacity(nodes=len(healthy), gpus=sum(len(n.gpus) for n in healthy) - held)
    wanted = {
        name: Wanted(c.spec.replicas, c.spec.gpu.count)
        for name, c in state.clusters.clusters.items()
        if name not in sharded
    }
    return short_clusters(wanted, capacity, _ready(state), settle_s=settle_s)


def unplaced_groups(state: FleetState, *, settle_s: float) -> list[Short]:
    """The invariant group_serving_or_unschedulable: once the fleet has settled, every sharded
    cluster (a `[sharding]` spec, placed by its plan as whole groups) has its wanted replicas
    ready, or the reason it cannot is recorded (`cluster.unschedulable.v1`, the cluster view's
    `unschedulable`) and still holds: no plan for one more group fits the fleet as it is. A
    cluster short with no reason recorded, or short while a group would fit, is stuck."""
    ready = _ready(state)
    replicas = list(state.replicas.replicas.values())
    nodes = sorted(state.nodes.nodes.values(), key=lambda n: n.node_id)
    out = []
    for name, cluster in sorted(state.clusters.clusters.items()):
        spec = cluster.spec
        if spec.sharding is None:
            continue
        have, want = ready.get(name, 0), spec.replicas
        if have >= want:
            continue
        head = f"{name}: {have}/{want} groups ready {settle_s:g} s after the faults stopped"
        if not cluster.unschedulable:
            detail = f"{head}, and no reason recorded (cluster.unschedulable)"
        else:
            fits = plan(spec, nodes, replicas)
            if isinstance(fits, NoPlan):
                continue  # short for the recorded reason, which still holds
            where = "+".join(s.node_id for s in fits.stages)
            detail = (
                f"{head}: recorded unschedulable ({cluster.unschedulable}), but a group fits "
                f"on {where}"
            )
        waiting = [
            f"{r.replica_id}@{r.epoch} {r.status}"
            for r in sorted(replicas, key=lambda r: r.replica_id)
            if r.cluster == name and r.status not in ("ready", "stopped")
        ]
        if waiting:
            detail += f"; not ready: {', '.join(waiting)}"
        out.append(Short(name, have, want, detail))
    return out


def _ready(state: FleetState) -> dict[str, int]:
    ready: dict[str, int] = {}
    for replica in state.replicas.replicas.values():
        if replica.status == "ready":
            ready[replica.cluster] = ready.get(replica.cluster, 0) + 1
    return ready
