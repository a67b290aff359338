"""The controller's link survey and the latency budget on virtual time (docs/sharding.md,
Measuring links): candidate nodes asked for their links and the answers recorded; a group
whose measured links put it over `max_token_latency_ms` replaced where a plan fits, stopped
once the replacement is ready; kept, with the cluster's reason recorded, where none fits.
The scripted agents measure nothing: a stand-in answers each node's links subject from a
table of round trips."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import msgspec

from actors.controller import ControllerConfig
from events import (
    ClusterUnschedulable,
    NodeLinksMeasured,
    ReplicaPlaced,
    ReplicaStopping,
)
from events.contract import subjects
from events.contract.messages import LinksReply, LinksRequest
from events.node import LinkMeasurement
from sim import run_simulation
from tests.control.harness import Fleet, fleet

SPEC = {
    "name": "big",
    "replicas": 1,
    "command": "llama-server --rpc {peers} --port {port}",
    "sharding": {
        "weights_gib": 30,
        "layers": 32,
        "parallelism": ["pipeline"],
        "worker_command": "ggml-rpc-server -p {port}",
        "max_token_latency_ms": 45,  # compute 31.96 ms: a link may take about 13 ms
    },
}
SURVEY = ControllerConfig(link_survey_interval=5.0)


class Links:
    """Round trips by pair (ms, either way); a pair not in it measures 1 ms."""

    def __init__(self) -> None:
        self.rtt: dict[frozenset[str], float] = {}
        self.asked: list[tuple[str, tuple[str, ...]]] = []

    def set(self, a: str, b: str, rtt_ms: float) -> None:
        self.rtt[frozenset((a, b))] = rtt_ms

    def answer(self, node: str, request: LinksRequest) -> LinksReply:
        self.asked.append((node, tuple(p.node_id for p in request.peers)))
        return LinksReply(
            ok=True,
            node_id=node,
            endpoint=f"{node}:7400",
            method="stand-in",
            links=tuple(
                LinkMeasurement(
                    peer=p.node_id, rtt_ms=self.rtt.get(frozenset((node, p.node_id)), 1.0), gbps=10
                )
                for p in request.peers
            ),
        )


@contextlib.asynccontextmanager
async def answering(f: Fleet, links: Links) -> AsyncIterator[None]:
    sub = await f.bus.subscribe(f"{subjects.PREFIX}.node.*.links")

    async def serve() -> None:
        async for msg in sub:
            request = msgspec.json.decode(msg.data, type=LinksRequest)
            reply = links.answer(subjects.node_of(msg.subject), request)
            await f.bus.publish(msg.reply, msgspec.json.encode(reply))

    task = asyncio.create_task(serve())
    try:
        yield
    finally:
        task.cancel()


def events(f: Fleet, kind: type) -> list:  # type: ignore[type-arg]
    return [e.payload for e in f.store.read_all_now() if isinstance(e.payload, kind)]


def test_the_survey_measures_every_pair_once_and_records_it() -> None:
    async def main() -> None:
        links = Links()
        async with fleet(3, gpus=1, config=SURVEY) as f, answering(f, links):
            await asyncio.sleep(6)
            assert events(f, NodeLinksMeasured) == []  # no pipeline cluster: nothing asked
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(links.asked) >= 3, within=10, why="one round")
            # In node id order, each measuring the nodes heard of before it: every pair once.
            assert links.asked[:3] == [("n0", ()), ("n1", ("n0",)), ("n2", ("n0", "n1"))]
            await asyncio.sleep(0.5)
            view = f.state.links
            assert view.endpoints == {n: f"{n}:7400" for n in ("n0", "n1", "n2")}
            seen = view.link("n0", "n2")
            assert seen is not None and (seen.rtt_ms, seen.gbps, seen.measured_by) == (1, 10, "n2")
            (recorded,) = [e for e in events(f, NodeLinksMeasured) if e.node_id == "n2"]
            assert recorded.method == "stand-in" and len(recorded.links) == 2

    run_simulation(main())


def test_a_group_whose_link_degrades_is_replaced_then_stopped() -> None:
    async def main() -> None:
        links = Links()
        async with fleet(4, gpus=1, config=SURVEY) as f, answering(f, links):
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: f.ready("big") == ["big-0"], within=20, why="the group serves")
            (first,) = [p for p in events(f, ReplicaPlaced) if p.replica_id == "big-0"]
            a, b = (s.node_id for s in first.stages)
            assert (a, b) == ("n0", "n1")
            links.set(
                a, b, 40.0
            )  # 40 ms a round trip: about 72 ms a token, over 45 (caught in the first round)
            await f.until(
                lambda: f.ready("big") == ["big-1"], within=30, why="replaced on good links"
            )
            (again,) = [p for p in events(f, ReplicaPlaced) if p.replica_id == "big-1"]
            assert [s.node_id for s in again.stages] == ["n2", "n3"]
            assert again.why.startswith(
                "replaces big-0: a link too slow: estimated 71.97 ms per token > "
                "max_token_latency_ms 45 (compute 31.96 ms + links 40.01 ms; slowest link "
                "n0-n1 40.01 ms (measured 40.00 ms round trip, 10 Gbit/s))"
            )
            (stopping,) = [s for s in events(f, ReplicaStopping) if s.replica_id == "big-0"]
            assert stopping.reason.startswith("links too slow: a link too slow: estimated 71.97")
            # It stopped only once its replacement was ready.
            log = f.store.read_all_now()
            ready_at = next(
                e.position
                for e in log
                if e.type == "replica.ready.v1" and e.payload.replica_id == "big-1"  # type: ignore[union-attr]
            )
            stop_at = next(e.position for e in log if e.payload == stopping)
            assert ready_at < stop_at

    run_simulation(main())


def test_with_no_plan_that_fits_the_slow_group_keeps_serving_and_the_cluster_says_why() -> None:
    async def main() -> None:
        links = Links()
        async with fleet(4, gpus=1, config=SURVEY) as f, answering(f, links):
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: f.ready("big") == ["big-0"], within=20, why="the group serves")
            for a, b in itertools.combinations(("n0", "n1", "n2", "n3"), 2):
                links.set(a, b, 40.0)
            await f.until(
                lambda: any(
                    "over the latency bound" in u.reason for u in events(f, ClusterUnschedulable)
                ),
                within=30,
                why="the cluster records why no replacement fits",
            )
            await asyncio.sleep(10)
            assert f.ready("big") == ["big-0"]
            assert events(f, ReplicaStopping) == []

    run_simulation(main())
