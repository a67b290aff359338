"""The Python HTTP clients that bench/gateway.py runs in their own processes (not a benchmark).

    python bench/_http_load.py plain  --url URL --connections 64 --seconds 10
        Closed loop: each connection POSTs a chat completion and reads the answer, again and
        again. The fallback when `wrk` is not installed.
    python bench/_http_load.py stream --url URL --connections 64 --seconds 10
        Closed loop of streamed chat completions: time to the first `data:` line, complete
        streams (those that reached `data: [DONE]`).
    python bench/_http_load.py hold   --url URL --streams 10000 --hold 20
        Opens that many streams at once (at most --opening connecting at a time), holds them
        open --hold seconds counting chunks, then closes them all.

Each prints JSON on stdout: one object for plain and stream; for hold one line per phase
(`{"event": "open", ...}` once every stream is open or failed, then `{"event": "held", ...}`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import sys
import time
from typing import Any


def body(model: str = "bench", *, stream: bool = False) -> bytes:
    """A 127-byte chat completion request (for model `bench`), as in the peers' runs."""
    tail = ',"stream":true' if stream else ""
    text = (
        f'{{"model":"{model}","messages":[{{"role":"user","content":"Say hello to the '
        f'benchmark, please. Keep it concise."}}],"max_tokens":16{tail}}}'
    )
    return text.encode()


BODY = body()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def _headers(key: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _session(connections: int) -> Any:
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, force_close=False),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        auto_decompress=False,
    )


async def plain(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    latencies: list[float] = []
    counts = {"ok": 0, "non2xx": 0, "errors": 0}
    headers = _headers(args.key)
    payload = body(args.model)
    async with _session(args.connections) as session:
        started = time.perf_counter()
        deadline = started + args.seconds

        async def worker() -> None:
            while (now := time.perf_counter()) < deadline:
                try:
                    async with session.post(args.url, data=payload, headers=headers) as response:
                        await response.read()
                        ok = 200 <= response.status < 300
                except (aiohttp.ClientError, OSError):
                    counts["errors"] += 1
                    continue
                latencies.append(time.perf_counter() - now)
                counts["ok" if ok else "non2xx"] += 1

        await asyncio.gather(*(worker() for _ in range(args.connections)))
        elapsed = time.perf_counter() - started
    return {
        "requests": counts["ok"] + counts["non2xx"],
        **counts,
        "seconds": elapsed,
        "rps": (counts["ok"] + counts["non2xx"]) / elapsed,
        "p50_ms": _percentile(latencies, 50) * 1000,
        "p99_ms": _percentile(latencies, 99) * 1000,
    }


async def stream(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    ttfc: list[float] = []
    totals: list[float] = []
    counts = {"complete": 0, "incomplete": 0, "non2xx": 0, "errors": 0, "chunks": 0}
    headers = _headers(args.key)
    payload = body(args.model, stream=True)
    async with _session(args.connections) as session:
        started = time.perf_counter()
        deadline = started + args.seconds

        async def worker() -> None:
            while (begin := time.perf_counter()) < deadline:
                first = 0.0
                done = False
                try:
                    async with session.post(args.url, data=payload, headers=headers) as r:
                        if not 200 <= r.status < 300:
                            await r.read()
                            counts["non2xx"] += 1
                            continue
                        async for line in r.content:
                            if not line.startswith(b"data:"):
                                continue
                            if not first:
                                first = time.perf_counter() - begin
                            if line.rstrip() == b"data: [DONE]":
                                done = True
                            else:
                                counts["chunks"] += 1
                except (aiohttp.ClientError, OSError):
                    counts["errors"] += 1
                    continue
                if first:
                    ttfc.append(first)
                if done:
                    counts["complete"] += 1
                    totals.append(time.perf_counter() - begin)
                else:
                    counts["incomplete"] += 1

        await asyncio.gather(*(worker() for _ in range(args.connections)))
        elapsed = time.perf_counter() - started
    return {
        **counts,
        "seconds": elapsed,
        "streams_per_s": counts["complete"] / elapsed,
        "ttfc_p50_ms": _percentile(ttfc, 50) * 1000,
        "ttfc_p99_ms": _percentile(ttfc, 99) * 1000,
        "stream_p50_ms": _percentile(totals, 50) * 1000,
        "stream_p99_ms": _percentile(totals, 99) * 1000,
    }


async def hold(args: argparse.Namespace) -> None:
    import aiohttp

    opening = asyncio.Semaphore(args.opening)
    state = {"open": 0, "failed": 0, "ended": 0, "chunks": 0}
    errors: dict[str, int] = {}
    ttfc: list[float] = []
    headers = _headers(args.key)
    payload = body(args.model, stream=True)
    all_in = asyncio.Event()

    def settle() -> None:
        if state["open"] + state["failed"] >= args.streams:
            all_in.set()

    async def one(session: aiohttp.ClientSession) -> None:
        got_first = False
        await opening.acquire()
        begin = time.perf_counter()  # time to first chunk: from sending, not from queueing
        try:
            async with session.post(args.url, data=payload, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}")
                async for line in r.content:
                    if not line.startswith(b"data:"):
                        continue
                    state["chunks"] += 1
                    if not got_first:
                        got_first = True
                        ttfc.append(time.perf_counter() - begin)
                        state["open"] += 1
                        opening.release()
                        settle()
            state["ended"] += 1
        except (aiohttp.ClientError, OSError, RuntimeError) as exc:
            name = type(exc).__name__ if not isinstance(exc, RuntimeError) else str(exc)
            errors[name] = errors.get(name, 0) + 1
            if got_first:
                state["ended"] += 1
            else:
                state["failed"] += 1
                opening.release()
                settle()

    def emit(event: str, **extra: Any) -> None:
        print(json.dumps({"event": event, **state, "errors": errors, **extra}), flush=True)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        tasks = [asyncio.create_task(one(session)) for _ in range(args.streams)]

        async def progress() -> None:
            while True:
                await asyncio.sleep(2.0)
                print(
                    f"  hold: {state['open']} open, {state['failed']} failed "
                    f"({time.perf_counter() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )

        reporter = asyncio.create_task(progress())
        await all_in.wait()
        reporter.cancel()
        emit(
            "open",
            open_s=time.perf_counter() - started,
            ttfc_p50_ms=_percentile(ttfc, 50) * 1000,
            ttfc_p99_ms=_percentile(ttfc, 99) * 1000,
        )
        before = state["chunks"]
        await asyncio.sleep(args.hold)
        emit("held", chunks_during_hold=state["chunks"] - before, hold_s=args.hold)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["plain", "stream", "hold"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", default="", help="sent as a bearer token")
    parser.add_argument("--model", default="bench")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=10_000)
    parser.add_argument("--opening", type=int, default=128)
    parser.add_argument("--hold", type=float, default=20.0)
    args = parser.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with contextlib.suppress(KeyboardInterrupt):
        if args.mode == "hold":
            asyncio.run(hold(args))
        else:
            result = asyncio.run(plain(args) if args.mode == "plain" else stream(args))
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
