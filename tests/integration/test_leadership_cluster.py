"""The leader lease through the loss of the nats-server that leads its stream (GPUMESH_LEADER)
on a cluster of three, with the production Leadership and timings (actors/leadership.py):
the leader's renewals get no answer while the other two elect a new stream leader, so it steps
down, and a controller leads again once the stream answers. A create sent into the election
gets no answer at all; before each create waited only a fraction of a second, such a create
waited out its 5 s request timeout first (up to 10.7 s in all against `gpumesh up --ha`, past
chaos's window). Never two holders at once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from actors.leader_kv import STREAM, KvLease
from actors.leadership import Leadership
from runtime.real_env import LoopClock
from wire.nats_bus import NatsBus
from wire.nats_cluster import NatsCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LEADS_AGAIN_S = 15.0  # after the SIGKILL: the stream's election (about 3-9 s), then a create
# After the stream answers again: the old key's expiry (3 s after its last renewal, which
# the election usually outlasts), then one create. Before the fix, up to 5 s.
AFTER_THE_STREAM_S = 4.0


@pytest.fixture
async def cluster(tmp_path: Path, nats_server_binary: Path) -> AsyncIterator[NatsCluster]:
    async with NatsCluster(tmp_path / "nats", binary=nats_server_binary) as c:
        yield c


async def stream_leader(js: object) -> str | None:
    """The server leading the lease's stream, once it answers; None while it does not."""
    import nats.errors

    try:
        info = await js.stream_info(STREAM)  # type: ignore[attr-defined]
    except (nats.errors.Error, TimeoutError):
        return None
    leader = info.cluster.leader if info.cluster is not None else None
    return str(leader) if leader else None


async def steady(js: object) -> str:
    """Until the stream has a leader and both other copies are current: its leader."""
    while True:
        with contextlib.suppress(Exception):
            info = await js.stream_info(STREAM)  # type: ignore[attr-defined]
            replicas = info.cluster.replicas or []
            if info.cluster.leader and len(replicas) == 2 and all(r.current for r in replicas):
                return str(info.cluster.leader)
        await asyncio.sleep(0.1)


@pytest.mark.timeout(150)
async def test_a_controller_leads_again_after_the_lease_streams_server_is_lost(
    cluster: NatsCluster,
) -> None:
    admin = await NatsBus.connect(cluster.urls, name="admin", reconnect_wait=0.1)
    buses = [await NatsBus.connect(cluster.urls, name=f"ctl-{i}") for i in range(2)]
    both = [Leadership(KvLease(bus), LoopClock(), f"ctl-{i}") for i, bus in enumerate(buses)]
    loop = asyncio.get_running_loop()
    started: asyncio.Queue[tuple[int, float]] = asyncio.Queue()  # each term's work, as it starts
    two_at_once: list[float] = []

    async def work(term: int) -> None:
        started.put_nowait((term, loop.time()))
        await asyncio.Event().wait()

    async def watch() -> None:  # never two holders at once
        while True:
            if sum(one.holds_lease() for one in both) > 1:
                two_at_once.append(loop.time())
            await asyncio.sleep(0.005)

    async def answered(victim: str) -> float:
        """When the lease's stream answers again, led by another server."""
        while True:
            if await stream_leader(js) not in (None, victim):
                return loop.time()
            await asyncio.sleep(0.02)

    tasks = [asyncio.create_task(one.run(work)) for one in both]
    tasks.append(asyncio.create_task(watch()))
    js = admin.jetstream(timeout=0.5)
    names = [m.server_name for m in cluster.members]
    figures = []
    try:
        term, _ = await asyncio.wait_for(started.get(), 30)
        for _ in range(2):
            victim_name = await asyncio.wait_for(steady(js), 60)
            await asyncio.sleep(1.5)  # renewing through the stream's leader
            victim = cluster.servers[names.index(victim_name)]
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)
            killed = loop.time()
            stream_back = asyncio.create_task(answered(victim_name))
            # Its renewals unanswered for far longer than acts_s (1.3 s), the leader steps
            # down: a controller leads again in a new term.
            new_term, leads = await asyncio.wait_for(started.get(), LEADS_AGAIN_S + 5)
            back = min(await asyncio.wait_for(stream_back, 10), leads)
            figures.append((leads - killed, back - killed))
            assert new_term > term and leads - killed < LEADS_AGAIN_S, figures
            assert leads - back < AFTER_THE_STREAM_S, figures
            term = new_term
            await victim.stop()  # the SIGKILLed process, reaped
            await victim.start()
        assert two_at_once == []
        print(
            "led again "
            + ", ".join(f"{t:.2f} s (the stream answered after {e:.2f} s)" for t, e in figures)
            + " after the SIGKILL of the lease stream's leader"
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for bus in (*buses, admin):
            await bus.close()
