"""Secrets in the simulator: the same code on virtual time, keys drawn from the seed. A cluster
with a secret survives its node's power loss (the replacement gets the value too), the log never
holds it, and the same seed gives the same log."""

from __future__ import annotations

import asyncio
import hashlib

import msgspec

from events.codec import encode_envelope
from events.secret_store import reference
from sim import run_simulation
from sim.run import quiet_logger
from sim.scenario import Fleet, Scenario
from sim.world import World, _api

SCENARIO = Scenario(
    name="secrets",
    duration_s=1.0,
    settle_s=0.0,
    fleet=Fleet(nodes=3, gpus="RTX4090:24GiB:1"),
    rate_per_s=0.0,
)
TOKEN = "hf_simulatedSECRET0123456789"


def _run(seed: int) -> tuple[World, list[dict[str, str]]]:
    world = World(SCENARIO, seed, log=quiet_logger())
    seen: list[dict[str, str]] = []

    async def main() -> None:
        async with world.running():
            await asyncio.sleep(2.0)  # every agent registers
            spec = {"name": "llama", "command": "serve", "secret_env": {"HF_TOKEN": TOKEN}}
            reply = await _api(world.network.endpoint("client"), "cluster.create", spec)
            assert reply.ok, reply.error
            await asyncio.sleep(5.0)
            [first] = [n for n in world.nodes.values() if n.driver.running()]
            seen.extend(w.spec.secret_env for w in first.driver.running())
            world.power_off(first)
            await asyncio.sleep(15.0)  # offline after 3 s, replaced elsewhere
            for node in world.nodes.values():
                if node is not first:
                    seen.extend(w.spec.secret_env for w in node.driver.running())

    run_simulation(main())
    return world, seen


def test_a_secret_follows_its_replica_to_another_node_and_never_reaches_the_log() -> None:
    world, seen = _run(11)
    assert seen == [{"HF_TOKEN": TOKEN}, {"HF_TOKEN": TOKEN}]  # before and after the failover
    log = b"".join(encode_envelope(e) for e in world.store.read_all_now())
    assert TOKEN.encode() not in log and reference(TOKEN).encode() in log
    spec = world.controller.live.state.clusters.clusters["llama"].spec  # type: ignore[union-attr]
    assert msgspec.to_builtins(spec)["secret_env"] == {"HF_TOKEN": reference(TOKEN)}

    again, _ = _run(11)
    digest = [
        hashlib.sha256(b"".join(encode_envelope(e) for e in w.store.read_all_now())).hexdigest()
        for w in (world, again)
    ]
    assert digest[0] == digest[1]
