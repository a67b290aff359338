"""What the modes of bench/failover.py share (a helper, not a benchmark): a stack serving the
paced, traced echo cluster, processes marked as the stack's own, the gateway in front of it,
and the readings of its metrics and JSON logs."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.integration.stack import STACK_ENV, Stack, echo_spec

ROOT = Path(__file__).resolve().parent.parent
REPLICAS = 3
PACE = ("--ttft-ms", "20", "--tokens-per-s", "200")
HELPER = ROOT / "bench" / "_failover_clients.py"
CLIENT_TIMEOUT_S = 10.0


async def _serving(stack: Stack, replicas: int, timeout: float = 60.0) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        cluster = await stack.cluster("echo")
        if cluster["ready"] != replicas:
            return None
        running = {(w.replica_id, w.epoch) for w in stack.workloads()}
        wanted = {
            (r["replica_id"], r["epoch"]) for r in cluster["replicas"] if r["status"] == "ready"
        }
        return cluster if running == wanted else None

    return await stack.wait_until(check, timeout=timeout, why=f"{replicas} echo replicas serving")


@dataclass
class _Proxy:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    detail: str

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(5)
                return
            except subprocess.TimeoutExpired:
                continue


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _spawn(stack: Stack, argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    # Marked like the stack's own processes, so that its teardown would reap a leftover.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", STACK_ENV: stack.marker}
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log_path.parent,
            start_new_session=True,
        )


def _traced_spec(trace_dir: Path) -> dict[str, Any]:
    """echo_spec(3) run through the traced wrapper of the same echo workload (see
    bench/_failover_clients.py): each answer names its replica, each request is traced."""
    argv = [sys.executable, str(HELPER), "workload", "--port", "{port}", "--model", "{model}"]
    argv += [*PACE, "--trace-dir", str(trace_dir)]
    return {**echo_spec(REPLICAS), "command": shlex.join(argv)}


def _start_gateway(stack: Stack, workdir: Path, binary: str) -> _Proxy:
    port = _free_port()
    log = workdir / "gateway.log"
    argv = [
        binary, "-m", "gpumesh", "gateway",
        "--nats", stack.url,
        "--listen", f"127.0.0.1:{port}",
        "--data-dir", str(stack.root),
        "--gateway-id", "gw-bench",
        "--log-format", "json",
        "--no-access-log",
    ]  # fmt: skip
    popen = _spawn(stack, argv, log)
    return _Proxy("gateway", f"http://127.0.0.1:{port}", popen, log, "defaults, direct transport")


async def _proxy_answers(proxy: _Proxy, timeout: float = 60.0) -> None:
    """Until a chat completion through the proxy answers 200, several times in a row."""
    body = {"model": "echo", "messages": [{"role": "user", "content": "ready"}]}
    deadline = time.monotonic() + timeout
    in_a_row = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while in_a_row < 6:
            if proxy.popen.poll() is not None:
                tail = Stack.log_tail(proxy.log_path)
                raise RuntimeError(f"{proxy.name} exited {proxy.popen.returncode}: {tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proxy.name} did not answer within {timeout:g} s")
            try:
                async with session.post(f"{proxy.url}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    in_a_row = in_a_row + 1 if resp.status == 200 else 0
            except (aiohttp.ClientError, TimeoutError):
                in_a_row = 0
            await asyncio.sleep(0.05 if in_a_row else 0.2)


async def _scrape(url: str) -> str:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(f"{url}/metrics") as resp,
        ):
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return ""


def _metric_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """`name{labels} value` lines summed per name and `reason` label."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith((name + "{", name + " ")):
                labels, _, value = line.rpartition(" ")
                reason = labels.partition('reason="')[2].partition('"')[0]
                key = f"{name}:{reason}" if reason else name
                with contextlib.suppress(ValueError):
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def _log_events(path: Path, event: str) -> list[dict[str, Any]]:
    """JSON log lines of one event, each with `at_ns` from its ISO timestamp."""
    found = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if f'"{event}"' not in line:
                continue
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                stamp = dt.datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00"))
                entry["at_ns"] = int(stamp.timestamp() * 1e9)
                found.append(entry)
    return found


async def _sleep_until(wall_ns: int) -> None:
    await asyncio.sleep(max(0.0, (wall_ns - time.time_ns()) / 1e9))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ok(r: dict[str, Any]) -> bool:
    return r["status"] == 200 and r["done"] and not r["error_event"]
