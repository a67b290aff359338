"""Canaries, on virtual time: `cluster.canary` creates `<name>-canary` with the new spec and
records the split, which the routing table carries to gateways; `promote` records the spec as
the cluster's next revision and rolls it out, `abort` leaves the cluster as it was; either
way the canary's cluster goes. Bad requests are one line each, and a rebuild of the log equals
the live state."""

from __future__ import annotations

import msgspec

import projections
from events import ClusterCanaryEnded, ClusterCanaryStarted, ClusterSpecChanged
from events.contract import subjects
from events.contract.messages import CanarySplit, RoutingUpdate
from runtime.env import Msg
from sim import run_simulation
from tests.control.harness import Fleet, fleet

SPEC = {"name": "llama", "replicas": 3, "command": "gpumesh workload echo --port {port}"}
NEW = {**SPEC, "env": {"MODEL_REV": "2"}}


def recorded(f: Fleet, kind: type) -> list:  # type: ignore[type-arg]
    return [e.payload for e in f.store.read_all_now() if isinstance(e.payload, kind)]


def test_a_canary_serves_beside_the_cluster_then_is_promoted() -> None:
    async def main() -> None:
        async with fleet(4, seed=5) as f:
            tables: list[RoutingUpdate] = []

            def routing(msg: Msg) -> None:
                tables.append(msgspec.json.decode(msg.data, type=RoutingUpdate))

            await f.bus.subscribe(subjects.ROUTING, handler=routing)
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 3, within=15, why="llama ready")

            reply = await f.api("cluster.canary", {"name": "llama", "spec": NEW, "weight": 25})
            assert reply.ok, reply.error
            assert reply.data["canary"] == {"cluster": "llama-canary", "weight": 25}
            canary = f.state.clusters.clusters["llama-canary"]
            # 25% of 3 replicas, rounded up; the cluster's model name, which stays the
            # cluster's (the split alone hands the canary its share).
            assert (canary.spec.replicas, canary.spec.model, canary.spec.env) == (
                1,
                "llama",
                {"MODEL_REV": "2"},
            )
            await f.until(lambda: len(f.ready("llama-canary")) == 1, within=15, why="canary")
            await f.until(
                lambda: (
                    bool(tables)
                    and tables[-1].splits == {"llama": CanarySplit(to="llama-canary", weight=25)}
                ),
                within=10,
                why="the split reaches gateways",
            )
            assert all("llama" not in t.models for t in tables), "the model stayed llama's"
            assert recorded(f, ClusterCanaryStarted) == [
                ClusterCanaryStarted(name="llama", canary="llama-canary", weight=25)
            ]

            reply = await f.api("cluster.promote", {"name": "llama", "reason": "looks good"})
            assert reply.ok, reply.error
            assert reply.data["revision"] == 2 and reply.data["changed"] is True
            [change] = recorded(f, ClusterSpecChanged)
            assert change.spec.name == "llama" and change.spec.env == {"MODEL_REV": "2"}
            assert change.spec.replicas == 3 and change.reason == "promoted canary llama-canary"
            assert recorded(f, ClusterCanaryEnded) == [
                ClusterCanaryEnded(
                    name="llama", canary="llama-canary", outcome="promoted", reason="looks good"
                )
            ]
            assert "llama-canary" not in f.state.clusters.clusters
            await f.until(
                lambda: bool(tables) and tables[-1].splits == {}, within=10, why="split gone"
            )
            # The promoted revision rolls out over the cluster's own replicas.
            await f.until(
                lambda: (
                    sum(
                        1
                        for r in f.state.replicas.replicas.values()
                        if r.cluster == "llama" and r.status == "ready" and r.revision == 2
                    )
                    == 3
                ),
                within=60,
                why="revision 2 rolled out",
            )
            await f.until(lambda: not f.ready("llama-canary"), within=15, why="canary stopped")
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_an_aborted_canary_leaves_the_cluster_as_it_was_and_bad_requests_are_one_line() -> None:
    async def main() -> None:
        async with fleet(3, seed=6) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 3, within=15, why="llama ready")
            for body, error in [
                ({"name": "llama", "spec": NEW, "weight": 0}, "weight: must be 1..99"),
                ({"name": "llama", "spec": NEW, "weight": 100}, "weight: must be 1..99"),
                ({"name": "nope", "spec": NEW, "weight": 10}, "unknown cluster 'nope'"),
                (
                    {"name": "llama", "spec": {**NEW, "name": "other"}, "weight": 10},
                    "spec.name: 'other' is not the cluster 'llama'",
                ),
            ]:
                reply = await f.api("cluster.canary", body)
                assert not reply.ok and reply.error.startswith(error), reply.error
                assert "\n" not in reply.error
            for verb in ("cluster.promote", "cluster.abort"):
                reply = await f.api(verb, {"name": "llama"})
                assert not reply.ok and "has no canary" in reply.error, reply.error

            assert (await f.api("cluster.canary", {"name": "llama", "spec": NEW})).ok
            again = await f.api("cluster.canary", {"name": "llama", "spec": NEW})
            assert not again.ok and "already has a canary (llama-canary)" in again.error
            gone = await f.api("cluster.delete", {"name": "llama"})
            assert not gone.ok and "promote or abort it" in gone.error

            reply = await f.api("cluster.abort", {"name": "llama", "reason": "p99 regressed"})
            assert reply.ok, reply.error
            assert reply.data["revision"] == 1 and reply.data["changed"] is False
            assert recorded(f, ClusterSpecChanged) == []
            [ended] = recorded(f, ClusterCanaryEnded)
            assert (ended.outcome, ended.reason) == ("aborted", "p99 regressed")
            assert "llama-canary" not in f.state.clusters.clusters
            assert f.state.clusters.clusters["llama"].canary == ""
            await f.until(lambda: not f.ready("llama-canary"), within=15, why="canary stopped")
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())
