"""The reference workload: a small OpenAI-compatible server that echoes the prompt back.

It stands in for a model server in demos, tests and benchmarks: the answer is the prompt's
words (so every run and every replica says the same thing), with a configurable time to first
token and token rate so that latency and streaming behave like a real model's.

    python -m nodeagent.workload.echo --port 8000 --model echo --ttft-ms 50 --tokens-per-s 40
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from runtime.shutdown import run_until_signal

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_SHUTDOWN_TIMEOUT_S = 2.0  # in-flight streams get this long after SIGTERM


@dataclass(frozen=True, slots=True)
class EchoSettings:
    model: str = "echo"
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0  # 0: as fast as possible


class _Rejected(Exception):
    """A request the echo workload answers with an OpenAI error (its status and code)."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _error(message: str, *, status: int, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return web.json_response(body, status=status)


@dataclass(frozen=True, slots=True)
class _Completion:
    id: str
    prompt_words: int
    pieces: tuple[str, ...]  # one per token: "word" then " word"
    finish_reason: str

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_words,
            "completion_tokens": len(self.pieces),
            "total_tokens": self.prompt_words + len(self.pieces),
        }


class EchoApp:
    def __init__(self, settings: EchoSettings) -> None:
        self.settings = settings
        self._ids = itertools.count(1)

    def build(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.on_response_prepare.append(_echo_request_id)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        entry = {"id": self.settings.model, "object": "model", "created": 0, "owned_by": "gpumesh"}
        return web.json_response({"object": "list", "data": [entry]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            prompt = _chat_prompt(body.get("messages"))
            limit = _max_tokens(body, ("max_completion_tokens", "max_tokens"), default=None)
        except _Rejected as exc:
            return _error(str(exc), status=exc.status, code=exc.code)
        completion = self._complete(request, "chatcmpl", prompt, limit)
        if body.get("stream"):
            return await self._stream(request, completion, body, chat=True)
        await self._pace(len(completion.pieces))
        return web.json_response(
            {
                **self._head(completion, "chat.completion"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": completion.text},
                        "finish_reason": completion.finish_reason,
                    }
                ],
                "usage": completion.usage(),
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            prompt = _text_prompt(body.get("prompt", ""))
            limit = _max_tokens(body, ("max_tokens",), default=_COMPLETIONS_DEFAULT_MAX_TOKENS)
        except _Rejected as exc:
            return _error(str(exc), status=exc.status, code=exc.code)
        completion = self._complete(request, "cmpl", prompt, limit)
        if body.get("stream"):
            return await self._stream(request, completion, body, chat=False)
        await self._pace(len(completion.pieces))
        choice = {
            "index": 0,
            "text": completion.text,
            "logprobs": None,
            "finish_reason": completion.finish_reason,
        }
        return web.json_response(
            {
                **self._head(completion, "text_completion"),
                "choices": [choice],
                "usage": completion.usage(),
            }
        )

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _Rejected(f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _Rejected("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.settings.model:
            raise _Rejected(
                f"The model `{model}` does not exist (this server serves `{self.settings.model}`).",
                status=404,
                code="model_not_found",
            )
        return body

    def _complete(
        self, request: web.Request, prefix: str, prompt: str, limit: int | None
    ) -> _Completion:
        words = prompt.split()
        kept = words if limit is None else words[:limit]
        pieces = tuple(word if i == 0 else f" {word}" for i, word in enumerate(kept))
        request_id = request.headers.get("X-Request-Id") or f"echo-{next(self._ids)}"
        return _Completion(
            id=f"{prefix}-{request_id}",
            prompt_words=len(words),
            pieces=pieces,
            finish_reason="length" if len(kept) < len(words) else "stop",
        )

    def _head(self, completion: _Completion, kind: str) -> dict[str, Any]:
        return {
            "id": completion.id,
            "object": kind,
            "created": int(time.time()),
            "model": self.settings.model,
        }

    async def _pace(self, tokens: int) -> None:
        """Wait as long as generating `tokens` would take (non-streaming answers)."""
        delay = self.settings.ttft_ms / 1000.0
        if self.settings.tokens_per_s > 0 and tokens > 1:
            delay += (tokens - 1) / self.settings.tokens_per_s
        if delay > 0:
            await asyncio.sleep(delay)

    async def _paced(self, pieces: Sequence[str]) -> AsyncIterator[str]:
        if self.settings.ttft_ms > 0:
            await asyncio.sleep(self.settings.ttft_ms / 1000.0)
        for i, piece in enumerate(pieces):
            if i and self.settings.tokens_per_s > 0:
                await asyncio.sleep(1.0 / self.settings.tokens_per_s)
            yield piece

    async def _stream(
        self, request: web.Request, completion: _Completion, body: dict[str, Any], *, chat: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = self._head(completion, kind)

        def chunk(piece: str | None, finish: str | None, *, role: bool = False) -> bytes:
            if chat:
                delta: dict[str, str] = {}
                if role:
                    delta["role"] = "assistant"
                if piece is not None:
                    delta["content"] = piece
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None}
                choice["finish_reason"] = finish
            return _sse({**head, "choices": [choice]})

        try:
            first = True
            async for piece in self._paced(completion.pieces):
                await response.write(chunk(piece, None, role=chat and first))
                first = False
            if first and chat:
                await response.write(chunk("", None, role=True))
            await response.write(chunk(None, completion.finish_reason))
            options = body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage"):
                await response.write(_sse({**head, "choices": [], "usage": completion.usage()}))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away mid-stream: nothing left to tell it
        return response


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _chat_prompt(messages: object) -> str:
    if not isinstance(messages, list) or not messages:
        raise _Rejected("`messages` must be a non-empty list")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    last = (users or messages)[-1]
    if not isinstance(last, dict):
        raise _Rejected("each message must be an object with `role` and `content`")
    content = last.get("content", "")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # Content parts: only the text ones carry words to echo.
        return " ".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    raise _Rejected("message `content` must be a string or a list of content parts")


def _text_prompt(prompt: object) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str | int) for p in prompt):
        return " ".join(str(p) for p in prompt)
    raise _Rejected("`prompt` must be a string or a list of strings")


def _max_tokens(body: dict[str, Any], keys: Sequence[str], *, default: int | None) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _Rejected(f"`{key}` must be a whole number >= 0")
        return value
    return default


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    # A signal, not a middleware, so that streamed answers carry it too.
    request_id = request.headers.get("X-Request-Id")
    if request_id:
        response.headers["X-Request-Id"] = request_id


def build_app(
    *, model: str = "echo", ttft_ms: float = 0.0, tokens_per_s: float = 0.0
) -> web.Application:
    return EchoApp(EchoSettings(model=model, ttft_ms=ttft_ms, tokens_per_s=tokens_per_s)).build()


class EchoServer:
    """A started echo server (see `start`)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        await self._runner.cleanup()


async def start(
    port: int = 0,
    *,
    host: str = "127.0.0.1",
    model: str = "echo",
    ttft_ms: float = 0.0,
    tokens_per_s: float = 0.0,
) -> EchoServer:
    """Serve in the background of the running loop until `close()`; port 0 picks a free one."""
    app = build_app(model=model, ttft_ms=ttft_ms, tokens_per_s=tokens_per_s)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if port == 0 else port
    return EchoServer(runner, host, bound)


async def serve(
    port: int,
    *,
    host: str = "127.0.0.1",
    model: str = "echo",
    ttft_ms: float = 0.0,
    tokens_per_s: float = 0.0,
    handle_signals: bool = True,
) -> None:
    """Serve until SIGTERM/SIGINT (if `handle_signals`) or cancellation, then shut down cleanly."""
    server = await start(port, host=host, model=model, ttft_ms=ttft_ms, tokens_per_s=tokens_per_s)
    try:
        sys.stdout.write(f"echo: serving model {model!r} on {server.url}\n")
        sys.stdout.flush()
        forever = asyncio.Event().wait()
        if handle_signals:
            await run_until_signal(forever)
        else:
            await forever
    finally:
        await server.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, required=True, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", default="echo", help="the model name it answers to")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token")
    parser.add_argument("--tokens-per-s", type=float, default=0.0, help="0: no pacing")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nodeagent.workload.echo",
        description="The reference workload: an OpenAI-compatible server that echoes the prompt.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    asyncio.run(
        serve(
            args.port,
            host=args.host,
            model=args.model,
            ttft_ms=args.ttft_ms,
            tokens_per_s=args.tokens_per_s,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
