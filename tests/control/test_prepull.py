"""A `[docker] prepull` spec: once recorded, every node that could host one of its replicas and
lacks the image is told to pull it, before any placement; the others are not."""

from __future__ import annotations

import asyncio

import pytest

from events.cluster import ClusterSpec, DockerOptions, GpuRequirement
from sim import run_simulation

from .harness import ScriptedAgent, fleet

IMAGE = "vllm/vllm-openai:v0.6.3"


def test_a_prepull_spec_asks_the_nodes_that_could_host_it() -> None:
    async def scenario() -> None:
        async with fleet(2) as f:
            await f.start_agent(ScriptedAgent("has-it", f.bus, f.commands, images=(IMAGE,)))
            await f.start_agent(ScriptedAgent("us", f.bus, f.commands, region="us-east"))
            await f.start_agent(ScriptedAgent("one-gpu", f.bus, f.commands, gpus=1))
            spec = ClusterSpec(
                name="big",
                replicas=0,
                image=IMAGE,
                regions=("eu-west",),
                gpu=GpuRequirement(count=2),
                docker=DockerOptions(prepull=True),
            )
            reply = await f.api("cluster.create", spec)
            assert reply.ok, reply.error
            await f.until(
                lambda: all(f.agents[n].pulled for n in ("n0", "n1")),
                within=10,
                why="n0 and n1 told to pull",
            )
            # Nothing was placed (0 replicas): the pull is ahead of any placement.
            assert f.agents["n0"].pulled == [IMAGE] and f.agents["n1"].pulled == [IMAGE]
            assert f.agents["n0"].started == []
            # Holding it already, outside the regions, too few GPUs: not asked.
            for other in ("has-it", "us", "one-gpu"):
                assert f.agents[other].pulled == [], other
            # A spec without prepull asks nobody (waited for on virtual time).
            plain = ClusterSpec(name="plain", replicas=0, image=IMAGE)
            assert (await f.api("cluster.create", plain)).ok
            await asyncio.sleep(5)
            assert f.agents["n0"].pulled == [IMAGE]
            # Deleted and created again under its name: asked again (a new command id).
            assert (await f.api("cluster.delete", {"name": "big"})).ok
            assert (await f.api("cluster.create", spec)).ok
            await f.until(
                lambda: f.agents["n0"].pulled == [IMAGE, IMAGE], within=10, why="asked again"
            )

    run_simulation(scenario())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_placement_prefers_a_node_that_holds_the_image(seed: int) -> None:
    # Six nodes equal on every other rule: a seeded draw would pick n9 one time in six.
    async def scenario() -> None:
        async with fleet(5, seed=seed) as f:
            await f.start_agent(ScriptedAgent("n9", f.bus, f.commands, images=(IMAGE,)))
            spec = ClusterSpec(name="one", replicas=1, image=IMAGE)
            assert (await f.api("cluster.create", spec)).ok
            await f.until(lambda: f.ready("one") != [], within=20, why="one replica ready")
            (replica,) = [r for r in f.state.replicas.replicas.values() if r.cluster == "one"]
            assert replica.node_id == "n9"

    run_simulation(scenario())
