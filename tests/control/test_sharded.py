"""A sharded replica on virtual time: a pipeline placed as a group, its workers started before
its head, and the group failed and placed again as a whole when any stage is lost
(docs/sharding.md). Scripted agents (tests/control/harness.py) with one 24 GiB GPU each: a
30 GiB model needs two of them, on two nodes."""

from __future__ import annotations

import projections
from events import ClusterUnschedulable, ReplicaFailed, ReplicaPlaced, ReplicaStageReady
from events.contract.messages import ReplicaState
from sim import run_simulation
from tests.control.harness import Fleet, ScriptedAgent, fleet

SPEC = {
    "name": "big",
    "replicas": 1,
    "command": "llama-server --rpc {peers} -ngl {peer_layers} -ts {peer_split} --port {port}",
    "sharding": {
        "weights_gib": 30,
        "layers": 32,
        "parallelism": ["pipeline"],
        "worker_command": "ggml-rpc-server -p {port}",
    },
}


def placements(f: Fleet, replica_id: str) -> list[ReplicaPlaced]:
    return [
        e.payload
        for e in f.store.read_all_now()
        if isinstance(e.payload, ReplicaPlaced) and e.payload.replica_id == replica_id
    ]


def test_a_pipeline_is_placed_in_one_event_workers_first_and_ready_with_its_head() -> None:
    async def main() -> None:
        async with fleet(3, gpus=1) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: f.ready("big") == ["big-0"], within=20, why="the group serves")
            (placed,) = placements(f, "big-0")
            assert [(s.rank, s.node_id, s.first_layer, s.last_layer) for s in placed.stages] == [
                (0, "n0", 0, 16),
                (1, "n1", 16, 32),
            ]
            assert (placed.node_id, placed.gpu_indices) == ("n0", (0,))
            assert "2 pipeline stages" in placed.why
            # The worker was started, and reported up, before the head was sent anything.
            (worker,) = f.agents["n1"].start_commands
            (head,) = f.agents["n0"].start_commands
            assert worker.stage is not None and head.stage is not None
            assert worker.command_id == "start-big-0-1-r1"
            assert head.command_id == "start-big-0-1"
            assert (worker.stage.rank, worker.stage.world_size, worker.stage.peers) == (1, 2, ())
            (up,) = [
                e.payload
                for e in f.store.read_all_now()
                if isinstance(e.payload, ReplicaStageReady)
            ]
            assert (up.rank, up.node_id) == (1, "n1")
            assert head.stage.peers == (up.address,)
            assert head.stage.split == (16, 16) and head.stage.total_layers == 32
            assert f.agents["n2"].start_commands == []
            # Both nodes' GPUs are held: nothing else fits there.
            view = f.state.replicas.replicas["big-0"]
            assert view.holds() == (("n0", (0,)), ("n1", (0,)))
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_losing_a_worker_node_fails_the_group_and_places_it_again_whole() -> None:
    async def main() -> None:
        async with fleet(3, gpus=1) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: f.ready("big") == ["big-0"], within=20, why="the group serves")
            f.kill("n1")  # the worker's node
            await f.until(
                lambda: any(isinstance(e.payload, ReplicaFailed) for e in f.store.read_all_now()),
                within=10,
                why="the group fails when a stage's node goes offline",
            )
            (failed,) = [
                e.payload for e in f.store.read_all_now() if isinstance(e.payload, ReplicaFailed)
            ]
            assert failed.reason == "node_offline" and "n1 (a pipeline stage's)" in failed.detail
            # The head on the surviving node is told to stop: it cannot serve, and holds a GPU.
            await f.until(
                lambda: ("big-0", 1) in f.agents["n0"].stopped, within=5, why="head stopped"
            )
            await f.until(lambda: f.ready("big") == ["big-0"], within=20, why="placed again")
            again = placements(f, "big-0")[-1]
            assert again.epoch == 2
            assert {s.node_id for s in again.stages} == {"n0", "n2"}
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_a_worker_that_fails_fails_the_group_before_the_head_starts() -> None:
    async def main() -> None:
        async with fleet(3, gpus=1) as f:
            f.agents["n1"].crash_on_start = True
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(
                lambda: any(isinstance(e.payload, ReplicaFailed) for e in f.store.read_all_now()),
                within=20,
                why="the worker's failure fails the group",
            )
            failed = next(
                e.payload for e in f.store.read_all_now() if isinstance(e.payload, ReplicaFailed)
            )
            assert failed.epoch == 1 and failed.detail.startswith("stage 1 on n1: ")
            # The head of that epoch was never started.
            assert ("big-0", 1) not in f.agents["n0"].started
            # The failure names the worker's node, and the replacement avoids it.
            assert failed.node_id == "n1"
            await f.until(lambda: f.ready("big") == ["big-0"], within=20, why="placed elsewhere")
            assert {s.node_id for s in placements(f, "big-0")[-1].stages} == {"n0", "n2"}

    run_simulation(main())


def test_a_worker_restarting_in_place_fails_the_group() -> None:
    async def main() -> None:
        async with fleet(3, gpus=1) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: f.ready("big") == ["big-0"], within=20, why="the group serves")
            # Its process died and the agent restarts it: the head's weights on it are gone.
            await f.agents["n1"]._report(
                ReplicaState(replica_id="big-0", epoch=1, state="starting", detail="restart 1")
            )
            await f.until(
                lambda: placements(f, "big-0")[-1].epoch == 2, within=10, why="placed again"
            )
            failed = next(
                e.payload for e in f.store.read_all_now() if isinstance(e.payload, ReplicaFailed)
            )
            assert failed.detail == "stage 1 on n1: restarted (restart 1)"

    run_simulation(main())


def test_two_groups_competing_for_the_last_gpus_never_share_one() -> None:
    async def main() -> None:
        # Three single-GPU nodes hold one 2-stage group, not two: the second is unschedulable,
        # and no GPU is ever promised to both (the whole group is one event, or nothing).
        async with fleet(3, gpus=1) as f:
            assert (await f.api("cluster.create", {**SPEC, "replicas": 2})).ok
            await f.until(lambda: f.ready("big") == ["big-0"], within=20, why="one group")
            await f.until(
                lambda: f.state.clusters.clusters["big"].unschedulable != "",
                within=10,
                why="the second group is recorded unschedulable",
            )
            (blocked,) = [
                e.payload
                for e in f.store.read_all_now()
                if isinstance(e.payload, ClusterUnschedulable)
            ]
            assert blocked.missing == 1 and blocked.reason.startswith("nothing fits big")
            live = [r for r in f.state.replicas.replicas.values() if r.status != "failed"]
            held = [(node, gpu) for r in live for node, gpus in r.holds() for gpu in gpus]
            assert len(held) == len(set(held)) == 2
            # A fourth node arrives: the waiting group is placed on it and the spare one.
            await f.start_agent(ScriptedAgent("n3", f.bus, f.commands, gpus=1))
            await f.until(
                lambda: f.ready("big") == ["big-0", "big-1"], within=20, why="both groups"
            )
            second = placements(f, "big-1")[-1]
            assert {s.node_id for s in second.stages} == {"n2", "n3"}

    run_simulation(main())


def test_the_plan_for_a_model_one_gpu_holds_is_an_ordinary_replica() -> None:
    async def main() -> None:
        async with fleet(2, gpus=1) as f:
            small = {**SPEC, "sharding": {**SPEC["sharding"], "weights_gib": 8}}  # type: ignore[dict-item]
            assert (await f.api("cluster.create", small)).ok
            await f.until(lambda: f.ready("big") == ["big-0"], within=20, why="serves")
            (placed,) = placements(f, "big-0")
            assert placed.stages == () and "one GPU" in placed.why
            (start,) = [c for a in f.agents.values() for c in a.start_commands]
            assert start.stage is None

    run_simulation(main())


def test_a_clusters_groups_go_to_different_nodes_when_they_can() -> None:
    async def main() -> None:
        # Two GPUs a node: the second group would fit beside the first, on the same two nodes;
        # it goes to the other two, as replicas of one cluster spread.
        async with fleet(4, gpus=2) as f:
            assert (await f.api("cluster.create", {**SPEC, "replicas": 2})).ok
            await f.until(lambda: f.ready("big") == ["big-0", "big-1"], within=20, why="both")
            first = {s.node_id for s in placements(f, "big-0")[-1].stages}
            second = {s.node_id for s in placements(f, "big-1")[-1].stages}
            assert first.isdisjoint(second) and first | second == {"n0", "n1", "n2", "n3"}

    run_simulation(main())


def test_two_groups_share_nodes_rather_than_wait() -> None:
    async def main() -> None:
        async with fleet(2, gpus=2) as f:
            assert (await f.api("cluster.create", {**SPEC, "replicas": 2})).ok
            await f.until(lambda: f.ready("big") == ["big-0", "big-1"], within=20, why="both")
            held = [g for r in f.state.replicas.replicas.values() for g in r.holds()]
            assert sorted(held) == [("n0", (0,)), ("n0", (1,)), ("n1", (0,)), ("n1", (1,))]

    run_simulation(main())
