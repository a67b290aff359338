"""Two processes for `bench/failover.py --clients N`: the load and a traced echo workload.

python bench/_failover_clients.py load --url URL --clients 64 --seconds 20 --out FILE
    Closed-loop aiohttp clients in their own process (so the bench's own work does not
    perturb them): half non-streaming, half streaming, no retries, a 10 s timeout each.
    One JSON line per request in FILE: start/end (wall clock ns, like an event's
    recorded_at), status, exception, the replica that answered, whether a stream got
    `[DONE]` or ended with an SSE `event: error`.

python bench/_failover_clients.py workload --port P --model M --trace-dir DIR [echo flags]
    The reference echo workload (nodeagent/workload/echo.py, unchanged handlers) with two
    additions that let the client side tell which replica served what:
      - every answer names its replica: the header `X-Replica-Port: P`, and the completion
        id ends in `@P` (in every chunk of a stream), so the marker survives any proxy that
        passes bodies through, whatever it does with headers;
      - every /v1 request is traced to DIR/replica-<port>-<pid>.trace as one `S <request id>
        <ns>` line when it arrives and one `E <request id> <ns>` line when its handler is
        done, each an unbuffered os.write on an O_APPEND file: the kernel holds the bytes,
        so a SIGKILL loses none of them. The requests a killed replica had in flight are
        exactly its `S` lines without an `E`; the request id is the client's X-Request-Id
        when the proxy passes it on (the gateway, nginx do), so each can be matched to what
        the client finally saw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from nodeagent.workload import echo  # noqa: E402

MARK_HEADER = "X-Replica-Port"
WORDS = 20  # prompt words: 20 tokens back, about 20 ms + 19 / 200 s = 115 ms at the bench's pace


def prompt(words: int = WORDS) -> str:
    return " ".join(f"word{i}" for i in range(words))


def replica_of(completion_id: str) -> int | None:
    """The port in a traced workload's completion id (`chatcmpl-<request id>@<port>`)."""
    _, sep, port = completion_id.rpartition("@")
    return int(port) if sep and port.isdigit() else None


# -- the traced workload ------------------------------------------------------------------


class _MarkedEcho(echo.EchoApp):
    def __init__(self, settings: echo.EchoSettings, port: int) -> None:
        super().__init__(settings)
        self.port = port

    def _complete(
        self, request: web.Request, prefix: str, prompt: str, limit: int | None
    ) -> echo._Completion:
        completion = super()._complete(request, prefix, prompt, limit)
        return dataclasses.replace(completion, id=f"{completion.id}@{self.port}")


def _tracer(fd: int) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def trace(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if not request.path.startswith("/v1/") or request.method != "POST":
            return await handler(request)
        rid = request.headers.get("X-Request-Id", "-").replace(" ", "_")
        os.write(fd, f"S {rid} {time.time_ns()}\n".encode())
        try:
            return await handler(request)
        finally:
            os.write(fd, f"E {rid} {time.time_ns()}\n".encode())

    return trace


async def _serve_workload(args: argparse.Namespace) -> None:
    path = os.path.join(args.trace_dir, f"replica-{args.port}-{os.getpid()}.trace")
    os.makedirs(args.trace_dir, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    settings = echo.EchoSettings(
        model=args.model, ttft_ms=args.ttft_ms, tokens_per_s=args.tokens_per_s
    )
    app = _MarkedEcho(settings, args.port).build()
    app.middlewares.append(_tracer(fd))

    async def mark(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[MARK_HEADER] = str(args.port)

    app.on_response_prepare.append(mark)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"traced echo: serving {args.model!r} on {args.host}:{args.port}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        os.close(fd)


def read_traces(trace_dir: Path) -> dict[int, dict[str, Any]]:
    """Per workload process (by pid): its port, and per request id its start/end ns."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted(trace_dir.glob("replica-*.trace")):
        _, port, pid = path.stem.split("-")
        starts: dict[str, int] = {}
        ends: dict[str, int] = {}
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) != 3 or not parts[2].isdigit():
                continue  # a line cut by the kill (a single write is atomic, but be safe)
            (starts if parts[0] == "S" else ends)[parts[1]] = int(parts[2])
        out[int(pid)] = {"port": int(port), "starts": starts, "ends": ends}
    return out


# -- the load -----------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Record:
    id: str
    client: int
    stream: bool
    start_ns: int
    end_ns: int = 0
    latency_s: float = 0.0
    head_s: float | None = None  # the response head
    first_token_s: float | None = None  # the first `data:` chunk (streams), the body (others)
    status: int = 0  # 0: no response head
    error: str = ""
    replica: int | None = None  # the port of the replica that answered
    chunks: int = 0  # `data:` chunks (tokens, then the finish chunk) before [DONE]
    done: bool = False  # streams: `data: [DONE]` arrived; others: a complete, valid body
    error_event: bool = False  # an SSE `event: error` arrived (the gateway's mid-stream error)
    tail: str = ""  # the last bytes of a failed answer, for the report


async def _one(
    session: aiohttp.ClientSession, url: str, rec: Record, body: bytes, expect: str
) -> None:
    t0 = time.perf_counter()
    got = bytearray()
    try:
        async with session.post(
            url,
            data=body,
            headers={"Content-Type": "application/json", "X-Request-Id": rec.id},
        ) as resp:
            rec.head_s = time.perf_counter() - t0
            rec.status = resp.status
            mark = resp.headers.get(MARK_HEADER)
            rec.replica = int(mark) if mark and mark.isdigit() else None
            if not rec.stream or resp.status != 200:
                raw = await resp.read()
                got += raw[-300:]
                rec.first_token_s = time.perf_counter() - t0
                if resp.status == 200:
                    answer = json.loads(raw)
                    rec.replica = rec.replica or replica_of(answer.get("id", ""))
                    text = answer["choices"][0]["message"]["content"]
                    rec.done = text == expect
                    if not rec.done:
                        rec.error = "wrong answer"
                return
            async for line in resp.content:
                got += line
                del got[:-300]
                if rec.error_event:
                    continue  # the error event's own `data:` line is no token
                if line.startswith(b"data: "):
                    if line.startswith(b"data: [DONE]"):
                        rec.done = True
                        continue
                    if rec.chunks == 0:
                        rec.first_token_s = time.perf_counter() - t0
                        if rec.replica is None:
                            with contextlib.suppress(ValueError, KeyError):
                                rec.replica = replica_of(json.loads(line[6:])["id"])
                    rec.chunks += 1
                elif line.startswith(b"event: error"):
                    rec.error_event = True
    except Exception as exc:  # every failure is a result here
        rec.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    finally:
        rec.end_ns = time.time_ns()
        rec.latency_s = time.perf_counter() - t0
        if not rec.done:
            rec.tail = got.decode(errors="replace")


async def _client(
    index: int,
    stream: bool,
    session: aiohttp.ClientSession,
    url: str,
    deadline: float,
    out: list[Record],
) -> None:
    text = prompt()
    body = json.dumps(
        {
            "model": "echo",
            "stream": stream,
            "messages": [{"role": "user", "content": text}],
        }
    ).encode()
    n = 0
    while time.monotonic() < deadline:
        n += 1
        rec = Record(id=f"c{index}-{n}", client=index, stream=stream, start_ns=time.time_ns())
        out.append(rec)
        await _one(session, url, rec, body, text)


async def _load(args: argparse.Namespace) -> list[dict[str, Any]]:
    url = args.url.rstrip("/") + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    records: list[Record] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        wait = (args.start_at - time.time_ns()) / 1e9
        if wait > 0:
            await asyncio.sleep(wait)
        started = time.time_ns()
        deadline = time.monotonic() + args.seconds
        streaming = round(args.clients * args.stream_fraction)
        async with asyncio.TaskGroup() as tasks:
            for i in range(args.clients):
                stream = i >= args.clients - streaming
                tasks.create_task(_client(i, stream, session, url, deadline, records))
        ended = time.time_ns()
    return [{"started_ns": started, "ended_ns": ended}, *map(dataclasses.asdict, records)]


def read_load(path: Path) -> tuple[dict[str, int], list[dict[str, Any]]]:
    lines = path.read_text().splitlines()
    return json.loads(lines[0]), [json.loads(line) for line in lines[1:]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    load = commands.add_parser("load")
    load.add_argument("--url", required=True)
    load.add_argument("--clients", type=int, default=64)
    load.add_argument("--stream-fraction", type=float, default=0.5)
    load.add_argument("--seconds", type=float, default=20.0)
    load.add_argument("--timeout", type=float, default=10.0)
    load.add_argument("--start-at", type=int, default=0, help="wall clock ns to begin at")
    load.add_argument("--out", required=True)
    workload = commands.add_parser("workload")
    echo.add_arguments(workload)
    workload.add_argument("--trace-dir", required=True)
    args = parser.parse_args()
    if args.command == "load":
        lines = asyncio.run(_load(args))
        Path(args.out).write_text("".join(json.dumps(line) + "\n" for line in lines))
    else:
        asyncio.run(_serve_workload(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
