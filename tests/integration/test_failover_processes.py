"""Failover end to end with real processes on loopback: nats-server, a controller process and
agent processes with fake GPUs running real echo workloads. One test per failure; the same
scenarios run on virtual time with scripted agents in tests/control/test_failover.py.

Default health settings throughout (heartbeat 1 s, offline after 3 missed): the suite is fast
enough without shortening them, and the detection bounds asserted are the production ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pytest

from events.envelope import Envelope
from nodeagent.config import RestartPolicy
from runtime.env import BusError
from tests.integration.stack import ApiError, Stack, Workload, echo_spec, pid_alive, started_stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AGENTS = 3
REPLICAS = 3


@pytest.fixture
async def stack(tmp_path: Path, nats_server_binary: Path) -> AsyncIterator[Stack]:
    async with started_stack(tmp_path / "stack", AGENTS, nats_server_binary) as s:
        yield s


# -- helpers ------------------------------------------------------------------------------


def p(envelope: Envelope) -> Any:
    """The payload, for attribute access in assertions."""
    return envelope.payload


async def serving(stack: Stack, replicas: int = REPLICAS, name: str = "echo") -> dict[str, Any]:
    """Wait until `replicas` replicas are ready, each one's workload process runs under the
    agent of the node the controller says at the epoch it says and answers /health, and no
    other workload process exists anywhere (no duplicate, no orphan, no superseded epoch)."""

    async def check() -> dict[str, Any] | None:
        cluster = await stack.cluster(name)
        ready = [r for r in cluster["replicas"] if r["status"] == "ready"]
        if cluster["ready"] != replicas or len(ready) != replicas:
            return None
        running = stack.workloads()
        expected = sorted((r["replica_id"], r["epoch"]) for r in ready)
        if sorted((w.replica_id, w.epoch) for w in running) != expected:
            return None
        by_key = {(w.replica_id, w.epoch): w for w in running}
        for r in ready:
            w = by_key[(r["replica_id"], r["epoch"])]
            # The address is the workload's own port, or the node's fencing front for it.
            fronted = r["address"].endswith(f"/replica/{r['replica_id']}/{r['epoch']}")
            if w.ppid != stack.agent_pid(r["node_id"]) or not (
                fronted or r["address"].endswith(f":{w.port}")
            ):
                return None
            if not await http_ok(w.port):
                return None
        return cluster

    return await stack.wait_until(
        check, timeout=45, why=f"{replicas} replicas of {name} ready and their processes serving"
    )


async def http_ok(port: int, path: str = "/health") -> bool:
    try:
        async with asyncio.timeout(2.0):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
                await writer.drain()
                status = await reader.readline()
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except (OSError, TimeoutError):
        return False
    return status.split()[1:2] == [b"200"]


async def deploy(stack: Stack, replicas: int = REPLICAS) -> dict[str, Any]:
    await stack.create_cluster(echo_spec(replicas))
    return await serving(stack, replicas)


def only(items: list[Workload]) -> Workload:
    assert len(items) == 1, items
    return items[0]


class RoutingWatch:
    """Polls `routing.get` every 0.1 s in the background, keeping (position, routes)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.seen: list[tuple[int, dict[str, list[dict[str, Any]]]]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(BusError, ApiError):
                table = await self.stack.routing()
                self.seen.append((table["position"], table.get("routes", {})))
            await asyncio.sleep(0.1)

    def assert_only_current_epochs(self) -> None:
        """Every route any poll saw is the newest placement of its replica as of the log
        position the table was taken at: never an old epoch, never the old node."""
        assert self.seen, "routing.get never answered"
        placed = self.stack.events("replica.placed.v1")
        for position, routes in self.seen:
            newest: dict[str, Any] = {}
            for e in placed:
                if e.position <= position:
                    newest[p(e).replica_id] = p(e)
            for route in routes.get("echo", []):
                current = newest[route["replica_id"]]
                assert (route["epoch"], route["node_id"]) == (current.epoch, current.node_id), (
                    f"routing at #{position} lists {route} but the newest placement is "
                    f"{current.node_id}@{current.epoch}"
                )

    def min_routes(self, after_position: int = 0) -> int:
        return min(
            (len(routes.get("echo", [])) for pos, routes in self.seen if pos >= after_position),
            default=0,
        )


# -- the failures -------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_power_loss_detected_and_replaced_elsewhere(stack: Stack) -> None:
    cluster = await deploy(stack)
    victim = cluster["replicas"][0]
    rid, node = victim["replica_id"], victim["node_id"]

    killed = await stack.kill_agent(node)  # SIGKILL the agent and its workload
    assert [(w.replica_id, w.epoch) for w in killed.workloads] == [(rid, 1)]

    offline = await stack.wait_for_event(
        "node.health_changed.v1", node_id=node, state="offline", timeout=15
    )
    assert p(offline).reason == "missed_heartbeats"
    detection = (offline.recorded_at - killed.at_ns) / 1e9
    interval, after = stack.heartbeat_interval, stack.offline_after
    # The last heartbeat left up to one interval before the kill and offline takes
    # `offline_after` silent intervals after it, checked every quarter interval: between
    # (after - 1) and (after + 1/4) intervals after the kill, with slack for a busy machine.
    assert (after - 1.5) * interval <= detection <= (after + 1) * interval, detection

    failed = await stack.wait_for_event("replica.failed.v1", replica_id=rid, epoch=1)
    assert p(failed).reason == "node_offline"
    placed = await stack.wait_for_event("replica.placed.v1", replica_id=rid, epoch=2)
    assert p(placed).node_id != node
    ready = await stack.wait_for_event("replica.ready.v1", replica_id=rid, epoch=2, timeout=30)
    assert offline.position < failed.position < placed.position < ready.position

    cluster = await serving(stack)
    moved = next(r for r in cluster["replicas"] if r["replica_id"] == rid)
    assert (moved["node_id"], moved["epoch"]) == (p(placed).node_id, 2)
    assert not any(pid_alive(w.pid) for w in killed.workloads)
    assert (await stack.node(node))["health"] == "offline"
    late = [
        e for e in stack.events("replica.placed.v1", node_id=node) if e.recorded_at > killed.at_ns
    ]
    assert late == [], "placed on the dead node"
    routes = (await stack.routing())["routes"]["echo"]
    assert {(r["replica_id"], r["epoch"]) for r in routes} == {
        (r["replica_id"], r["epoch"]) for r in cluster["replicas"]
    }
    replacement = (ready.recorded_at - killed.at_ns) / 1e9
    print(f"power loss: detection {detection:.2f} s, replacement ready {replacement:.2f} s")

    # The machine comes back: the node rejoins healthy, and nothing moves back or doubles.
    stack.start_agent(node)
    await stack.wait_for_event(
        "node.health_changed.v1", node_id=node, state="healthy", after=offline.position
    )
    await asyncio.sleep(2 * interval)  # a couple of reconcile passes with the node back
    assert await serving(stack) == cluster
    assert stack.workloads(node) == []


@pytest.mark.timeout(90)
async def test_hung_agent_is_replaced_and_its_superseded_replica_stopped(stack: Stack) -> None:
    cluster = await deploy(stack)
    victim = cluster["replicas"][1]
    rid, node = victim["replica_id"], victim["node_id"]
    old = only([w for w in stack.workloads(node) if w.replica_id == rid])

    async with RoutingWatch(stack) as watch:
        stack.stop_agent(node)  # SIGSTOP: no heartbeats, no commands; the workload runs on
        offline = await stack.wait_for_event(
            "node.health_changed.v1", node_id=node, state="offline", timeout=15
        )
        await stack.wait_for_event("replica.failed.v1", replica_id=rid, epoch=1)
        placed = await stack.wait_for_event("replica.placed.v1", replica_id=rid, epoch=2)
        assert p(placed).node_id != node
        await stack.wait_for_event("replica.ready.v1", replica_id=rid, epoch=2, timeout=30)
        assert pid_alive(old.pid), "a hung agent's workload keeps running"

        stack.cont_agent(node)  # back from the partition, still running rid at epoch 1
        healthy = await stack.wait_for_event(
            "node.health_changed.v1", node_id=node, state="healthy", after=offline.position
        )
        assert p(healthy).reason == "recovered"
        await stack.wait_until(
            lambda: not pid_alive(old.pid), timeout=20, why=f"superseded {rid}@1 process exits"
        )
        cluster = await serving(stack)
        await asyncio.sleep(1.0)  # a few more routing polls and heartbeats after the return

    moved = next(r for r in cluster["replicas"] if r["replica_id"] == rid)
    assert (moved["epoch"], moved["node_id"]) == (2, p(placed).node_id)
    stale = [
        e
        for e in stack.events("replica.ready.v1", replica_id=rid)
        if e.position > placed.position and p(e).epoch < 2
    ]
    assert stale == [], "an old epoch was recorded ready after the new placement"
    watch.assert_only_current_epochs()
    assert (await stack.node(node))["health"] == "healthy"
    assert stack.agents[node].popen.poll() is None, "the agent survived SIGSTOP/SIGCONT"


@pytest.mark.timeout(90)
async def test_thermal_migration_replacement_ready_before_old_stops(stack: Stack) -> None:
    cluster = await deploy(stack)
    victim = cluster["replicas"][0]
    rid, hot = victim["replica_id"], victim["node_id"]
    old = only([w for w in stack.workloads(hot) if w.replica_id == rid])

    async with RoutingWatch(stack) as watch:
        await stack.fault(hot, "thermal", 95)
        degraded = await stack.wait_for_event(
            "node.health_changed.v1", node_id=hot, state="degraded", timeout=10
        )
        assert p(degraded).reason == "thermal"
        stopping = await stack.wait_for_event(
            "replica.stopping.v1", replica_id=rid, epoch=1, timeout=30
        )
        assert p(stopping).reason == "node degraded"
        new = [e for e in stack.events("replica.placed.v1") if e.position > degraded.position]
        assert len(new) == 1 and p(new[0]).node_id != hot, new
        ready_new = only_event(
            stack.events("replica.ready.v1", replica_id=p(new[0]).replica_id, epoch=1)
        )
        assert ready_new.position < stopping.position, (
            "the old one stopped before the new was ready"
        )
        await stack.wait_for_event("replica.stopped.v1", replica_id=rid, epoch=1)
        await stack.wait_until(lambda: not pid_alive(old.pid), timeout=15, why="old process exits")
        cluster = await serving(stack)

        await stack.fault(hot, "thermal", 60)  # below the 75 C low mark
        healthy = await stack.wait_for_event(
            "node.health_changed.v1", node_id=hot, state="healthy", after=degraded.position
        )
        assert p(healthy).reason == "recovered"

    # Never fewer than 3 routable replicas after the deploy: the migration had no gap.
    assert watch.min_routes() >= REPLICAS, watch.seen
    watch.assert_only_current_epochs()
    assert hot not in {r["node_id"] for r in cluster["replicas"] if r["status"] == "ready"}


def only_event(events: list[Envelope]) -> Envelope:
    assert len(events) == 1, events
    return events[0]


@pytest.mark.timeout(90)
async def test_driver_crash_stops_the_workload_and_replaces_it(stack: Stack) -> None:
    cluster = await deploy(stack)
    victim = cluster["replicas"][2]
    rid, sick = victim["replica_id"], victim["node_id"]
    old = only([w for w in stack.workloads(sick) if w.replica_id == rid])

    await stack.fault(sick, "driver", 1)
    unhealthy = await stack.wait_for_event(
        "node.health_changed.v1", node_id=sick, state="unhealthy", timeout=10
    )
    assert p(unhealthy).reason == "driver"
    failed = await stack.wait_for_event("replica.failed.v1", replica_id=rid, epoch=1)
    assert p(failed).reason == "node_unhealthy"
    # The node still answers: the controller tells it to stop the workload, and it does.
    await stack.wait_until(
        lambda: not pid_alive(old.pid), timeout=20, why=f"{rid}@1 stopped on the sick node"
    )
    placed = await stack.wait_for_event("replica.placed.v1", replica_id=rid, epoch=2)
    assert p(placed).node_id != sick
    ready = await stack.wait_for_event("replica.ready.v1", replica_id=rid, epoch=2, timeout=30)
    assert unhealthy.position < failed.position < placed.position < ready.position
    cluster = await serving(stack)
    assert stack.agents[sick].popen.poll() is None, "the agent itself keeps running"
    assert stack.workloads(sick) == []

    await stack.fault(sick, "clear")
    await stack.wait_for_event(
        "node.health_changed.v1", node_id=sick, state="healthy", after=unhealthy.position
    )


@pytest.mark.timeout(90)
async def test_workload_crash_loop_restarts_in_place_then_moves(stack: Stack) -> None:
    policy = RestartPolicy()  # the agent's: 3 restarts within 60 s, back-off 0.5 s doubling
    cluster = await deploy(stack, replicas=1)
    (victim,) = cluster["replicas"]
    rid, node = victim["replica_id"], victim["node_id"]
    port = only(stack.workloads(node)).port

    killed: list[int] = []
    kill_times: list[float] = []
    gaps: list[float] = []
    for crash in range(policy.max_restarts + 1):

        async def restarted() -> Workload | None:
            for w in stack.workloads(node):
                if w.replica_id == rid and w.pid not in killed and await http_ok(w.port):
                    return w
            return None

        w = await stack.wait_until(restarted, timeout=20, why=f"{rid} up for crash {crash + 1}")
        if kill_times:
            gaps.append(time.monotonic() - kill_times[-1])
        # In place: same slot, same epoch, same node, same port.
        assert (w.epoch, w.port) == (1, port)
        os.killpg(w.pid, signal.SIGKILL)  # the workload only, not the agent
        kill_times.append(time.monotonic())
        last_kill_ns = time.time_ns()
        killed.append(w.pid)

    # Each restart waited its back-off (0.5, 1, 2 s) before the process came back.
    for n, gap in enumerate(gaps, start=1):
        assert gap >= policy.backoff(n), (n, gaps)
    failed = await stack.wait_for_event("replica.failed.v1", replica_id=rid, epoch=1, timeout=20)
    assert p(failed).reason == "workload_exited"
    assert "crash loop" in p(failed).detail
    assert failed.recorded_at >= last_kill_ns, "failed before the crash-loop limit"
    placed = await stack.wait_for_event("replica.placed.v1", replica_id=rid, epoch=2)
    assert p(placed).node_id != node
    await stack.wait_for_event("replica.ready.v1", replica_id=rid, epoch=2, timeout=30)
    cluster = await serving(stack, replicas=1)
    assert cluster["replicas"][0]["node_id"] == p(placed).node_id
    assert stack.workloads(node) == []
    assert stack.agents[node].popen.poll() is None


@pytest.mark.timeout(90)
async def test_controller_killed_mid_deploy_recovers_from_the_log(stack: Stack) -> None:
    await stack.create_cluster(echo_spec(REPLICAS))
    await stack.wait_until(
        lambda: stack.events("replica.placed.v1"), timeout=10, interval=0.005, why="placing"
    )
    await stack.kill_controller()
    at_kill = stack.events()
    ready_at_kill = [e for e in at_kill if e.type == "replica.ready.v1"]
    placed_at_kill = {
        (p(e).replica_id, p(e).epoch) for e in at_kill if e.type == "replica.placed.v1"
    }
    assert len(ready_at_kill) < REPLICAS, "not mid-deploy: everything was ready already"

    await stack.start_controller()
    cluster = await serving(stack)

    assert sorted(r["replica_id"] for r in cluster["replicas"]) == ["echo-0", "echo-1", "echo-2"]
    placed = [(p(e).replica_id, p(e).epoch) for e in stack.events("replica.placed.v1")]
    assert len(placed) == len(set(placed)), f"a slot was placed twice at one epoch: {placed}"
    assert placed_at_kill <= set(placed)
    # Nothing lost and nothing placed again: every slot kept its first placement.
    assert {(r["replica_id"], r["epoch"]) for r in cluster["replicas"]} == {
        (f"echo-{i}", 1) for i in range(REPLICAS)
    }
    assert len(stack.events("cluster.created.v1")) == 1
    assert len(stack.workloads()) == REPLICAS


def slow_restart_command(marker: Path) -> str:
    """The echo workload, except that every launch after the first sleeps 5 s before it
    serves: a restart in place that is visibly not ready for a while."""
    q = shlex.quote
    script = (
        f"test -e {q(str(marker))} && sleep 5; touch {q(str(marker))}; "
        f"exec {q(sys.executable)} -m gpumesh workload echo --port {{port}} --model {{model}}"
    )
    return f"sh -c {q(script)}"


@pytest.mark.timeout(60)
async def test_crashed_workload_is_not_routed_while_it_restarts(
    stack: Stack, tmp_path: Path
) -> None:
    spec = {**echo_spec(1), "command": slow_restart_command(tmp_path / "launched-once")}
    await stack.create_cluster(spec)
    cluster = await serving(stack, replicas=1)
    (replica,) = cluster["replicas"]
    rid, node = replica["replica_id"], replica["node_id"]
    first = only(stack.workloads(node))

    os.killpg(first.pid, signal.SIGKILL)  # the workload crashes; the agent restarts it
    again = await stack.wait_until(
        lambda: [w for w in stack.workloads(node) if w.pid != first.pid],
        timeout=5,
        why="relaunched in place",
    )
    assert only(again).port == first.port and not await http_ok(first.port)

    async def unrouted() -> bool:
        routes = (await stack.routing()).get("routes", {}).get("echo", [])
        return all(r["replica_id"] != rid for r in routes)

    # The relaunched process will not serve for 5 s: the table must not offer it meanwhile.
    await stack.wait_until(unrouted, timeout=2.5, why=f"{rid} out of the routing table")
    assert (await stack.cluster("echo"))["ready"] == 0
    await serving(stack, replicas=1)  # and back once it serves again, same epoch


@pytest.mark.timeout(120)
async def test_a_nats_restart_is_survived(stack: Stack) -> None:
    """The server goes away and comes back on the same port and store: every process reconnects,
    the fleet converges again, and the durable command path (JetStream) works afterwards."""
    await stack.create_cluster(echo_spec(2))
    await serving(stack, replicas=2)
    await stack.nats.stop()
    await asyncio.sleep(1.0)  # the outage itself: a fault's duration, not a wait for an event
    await stack.nats.start()
    await stack.wait_until(stack._all_nodes_healthy, timeout=40, why="nodes healthy again")
    await serving(stack, replicas=2)
    # New commands go through the restarted JetStream: scaling up places and starts a replica.
    await stack.api("cluster.scale", {"name": "echo", "replicas": 3})
    await serving(stack, replicas=3)
