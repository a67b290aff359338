"""The inference engines docs/workloads.md has templates for, and what to tell an operator
whose node lacks one: a replica whose command names a program that is not on the node's PATH
fails to start with one line saying which engine is missing and how it is installed."""

from __future__ import annotations

from pathlib import PurePath
from typing import Final

# The program a template's command starts -> how a node gets it.
INSTALL_HINTS: Final[dict[str, str]] = {
    "vllm": "pip install vllm on a CUDA node, or run the image vllm/vllm-openai with "
    "--workload-driver docker",
    "llama-server": "install a llama.cpp release (github.com/ggml-org/llama.cpp/releases) or "
    "build it; `gpumesh workload llm` runs the same server from the [llm] extra",
    "text-embeddings-router": "run text-embeddings-inference's image "
    "ghcr.io/huggingface/text-embeddings-inference with --workload-driver docker, or `cargo "
    "install` it from its repository",
    "ollama": "install Ollama (ollama.com/download), then `ollama pull MODEL` on the node",
    "docker": "install docker, or use --workload-driver docker with the spec's image",
}


def missing_program(program: str) -> str:
    """One line for a command whose program is not found on this node."""
    name = PurePath(program).name
    hint = INSTALL_HINTS.get(name)
    if hint is None:
        return f"cannot run {program!r}: not found on this node's PATH"
    return f"the engine {name!r} is not installed on this node (not on its PATH): {hint}"
