"""What one stage of a sharded replica runs (docs/sharding.md): the spec with its stage's
command, probe and environment.

The head (rank 0) runs the spec's command and serves the API; a worker runs
`sharding.worker_command` (the spec's command when empty), probed as `sharding.worker_probe`
says. Both get the stage placeholders in their command and the same values as GPUMESH_*
variables, enough to launch llama.cpp's RPC backend or vLLM across nodes:

    {rank} {world_size}        this stage's rank (0: the head) and the number of stages
    {first_layer} {last_layer} its layers, [first, last) (last exclusive)
    {layers}                   how many layers it holds
    {split}                    layers per stage, rank order, comma-separated
    {peer_layers} {peer_split} the workers' layers in all, and per worker (the head's llama.cpp
                               --rpc flags: -ngl {peer_layers} -ts {peer_split})
    {peers}                    the head's: each worker's host:port, comma-separated
    {head_host}                the head node's address

Plain replacement, before the command is split into arguments: the values hold no spaces.
"""

from __future__ import annotations

import msgspec

from events.cluster import ClusterSpec
from events.contract.messages import StageLaunch


def stage_values(stage: StageLaunch) -> dict[str, str]:
    """Placeholder -> value for one stage."""
    peers = stage.split[1:]
    return {
        "{rank}": str(stage.rank),
        "{world_size}": str(stage.world_size),
        "{first_layer}": str(stage.first_layer),
        "{last_layer}": str(stage.last_layer),
        "{layers}": str(stage.last_layer - stage.first_layer),
        "{split}": ",".join(map(str, stage.split)),
        "{peer_layers}": str(sum(peers)),
        "{peer_split}": ",".join(map(str, peers)),
        "{peers}": ",".join(stage.peers),
        "{head_host}": stage.head_host,
    }


def stage_spec(spec: ClusterSpec, stage: StageLaunch) -> ClusterSpec:
    """The spec this node runs for its stage: command, probe and environment."""
    command = spec.command
    probes = spec.probes
    if stage.rank > 0:
        sharding = spec.sharding
        if sharding is not None and sharding.worker_command:
            command = sharding.worker_command
        kind = sharding.worker_probe if sharding is not None else "tcp"
        probes = msgspec.structs.replace(probes, kind=kind)
    values = stage_values(stage)
    for placeholder, value in values.items():
        command = command.replace(placeholder, value)
    env = {**spec.env}
    for placeholder, value in values.items():
        env["GPUMESH_" + placeholder.strip("{}").upper()] = value
    return msgspec.structs.replace(spec, command=command, probes=probes, env=env)


def worker_address(host: str, port: int) -> str:
    """A worker stage's address as the head's engine takes it: host:port (no scheme)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return f"{host}:{port}"
