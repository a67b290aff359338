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


# -- `bench/failover.py --plot FILE.png [--from-json FILE]`: the printed figures as a picture --

DETECTION_S_TARGET = 3.0  # bench/failover.py's DETECTION_TARGET_S (a --clients result has none)
PHASES = (
    ("detection_s", "detection (kill → offline)", "#8250df"),
    ("decision_s", "decision (→ placed)", "#bf8700"),
    ("launch_s", "launch (→ starting)", "#6e7781"),
    ("workload_start_s", "workload start (→ ready)", "#2454c5"),
)


def plot_result(result: dict[str, Any], path: Path) -> None:
    """The PNG of a result as `--json` prints it, by its mode: per run and per failure class
    the times the table gives (detection, replacement, leading again) and the requests failed.
    matplotlib missing: sim.plot.PlotUnavailable, whose message is the install hint."""
    from sim.plot import pyplot, save

    plt = pyplot()
    mode = result.get("mode")
    drawers = {"failover": _plot_node_kill, "ha": _plot_classes, "proxied": _plot_proxied}
    if mode not in drawers:
        raise ValueError(
            f"no plot for a {mode!r} result (plots: {', '.join(drawers)}; the soak and "
            "--controller-down modes print counts only)"
        )
    fig, title = drawers[mode](plt, result)
    quick = "\nQUICK RUN (--quick): figures not comparable" if result.get("quick") else ""
    fig.suptitle(title + quick, fontsize=11)
    save(fig, path)


def _plot_node_kill(plt: Any, result: dict[str, Any]) -> tuple[Any, str]:
    """`bench/failover.py [--runs N]`: each run's phases from the kill as one bar, and the
    detection and replacement times over the runs against their targets."""
    from sim.plot import distributions

    runs = result["runs"]
    fig, (timeline, spread) = plt.subplots(
        1,
        2,
        figsize=(11, 1.2 + 0.45 * max(len(runs), 4)),
        width_ratios=[1.8, 1.0],
        layout="constrained",
    )
    title = (
        f"bench/failover.py: SIGKILL of an agent holding a replica, {len(runs)} runs "
        f"({result.get('agents', '?')} agents, echo x{result.get('replicas', '?')}, heartbeat "
        f"{result.get('heartbeat_interval_s', 1.0):g} s, offline after "
        f"{result.get('offline_after', 3)} missed)"
    )
    labels = []
    longest = 0.0
    for row, run in enumerate(runs):
        left = 0.0
        for key, label, colour in PHASES:
            width = float(run.get(key) or 0.0)
            timeline.barh(
                row, width, left=left, color=colour, height=0.6, label=label if row == 0 else None
            )
            left += width
        longest = max(longest, left)
        timeline.annotate(f" {run['replacement_s']:.2f} s", (left, row), va="center", fontsize=8)
        labels.append(f"run {run.get('run', row + 1)}")
    timeline.set_yticks(range(len(runs)), labels)
    timeline.invert_yaxis()
    timeline.set_xlim(0, longest * 1.12 or 1.0)  # room for each run's total beside its bar
    timeline.set_xlabel("seconds from the kill")
    timeline.set_title("each run, from the kill to the replacement ready", loc="left", fontsize=10)
    target = result.get("targets", {}).get("detection_s")
    if target is not None:
        timeline.axvline(target, color="#c62828", linestyle="--", linewidth=1)
    timeline.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=4, fontsize=8, frameon=False
    )
    timeline.grid(axis="x", alpha=0.3)
    distributions(
        spread,
        {
            "detection": [r["detection_s"] for r in runs],
            "replacement": [r["replacement_s"] for r in runs],
        },
        title="over the runs (dashed: detection target)",
        target=target,
    )
    return fig, title


def _plot_classes(plt: Any, result: dict[str, Any]) -> tuple[Any, str]:
    """`bench/failover.py --classes`: per failure class, the seconds until a controller leads
    again and until `cluster scale` is accepted, and the requests failed, one dot a run."""
    from sim.plot import distributions

    runs = result["runs"]
    classes = list(result.get("summary") or dict.fromkeys(r["class"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.4), layout="constrained")
    title = (
        f"bench/failover.py --classes: {result.get('clients', '?')} clients through the "
        f"gateway, the fault at {result.get('fault_at_s', '?')} s, lease "
        f"{result.get('lease', '?')}, log {result.get('controller_log', '?')}"
    )
    target = result.get("target_s")

    def per_class(value: Any) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {k: [] for k in classes}
        for r in runs:
            v = value(r)
            if r["class"] in out and v is not None:
                out[r["class"]].append(float(v))
        return out

    def never(key: str) -> dict[str, int]:
        return {k: sum(1 for r in runs if r["class"] == k and r[key] is None) for k in classes}

    distributions(
        axes[0],
        per_class(lambda r: r["leads_again_s"]),
        title="a controller leads again (s from the fault)",
        target=target,
        never=never("leads_again_s"),
    )
    distributions(
        axes[1],
        per_class(lambda r: r["scale_accepted_s"]),
        title="`cluster scale` accepted (s from the fault)",
        target=target,
        never=never("scale_accepted_s"),
        colour="#8250df",
    )
    distributions(
        axes[2],
        per_class(
            lambda r: (
                r["requests"]["failed_before_first_byte"] + r["requests"]["failed_after_first_byte"]
            )
        ),
        title=f"requests failed per run, of {_sent_range(runs)} sent (target 0)",
        unit="requests",
        colour="#c62828",
    )
    return fig, title


def _plot_proxied(plt: Any, result: dict[str, Any]) -> tuple[Any, str]:
    """`bench/failover.py --clients N`: per proxy, the control plane's detection and
    replacement after the kill, and the requests failed before the first byte and streams cut."""
    from sim.plot import distributions

    runs = result["runs"]
    proxies = list(dict.fromkeys(r["proxy"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.4), layout="constrained")
    title = (
        f"bench/failover.py --clients {result.get('clients', '?')}: SIGKILL of 1 of "
        f"{result.get('replicas', '?')} replicas at {result.get('kill_at_s', '?')} s of "
        f"{result.get('seconds', '?')} s"
    )

    def per_proxy(key: str) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {p: [] for p in proxies}
        for r in runs:
            if r.get(key) is not None:
                out[r["proxy"]].append(float(r[key]))
        return out

    distributions(
        axes[0],
        per_proxy("detection_s"),
        title="detection (kill → offline, s)",
        target=DETECTION_S_TARGET,
    )
    distributions(
        axes[1], per_proxy("replacement_s"), title="replacement (kill → ready, s)", colour="#8250df"
    )
    distributions(
        axes[2],
        per_proxy("failed_before_first_byte"),
        title="failed before the first byte (target 0)",
        unit="requests",
        colour="#c62828",
    )
    return fig, title


def _sent_range(runs: list[dict[str, Any]]) -> str:
    sent = [r["requests"]["sent"] for r in runs if "sent" in r.get("requests", {})]
    if not sent:
        return "?"
    return f"{min(sent):,}" if min(sent) == max(sent) else f"{min(sent):,}-{max(sent):,}"
