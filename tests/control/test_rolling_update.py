"""Rolling updates, rollback and automatic rollback, on virtual time: the real controller and
scripted agents. Every test replays the log event by event afterwards and checks the bounds at
each one: never fewer than `replicas` routed once all were, never more than `replicas +
max_surge` in service; and a rebuild of the log equals the live state."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from hypothesis import given, settings, strategies as st

import projections
from actors.cluster_actor import RolloutSlot, RolloutStep, plan_rollout
from events import (
    ClusterRolledOut,
    ClusterSpec,
    ClusterSpecChanged,
    ClusterUnschedulable,
    Envelope,
    ReplicaPlaced,
    ReplicaStopping,
    RolloutPolicy,
)
from events.contract.messages import ReplicaState, StartReplica, StopReplica
from projections import FleetState
from projections.fleet import apply as fold
from sim import run_simulation
from tests.control.harness import Fleet, ScriptedAgent, fleet

ACTIVE = ("placed", "starting", "ready")
SPEC: dict[str, Any] = {
    "name": "llama",
    "replicas": 3,
    "command": "gpumesh workload echo --port {port}",
    "env": {"GREETING": "hello"},
}


def spec(**changes: Any) -> dict[str, Any]:
    return {**SPEC, **changes}


class SpecAgent(ScriptedAgent):
    """A scripted agent whose workload crashes at start when its spec's env says CRASH=1."""

    async def _obey(self) -> None:
        async for delivery in self.commands.consume(self.node_id):
            await self.gate.wait()
            match delivery.command:
                case StartReplica(replica_id=rid, epoch=epoch, spec=wanted):
                    self.started.append((rid, epoch))
                    await self._report(
                        ReplicaState(replica_id=rid, epoch=epoch, state="starting", port=9000)
                    )
                    await asyncio.sleep(self.start_delay)
                    if wanted.env.get("CRASH") == "1":
                        self.running.pop(rid, None)
                        await self._report(
                            ReplicaState(
                                replica_id=rid,
                                epoch=epoch,
                                state="failed",
                                detail="crash loop: 4 failures within 60 s",
                            )
                        )
                    else:
                        address = f"http://{self.node_id}:9000/{rid}/{epoch}"
                        await self._report(
                            ReplicaState(
                                replica_id=rid,
                                epoch=epoch,
                                state="ready",
                                port=9000,
                                address=address,
                            )
                        )
                case StopReplica(replica_id=rid, epoch=epoch):
                    current = self.running.get(rid)
                    if current is not None and current.epoch == epoch:
                        self.stopped.append((rid, epoch))
                        self.running.pop(rid)
                        await self._report(
                            ReplicaState(replica_id=rid, epoch=epoch, state="stopped", exit_code=0)
                        )
            await delivery.ack()


async def spec_fleet_agents(f: Fleet, nodes: int) -> None:
    for i in range(nodes):
        await f.start_agent(SpecAgent(f"s{i}", f.bus, f.commands))


def check_bounds(
    log: list[Envelope], cluster: str, desired: int, surge: int, after: int = 0
) -> dict[str, int]:
    """Fold the log one event at a time; from the first moment `desired` replicas were routed
    (and past position `after`), never fewer are routed and never more than `desired + surge`
    are in service. Returns the fewest routed and the most in service seen."""
    state = FleetState()
    full = False
    seen = {"fewest_routed": 1 << 30, "most_in_service": 0}
    for envelope in log:
        fold(state, envelope)
        routed = len(state.routing.routes.get(cluster, ()))
        in_service = sum(
            1
            for r in state.replicas.replicas.values()
            if r.cluster == cluster and r.status in ACTIVE
        )
        if envelope.position > after and routed >= desired:
            full = True
        if full:
            assert routed >= desired, f"{routed} routed at {envelope.position}: {envelope.type}"
            assert in_service <= desired + surge, f"{in_service} in service at {envelope.position}"
            seen["fewest_routed"] = min(seen["fewest_routed"], routed)
            seen["most_in_service"] = max(seen["most_in_service"], in_service)
    assert full, "the cluster never had all its replicas routed"
    return seen


def revisions_of(f: Fleet, cluster: str) -> set[int]:
    return {
        r.revision
        for r in f.state.replicas.replicas.values()
        if r.cluster == cluster and r.status in ACTIVE
    }


def rolled_out(f: Fleet, cluster: str, revision: int) -> bool:
    view = f.state.clusters.clusters.get(cluster)
    return view is not None and view.rolled_out == revision


def stop_reasons(f: Fleet) -> list[str]:
    return [
        e.payload.reason for e in f.store.read_all_now() if isinstance(e.payload, ReplicaStopping)
    ]


def test_a_rolling_update_keeps_every_replica_routed_and_ends_on_the_new_revision() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            created = await f.api("cluster.apply", SPEC)
            assert created.ok and created.data["revision"] == 1, created
            assert created.data["changed"] is True
            await f.until(lambda: len(f.ready("llama")) == 3, within=10, why="revision 1 out")
            start = f.store.read_all_now()[-1].position

            same = await f.api("cluster.apply", SPEC)
            assert same.ok and same.data["changed"] is False
            assert same.data["message"] == "unchanged: the spec is revision 1's"

            reply = await f.api("cluster.apply", spec(env={"GREETING": "bonjour"}))
            assert reply.ok and reply.data["revision"] == 2 and reply.data["changed"]
            took = await f.until(lambda: rolled_out(f, "llama", 2), within=30, why="rolled out")
            assert revisions_of(f, "llama") == {2}
            assert len(f.ready("llama")) == 3
            assert stop_reasons(f) == ["replaced by revision 2"] * 3
            seen = check_bounds(f.store.read_all_now(), "llama", 3, 1, after=start)
            assert seen == {"fewest_routed": 3, "most_in_service": 4}, seen
            placed = [
                e.payload
                for e in f.store.read_all_now()
                if isinstance(e.payload, ReplicaPlaced) and e.payload.revision == 2
            ]
            assert len(placed) == 3 and all(p.why for p in placed)
            assert took < 10, took
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_max_unavailable_replaces_without_surge() -> None:
    async def main() -> None:
        async with fleet(3, gpus=1) as f:  # no room for a fourth replica: surge 0 it must be
            rollout = {"max_surge": 0, "max_unavailable": 1}
            assert (await f.api("cluster.create", spec(rollout=rollout))).ok
            await f.until(lambda: len(f.ready("llama")) == 3, within=10, why="revision 1 out")
            start = f.store.read_all_now()[-1].position
            changed = spec(rollout=rollout, command="gpumesh workload echo --port {port} -v")
            assert (await f.api("cluster.apply", changed)).data["revision"] == 2
            await f.until(lambda: rolled_out(f, "llama", 2), within=30, why="rolled out")
            assert revisions_of(f, "llama") == {2}
            # One ready replica may go (max_unavailable 1): 2 routed at least, 3 in service.
            seen = check_bounds(f.store.read_all_now(), "llama", 2, 1, after=start)
            assert seen["most_in_service"] == 3
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_a_change_of_count_or_policy_alone_replaces_nothing() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 3, within=10, why="revision 1 out")
            reply = await f.api(
                "cluster.apply", spec(replicas=4, rollout={"max_surge": 2, "max_unavailable": 1})
            )
            assert reply.ok and reply.data["revision"] == 2
            await f.until(lambda: rolled_out(f, "llama", 2), within=10, why="scaled")
            assert stop_reasons(f) == []
            assert len(f.ready("llama")) == 4
            history = await f.api("cluster.history", {"name": "llama"})
            changes = [r["change"] for r in history.data["revisions"]]
            assert changes == [
                "created",
                "replicas: 3 -> 4; rollout.max_surge: (none) -> 2; rollout.max_unavailable: "
                "(none) -> 1",
            ]

    run_simulation(main())


def test_rollback_applies_an_earlier_spec_as_a_new_revision() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 3, within=10, why="revision 1 out")
            none_before = await f.api("cluster.rollback", {"name": "llama"})
            assert not none_before.ok
            assert none_before.error == "cluster 'llama' has no revision before 1"
            assert (await f.api("cluster.apply", spec(env={"GREETING": "hola"}))).ok
            await f.until(lambda: rolled_out(f, "llama", 2), within=30, why="revision 2 out")
            await f.api("cluster.scale", {"name": "llama", "replicas": 2})
            start = f.store.read_all_now()[-1].position

            for body, error in [
                ({"name": "llama", "to": 2}, "revision 2 is the current revision of cluster "),
                ({"name": "llama", "to": 7}, "unknown revision 7 of cluster 'llama' (revisions"),
                ({"name": "llama", "to": -1}, "to: must be a revision number (1 or more), got -1"),
                ({"name": "nope"}, "unknown cluster 'nope'"),
                ({"name": "llama", "to": "1"}, "bad request body: Expected `int`, got `str`"),
            ]:
                refused = await f.api("cluster.rollback", body)
                assert not refused.ok and refused.error.startswith(error), refused.error

            reply = await f.api("cluster.rollback", {"name": "llama"})
            assert reply.ok and reply.data["revision"] == 3, reply
            assert reply.data["message"] == "revision 3: the spec of revision 1"
            assert reply.data["desired"] == 2  # the count stays what it is now
            await f.until(lambda: rolled_out(f, "llama", 3), within=30, why="rolled back")
            assert revisions_of(f, "llama") == {3}
            view = f.state.clusters.clusters["llama"]
            assert view.spec.env == {"GREETING": "hello"} and view.spec.replicas == 2
            check_bounds(f.store.read_all_now(), "llama", 2, 1, after=start)

            again = await f.api("cluster.rollback", {"name": "llama", "to": 1})
            assert again.ok and again.data["changed"] is False
            history = await f.api("cluster.history", {"name": "llama"})
            rows = [
                (r["revision"], r["reason"], r["rollback_to"], r["change"])
                for r in history.data["revisions"]
            ]
            assert rows == [
                (1, "created", 0, "created"),
                (2, "applied", 0, 'env.GREETING: "hello" -> "hola"'),
                (3, "rollback to revision 1", 1, 'env.GREETING: "hola" -> "hello"'),
            ]
            assert history.data["revision"] == 3 and history.data["rolled_out"] == 3
            changed = [
                e.payload
                for e in f.store.read_all_now()
                if isinstance(e.payload, ClusterSpecChanged)
            ]
            assert [c.revision for c in changed] == [2, 3]
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_a_crashing_revision_is_rolled_back_on_its_own() -> None:
    async def main() -> None:
        async with fleet(0) as f:
            await spec_fleet_agents(f, 3)
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 3, within=10, why="revision 1 out")
            start = f.store.read_all_now()[-1].position
            bad = spec(env={"GREETING": "hello", "CRASH": "1"})
            assert (await f.api("cluster.apply", bad)).data["revision"] == 2
            await f.until(lambda: rolled_out(f, "llama", 3), within=60, why="rolled back")
            changed = [
                e.payload
                for e in f.store.read_all_now()
                if isinstance(e.payload, ClusterSpecChanged)
            ]
            assert [(c.revision, c.rollback_to) for c in changed] == [(2, 0), (3, 1)]
            reason = changed[-1].reason
            assert reason.startswith(
                "automatic rollback to revision 1: replicas of revision 2 failed 3 times "
                "during its rollout (last: llama-3 workload_exited: crash loop"
            ), reason
            assert f.state.clusters.clusters["llama"].spec.env == {"GREETING": "hello"}
            # The replicas of revision 1 never left: revision 3 runs what they run.
            assert revisions_of(f, "llama") == {1}
            assert len(f.ready("llama")) == 3
            check_bounds(f.store.read_all_now(), "llama", 3, 1, after=start)
            rolled = [
                e.payload.revision
                for e in f.store.read_all_now()
                if isinstance(e.payload, ClusterRolledOut)
            ]
            assert rolled == [1, 3]
            assert projections.rebuild(f.store.read_all_now()) == f.state
            # Nothing more happens: no rollback of the rollback.
            await asyncio.sleep(30.0)
            assert f.state.clusters.clusters["llama"].revision == 3

    run_simulation(main())


def test_bad_rollout_policies_are_refused_with_the_field() -> None:
    async def main() -> None:
        async with fleet(1) as f:
            for rollout, error in [
                ({"max_surge": 0, "max_unavailable": 0}, "rollout: max_surge and max_unavailable"),
                ({"max_surge": -1}, "rollout.max_surge: must not be negative"),
                ({"max_unavailable": -2}, "rollout.max_unavailable: must not be negative"),
                ({"max_surge": "1"}, "rollout.max_surge: Expected `int`, got `str`"),
            ]:
                for verb in ("cluster.create", "cluster.apply"):
                    refused = await f.api(verb, spec(rollout=rollout))
                    assert not refused.ok and refused.error.startswith(error), refused.error

    run_simulation(main())


# -- the plan alone ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    desired=st.integers(0, 8),
    surge=st.integers(0, 4),
    unavailable=st.integers(0, 4),
    draws=st.randoms(use_true_random=False),
)
def test_the_plan_respects_both_bounds_at_every_step(
    desired: int, surge: int, unavailable: int, draws: Any
) -> None:
    """From `desired` ready outdated replicas, steps of the plan with new replicas becoming
    ready in any order: never more than desired + surge in service, never fewer than
    desired - unavailable ready, and it ends with `desired` new ready replicas."""
    if surge == 0 and unavailable == 0:
        return  # refused by the spec's validation
    policy = RolloutPolicy(max_surge=surge, max_unavailable=unavailable)
    slots = [RolloutSlot(f"old-{i}", current=False, ready=True) for i in range(desired)]
    made = 0
    for _ in range(10 * (desired + 1) + 10):
        step = plan_rollout(desired, policy, slots)
        if step == RolloutStep() and all(s.current and s.ready for s in slots):
            break
        gone = set(step.stop_outdated) | set(step.stop_extra)
        slots = [s for s in slots if s.replica_id not in gone]
        assert sum(s.ready for s in slots) >= desired - unavailable
        for _ in range(step.place):
            slots.append(RolloutSlot(f"new-{made}", current=True, ready=False))
            made += 1
        assert len(slots) <= desired + surge
        waiting = [i for i, s in enumerate(slots) if not s.ready]
        if waiting:  # at least one becomes ready, some others may too
            for i in {
                draws.choice(waiting),
                *draws.sample(waiting, draws.randint(0, len(waiting))),
            }:
                slots[i] = RolloutSlot(slots[i].replica_id, current=True, ready=True)
    assert len(slots) == desired and all(s.current and s.ready for s in slots), slots
    assert made == desired


def test_an_old_log_without_revisions_still_folds() -> None:
    """Rows written before revisions existed: no `revision` on replica.placed.v1, and
    cluster.spec_changed.v1 without one either. They decode with the defaults and fold."""
    from events.codec import decode_payload

    old_rows = [
        ("cluster/a", "cluster.created.v1", {"spec": {"name": "a", "command": "x"}}),
        (
            "replica/a-0",
            "replica.placed.v1",
            {"replica_id": "a-0", "cluster": "a", "node_id": "n0", "epoch": 1},
        ),
        ("cluster/a", "cluster.spec_changed.v1", {"spec": {"name": "a", "command": "y"}}),
    ]
    envelopes = []
    for position, (stream, tag, body) in enumerate(old_rows, start=1):
        payload = decode_payload(tag, msgspec.json.encode({"type": tag, **body}))
        assert not isinstance(payload, msgspec.Struct) or type(payload).__name__ != "Undecodable"
        envelopes.append(
            Envelope(
                event_id=f"e{position}",
                stream=stream,
                version=1 if position < 3 else 2,
                position=position,
                type=tag,
                recorded_at=position,
                payload=payload,  # type: ignore[arg-type]
            )
        )
    state = projections.rebuild(envelopes)
    assert state.undecodable == []
    replica = state.replicas.replicas["a-0"]
    assert replica.revision == 0 and replica.crashes == 0
    cluster = state.clusters.clusters["a"]
    assert cluster.revision == 2 and cluster.spec.command == "y"
    assert cluster.spec.rollout == RolloutPolicy()


def test_a_surge_with_no_room_waits_says_why_once_and_goes_on_when_allowed() -> None:
    async def main() -> None:
        async with fleet(3, gpus=1) as f:  # every GPU in use: no room for a surge replica
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 3, within=10, why="revision 1 out")
            assert (await f.api("cluster.apply", spec(env={"GREETING": "hej"}))).ok
            await asyncio.sleep(20.0)  # many reconcile passes
            unschedulable = [
                e.payload.reason
                for e in f.store.read_all_now()
                if isinstance(e.payload, ClusterUnschedulable)
            ]
            assert len(unschedulable) == 1, unschedulable
            assert unschedulable[0].startswith("rolling out revision 2: "), unschedulable
            assert revisions_of(f, "llama") == {1} and len(f.ready("llama")) == 3
            allowed = spec(env={"GREETING": "hej"}, rollout={"max_unavailable": 1})
            assert (await f.api("cluster.apply", allowed)).data["revision"] == 3
            await f.until(lambda: rolled_out(f, "llama", 3), within=30, why="rolled out")
            assert revisions_of(f, "llama") == {3}
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_a_restarted_controller_sends_a_replica_of_an_earlier_revision_that_revision_s_spec() -> (
    None
):
    """A replica placed under revision 1 has not started when revision 2 is recorded, and the
    controller dies before its rollout acts: the next controller sends the start again with
    revision 1's spec, not the current one under revision 1's number (its rollout then
    replaces it in its turn)."""

    async def main() -> None:
        async with fleet(3) as f:
            for agent in f.agents.values():
                agent.gate.clear()  # commands pile up: nothing starts
            assert (await f.api("cluster.apply", spec(replicas=1))).ok
            await f.until(lambda: "llama-0" in f.state.replicas.replicas, within=5, why="placed")
            store, env = f.store, f.env
        # Revision 2 recorded, and the controller gone before it acted on it.
        stream = "cluster/llama"
        version = await store.stream_version(stream)
        revised = msgspec.convert(spec(replicas=1, env={"GREETING": "bonjour"}), ClusterSpec)
        change = ClusterSpecChanged(spec=revised, revision=2, reason="applied")
        await store.append(stream, [env.new_event(change)], version)
        async with fleet(0, store=store) as g:
            old = g.state.replicas.replicas["llama-0"]
            assert old.revision == 1
            starts = [
                c
                for c in g.commands.pending(old.node_id)
                if isinstance(c, StartReplica) and c.replica_id == "llama-0" and c.epoch == 1
            ]
            assert starts and {c.spec.env["GREETING"] for c in starts} == {"hello"}

    run_simulation(main())
