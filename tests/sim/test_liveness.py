"""The liveness rule, "every cluster whole", that the simulator's Checker and `gpumesh chaos`
share (sim/liveness.py)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from events import ClusterSpec, GpuInfo, GpuRequirement
from projections import FleetState
from projections.views import ClusterView, NodeView, ReplicaView
from sim.liveness import Capacity, Short, Wanted, short_clusters, short_in


def test_a_short_cluster_is_named_with_the_simulators_words() -> None:
    wanted = {"llama": Wanted(3), "mistral": Wanted(2, gpus_each=2)}
    shorts = short_clusters(wanted, Capacity(nodes=4, gpus=8), {"llama": 1}, settle_s=40)
    assert shorts == [
        Short(
            "llama", 1, 3, "llama: 1/3 ready 40 s after the faults stopped, with 4 healthy nodes"
        ),
        Short(
            "mistral",
            0,
            2,
            "mistral: 0/2 ready 40 s after the faults stopped, with 4 healthy nodes",
        ),
    ]
    whole = {"llama": 3, "mistral": 2}
    assert short_clusters(wanted, Capacity(nodes=4, gpus=8), whole, settle_s=40) == []


def test_nothing_is_demanded_beyond_the_capacity() -> None:
    wanted = {"llama": Wanted(3, gpus_each=2)}
    assert short_clusters(wanted, Capacity(nodes=2, gpus=5), {}, settle_s=1) == []
    assert [s.cluster for s in short_clusters(wanted, Capacity(2, 6), {}, settle_s=1)] == ["llama"]


def _fleet(nodes: list[tuple[str, int, bool]], clusters: dict[str, tuple[int, int]],
           replicas: list[tuple[str, str]]) -> FleetState:  # fmt: skip
    state = FleetState()
    for i, (health, gpus, drained) in enumerate(nodes):
        gpu = tuple(GpuInfo(index=g, uuid=f"{i}-{g}", model="m", vram_mib=1) for g in range(gpus))
        state.nodes.nodes[f"node-{i}"] = NodeView(
            node_id=f"node-{i}",
            gpus=gpu,
            health=health,
            drained=drained,
        )
    for name, (count, each) in clusters.items():
        spec = ClusterSpec(name=name, replicas=count, gpu=GpuRequirement(count=each))
        state.clusters.clusters[name] = ClusterView(spec=spec)
    for i, (cluster, status) in enumerate(replicas):
        state.replicas.replicas[f"r{i}"] = ReplicaView(
            replica_id=f"r{i}",
            cluster=cluster,
            node_id="node-0",
            epoch=1,
            status=status,
        )
    return state


def _as_the_checker_judged_before(state: FleetState, settle_s: float) -> list[str]:
    """sim/invariants.py's own loop before the rule moved to sim/liveness.py, verbatim."""
    out = []
    healthy = [n for n in state.nodes.nodes.values() if n.health == "healthy" and not n.drained]
    clusters = sorted(state.clusters.clusters.items())
    demand = sum(c.spec.replicas * c.spec.gpu.count for _, c in clusters)
    if demand > sum(len(n.gpus) for n in healthy):
        return out
    for name, cluster in clusters:
        desired = cluster.spec.replicas
        ready = sum(
            1 for r in state.replicas.replicas.values() if r.cluster == name and r.status == "ready"
        )
        if ready < desired:
            out.append(
                f"{name}: {ready}/{desired} ready {settle_s:g} s after "
                f"the faults stopped, with {len(healthy)} healthy nodes"
            )
    return out


names = st.sampled_from(["a", "b", "c", "gone"])


@given(
    nodes=st.lists(
        st.tuples(st.sampled_from(["healthy", "offline", "degraded"]), st.integers(0, 4),
                  st.booleans()), max_size=6,
    ),
    clusters=st.dictionaries(st.sampled_from(["a", "b", "c"]),
                             st.tuples(st.integers(0, 4), st.integers(1, 2)), max_size=3),
    replicas=st.lists(st.tuples(names, st.sampled_from(["ready", "starting", "failed"])),
                      max_size=12),
    settle_s=st.sampled_from([0.0, 2.5, 120.0]),
)  # fmt: skip
def test_the_shared_rule_judges_as_the_checker_did(
    nodes: list[tuple[str, int, bool]],
    clusters: dict[str, tuple[int, int]],
    replicas: list[tuple[str, str]],
    settle_s: float,
) -> None:
    state = _fleet(nodes, clusters, replicas)
    shared = [s.detail for s in short_in(state, settle_s=settle_s)]
    assert shared == _as_the_checker_judged_before(state, settle_s)
