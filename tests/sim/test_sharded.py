"""Sharded replicas in the simulator (docs/sharding.md, docs/simulation.md): the checker's three
invariants for pipelines (no_partial_group_serving, no_gpu_held_twice,
group_serving_or_unschedulable) each report a violation planted by hand or by a planted bug,
and the shipped scenarios show a stage lost under load and two clusters contending for GPUs,
the same run for the same seed."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec
import pytest

from actors import cluster_actor, scheduler, sharding
from events import (
    ClusterCreated,
    ClusterSpec,
    ClusterUnschedulable,
    DomainEvent,
    Envelope,
    GpuInfo,
    NodeHealthChanged,
    NodeRegistered,
    ReplicaFailed,
    ReplicaPlaced,
    ReplicaReady,
    ReplicaStageReady,
    ShardingSpec,
    StagePlacement,
    stream_of,
)
from projections import FleetState
from projections.views import ClusterView, NodeView, ReplicaView
from sim.clock import SIM_EPOCH_NS
from sim.invariants import Checker
from sim.liveness import short_in, unplaced_groups
from sim.run import SCENARIOS, RunResult, run_scenario
from sim.scenario import FaultPlan, Scenario, load

# 30 GiB of weights: more than a 24 GiB card holds, so 2 pipeline stages on 2 nodes.
TWO_STAGES = ShardingSpec(weights_gib=30, layers=32, parallelism=("pipeline",))
SPEC = ClusterSpec(name="big", command="x", replicas=2, sharding=TWO_STAGES)
GPU = GpuInfo(index=0, uuid="u", model="RTX4090", vram_mib=24_564)


class _World:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


class _Log:
    """Feeds crafted events to a Checker, as the simulator and `gpumesh chaos` do."""

    def __init__(self, nodes: int = 4) -> None:
        self.checker = Checker(_World())  # type: ignore[arg-type]
        self.position = 0
        self.versions: dict[str, int] = {}
        for i in range(nodes):
            gpu = msgspec.structs.replace(GPU, uuid=f"u{i}")
            self.add(0.0, NodeRegistered(node_id=f"n{i}", gpus=(gpu,)))
        self.add(0.0, ClusterCreated(spec=SPEC))

    def add(self, at_s: float, payload: DomainEvent) -> None:
        stream = stream_of(payload)
        self.position += 1
        self.versions[stream] = self.versions.get(stream, 0) + 1
        self.checker.check_event(
            Envelope(
                event_id=f"e{self.position}",
                stream=stream,
                version=self.versions[stream],
                position=self.position,
                type=type(payload).__struct_config__.tag,  # type: ignore[arg-type]
                recorded_at=SIM_EPOCH_NS + int(at_s * 1e9),
                payload=payload,
            )
        )

    def place(self, at_s: float, replica: str, nodes: Sequence[str], epoch: int = 1) -> None:
        stages = tuple(
            StagePlacement(rank=r, node_id=n, gpu_indices=(0,), first_layer=16 * r,
                           last_layer=16 * (r + 1))
            for r, n in enumerate(nodes)
        )  # fmt: skip
        self.add(
            at_s,
            ReplicaPlaced(
                replica_id=replica, cluster="big", node_id=nodes[0], gpu_indices=(0,),
                epoch=epoch, why="plan", stages=stages,
            ),
        )  # fmt: skip

    def stage_up(self, at_s: float, replica: str, node: str, epoch: int = 1) -> None:
        self.add(
            at_s,
            ReplicaStageReady(
                replica_id=replica, epoch=epoch, rank=1, node_id=node, address=f"{node}:9"
            ),
        )

    def ready(self, at_s: float, replica: str, epoch: int = 1) -> None:
        self.add(at_s, ReplicaReady(replica_id=replica, epoch=epoch, address="http://h:1"))

    def offline(self, at_s: float, node: str) -> None:
        self.add(at_s, NodeHealthChanged(node_id=node, state="offline", reason="heartbeats"))

    def fail(self, at_s: float, replica: str, epoch: int = 1) -> None:
        self.add(at_s, ReplicaFailed(replica_id=replica, epoch=epoch, reason="node_offline"))

    @property
    def violations(self) -> list[str]:
        return [v.invariant for v in self.checker.violations]


# -- no_partial_group_serving --------------------------------------------------------------


def test_a_pipeline_ready_before_its_worker_is_up_is_partial() -> None:
    log = _Log()
    log.place(1.0, "big-0", ["n0", "n1"])
    log.ready(1.5, "big-0")  # the head, with no replica.stage_ready.v1 for rank 1
    assert log.violations == ["no_partial_group_serving"]
    assert "big-0@1 ready with worker stage(s) 1 never recorded up" in str(
        log.checker.violations[0]
    )

    whole = _Log()
    whole.place(1.0, "big-0", ["n0", "n1"])
    whole.stage_up(1.2, "big-0", "n1")
    whole.ready(1.5, "big-0")
    assert whole.violations == []


def test_a_pipeline_ready_past_the_allowance_with_a_stage_node_offline_is_partial() -> None:
    def run(failed_after: float | None, next_event_after: float) -> list[str]:
        log = _Log()
        log.place(1.0, "big-0", ["n0", "n1"])
        log.stage_up(1.2, "big-0", "n1")
        log.ready(1.5, "big-0")
        log.offline(10.0, "n1")  # the worker's node: the head's node is fine
        if failed_after is not None:
            log.fail(10.0 + failed_after, "big-0")
        log.offline(10.0 + next_event_after, "n3")  # any later event: the checker looks then
        return log.violations

    assert run(None, 0.5) == []  # within the 1 s a single-node replica's routes have
    assert run(None, 1.5) == ["no_partial_group_serving"]
    assert run(0.2, 1.5) == []  # the group failed in time
    assert run(1.2, 1.5) == ["no_partial_group_serving"]  # failed, but too late


def test_no_stage_node_is_held_against_the_group_while_no_controller_runs() -> None:
    """The allowance counts controller uptime, as detection does: nobody can fail a group
    while the controller is down."""
    log = _Log()
    log.place(1.0, "big-0", ["n0", "n1"])
    log.stage_up(1.2, "big-0", "n1")
    log.ready(1.5, "big-0")
    log.offline(10.0, "n1")
    log.checker.controller_down(10.2)
    log.offline(20.0, "n3")
    assert log.violations == []
    log.checker.controller_up(20.0)
    log.offline(20.5, "n2")
    assert log.violations == []
    log.offline(21.5, "n2")
    assert log.violations == ["no_partial_group_serving"]


# -- no_gpu_held_twice -----------------------------------------------------------------------


def test_a_gpu_of_a_worker_stage_given_to_another_replica_is_held_twice() -> None:
    log = _Log()
    log.place(1.0, "big-0", ["n0", "n1"])
    log.place(2.0, "big-1", ["n1", "n2"])  # n1's GPU 0: big-0's worker stage holds it
    assert log.violations == ["no_gpu_held_twice"]
    assert "n1 GPU 0 held by big-1@1 (placed) and by big-0@1 (placed)" in str(
        log.checker.violations[0]
    )

    released = _Log()
    released.place(1.0, "big-0", ["n0", "n1"])
    released.fail(1.5, "big-0")  # a failed replica holds nothing (the scheduler's rule)
    released.place(2.0, "big-1", ["n1", "n2"])
    released.place(3.0, "big-0", ["n0", "n3"], epoch=2)
    assert released.violations == []


# -- group_serving_or_unschedulable ----------------------------------------------------------


def _fleet(healthy: int, *, ready: int, unschedulable: str) -> FleetState:
    state = FleetState()
    for i in range(healthy):
        state.nodes.nodes[f"n{i}"] = NodeView(node_id=f"n{i}", gpus=(GPU,))
    state.clusters.clusters["big"] = ClusterView(spec=SPEC, unschedulable=unschedulable)
    for r in range(ready):
        nodes = (f"n{2 * r}", f"n{2 * r + 1}")
        state.replicas.replicas[f"big-{r}"] = ReplicaView(
            replica_id=f"big-{r}", cluster="big", node_id=nodes[0], epoch=1, gpu_indices=(0,),
            status="ready",
            stages=tuple(StagePlacement(rank=i, node_id=n, gpu_indices=(0,))
                         for i, n in enumerate(nodes)),
            stage_addresses={1: "h:1"},
        )  # fmt: skip
    return state


def test_a_sharded_cluster_short_at_the_end_needs_a_reason_that_still_holds() -> None:
    whole = _fleet(4, ready=2, unschedulable="")
    assert unplaced_groups(whole, settle_s=60) == []
    # Short, and the reason is recorded and true: 3 nodes hold one group, not two.
    explained = _fleet(3, ready=1, unschedulable="nothing fits big")
    assert unplaced_groups(explained, settle_s=60) == []
    silent = _fleet(3, ready=1, unschedulable="")
    assert [s.detail for s in unplaced_groups(silent, settle_s=60)] == [
        "big: 1/2 groups ready 60 s after the faults stopped, and no reason recorded "
        "(cluster.unschedulable)"
    ]
    # A reason recorded once, but 4 healthy nodes hold the second group now: stuck.
    stale = _fleet(4, ready=1, unschedulable="nothing fits big")
    assert [s.detail for s in unplaced_groups(stale, settle_s=60)] == [
        "big: 1/2 groups ready 60 s after the faults stopped: recorded unschedulable "
        "(nothing fits big), but a group fits on n2+n3"
    ]


def test_the_liveness_rule_leaves_sharded_clusters_to_their_own() -> None:
    """`gpu.count` is not a sharded spec's demand: the plan's is. short_in neither demands a
    sharded cluster by it nor counts the GPUs its groups hold as room for the others."""
    state = _fleet(3, ready=1, unschedulable="nothing fits big")
    assert short_in(state, settle_s=60) == []
    small = ClusterSpec(name="small", command="x", replicas=1)
    state.clusters.clusters["small"] = ClusterView(spec=small)
    assert [s.cluster for s in short_in(state, settle_s=60)] == ["small"]  # n2 is free
    state.nodes.nodes["n2"].health = "offline"
    assert short_in(state, settle_s=60) == []  # no GPU left for it: nothing to demand


# -- the shipped scenarios, and planted bugs they catch ---------------------------------------


def _run(name: str, seed: int = 1, **fleet: int) -> RunResult:
    scenario: Scenario = load(SCENARIOS / f"{name}.toml")
    if fleet:
        scenario = dataclasses.replace(scenario, fleet=dataclasses.replace(scenario.fleet, **fleet))
    result, _ = run_scenario(scenario, seed=seed)
    return result


def _invariants(result: RunResult) -> list[str]:
    return sorted({v["invariant"] for v in result.violations})


def test_a_lost_stage_fails_its_group_and_the_other_group_serves() -> None:
    result, world = run_scenario(load(SCENARIOS / "sharded-stage-loss.toml"), seed=1)
    assert result.violations == []
    assert result.availability["big"]["availability"] == 1.0
    failed = [
        e.payload
        for e in world.store.read_all_now()
        if isinstance(e.payload, ReplicaFailed) and "pipeline stage" in e.payload.detail
    ]
    assert len(failed) == 2  # each power loss struck a worker stage, and failed its group


def test_contending_clusters_wait_recorded_then_are_placed() -> None:
    result, world = run_scenario(load(SCENARIOS / "sharded-contention.toml"), seed=1)
    assert result.violations == []
    log = world.store.read_all_now()
    waited = [e for e in log if isinstance(e.payload, ClusterUnschedulable)]
    assert waited and all(e.payload.reason for e in waited)
    loser = waited[0].payload.name
    placed_after = [
        e
        for e in log
        if isinstance(e.payload, ReplicaPlaced)
        and e.payload.cluster == loser
        and e.position > waited[0].position
    ]
    assert placed_after, "the waiting cluster was never placed once the GPUs came free"
    state = world.checker.state
    assert all(
        sum(r.status == "ready" for r in state.replicas.replicas.values() if r.cluster == c) == 2
        for c in ("alpha", "beta")
    )


def test_contention_that_never_ends_is_recorded_and_no_violation() -> None:
    """Six nodes hold 3 of the 4 groups wanted: one cluster stays short to the end, recorded
    unschedulable, and that is what group_serving_or_unschedulable accepts."""
    result = _run("sharded-contention", nodes=6)
    assert result.violations == []


def test_the_new_scenarios_give_the_same_run_for_the_same_seed() -> None:
    for name in ("sharded-stage-loss", "sharded-contention"):
        first, again = _run(name, seed=3), _run(name, seed=3)
        assert first.digest == again.digest, name
        assert first.to_json() == again.to_json(), name


def _head_only(self: ReplicaView) -> tuple[str, ...]:
    return (self.node_id,)


def test_a_controller_blind_to_worker_stages_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the controller judges a pipeline by its head's node alone (ReplicaView.node_ids
    as before pipelines), so a worker's node lost leaves the group ready."""
    monkeypatch.setattr(ReplicaView, "node_ids", property(_head_only))
    assert "no_partial_group_serving" in _invariants(_run("sharded-stage-loss"))


def _taken_heads_only(placements: Sequence[ReplicaView]) -> dict[str, set[int]]:
    taken: dict[str, set[int]] = {}
    for p in placements:
        if p.status not in scheduler.RELEASED:
            taken.setdefault(p.node_id, set()).update(p.gpu_indices)
    return taken


def test_a_scheduler_that_forgets_worker_stages_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted: the GPUs taken are the heads' alone (the scheduler before pipelines), so a
    worker stage's GPU is given again."""
    monkeypatch.setattr(scheduler, "_taken", _taken_heads_only)
    monkeypatch.setattr(sharding, "_taken", _taken_heads_only)
    assert "no_gpu_held_twice" in _invariants(_run("sharded-contention"))


def test_a_cluster_that_waits_without_saying_why_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted: the cluster actor records no cluster.unschedulable.v1; a cluster left short
    at the end says nothing about why."""
    real = cluster_actor.ClusterActor._persist_and_wait

    async def silent(
        self: cluster_actor.ClusterActor, ctx: object, events: Sequence[DomainEvent]
    ) -> list[int]:
        kept = [e for e in events if not isinstance(e, ClusterUnschedulable)]
        return await real(self, ctx, kept) if kept else []  # type: ignore[arg-type]

    monkeypatch.setattr(cluster_actor.ClusterActor, "_persist_and_wait", silent)
    result = _run("sharded-contention", nodes=6)
    assert _invariants(result) == ["group_serving_or_unschedulable"]
    assert "no reason recorded" in result.violations[0]["detail"]


# -- core bugs the invariants found, fixed: these runs failed before ---------------------------


def test_a_reason_that_holds_again_after_a_placement_is_shown_again() -> None:
    """Six nodes, 3 groups of the 4 wanted: alpha loses a group (a stage's power, 20 s), gets
    it back (replica.placed clears alpha's reason in the view), then loses another for good,
    for the same reason text as before, which is recorded again. (Before the cluster actor
    compared with the read model's reason, nothing was: seed 1 ended `alpha: 1/2 groups ready
    ..., and no reason recorded`.)"""
    scenario = load(SCENARIOS / "sharded-contention.toml")
    scenario = dataclasses.replace(
        scenario,
        fleet=dataclasses.replace(scenario.fleet, nodes=6),
        faults=(
            FaultPlan(at_s=40, kind="power_loss", nodes="stage", duration_s=20),
            FaultPlan(at_s=80, kind="power_loss", nodes="stage"),
        ),
    )
    result, _ = run_scenario(scenario, seed=1)
    assert result.violations == []


def test_a_group_is_not_placed_again_on_its_crash_looping_stage() -> None:
    """A worker stage's node crash-loops for good (seed 1: node-1, big-0's worker): the
    replacement avoids the node the failure names (replica.failed.v1 `node_id`), as a
    single-node replica's slot avoids its own. (Before, big-0 was placed on node-0+node-1 again
    and again, epoch 33 at the end, never on the free node-4.)"""
    scenario = load(SCENARIOS / "sharded-stage-loss.toml")
    scenario = scenario.with_faults((FaultPlan(at_s=130, kind="crash_loop", nodes="stage"),))
    result, _ = run_scenario(scenario, seed=1)
    assert result.violations == []
