"""Cordons, on virtual time: a cordoned node takes no new replicas (the placement says why) while
the ones it runs keep serving and routing; the cordon ends on its own at its time (a cluster
that had nowhere to go is placed then) or when uncordoned; the refusals are one line each, and
a rebuild of the log equals the live state."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import msgspec
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

import projections
from actors.scheduler import cordon_end
from events import NodeCordoned, NodeUncordoned, ReplicaPlaced
from events.contract import subjects
from gateway.control_routes import control_app
from runtime.env import Bus, Msg
from sim import run_simulation
from tests.control.harness import Fleet, fleet

SPEC = {"name": "llama", "replicas": 2, "command": "gpumesh workload echo --port {port}"}
S = 1_000_000_000


def cordon_events(f: Fleet) -> list[tuple[str, int, str]]:
    return [
        (e.type, getattr(e.payload, "until_ns", 0), e.payload.reason)
        for e in f.store.read_all_now()
        if isinstance(e.payload, NodeCordoned | NodeUncordoned)
    ]


def placements(f: Fleet) -> list[ReplicaPlaced]:
    return [e.payload for e in f.store.read_all_now() if isinstance(e.payload, ReplicaPlaced)]


def test_a_cordoned_node_takes_no_new_replicas_and_its_own_keep_serving() -> None:
    async def main() -> None:
        async with fleet(2) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="one on each node")
            [on_n0] = [r for r in f.state.replicas.replicas.values() if r.node_id == "n0"]
            until = f.env.clock.wall_ns() + 3600 * S
            body = {"node_id": "n0", "until_ns": until, "reason": "kernel upgrade"}
            reply = await f.api("node.cordon", body)
            assert reply.ok, reply.error
            assert reply.data == {
                "node_id": "n0",
                "cordoned": True,
                "until_ns": until,
                "reason": "kernel upgrade",
            }
            view = f.state.nodes.nodes["n0"]
            assert (view.cordoned_until_ns, view.cordon_reason) == (until, "kernel upgrade")

            assert (await f.api("cluster.scale", {"name": "llama", "replicas": 3})).ok
            await f.until(lambda: len(f.ready("llama")) == 3, within=10, why="a third, on n1")
            third = placements(f)[-1]
            assert third.node_id == "n1"
            [rejected] = [c for c in third.candidates if c.node_id == "n0"]
            assert rejected.rejected == f"cordoned until {cordon_end(until)}: kernel upgrade"
            assert "\n" not in rejected.rejected and rejected.rejected.endswith(": kernel upgrade")

            # Unlike a drain, the replica on n0 stays: ready, routed, not stopped.
            await asyncio.sleep(30.0)
            replica = f.state.replicas.replicas[on_n0.replica_id]
            assert (replica.node_id, replica.status, replica.epoch) == ("n0", "ready", on_n0.epoch)
            assert f.agents["n0"].stopped == []
            routing = (await f.api("routing.get")).data
            assert on_n0.replica_id in str(routing)
            assert cordon_events(f) == [("node.cordoned.v1", until, "kernel upgrade")]
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_the_cordon_ends_at_its_time_and_a_waiting_cluster_is_placed() -> None:
    async def main() -> None:
        async with fleet(1) as f:
            start = f.env.clock.wall_ns()
            until = start + 600 * S
            body = {"node_id": "n0", "until_ns": until, "reason": "firmware"}
            assert (await f.api("node.cordon", body)).ok
            assert (await f.api("cluster.create", {**SPEC, "replicas": 1})).ok
            await f.until(
                lambda: f.state.clusters.clusters["llama"].unschedulable != "",
                within=5,
                why="nowhere to place while n0 is cordoned",
            )
            assert f.state.clusters.clusters["llama"].unschedulable.endswith("1 cordoned")
            await asyncio.sleep(500.0)  # virtual time: still cordoned
            assert f.ready("llama") == []
            await f.until(lambda: len(f.ready("llama")) == 1, within=200, why="placed after")
            placed_at = f.env.clock.wall_ns()
            assert until <= placed_at <= until + 5 * S, (placed_at - until) / S
            assert placements(f)[-1].node_id == "n0"
            # Nothing recorded the end: the cordon is still in the view, and in the past.
            assert f.state.nodes.nodes["n0"].cordoned_until_ns == until
            assert cordon_events(f) == [("node.cordoned.v1", until, "firmware")]
            # An ended cordon cannot be lifted: one line, and a 409 over HTTP ("node ...").
            refused = await f.api("node.uncordon", {"node_id": "n0"})
            assert not refused.ok
            assert refused.error == (
                f"node 'n0' is not cordoned (its cordon ended {cordon_end(until)})"
            )
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_uncordon_lifts_a_cordon_with_no_end_and_the_refusals() -> None:
    async def main() -> None:
        async with fleet(1) as f:
            refused = await f.api("node.uncordon", {"node_id": "n0"})
            assert not refused.ok and refused.error == "node 'n0' is not cordoned"
            unknown = await f.api("node.cordon", {"node_id": "nope"})
            assert not unknown.ok and unknown.error == "unknown node 'nope'"
            unknown = await f.api("node.uncordon", {"node_id": "nope"})
            assert not unknown.ok and unknown.error == "unknown node 'nope'"
            now = f.env.clock.wall_ns()
            past = await f.api("node.cordon", {"node_id": "n0", "until_ns": now - S})
            assert not past.ok and past.error.startswith("until: ")
            assert past.error.endswith("is in the past (now " + cordon_end(now) + ")")
            assert "\n" not in past.error
            assert f.state.nodes.nodes["n0"].cordoned_until_ns == 0  # nothing recorded

            reply = await f.api("node.cordon", {"node_id": "n0"})
            assert reply.ok and reply.data["reason"] == "cordoned by operator"
            assert f.state.nodes.nodes["n0"].cordoned_until_ns == -1  # no end
            assert (await f.api("cluster.create", {**SPEC, "replicas": 1})).ok
            await f.until(
                lambda: f.state.clusters.clusters["llama"].unschedulable != "",
                within=5,
                why="nowhere to place while n0 is cordoned",
            )
            await asyncio.sleep(3600.0)  # no end: an hour on, still nothing
            assert f.ready("llama") == []
            rejected = f.state.clusters.clusters["llama"].unschedulable
            assert rejected == "no node fits llama: 1 cordoned"

            reply = await f.api("node.uncordon", {"node_id": "n0"})
            assert reply.ok and reply.data == {"node_id": "n0", "cordoned": False}
            assert f.state.nodes.nodes["n0"].cordoned_until_ns == 0
            await f.until(lambda: len(f.ready("llama")) == 1, within=10, why="placed on n0")
            assert cordon_events(f) == [
                ("node.cordoned.v1", 0, "cordoned by operator"),
                ("node.uncordoned.v1", 0, "uncordoned by operator"),
            ]
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_a_cordon_survives_the_agent_registering_again() -> None:
    async def main() -> None:
        async with fleet(1) as f:
            assert (await f.api("node.cordon", {"node_id": "n0", "reason": "rma"})).ok
            agent = f.agents["n0"]
            f.kill("n0")
            await f.start_agent(agent)  # a restart: registered again, still cordoned
            assert f.state.nodes.nodes["n0"].cordoned_until_ns == -1
            assert f.state.nodes.nodes["n0"].cordon_reason == "rma"
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


class AnsweringBus:
    """The controller's side of the REST routes: records each request; echoes it, or `error`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.error = ""

    async def request(self, subject: str, data: bytes, *, timeout: float, **kw: Any) -> Msg:
        body = msgspec.json.decode(data)
        self.calls.append((subject.removeprefix(f"{subjects.PREFIX}.api."), body))
        reply = {"ok": False, "error": self.error} if self.error else {"ok": True, "data": body}
        return Msg(subject="reply", data=msgspec.json.encode(reply))


async def test_the_rest_routes_turn_until_into_until_ns_and_map_the_refusals() -> None:
    bus = AnsweringBus()
    root = web.Application()
    root.add_subapp("/api/v1", control_app(cast(Bus, bus)))
    async with TestClient(TestServer(root, host="127.0.0.1")) as client:
        before = time.time_ns()
        body = {"until": "30m", "reason": "kernel upgrade"}
        resp = await client.post("/api/v1/nodes/gpu-1/cordon", json=body)
        assert resp.status == 200, await resp.text()
        [(verb, sent)] = bus.calls
        assert verb == "node.cordon" and sent["node_id"] == "gpu-1"
        assert sent["reason"] == "kernel upgrade"
        assert before + 1800 * S <= sent["until_ns"] <= time.time_ns() + 1800 * S

        resp = await client.post("/api/v1/nodes/gpu-1/cordon")  # no body: until uncordon
        assert resp.status == 200 and bus.calls[-1][1]["until_ns"] == 0
        at = {"until": "2026-11-26T04:00:00+01:00"}
        resp = await client.post("/api/v1/nodes/gpu-1/cordon", json=at)
        assert resp.status == 200 and bus.calls[-1][1]["until_ns"] == 1_795_662_000 * S

        calls = len(bus.calls)
        resp = await client.post("/api/v1/nodes/gpu-1/cordon", json={"until": "soon"})
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["field"] == "$.until"
        assert error["message"].startswith("until: not a time or a duration: 'soon'")
        resp = await client.post("/api/v1/nodes/gpu-1/cordon", json={"for": "2h"})
        assert resp.status == 400
        assert len(bus.calls) == calls  # refused before the controller was asked

        bus.error = "until: 2001-01-01T00:00:00Z is in the past (now 2026-11-26T00:00:00Z)"
        resp = await client.post("/api/v1/nodes/gpu-1/cordon", json={"until": "2001-01-01Z"})
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["field"] == "$.until"
        bus.error = "node 'gpu-1' is not cordoned"
        resp = await client.post("/api/v1/nodes/gpu-1/uncordon")
        assert resp.status == 409 and (await resp.json())["error"]["message"] == bus.error
        assert bus.calls[-1] == ("node.uncordon", {"node_id": "gpu-1"})
        bus.error = "unknown node 'nope'"
        resp = await client.post("/api/v1/nodes/nope/uncordon")
        assert resp.status == 404


def test_the_scheduler_holds_a_cordon_until_its_end_and_one_with_none_always() -> None:
    from random import Random

    from actors.scheduler import NoFit, Placement, schedule
    from events import ClusterSpec, GpuInfo
    from projections.views import NodeView

    gpus = (GpuInfo(index=0, uuid="g0", model="A100", vram_mib=81920),)
    end = 1_795_662_000 * S
    timed = NodeView(node_id="a", gpus=gpus, cordoned_until_ns=end, cordon_reason="bios")
    endless = NodeView(node_id="b", gpus=gpus, cordoned_until_ns=-1)
    spec = ClusterSpec(name="llama")
    rng = Random(1)
    before = schedule([timed, endless], spec, [], rng, now_ns=end - 1)
    assert isinstance(before, NoFit) and before.reason == "no node fits llama: 2 cordoned"
    assert [(c.node_id, c.rejected) for c in before.candidates] == [
        ("a", "cordoned until 2026-11-26T03:00:00Z: bios"),
        ("b", "cordoned until uncordoned"),
    ]
    after = schedule([timed, endless], spec, [], rng, now_ns=end)
    assert isinstance(after, Placement) and after.node_id == "a"
    assert isinstance(schedule([timed], spec, [], rng), NoFit)  # no clock: every cordon holds
