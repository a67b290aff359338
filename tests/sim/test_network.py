"""SimNetwork: links with latency, loss, duplication and reordering, partitions, isolation and a
NATS outage, all on the virtual clock (no test here waits in real time)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from runtime.env import BusError, Msg, NoResponders, RequestTimeout
from sim import LinkFaults, MemoryBus, SimNetwork, run_simulation
from sim.bus import MemorySubscription
from sim.network import SimEndpoint, TraceEntry

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]


def simulate(main: Callable[[], Awaitable[T]]) -> T:
    async def run() -> T:
        return await main()

    return run_simulation(run())


def now() -> float:
    return asyncio.get_running_loop().time()


def drain(sub: MemorySubscription) -> list[Msg]:
    """What has arrived at `sub` so far."""
    out = []
    while not sub._inbox.empty():
        msg = sub._inbox.get_nowait()
        assert msg is not None
        out.append(msg)
    return out


async def serve(endpoint: SimEndpoint, subject: str, *, queue: str = "") -> asyncio.Task[None]:
    """An echo responder on `endpoint`, answering in upper case."""
    sub = await endpoint.subscribe(subject, queue=queue)

    async def loop() -> None:
        async for msg in sub:
            await endpoint.publish(msg.reply, msg.data.upper())

    return asyncio.get_running_loop().create_task(loop())


# -- the default network ---------------------------------------------------------------------


def test_default_network_delivers_like_memory_bus_after_a_small_latency() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(1))
        a, b, c = net.endpoint("a"), net.endpoint("b"), net.endpoint("c")
        assert net.endpoint("a") is a  # one Bus per process
        plain = await a.subscribe("jobs.>")
        workers = [await b.subscribe("jobs.*", queue="w"), await c.subscribe("jobs.*", queue="w")]
        start = now()
        for i in range(4):
            await a.publish(f"jobs.{i}", b"x")
        assert drain(plain) == []  # nothing is instant any more
        await asyncio.sleep(0.002)  # the default latency is 0.5 to 2 ms
        assert [m.subject for m in drain(plain)] == [f"jobs.{i}" for i in range(4)]
        assert [[m.subject for m in drain(w)] for w in workers] == [
            ["jobs.0", "jobs.2"],
            ["jobs.1", "jobs.3"],
        ]
        responder = await serve(b, "svc.echo")
        t0 = now()
        reply = await a.request("svc.echo", b"hi", timeout=1)
        assert reply.data == b"HI"
        assert 0.001 <= now() - t0 <= 0.004  # a round trip
        with pytest.raises(NoResponders):
            await a.request("svc.nobody", b"", timeout=1)
        assert now() - t0 < 0.01  # the 503 comes back at once, not after the timeout
        responder.cancel()
        assert net.stats.dropped == {}
        assert now() - start < 0.02

    simulate(main)


@pytest.mark.parametrize("seed", range(5))
def test_routing_is_memory_bus_routing(seed: int) -> None:
    """Random subscriptions (literal and wildcard, plain and in queue groups) on several
    endpoints get exactly what the same subscriptions on a MemoryBus get, in the same order."""
    rng = random.Random(seed)
    tokens = ["a", "b", "c"]
    patterns = [
        ".".join(rng.choice([*tokens, "*"]) for _ in range(rng.randint(1, 3)))
        + rng.choice(["", "", ".>"])
        for _ in range(30)
    ]
    subjects = [".".join(rng.choice(tokens) for _ in range(rng.randint(1, 4))) for _ in range(300)]
    plan = [(p, rng.choice(["", "", "g1", "g2"]), f"e{rng.randint(0, 3)}") for p in patterns]

    async def main() -> tuple[list[list[bytes]], list[list[bytes]]]:
        memory = MemoryBus()
        net = SimNetwork(random.Random(seed), default=LinkFaults(latency_s=(0.001, 0.05)))
        mem_subs = [await memory.subscribe(p, queue=q) for p, q, _ in plan]
        net_subs = [await net.endpoint(e).subscribe(p, queue=q) for p, q, e in plan]
        for i, subject in enumerate(subjects):
            await memory.publish(subject, str(i).encode())
            await net.endpoint("publisher").publish(subject, str(i).encode())
        await asyncio.sleep(1)
        got_memory = [[m.data for m in drain(s)] for s in mem_subs]
        return got_memory, [[m.data for m in drain(s)] for s in net_subs]

    got_memory, got_network = run_simulation(main())
    assert sum(map(len, got_memory)) > 300
    assert got_network == got_memory


# -- link faults -----------------------------------------------------------------------------


def test_latency_is_drawn_within_the_link_bounds_and_wildcards_pick_the_most_specific() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(2))
        net.set_link("*", "*", LinkFaults(latency_s=(1.0, 1.0)))
        net.set_link("*", "b", LinkFaults(latency_s=(2.0, 2.0)))
        net.set_link("a", "*", LinkFaults(latency_s=(3.0, 3.0)))
        net.set_link("a", "b", LinkFaults(latency_s=(0.1, 0.2)))
        a, b, c = net.endpoint("a"), net.endpoint("b"), net.endpoint("c")
        at_b, at_c = await b.subscribe("t"), await c.subscribe("t")
        delays = []
        for _ in range(200):
            sent = now()
            await a.publish("t", b"")
            await at_b.next_msg(10)
            delays.append(now() - sent)
            await asyncio.sleep(0.01)
        assert all(0.1 <= d <= 0.2 + 1e-9 for d in delays)
        assert max(delays) - min(delays) > 0.05  # drawn, not fixed
        await asyncio.sleep(3)
        assert len(drain(at_c)) == 200
        sent = now()
        await a.publish("t", b"")
        await at_c.next_msg(10)
        assert now() - sent == pytest.approx(3.0)  # a -> c: the (a, *) entry
        assert net.link("a", "c").latency_s == (3.0, 3.0)
        assert net.link("c", "b").latency_s == (2.0, 2.0)
        assert net.link("c", "a").latency_s == (1.0, 1.0)
        net.clear_link("a", "b")
        assert net.link("a", "b").latency_s == (3.0, 3.0)

    simulate(main)


async def _lossy_run(seed: int, count: int = 10_000) -> tuple[list[int], SimNetwork]:
    net = SimNetwork(random.Random(seed), default=LinkFaults(loss=0.1))
    sender, receiver = net.endpoint("sender"), net.endpoint("receiver")
    sub = await receiver.subscribe("data")
    for i in range(count):
        await sender.publish("data", str(i).encode())
    await asyncio.sleep(1)
    return [int(m.data) for m in drain(sub)], net


def test_loss_rate_is_about_right_and_reproducible_by_seed() -> None:
    got, net = run_simulation(_lossy_run(7))
    assert 8_700 <= len(got) <= 9_300
    assert net.stats.dropped["loss"] + len(got) == 10_000
    assert net.stats.delivered == len(got)
    assert got == sorted(got)  # loss without reorder keeps the order of what is left
    again, _ = run_simulation(_lossy_run(7))
    assert again == got  # the very same messages lost
    other, _ = run_simulation(_lossy_run(8))
    assert other != got


def test_duplicates_arrive_right_behind_the_original() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(3), default=LinkFaults(duplicate=0.2))
        a, b = net.endpoint("a"), net.endpoint("b")
        sub = await b.subscribe("d")
        for i in range(1000):
            await a.publish("d", str(i).encode())
        await asyncio.sleep(1)
        got = [int(m.data) for m in drain(sub)]
        assert 150 <= net.stats.duplicated <= 250
        assert len(got) == 1000 + net.stats.duplicated
        assert sorted(set(got)) == list(range(1000))
        assert got == sorted(got)  # a duplicate is not a reordering

    simulate(main)


async def _inversions(reorder: float, seed: int = 4) -> tuple[int, SimNetwork]:
    faults = LinkFaults(latency_s=(0.001, 0.05), reorder=reorder)
    net = SimNetwork(random.Random(seed), default=faults)
    a, b = net.endpoint("a"), net.endpoint("b")
    sub = await b.subscribe("r")
    for i in range(2000):
        await a.publish("r", str(i).encode())
        if i % 3 == 0:
            await asyncio.sleep(0.001)  # bursts and gaps: random latencies would cross
    await asyncio.sleep(5)
    got = [int(m.data) for m in drain(sub)]
    assert sorted(got) == list(range(2000))
    return sum(1 for x, y in itertools.pairwise(got) if x > y), net


def test_reordering_happens_only_with_reorder() -> None:
    inversions, net = run_simulation(_inversions(0.0))
    assert inversions == 0 and net.stats.delayed == 0  # a link is FIFO, like a TCP connection
    inversions, net = run_simulation(_inversions(0.1))
    assert inversions > 50
    assert 150 <= net.stats.delayed <= 250


def test_link_faults_are_validated() -> None:
    with pytest.raises(ValueError):
        LinkFaults(latency_s=(0.2, 0.1))
    with pytest.raises(ValueError):
        LinkFaults(loss=1.5)
    with pytest.raises(ValueError):
        SimNetwork(random.Random(0)).endpoint("nats")


# -- partitions ------------------------------------------------------------------------------


def test_symmetric_partition_blocks_both_ways_one_way_only_one_and_heal_restores() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(5))
        a, b, c = net.endpoint("a"), net.endpoint("b"), net.endpoint("c")
        at_a, at_b, at_c = [await e.subscribe(f"to.{e.name}") for e in (a, b, c)]

        async def exchange() -> tuple[int, int, int]:
            await a.publish("to.b", b"")
            await b.publish("to.a", b"")
            await a.publish("to.c", b"")
            await asyncio.sleep(0.01)
            return len(drain(at_b)), len(drain(at_a)), len(drain(at_c))

        net.partition(["a"], ["b"])
        assert await exchange() == (0, 0, 1)  # a -/- b both ways; a -> c untouched
        assert net.stats.dropped["partition"] == 2
        net.heal()
        assert await exchange() == (1, 1, 1)
        net.partition(["a"], ["b"], one_way=True)
        assert await exchange() == (0, 1, 1)  # a -> b cut, b -> a delivered
        net.heal(["b"], ["a"])  # only the partitions between those two
        assert await exchange() == (1, 1, 1)
        net.partition(["a"], ["nats"])  # a cut from the server: from everybody, silently
        assert await exchange() == (0, 0, 0)
        assert a.is_connected  # nobody noticed
        net.heal()
        assert await exchange() == (1, 1, 1)

    simulate(main)


def test_a_partition_that_starts_while_a_message_is_in_flight_loses_it() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(6), default=LinkFaults(latency_s=(1.0, 1.0)))
        a, b = net.endpoint("a"), net.endpoint("b")
        sub = await b.subscribe("x")
        await a.publish("x", b"")
        await asyncio.sleep(0.5)
        net.partition(["a"], ["b"])
        await asyncio.sleep(1)
        assert drain(sub) == [] and net.stats.dropped["partition"] == 1

    simulate(main)


def test_a_request_across_a_partition_times_out_on_the_virtual_clock() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(7))
        client, server = net.endpoint("client"), net.endpoint("server")
        responder = await serve(server, "svc.echo")
        assert (await client.request("svc.echo", b"a", timeout=1)).data == b"A"
        net.partition(["client"], ["server"])
        t0 = now()
        with pytest.raises(RequestTimeout):  # not NoResponders: the server has a subscriber
            await client.request("svc.echo", b"b", timeout=30)
        assert now() - t0 == pytest.approx(30)
        net.heal()
        net.partition(["server"], ["client"], one_way=True)  # the request arrives, the reply not
        with pytest.raises(RequestTimeout):
            await client.request("svc.echo", b"c", timeout=5)
        net.heal()
        assert (await client.request("svc.echo", b"d", timeout=1)).data == b"D"
        responder.cancel()

    wall = time.perf_counter()
    simulate(main)
    assert time.perf_counter() - wall < 5  # 35 virtual seconds, no real waiting


def test_a_queue_group_member_behind_a_partition_loses_its_share() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(8))
        publisher = net.endpoint("pub")
        members = [await net.endpoint(f"w{i}").subscribe("jobs.*", queue="w") for i in range(3)]
        net.partition(["pub"], ["w1"])
        for i in range(30):
            await publisher.publish(f"jobs.{i}", b"")
        await asyncio.sleep(0.01)
        assert [len(drain(m)) for m in members] == [10, 0, 10]  # the server still picks w1
        assert net.stats.dropped["partition"] == 10

    simulate(main)


# -- isolation and outage --------------------------------------------------------------------


def test_an_isolated_endpoint_buffers_gets_nothing_and_reregisters_on_reconnect() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(9), reconnect_wait_s=0.5)
        node, ctl = net.endpoint("node"), net.endpoint("controller")
        at_node = await node.subscribe("to.node")
        at_ctl = await ctl.subscribe("to.ctl")
        calls: list[tuple[str, float]] = []

        async def broken() -> None:
            calls.append(("broken", now()))
            raise RuntimeError("a failing callback must not stop the others")

        async def reregister() -> None:
            calls.append(("reregister", now()))
            await node.publish("to.ctl", b"register")

        node.add_reconnect_callback(broken)
        node.add_reconnect_callback(reregister)
        await ctl.publish("to.node", b"in flight")  # lost: it arrives after the cut
        net.isolate("node")
        assert not node.is_connected
        await node.publish("to.ctl", b"buffered 1")  # no error: held, as nats-py does
        await node.publish("to.ctl", b"buffered 2")
        late = await node.subscribe("to.node.late")  # accepted, live once back
        await ctl.publish("to.node", b"while away")
        await ctl.publish("to.node.late", b"while away")
        with pytest.raises(RequestTimeout):
            await node.request("to.ctl", b"?", timeout=2)  # held, and nobody answers in time
        assert drain(at_node) == [] and drain(at_ctl) == [] and drain(late) == []
        assert net.stats.buffered == 3 and node.pending_bytes > 0
        # The server still routes to the node's old connection (it has not noticed), so those
        # are lost; it never heard of `late`, so that one is unrouted.
        assert net.stats.dropped["disconnected"] == 2 and net.stats.unrouted == 1

        back = now()
        net.reconnect("node")
        await asyncio.sleep(0.6)  # the reconnect wait (<= 0.5 s), then a link latency
        assert net.endpoint("node").is_connected and node.reconnects == 1 and node.disconnects == 1
        # The buffer first, in order (the held request too), then what the callback sent.
        assert [m.data for m in drain(at_ctl)] == [b"buffered 1", b"buffered 2", b"?", b"register"]
        assert [name for name, _ in calls] == ["broken", "reregister"]
        assert all(back <= t <= back + 0.5 for _, t in calls)
        await ctl.publish("to.node.late", b"now")
        await ctl.publish("to.node", b"now")
        await asyncio.sleep(0.01)
        assert [m.data for m in drain(late)] == [b"now"]
        assert [m.data for m in drain(at_node)] == [b"now"]

    simulate(main)


def test_a_request_made_while_cut_off_is_answered_if_the_endpoint_is_back_in_time() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(14))
        client = net.endpoint("client")
        responder = await serve(net.endpoint("server"), "svc.echo")
        net.isolate("client")

        async def back_soon() -> None:
            await asyncio.sleep(2)
            net.reconnect("client")

        task = asyncio.get_running_loop().create_task(back_soon())
        t0 = now()
        assert (await client.request("svc.echo", b"late", timeout=5)).data == b"LATE"
        assert 2 <= now() - t0 <= 2.6  # held in the buffer, sent on reconnect, answered
        await task
        responder.cancel()

    simulate(main)


def test_the_pending_buffer_is_bounded() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(10), pending_size=1000)
        node = net.endpoint("node")
        net.isolate("node")
        await node.publish("x", b"." * 900)
        with pytest.raises(BusError):
            await node.publish("x", b"." * 200)
        assert net.stats.rejected == 1

    simulate(main)


def test_a_stale_connection_is_evicted_by_the_server_after_its_pings_time_out() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(11), evict_after_s=240)
        publisher = net.endpoint("pub")
        members = [await net.endpoint(f"w{i}").subscribe("jobs", queue="w") for i in range(2)]
        responder = await serve(net.endpoint("w1"), "svc.only")
        net.isolate("w1")
        for _ in range(10):
            await publisher.publish("jobs", b"")
        await asyncio.sleep(0.01)
        assert [len(drain(m)) for m in members] == [5, 0]  # the server has not noticed
        with pytest.raises(RequestTimeout):
            await publisher.request("svc.only", b"", timeout=1)
        await asyncio.sleep(240)
        for _ in range(10):
            await publisher.publish("jobs", b"")
        await asyncio.sleep(0.01)
        assert [len(drain(m)) for m in members] == [10, 0]  # now it has
        with pytest.raises(NoResponders):
            await publisher.request("svc.only", b"", timeout=1)
        net.reconnect("w1")
        await asyncio.sleep(1)
        assert (await publisher.request("svc.only", b"ok", timeout=1)).data == b"OK"
        responder.cancel()

    simulate(main)


def test_a_nats_outage_disconnects_everybody_and_loses_what_was_in_flight() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(12), default=LinkFaults(latency_s=(0.1, 0.1)))
        names = ["controller", "gateway", "node-1", "node-2"]
        endpoints = [net.endpoint(name) for name in names]
        subs = [await e.subscribe(f"to.{e.name}") for e in endpoints]
        reconnected: list[str] = []
        for e in endpoints:

            async def note(name: str = e.name) -> None:
                reconnected.append(name)

            e.add_reconnect_callback(note)
        responder = await serve(endpoints[2], "svc.node-1")
        await endpoints[0].publish("to.node-1", b"in flight")
        await asyncio.sleep(0.05)
        net.outage(True)
        assert not any(e.is_connected for e in endpoints)
        await endpoints[0].publish("to.controller", b"held")
        with pytest.raises(RequestTimeout):
            await endpoints[0].request("svc.node-1", b"", timeout=3)
        await asyncio.sleep(60)
        assert all(drain(s) == [] for s in subs)
        assert net.stats.dropped["outage"] == 1

        net.isolate("gateway")  # still cut off when the server is back
        net.outage(False)
        await asyncio.sleep(1)
        assert [e.is_connected for e in endpoints] == [True, False, True, True]
        assert sorted(reconnected) == ["controller", "node-1", "node-2"]
        # The controller's buffer was flushed after its subscriptions were replayed. (Sent to
        # another endpoint, it would race with that one's reconnection, as with real NATS.)
        assert [m.data for m in drain(subs[0])] == [b"held"]
        assert (await endpoints[0].request("svc.node-1", b"x", timeout=1)).data == b"X"
        net.reconnect("gateway")
        await asyncio.sleep(1)
        assert endpoints[1].is_connected and sorted(reconnected)[1] == "gateway"
        responder.cancel()

    simulate(main)


def test_a_closed_endpoint_ends_its_subscriptions_and_a_new_process_gets_a_fresh_one() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(13))
        old = net.endpoint("node")
        sub = await old.subscribe("x")
        other = net.endpoint("other")
        queue = [await old.subscribe("q", queue="g"), await other.subscribe("q", queue="g")]
        await old.close()
        assert [m async for m in sub] == []  # the iteration ended
        with pytest.raises(BusError):
            await sub.next_msg(1)
        with pytest.raises(BusError):
            await old.publish("x", b"")
        fresh = net.endpoint("node")
        assert fresh is not old and fresh.is_connected
        for _ in range(4):
            await fresh.publish("q", b"")
        await asyncio.sleep(0.01)
        assert len(drain(queue[1])) == 4  # the server forgot the closed member at once

    simulate(main)


# -- determinism -----------------------------------------------------------------------------


async def scripted(seed: int) -> list[TraceEntry]:
    """A busy network with every fault, recorded."""
    rng = random.Random(seed)
    faults = LinkFaults(latency_s=(0.001, 0.02), loss=0.05, duplicate=0.05, reorder=0.1)
    net = SimNetwork(rng, default=faults, record=True)
    names = ["controller", "gateway", *(f"node-{i}" for i in range(6))]
    endpoints = {name: net.endpoint(name) for name in names}
    for name, e in endpoints.items():
        await e.subscribe("events.>")
        await e.subscribe(f"cmd.{name}")
        await e.subscribe("work", queue="workers")
    tasks = [await serve(endpoints[n], f"svc.{n}") for n in names]

    async def chatter(name: str) -> None:
        me = endpoints[name]
        local = random.Random(f"{seed}:{name}")
        for i in range(40):
            await asyncio.sleep(local.uniform(0.0, 0.2))
            target = local.choice(names)
            try:
                await me.publish(f"events.{name}.{i}", b"e")
                await me.publish(f"cmd.{target}", str(i).encode())
                await me.publish("work", str(i).encode())
                if i % 5 == 0:
                    await me.request(f"svc.{target}", b"ping", timeout=0.5)
            except (RequestTimeout, NoResponders, BusError):
                pass

    async def faults_script() -> None:
        await asyncio.sleep(1)
        net.partition(["node-1", "node-2"], ["controller"])
        await asyncio.sleep(1)
        net.isolate("node-3")
        net.partition(["gateway"], ["node-4"], one_way=True)
        await asyncio.sleep(1)
        net.heal()
        net.reconnect("node-3")
        await asyncio.sleep(1)
        net.outage(True)
        await asyncio.sleep(0.5)
        net.outage(False)

    async with asyncio.TaskGroup() as tg:
        for name in names:
            tg.create_task(chatter(name))
        tg.create_task(faults_script())
    for task in tasks:
        task.cancel()
    assert net.trace is not None
    return net.trace


def digest(trace: list[TraceEntry]) -> str:
    return hashlib.sha256(repr(trace).encode()).hexdigest()


def test_the_same_seed_gives_the_same_delivery_trace_and_another_seed_another() -> None:
    first = run_simulation(scripted(1))
    assert len(first) > 1000
    outcomes = {entry.outcome for entry in first}
    assert {"delivered", "loss", "partition", "disconnected"} <= outcomes
    assert first == run_simulation(scripted(1))
    assert digest(run_simulation(scripted(2))) != digest(first)


def test_the_trace_does_not_depend_on_the_hash_seed() -> None:
    program = (
        "import sys; from sim import run_simulation; "
        "from tests.sim.test_network import scripted, digest; "
        "print(digest(run_simulation(scripted(1))))"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env: dict[str, Any] = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", program],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        digests.add(done.stdout.strip())
    assert digests == {digest(run_simulation(scripted(1)))}


def test_wildcard_subscriptions_made_or_dropped_after_a_subject_was_routed_take_effect() -> None:
    """The network remembers which wildcard subscriptions match a subject; subscribing or
    unsubscribing a wildcard must make it look again."""

    async def main() -> list[tuple[int, int, int]]:
        net = SimNetwork(random.Random(3))
        sender, receiver = net.endpoint("a"), net.endpoint("b")
        plain = await receiver.subscribe("node.heartbeat.v1.n1")
        counts = []
        for step in range(3):
            if step == 1:
                star = await receiver.subscribe("node.heartbeat.v1.*")
                tail = await receiver.subscribe("node.>")
            if step == 2:
                await star.unsubscribe()
            await sender.publish("node.heartbeat.v1.n1", b"x")
            await asyncio.sleep(1.0)
            counts.append(
                (arrived(plain), arrived(star) if step else 0, arrived(tail) if step else 0)
            )
        return counts

    def arrived(sub: MemorySubscription) -> int:
        items = [sub._inbox.get_nowait() for _ in range(sub._inbox.qsize())]
        return sum(1 for msg in items if msg is not None)  # None: the unsubscribe marker

    assert simulate(main) == [(1, 0, 0), (1, 1, 1), (1, 0, 1)]


def test_literal_subscriptions_made_or_dropped_after_a_subject_was_routed_take_effect() -> None:
    """The network keeps a routing plan per subject; a plain subscription to that subject, or
    a queue-group member, subscribing or unsubscribing must replace it."""

    async def main() -> list[list[int]]:
        net = SimNetwork(random.Random(4))
        sender = net.endpoint("a")
        first = await net.endpoint("b").subscribe("jobs")
        subs: list[MemorySubscription] = [first]
        counts = []
        for step in range(4):
            if step == 1:
                subs.append(await net.endpoint("c").subscribe("jobs"))
                subs.append(await net.endpoint("d").subscribe("jobs", queue="w"))
            if step == 2:
                subs.append(await net.endpoint("e").subscribe("jobs", queue="w"))
            if step == 3:
                await first.unsubscribe()
            for _ in range(2):
                await sender.publish("jobs", b"x")
            await asyncio.sleep(1.0)
            counts.append([sum(1 for m in drain_all(sub) if m is not None) for sub in subs])
        assert net.stats.dropped["unsubscribed"] == 0  # nothing was routed to the gone one
        return counts

    def drain_all(sub: MemorySubscription) -> list[Msg | None]:
        return [sub._inbox.get_nowait() for _ in range(sub._inbox.qsize())]

    assert simulate(main) == [[2], [2, 2, 2], [2, 2, 1, 1], [0, 2, 1, 1]]


def test_on_a_tick_arrivals_land_on_it_within_the_link_bounds() -> None:
    """With `tick_s`, an arrival moves to the nearest tick inside the link's latency bounds;
    when no tick falls inside them it stays as drawn."""
    tick = 0.001

    async def delays(low: float, high: float) -> list[tuple[float, float]]:
        net = SimNetwork(random.Random(5), default=LinkFaults(latency_s=(low, high)), tick_s=tick)
        sender, sub = net.endpoint("a"), await net.endpoint("b").subscribe("t")
        rng = random.Random(6)
        out = []
        for _ in range(300):
            await asyncio.sleep(rng.uniform(0.0, 0.01))  # sends at arbitrary instants
            sent = now()
            await sender.publish("t", b"")
            await sub.next_msg(1)
            out.append((sent, now()))
        return out

    def on_tick(t: float) -> bool:
        return abs(t / tick - round(t / tick)) < 1e-6

    async def main() -> None:
        wide = await delays(0.0005, 0.0035)
        assert all(0.0005 - 1e-12 <= at - sent <= 0.0035 + 1e-12 for sent, at in wide)
        assert all(on_tick(at) for _, at in wide)
        assert len({round(at - sent, 4) for sent, at in wide}) > 10  # still spread
        narrow = await delays(0.0012, 0.0014)  # a tick falls inside for a fifth of sends
        assert all(0.0012 - 1e-12 <= at - sent <= 0.0014 + 1e-12 for sent, at in narrow)
        off = sum(1 for _, at in narrow if not on_tick(at))
        assert 150 < off < 300

    simulate(main)


def test_messages_due_at_one_tick_reach_a_subscriber_in_one_turn_in_send_order() -> None:
    """Fifty nodes publish within 50 microseconds; on a 1 ms tick their messages arrive at
    two instants at most, each batch in the order it was sent, and a subscriber's reader wakes
    once per instant and finds the whole batch there."""

    async def main() -> list[tuple[float, int]]:
        net = SimNetwork(random.Random(7), tick_s=0.001)  # default latency: 0.5 to 2 ms
        senders = [net.endpoint(f"node-{i}") for i in range(50)]
        sub = await net.endpoint("controller").subscribe("hb.*")
        got: list[tuple[float, int]] = []
        wakeups: list[float] = []

        async def reader() -> None:
            while True:
                wakeups.append(now())
                msg = await sub.next_msg(10)
                got.append((now(), int(msg.data)))
                while not sub._inbox.empty():  # the rest of the batch, without waiting
                    rest = sub._inbox.get_nowait()
                    assert rest is not None
                    got.append((now(), int(rest.data)))

        task = asyncio.get_running_loop().create_task(reader())
        for i, sender in enumerate(senders):
            await sender.publish(f"hb.node-{i}", str(i).encode())
            await asyncio.sleep(0.000001)
        await asyncio.sleep(0.01)
        task.cancel()
        assert len(got) == 50 and len(wakeups) <= 3  # the first, then one per instant
        return got

    got = simulate(main)
    assert {round(at, 9) for at, _ in got} <= {0.001, 0.002}
    assert got == sorted(got)  # by instant, then in send order within it


def test_a_negative_tick_is_refused() -> None:
    with pytest.raises(ValueError, match="tick_s"):
        SimNetwork(random.Random(1), tick_s=-0.001)


def test_a_handler_subscription_takes_each_message_on_arrival_and_survives_one_that_fails() -> None:
    async def main() -> tuple[list[tuple[float, str]], list[Msg]]:
        net = SimNetwork(random.Random(1))
        got: list[tuple[float, str]] = []

        def handler(msg: Msg) -> None:
            if msg.data == b"bad":
                raise ValueError("a handler that fails on one message")
            got.append((now(), msg.data.decode()))

        sub = await net.endpoint("b").subscribe("h.*", handler=handler)
        sender = net.endpoint("a")
        sent_at = now()
        for data in (b"1", b"bad", b"2"):
            await sender.publish("h.x", data)
        await asyncio.sleep(1)
        await sub.unsubscribe()
        await sender.publish("h.x", b"after")
        await asyncio.sleep(1)
        assert all(at > sent_at for at, _ in got)  # after the link's latency, like any other
        return got, [m async for m in sub]  # nothing queued: the iteration just ends

    got, queued = simulate(main)
    assert [data for _, data in got] == ["1", "2"]
    assert queued == []
