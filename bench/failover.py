"""Failover timings on a real local stack, and a no-fault soak that counts false verdicts.

Every part is its own process on loopback (tests/integration/stack.py): nats-server, the
controller, N agents with fake GPUs, real echo workloads. Health settings are the defaults
(heartbeat 1 s, offline after 3 missed heartbeats).

    python bench/failover.py [--runs 5] [--json]
        Each run: a fresh stack (4 agents, cluster `echo` of 3 replicas), all serving; after a
        random 0-1 s pause (so the kill falls anywhere in the heartbeat cycle) SIGKILL one agent
        that holds a replica, and its workload. From the event log's recorded_at times:
          detection    kill -> node.health_changed(offline)
          decision     offline -> the replacement's replica.placed
          launch       placed -> replica.starting (command delivered, process started)
          start        replica.starting -> replica.ready (the echo workload's own start time)
          replacement  kill -> the replacement's replica.ready

    python bench/failover.py --soak 300 --agents 20 [--json]
        20 agents and a cluster of 3 echo replicas, no faults, for 300 s: any health verdict
        other than healthy (offline above all) is a false alarm; also reports the largest gap
        between two recorded heartbeats of any node.

    python bench/failover.py --clients 64 [--seconds 20] [--kill-at 5]
            [--proxies gateway,nginx,vllm-router] [--peers-venv DIR | --install-peers] [--json]
        Client-side failover. Per proxy: a fresh stack (4 agents, cluster `echo` of 3 paced
        replicas: 20 ms to the first token, 200 tokens/s, 20-word prompts, so an answer takes
        about 115 ms), the proxy in front of it (the gateway following the stack's NATS; nginx
        or vllm-router configured with the 3 replica addresses), and N closed-loop clients in
        their own process (bench/_failover_clients.py: half streaming, no retries, 10 s
        timeout). At --kill-at s, SIGKILL the agent of a node holding one replica, and its
        workload; the load goes on until --seconds. Reported per proxy: requests sent and
        succeeded; failed before the first byte (no response head, or an error status;
        target 0); streams cut mid-answer, with an SSE `event: error` or silently; the requests
        in flight on the killed replica at the kill (from the replicas' own request traces) and
        what became of each; p50/p99 latency before the kill and in the failover window (kill
        -> the replacement replica ready, else kill + 10 s); for the gateway its ejection of
        the dead replica and the `replica.suspected.v1` events. nginx runs if it is on PATH,
        vllm-router if installed (on PATH, in --peers-venv, or installed there by
        --install-peers); otherwise each is skipped with the reason.

    python bench/failover.py --clients 64 --controller-down 30 [--seconds 45] [--kill-at 5]
        The controller, not a node: a fresh stack (3 agents, cluster `echo` of 3 paced
        replicas advertised through the nodes' fencing fronts), the gateway, N clients as above;
        at --kill-at s SIGKILL the controller, start it again 30 s later, and load on until
        --seconds. Reported: what clients saw while it was down and after it came back (target:
        0 failed before the first byte, no stream cut), offline verdicts and replicas placed
        again (both 0: nothing moves), and the controller's grace events.

    python bench/failover.py --classes all [--runs 3] [--clients 64] [--class-seconds 20]
            [--fault-at 3] [--hold 8] [--event-log sqlite|jetstream] [--json]
        The control plane itself, per failure class (controller-kill, controller-stop,
        nats-kill, nats-kill-lease; `all`, or a comma-separated list), on a stack in HA shape:
        3 clustered nats-servers, 2 controllers on one leader lease, 3 agents, cluster `echo`
        of 3 paced replicas behind the nodes' fences, the gateway, N clients (half streaming).
        Per class: SIGKILL the leading controller / SIGSTOP it past its lease and SIGCONT it /
        SIGKILL the nats-server it is connected to / the one leading the lease's stream; then
        the seconds until a controller leads again and until `cluster scale` is accepted, the
        requests failed before and after their first byte, and whether the continued old
        leader wrote anything (strace). The killed process is started again and the stack
        steady before the next class. Details: bench/_failover_ha.py.

    python bench/failover.py --sharded [--runs 3] [--clients 16] [--seconds 20] [--kill-at 5]
            [--victim worker|head|both] [--worker-probe tcp|http|none] [--head-needs-workers]
        A sharded group loses a node (issue 18): 5 agents with one fake 24 GiB GPU each, cluster
        `echo` of 2 replicas that each need 2 pipeline stages (30 GiB of weights), the gateway,
        N clients (half streaming); SIGKILL the node of one group's worker stage, or its head.
        Reported: kill -> offline, -> the group failed, -> placed again, -> worker up, ->
        serving again; requests failed before the first byte (target 0), streams cut.
        Details: bench/_failover_sharded.py.

    python bench/failover.py ... --plot FILE.png
    python bench/failover.py --from-json RESULT.json --plot FILE.png
        The figures above as one PNG (needs matplotlib: pip install 'gpumesh[plot]'): for the
        node kill each run's phases from the kill and detection and replacement over the runs;
        for --classes per failure class the seconds until a controller leads again and until
        `cluster scale` is accepted, and the requests failed; for --clients per proxy detection,
        replacement and the requests failed before the first byte. --from-json draws a result
        saved with --json, running nothing.

--quick shrinks whichever mode runs, for CI (its figures are marked, not comparable): one run;
4 agents for --soak too; --seconds 3 --kill-at 1.5 for --clients; for --classes, the class
controller-stop alone (unless --classes names others), 7 s of load with the fault at 1.5 s.

Targets printed beside the results: detection <= 3 s; replacement <= detection + 2 s + the
workload's start time; through a proxy, 0 requests failed before the first byte and no stream
cut silently. A benchmark that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from bench import _failover_ha, _failover_ha_report, _failover_sharded  # noqa: E402
from bench._failover_clients import WORDS, read_load, read_traces  # noqa: E402
from bench._failover_common import (  # noqa: E402
    CLIENT_TIMEOUT_S,
    HELPER,
    PACE,
    REPLICAS,
    _free_port,
    _log_events,
    _metric_sums,
    _ok,
    _pct,
    _Proxy,
    _proxy_answers,
    _scrape,
    _serving,
    _sleep_until,
    _spawn,
    _start_gateway,
    _traced_spec,
    plot_result,
)
from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from events.envelope import Envelope  # noqa: E402
from gpumesh.logconfig import configure_logging  # noqa: E402
from tests.integration.stack import (  # noqa: E402
    Killed,
    Stack,
    echo_spec,
    payload,
    pid_alive,
)

DETECTION_TARGET_S = 3.0
DECISION_BUDGET_S = 2.0  # replacement <= detection + this + the workload's start time
QUICK: dict[str, Any] = {
    "runs": 1,
    "agents": 4,
    "seconds": 3.0,
    "kill_at": 1.5,
    "class_seconds": 7.0,
    "fault_at": 1.5,
    "hold": 4.0,
}


def _s(ns: int) -> float:
    return ns / 1e9


def _start_times(events: list[Envelope]) -> list[float]:
    """replica.starting -> replica.ready, per (replica, epoch), in seconds."""
    starting: dict[tuple[str, int], int] = {}
    out = []
    for e in events:
        p = payload(e)
        key = (p.get("replica_id", ""), p.get("epoch", 0))
        if e.type == "replica.starting.v1":
            starting[key] = e.recorded_at
        elif e.type == "replica.ready.v1" and key in starting:
            out.append(_s(e.recorded_at - starting[key]))
    return out


async def one_run(index: int, workdir: Path, agents: int, rng: random.Random) -> dict[str, Any]:
    async with Stack(workdir / f"run-{index}", agents=agents) as stack:
        await stack.create_cluster(echo_spec(REPLICAS))
        cluster = await _serving(stack, REPLICAS)
        initial_starts = _start_times(stack.events())
        victim = cluster["replicas"][index % REPLICAS]
        rid, node = victim["replica_id"], victim["node_id"]
        await asyncio.sleep(rng.uniform(0.0, 1.0))
        killed = await stack.kill_agent(node)
        offline = await stack.wait_for_event(
            "node.health_changed.v1", node_id=node, state="offline", timeout=30
        )
        placed = await stack.wait_for_event(
            "replica.placed.v1", replica_id=rid, epoch=2, after=offline.position, timeout=30
        )
        starting = await stack.wait_for_event(
            "replica.starting.v1", replica_id=rid, epoch=2, timeout=30
        )
        ready = await stack.wait_for_event("replica.ready.v1", replica_id=rid, epoch=2, timeout=60)
        await _serving(stack, REPLICAS)
        assert not any(pid_alive(w.pid) for w in killed.workloads)
        return {
            "run": index + 1,
            "victim": node,
            "replica": rid,
            "replacement_node": payload(placed)["node_id"],
            "detection_s": _s(offline.recorded_at - killed.at_ns),
            "decision_s": _s(placed.recorded_at - offline.recorded_at),
            "launch_s": _s(starting.recorded_at - placed.recorded_at),
            "workload_start_s": _s(ready.recorded_at - starting.recorded_at),
            "replacement_s": _s(ready.recorded_at - killed.at_ns),
            "initial_workload_starts_s": initial_starts,
        }


def _verdicts(run: dict[str, Any]) -> tuple[bool, bool]:
    detect_ok = run["detection_s"] <= DETECTION_TARGET_S
    budget = run["detection_s"] + DECISION_BUDGET_S + run["workload_start_s"]
    return detect_ok, run["replacement_s"] <= budget


async def failover(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpumesh-failover-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        for i in range(args.runs):
            run = await one_run(i, workdir, args.agents, rng)
            runs.append(run)
            if not args.json:
                _print_run(run)
    keys = ("detection_s", "decision_s", "launch_s", "workload_start_s", "replacement_s")
    medians = {k: statistics.median(r[k] for r in runs) for k in keys}
    initial = [t for r in runs for t in r["initial_workload_starts_s"]]
    medians["initial_workload_start_s"] = statistics.median(initial) if initial else 0.0
    maxima = {k: max(r[k] for r in runs) for k in keys}
    verdicts = [_verdicts(r) for r in runs]
    return {
        "mode": "failover",
        "agents": args.agents,
        "replicas": REPLICAS,
        "heartbeat_interval_s": 1.0,
        "offline_after": 3,
        "runs": runs,
        "median": medians,
        "max": maxima,
        "targets": {
            "detection_s": DETECTION_TARGET_S,
            "detection_met": sum(d for d, _ in verdicts),
            "replacement_budget": f"detection + {DECISION_BUDGET_S:g} s + workload start",
            "replacement_met": sum(r for _, r in verdicts),
            "runs": len(runs),
        },
    }


def _print_header(agents: int) -> None:
    print(
        f"failover: {agents} agents, cluster echo x{REPLICAS}, heartbeat 1 s, offline after 3 "
        "missed; SIGKILL one agent holding a replica (and its workload) per run"
    )
    print(
        f"{'run':>3} {'victim':7} {'detection':>9} {'decision':>9} {'launch':>7} "
        f"{'wl start':>8} {'replacement':>11}  targets"
    )


def _print_run(run: dict[str, Any]) -> None:
    detect_ok, replace_ok = _verdicts(run)
    verdict = (
        f"detection {'ok' if detect_ok else 'MISSED'}, "
        f"replacement {'ok' if replace_ok else 'MISSED'}"
    )
    print(
        f"{run['run']:>3} {run['victim']:7} {run['detection_s']:8.2f}s {run['decision_s']:8.3f}s "
        f"{run['launch_s']:6.3f}s {run['workload_start_s']:7.2f}s {run['replacement_s']:10.2f}s  "
        f"{verdict}"
    )


def _print_summary(result: dict[str, Any]) -> None:
    m, x, t = result["median"], result["max"], result["targets"]
    print(
        f"med {'':7} {m['detection_s']:8.2f}s {m['decision_s']:8.3f}s {m['launch_s']:6.3f}s "
        f"{m['workload_start_s']:7.2f}s {m['replacement_s']:10.2f}s"
    )
    print(
        f"max {'':7} {x['detection_s']:8.2f}s {x['decision_s']:8.3f}s {x['launch_s']:6.3f}s "
        f"{x['workload_start_s']:7.2f}s {x['replacement_s']:10.2f}s"
    )
    budget = m["detection_s"] + DECISION_BUDGET_S + m["workload_start_s"]
    print(
        f"target: detection <= {t['detection_s']:.1f} s: median {m['detection_s']:.2f} s, "
        f"met in {t['detection_met']}/{t['runs']} runs"
    )
    print(
        f"target: replacement <= detection + {DECISION_BUDGET_S:g} s + workload start "
        f"(median {m['detection_s']:.2f} + {DECISION_BUDGET_S:g} + {m['workload_start_s']:.2f} "
        f"= {budget:.2f} s): median {m['replacement_s']:.2f} s, met in "
        f"{t['replacement_met']}/{t['runs']} runs"
    )
    print(
        f"echo workload start (replica.starting -> replica.ready): median "
        f"{m['workload_start_s']:.2f} s for replacements, {m['initial_workload_start_s']:.2f} s "
        "at the initial deploys"
    )


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpumesh-soak-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        started = time.monotonic()
        async with Stack(workdir / "soak", agents=args.agents) as stack:
            setup_s = time.monotonic() - started
            await stack.create_cluster(echo_spec(REPLICAS))
            await _serving(stack, REPLICAS)
            begin = stack.events()[-1].position
            begin_ns = time.time_ns()
            if not args.json:
                print(
                    f"soak: {args.agents} agents up in {setup_s:.1f} s, cluster echo x{REPLICAS} "
                    f"serving; no faults for {args.soak:g} s",
                    flush=True,
                )
            deaths: list[str] = []
            deadline = time.monotonic() + args.soak
            while time.monotonic() < deadline:
                await asyncio.sleep(min(5.0, max(deadline - time.monotonic(), 0.0)))
                for node, child in stack.agents.items():
                    if child.popen.poll() is not None and node not in deaths:
                        deaths.append(node)
            end_ns = time.time_ns()
            events = [e for e in stack.events() if e.position > begin]
            beats = [
                e for e in stack.events("node.heartbeat.v1") if begin_ns <= e.recorded_at <= end_ns
            ]
            final_nodes = await stack.nodes()
            final = await stack.cluster("echo")
    verdicts = [
        {
            "node_id": payload(e)["node_id"],
            "state": payload(e)["state"],
            "reason": payload(e)["reason"],
            "detail": payload(e).get("detail", ""),
            "at_s": round(_s(e.recorded_at - begin_ns), 3),
        }
        for e in events
        if e.type == "node.health_changed.v1"
    ]
    replica_events = [e.type for e in events if e.type.startswith("replica.")]
    per_node: dict[str, list[int]] = defaultdict(list)
    for e in beats:
        per_node[payload(e)["node_id"]].append(e.recorded_at)
    gaps = {
        node: max((_s(b - a) for a, b in itertools.pairwise(times)), default=0.0)
        for node, times in per_node.items()
    }
    worst = max(gaps.items(), key=lambda kv: kv[1], default=("-", 0.0))
    return {
        "mode": "soak",
        "agents": args.agents,
        "seconds": args.soak,
        "setup_s": setup_s,
        "offline_verdicts": sum(1 for v in verdicts if v["state"] == "offline"),
        "health_verdicts": verdicts,
        "replica_events": replica_events,
        "agents_died": deaths,
        "heartbeats_recorded": len(beats),
        "heartbeats_expected": int(args.agents * args.soak),
        "max_heartbeat_gap_s": worst[1],
        "max_heartbeat_gap_node": worst[0],
        "nodes_healthy_at_end": sum(1 for n in final_nodes if n["health"] == "healthy"),
        "cluster_ready_at_end": final["ready"],
    }


def _print_soak(r: dict[str, Any]) -> None:
    print(
        f"offline verdicts: {r['offline_verdicts']} (target 0); other health changes: "
        f"{len(r['health_verdicts']) - r['offline_verdicts']}"
    )
    for v in r["health_verdicts"]:
        print(f"  +{v['at_s']:.1f}s {v['node_id']} -> {v['state']} ({v['reason']}: {v['detail']})")
    print(
        f"heartbeats recorded: {r['heartbeats_recorded']} (~{r['heartbeats_expected']} expected); "
        f"largest gap between two of one node: {r['max_heartbeat_gap_s']:.2f} s "
        f"({r['max_heartbeat_gap_node']}; offline needs 3 s)"
    )
    print(
        f"replica events during the soak: {len(r['replica_events'])} "
        f"{sorted(set(r['replica_events']))}; agents died: {r['agents_died'] or 'none'}; "
        f"at the end: {r['nodes_healthy_at_end']}/{r['agents']} nodes healthy, "
        f"echo {r['cluster_ready_at_end']}/{REPLICAS} ready"
    )


# -- client-side failover through a proxy ---------------------------------------------------

PROXIES = ("gateway", "nginx", "vllm-router")
WARMUP_S = 1.0  # the first second of load (connections opening) is left out of "before"
WINDOW_FALLBACK_S = 10.0  # the failover window when no replacement became ready
DEFAULT_PEERS_VENV = Path(tempfile.gettempdir()) / "gpumesh-peers-venv"


def _nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def _vllm_router_binary(args: argparse.Namespace) -> tuple[str | None, str]:
    """The vllm-router launcher, or None and why not."""
    venv = Path(args.peers_venv) if args.peers_venv else None
    if venv is not None and (venv / "bin" / "vllm-router").exists():
        return str(venv / "bin" / "vllm-router"), f"from {venv}"
    found = shutil.which("vllm-router")
    if found:
        return found, "on PATH"
    if not args.install_peers:
        return None, "not installed (give --peers-venv DIR or --install-peers)"
    venv = venv or DEFAULT_PEERS_VENV
    try:
        if not (venv / "bin" / "pip").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "vllm-router"],
            check=True,
            timeout=600,
            capture_output=True,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        tail = detail.decode(errors="replace").strip().splitlines()[-1:] if detail else []
        return None, f"pip install vllm-router failed: {exc} {' '.join(tail)}".strip()
    return str(venv / "bin" / "vllm-router"), f"installed into {venv}"


def _available(args: argparse.Namespace) -> dict[str, tuple[str | None, str]]:
    """Per proxy asked for: its binary (None: skip) and a note."""
    out: dict[str, tuple[str | None, str]] = {}
    for name in args.proxies:
        if name == "gateway":
            out[name] = (sys.executable, "python -m gpumesh gateway")
        elif name == "nginx":
            binary = _nginx_binary()
            out[name] = (binary, binary or "not on PATH (apt-get install nginx-light)")
        elif name == "vllm-router":
            out[name] = _vllm_router_binary(args)
    return out


NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi; uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
    upstream llm {{ {servers} keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://llm; proxy_http_version 1.1; proxy_set_header Connection "";
            proxy_next_upstream error timeout; proxy_buffering off;
        }}
    }}
}}
"""


def _start_nginx(stack: Stack, workdir: Path, binary: str, addresses: list[str]) -> _Proxy:
    port = _free_port()
    conf_dir = workdir / "nginx"
    conf_dir.mkdir(parents=True, exist_ok=True)
    servers = " ".join(f"server {a.removeprefix('http://')};" for a in addresses)
    conf = conf_dir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=conf_dir, servers=servers, port=port))
    argv = [binary, "-p", str(conf_dir), "-e", str(conf_dir / "error.log"), "-c", str(conf)]
    popen = _spawn(stack, argv, workdir / "nginx.log")
    detail = "1 worker, keepalive 64, proxy_next_upstream error timeout (the peers' config)"
    return _Proxy("nginx", f"http://127.0.0.1:{port}", popen, conf_dir / "error.log", detail)


def _start_vllm_router(stack: Stack, workdir: Path, binary: str, addresses: list[str]) -> _Proxy:
    port = _free_port()
    log = workdir / "vllm-router.log"
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
    argv += ["--worker-urls", *addresses]
    popen = _spawn(stack, argv, log)
    detail = "round_robin, other settings default (retries 5, breaker 10 failures / 60 s)"
    return _Proxy("vllm-router", f"http://127.0.0.1:{port}", popen, log, detail)


def _cpu_sample(proxy_pid: int) -> tuple[float, float, float]:
    """(monotonic s, the machine's busy CPU s, the proxy's CPU s over its process tree)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # less idle and iowait
    parents: dict[int, int] = {}
    cpu: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rindex(b")") + 2 :].split()
        parents[int(name)] = int(rest[1])
        cpu[int(name)] = int(rest[11]) + int(rest[12])  # utime + stime
    tree, grew = {proxy_pid}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return time.monotonic(), busy / tick, sum(cpu.get(pid, 0) for pid in tree) / tick


def _cpu_used(
    start: tuple[float, float, float], end: tuple[float, float, float], requests: int
) -> dict[str, float]:
    elapsed = max(end[0] - start[0], 1e-9)
    proxy = end[2] - start[2]
    return {
        "box_cores": round((end[1] - start[1]) / elapsed, 2),
        "proxy_cores": round(proxy / elapsed, 2),
        "proxy_us_per_request": round(proxy / max(requests, 1) * 1e6, 1),
    }


def _window(records: list[dict[str, Any]], start_ns: int, end_ns: int) -> dict[str, Any]:
    """The requests that overlap [start, end) (ended after `start`, started before `end`), so
    that one in flight at the kill counts in the failover window, never before it. The
    windows below are cut so that each request falls in exactly one."""
    inside = [r for r in records if r["end_ns"] > start_ns and r["start_ns"] < end_ns]
    ok = [r for r in inside if _ok(r)]
    lat = [r["latency_s"] * 1000 for r in ok]
    ttft = [r["first_token_s"] * 1000 for r in ok if r["stream"] and r["first_token_s"]]
    span = max((end_ns - start_ns) / 1e9, 1e-9)
    return {
        "span_s": round(span, 3),
        "requests": len(inside),
        "succeeded": len(ok),
        "succeeded_per_s": round(len(ok) / span, 1),
        "p50_ms": _pct(lat, 0.50),
        "p99_ms": _pct(lat, 0.99),
        "max_ms": max(lat, default=None),
        "stream_ttft_p99_ms": _pct(ttft, 0.99),
    }


def _fate(r: dict[str, Any] | None) -> str:
    if r is None:
        return "unknown (id not seen by the client)"
    if _ok(r):
        return "answered"
    if r["status"] != 200:
        return f"failed before the first byte ({r['status'] or r['error'].split(':')[0]})"
    if not r["stream"]:
        return "truncated body"
    return "cut, SSE error event" if r["error_event"] else "cut silently"


def _analyse(
    header: dict[str, int],
    records: list[dict[str, Any]],
    traces: dict[int, dict[str, Any]],
    killed: Killed,
    victim_port: int,
    window_end_ns: int,
) -> dict[str, Any]:
    kill = killed.at_ns
    ok = [r for r in records if _ok(r)]
    early = [r for r in records if r["status"] != 200]
    streams_cut = [r for r in records if r["stream"] and r["status"] == 200 and not _ok(r)]
    truncated = [r for r in records if not r["stream"] and r["status"] == 200 and not _ok(r)]
    by_id = {r["id"]: r for r in records}
    # What the killed replica had begun and not finished when it died: its trace's starts
    # without an end. (Not "started before kill.at_ns": the agent's process group is killed
    # first, so a request may still reach the workload in the millisecond after that stamp.)
    victim_pids = {w.pid for w in killed.workloads}
    in_flight: list[str] = []
    for pid, trace in traces.items():
        if pid in victim_pids:
            in_flight += [rid for rid in trace["starts"] if rid not in trace["ends"]]
    fates: dict[str, int] = defaultdict(int)
    for rid in in_flight:
        fates[_fate(by_id.get(rid))] += 1
    kinds: dict[str, int] = defaultdict(int)
    for r in early:
        kinds[str(r["status"]) if r["status"] else r["error"].split(":")[0]] += 1

    def rel(rs: list[dict[str, Any]], key: str) -> list[float]:
        return [round((r[key] - kill) / 1e9, 3) for r in rs]

    return {
        "load_s": round((header["ended_ns"] - header["started_ns"]) / 1e9, 2),
        "sent": len(records),
        "sent_streaming": sum(1 for r in records if r["stream"]),
        "succeeded": len(ok),
        "failed_before_first_byte": len(early),
        "failed_before_first_byte_kinds": dict(kinds),
        "failed_before_first_byte_in_flight": len({r["id"] for r in early} & set(in_flight)),
        "failed_before_first_byte_reached_no_replica": len(
            {r["id"] for r in early} - {rid for t in traces.values() for rid in t["starts"]}
        ),
        "failed_before_first_byte_start_rel_kill_s": rel(early, "start_ns"),
        "streams_cut": len(streams_cut),
        "streams_cut_error_event": sum(1 for r in streams_cut if r["error_event"]),
        "streams_cut_silent": sum(1 for r in streams_cut if not r["error_event"]),
        "streams_cut_before_first_token": sum(1 for r in streams_cut if r["chunks"] == 0),
        "streams_cut_on_killed_replica": sum(1 for r in streams_cut if r["replica"] == victim_port),
        "streams_cut_start_rel_kill_s": rel(streams_cut, "start_ns"),
        "non_streaming_truncated": len(truncated),
        "in_flight_on_killed_replica": len(in_flight),
        "in_flight_fates": dict(fates),
        "served_by_killed_replica_after_kill": sum(
            1 for r in ok if r["replica"] == victim_port and r["end_ns"] > kill + 50_000_000
        ),
        "unmarked_answers": sum(1 for r in ok if r["replica"] is None),
        "examples": [
            {k: r[k] for k in ("id", "stream", "status", "error", "chunks", "replica", "tail")}
            for r in (early + streams_cut + truncated)[:6]
        ],
        # before: ended between the warm-up and the kill; failover: in flight at the kill or
        # started before the window's end; after: started after it.
        "window_before": _window(
            [r for r in records if r["end_ns"] <= kill],
            header["started_ns"] + int(WARMUP_S * 1e9),
            kill,
        ),
        "window_failover": _window(records, kill, window_end_ns),
        "window_after": _window(
            [r for r in records if r["start_ns"] >= window_end_ns],
            window_end_ns,
            header["ended_ns"],
        ),
    }


async def _proxied_run(
    name: str, binary: str, workdir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    trace_dir = workdir / "traces"
    # Workloads advertised at their own ports: nginx and vllm-router take host:port upstreams,
    # and every proxy is then measured against the same replicas (no node front in the way).
    # A controller outage is measured through the nodes' fences, which are what it tests.
    fence = [] if args.controller_down > 0 else ["--no-direct-fence"]
    async with Stack(workdir / "stack", agents=args.agents, agent_args=fence) as stack:
        await stack.create_cluster(_traced_spec(trace_dir))
        cluster = await _serving(stack, REPLICAS)
        replicas = cluster["replicas"]
        per_node: dict[str, int] = defaultdict(int)
        for r in replicas:
            per_node[r["node_id"]] += 1
        victim = next((r for r in replicas if per_node[r["node_id"]] == 1), replicas[0])
        # host:port, or host:port/replica/<id>/<epoch> behind a node's fencing front
        victim_port = int(victim["address"].rsplit(":", 1)[1].split("/", 1)[0])
        addresses = [r["address"] for r in replicas]
        if name == "gateway":
            proxy = _start_gateway(stack, workdir, binary)
        elif name == "nginx":
            proxy = _start_nginx(stack, workdir, binary, addresses)
        else:
            proxy = _start_vllm_router(stack, workdir, binary, addresses)
        try:
            await _proxy_answers(proxy)
            out = workdir / "load.jsonl"
            start_at = time.time_ns() + 1_500_000_000  # the client process's imports
            argv = [sys.executable, str(HELPER), "load", "--url", proxy.url]
            argv += ["--clients", str(args.clients), "--seconds", f"{args.seconds:g}"]
            argv += ["--timeout", f"{CLIENT_TIMEOUT_S:g}", "--start-at", str(start_at)]
            argv += ["--out", str(out)]
            load = _spawn(stack, argv, workdir / "load.log")
            await _sleep_until(start_at)
            cpu_start = _cpu_sample(proxy.popen.pid)
            await _sleep_until(start_at + int(args.kill_at * 1e9))
            back_ns = 0
            if args.controller_down > 0:
                # The controller, not a node: SIGKILL it, and start it again after the outage.
                at = await stack.kill_controller()
                killed = Killed(node_id="controller", at_ns=at, agent_pid=0, workloads=())
                await _sleep_until(at + int(args.controller_down * 1e9))
                back_ns = time.time_ns()
                await stack.start_controller()
            else:
                killed = await stack.kill_agent(victim["node_id"], with_workloads=True)
            await _sleep_until(start_at + int(args.seconds * 1e9))
            cpu_end = _cpu_sample(proxy.popen.pid)
            code = await asyncio.to_thread(load.wait, CLIENT_TIMEOUT_S + 60)
            if code != 0:
                raise RuntimeError(
                    f"the load exited {code}: {Stack.log_tail(workdir / 'load.log')}"
                )
            metrics = await _scrape(proxy.url) if name == "gateway" else ""
        finally:
            proxy.stop()
        if args.controller_down > 0:
            header, records = read_load(workdir / "load.jsonl")
            return _controller_outage(proxy, args, stack, header, records, killed.at_ns, back_ns)
        rid, epoch = victim["replica_id"], victim["epoch"]
        offline = next(
            iter(
                stack.events("node.health_changed.v1", node_id=victim["node_id"], state="offline")
            ),
            None,
        )
        try:
            ready = await stack.wait_for_event(
                "replica.ready.v1", replica_id=rid, epoch=epoch + 1, timeout=30
            )
        except AssertionError:
            ready = None
        suspected = stack.events("replica.suspected.v1")
    header, records = read_load(workdir / "load.jsonl")
    traces = read_traces(trace_dir)
    kill = killed.at_ns
    window_end = ready.recorded_at if ready is not None else kill + int(WINDOW_FALLBACK_S * 1e9)
    window_end = min(window_end, header["ended_ns"])
    result: dict[str, Any] = {
        "proxy": name,
        "proxy_setup": proxy.detail,
        "clients": args.clients,
        "seconds": args.seconds,
        "kill_at_s": round((kill - header["started_ns"]) / 1e9, 3),
        "victim_node": victim["node_id"],
        "victim_replica": rid,
        "victim_port": victim_port,
        "replicas_killed": len(killed.workloads),
        "detection_s": _s(offline.recorded_at - kill) if offline else None,
        "replacement_s": _s(ready.recorded_at - kill) if ready else None,
        "window_end": "replacement ready"
        if ready is not None
        else f"kill + {WINDOW_FALLBACK_S:g} s",
        **_analyse(header, records, traces, killed, victim_port, window_end),
        "cpu": _cpu_used(cpu_start, cpu_end, len(records)),
        "suspected": [
            {
                "replica_id": payload(e)["replica_id"],
                "reason": payload(e)["reason"],
                "failures": payload(e).get("failures", 0),
                "at_s": round(_s(e.recorded_at - kill), 3),
            }
            for e in suspected
        ],
    }
    if name == "gateway":
        result["ejections"] = [
            {
                "replica": e.get("replica"),
                "reason": e.get("reason"),
                "failures": e.get("failures"),
                "at_s": round((e["at_ns"] - kill) / 1e9, 3),
            }
            for e in _log_events(proxy.log_path, "replica_ejected")
        ]
        result["gateway_metrics"] = _metric_sums(
            metrics,
            (
                "gpumesh_gateway_retries_total",
                "gpumesh_gateway_ejections_total",
                "gpumesh_gateway_stream_errors_total",
            ),
        )
    return result


def _controller_outage(
    proxy: _Proxy,
    args: argparse.Namespace,
    stack: Stack,
    header: dict[str, int],
    records: list[dict[str, Any]],
    kill_ns: int,
    back_ns: int,
) -> dict[str, Any]:
    """What clients saw while the controller was down and after it came back: the data
    plane must not notice (target: 0 failed before the first byte, no stream cut)."""
    down = [r for r in records if r["end_ns"] > kill_ns and r["start_ns"] < back_ns]
    after = [r for r in records if r["start_ns"] >= back_ns]

    def failures(rs: list[dict[str, Any]]) -> dict[str, int]:
        return {
            "sent": len(rs),
            "succeeded": sum(1 for r in rs if _ok(r)),
            "failed_before_first_byte": sum(1 for r in rs if r["status"] != 200),
            "streams_cut": sum(1 for r in rs if r["stream"] and r["status"] == 200 and not _ok(r)),
        }

    placed_again = [e for e in stack.events("replica.placed.v1") if payload(e)["epoch"] > 1]
    return {
        "proxy": proxy.name,
        "proxy_setup": proxy.detail,
        "failure": "controller SIGKILL",
        "clients": args.clients,
        "seconds": args.seconds,
        "kill_at_s": round((kill_ns - header["started_ns"]) / 1e9, 3),
        "controller_down_s": round((back_ns - kill_ns) / 1e9, 3),
        "while_down": failures(down) | _window(down, kill_ns, back_ns),
        "after_back": failures(after) | _window(after, back_ns, header["ended_ns"]),
        "all": failures(records),
        "offline_verdicts": len(stack.events("node.health_changed.v1", state="offline")),
        "replicas_placed_again": len(placed_again),
        "grace_events": len(stack.events("controller.grace.v1")),
    }


async def proxied(args: argparse.Namespace) -> dict[str, Any]:
    available = _available(args)
    runs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name in args.proxies:
        binary, note = available[name]
        if binary is None:
            skipped[name] = note
            if not args.json:
                print(f"{name}: skipped, {note}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpumesh-failover-proxies-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        for i in range(args.runs):  # interleaved, so that a slow spell hits every proxy alike
            for name in args.proxies:
                binary, note = available[name]
                if binary is None or name in skipped:
                    continue
                if not args.json:
                    print(f"{name}, run {i + 1}/{args.runs} ({note}):", flush=True)
                try:
                    run = await _proxied_run(name, binary, workdir / f"{name}-{i + 1}", args)
                except (RuntimeError, AssertionError, subprocess.TimeoutExpired) as exc:
                    skipped[name] = f"failed: {str(exc).splitlines()[0]}"
                    if not args.json:
                        print(f"  {skipped[name]}", flush=True)
                    continue
                run["run"] = i + 1
                runs.append(run)
                if not args.json:
                    _print_proxied(run)
    return {
        "mode": "proxied",
        "clients": args.clients,
        "streaming_clients": round(args.clients / 2),
        "seconds": args.seconds,
        "kill_at_s": args.kill_at,
        "agents": args.agents,
        "replicas": REPLICAS,
        "workload": f"echo {' '.join(PACE)}, {WORDS}-word prompts",
        "runs": runs,
        "summary": _summarise(runs),
        "skipped": skipped,
    }


async def controller_outages(args: argparse.Namespace) -> dict[str, Any]:
    """`--controller-down S`: through the gateway only (the nodes' fences answer for it)."""
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpumesh-controller-outage-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        for i in range(args.runs):
            run = await _proxied_run("gateway", sys.executable, workdir / f"run-{i + 1}", args)
            run["run"] = i + 1
            runs.append(run)
            if not args.json:
                _print_outage(run)
    return {"mode": "controller-outage", "agents": args.agents, "replicas": REPLICAS, "runs": runs}


def _print_outage(run: dict[str, Any]) -> None:
    print(
        f"  run {run['run']}: {run['clients']} clients (half streaming), controller SIGKILLed at "
        f"{run['kill_at_s']:g} s, back after {run['controller_down_s']:g} s"
    )
    for label, key in (("while down", "while_down"), ("after back", "after_back")):
        w = run[key]
        print(
            f"    {label:<10}  {w['sent']:>6} sent  {w['succeeded']:>6} ok  "
            f"failed before first byte {w['failed_before_first_byte']} (target 0)  "
            f"streams cut {w['streams_cut']}  p50 {_ms(w['p50_ms'])}  p99 {_ms(w['p99_ms'])}"
        )
    print(
        f"    offline verdicts {run['offline_verdicts']}, replicas placed again "
        f"{run['replicas_placed_again']}, grace events {run['grace_events']}"
    )


def _summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per proxy: each run's counts side by side, medians of the rates and latencies."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["proxy"] for r in runs):
        mine = [r for r in runs if r["proxy"] == name]

        def each(key: str, rs: list[dict[str, Any]] = mine) -> list[Any]:
            return [r[key] for r in rs]

        def med(values: list[float | None]) -> float | None:
            kept = [v for v in values if v is not None]
            return statistics.median(kept) if kept else None

        out[name] = {
            "runs": len(mine),
            "sent": each("sent"),
            "succeeded": each("succeeded"),
            "failed_before_first_byte": each("failed_before_first_byte"),
            "streams_cut_error_event": each("streams_cut_error_event"),
            "streams_cut_silent": each("streams_cut_silent"),
            "in_flight_on_killed_replica": each("in_flight_on_killed_replica"),
            "p99_before_ms": med([r["window_before"]["p99_ms"] for r in mine]),
            "p99_failover_ms": med([r["window_failover"]["p99_ms"] for r in mine]),
            "p50_before_ms": med([r["window_before"]["p50_ms"] for r in mine]),
            "p50_failover_ms": med([r["window_failover"]["p50_ms"] for r in mine]),
            "failover_window_s": med([r["window_failover"]["span_s"] for r in mine]),
            "box_cores": med([r["cpu"]["box_cores"] for r in mine]),
            "proxy_cores": med([r["cpu"]["proxy_cores"] for r in mine]),
            "proxy_cpu_us_per_request": med([r["cpu"]["proxy_us_per_request"] for r in mine]),
            "ejection_s": [
                min((e["at_s"] for e in r.get("ejections", [])), default=None) for r in mine
            ],
        }
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _print_proxied(r: dict[str, Any]) -> None:
    b, f, a = r["window_before"], r["window_failover"], r["window_after"]
    ok = 100.0 * r["succeeded"] / max(r["sent"], 1)
    print(
        f"  sent {r['sent']:,} ({r['sent_streaming']:,} streaming) in {r['load_s']:.1f} s, "
        f"succeeded {r['succeeded']:,} ({ok:.2f} %)"
    )
    kinds = ", ".join(f"{n}x {k}" for k, n in r["failed_before_first_byte_kinds"].items())
    if kinds:
        held = r["failed_before_first_byte_in_flight"]
        kinds += (
            f" ({held} in flight on the killed replica when it died, "
            f"{r['failed_before_first_byte_reached_no_replica']} reached no replica)"
        )
    print(
        f"  failed before the first byte: {r['failed_before_first_byte']} (target 0)"
        + (
            f": {kinds}; started {_span(r['failed_before_first_byte_start_rel_kill_s'])}"
            if kinds
            else ""
        )
    )
    print(
        f"  streams cut mid-answer: {r['streams_cut']} ({r['streams_cut_error_event']} with an "
        f"SSE error event, {r['streams_cut_silent']} silent; {r['streams_cut_before_first_token']} "
        f"before the first token; {r['streams_cut_on_killed_replica']} on the killed replica)"
        + (f", started {_span(r['streams_cut_start_rel_kill_s'])}" if r["streams_cut"] else "")
    )
    if r["non_streaming_truncated"]:
        print(f"  non-streaming answers truncated after a 200: {r['non_streaming_truncated']}")
    fates = ", ".join(f"{n} {k}" for k, n in sorted(r["in_flight_fates"].items()))
    print(
        f"  in flight on the killed replica ({r['victim_node']}, port {r['victim_port']}) at the "
        f"kill: {r['in_flight_on_killed_replica']}" + (f": {fates}" if fates else "")
    )
    print(
        f"  latency p50/p99 ms of the succeeded requests: ended before the kill "
        f"{_ms(b['p50_ms'])}/{_ms(b['p99_ms'])} ({b['succeeded_per_s']:.0f}/s); failover window "
        f"[kill, +{f['span_s']:.2f} s: {r['window_end']}] {_ms(f['p50_ms'])}/{_ms(f['p99_ms'])} "
        f"({f['succeeded_per_s']:.0f}/s, max {_ms(f['max_ms'])}); after {_ms(a['p50_ms'])}/"
        f"{_ms(a['p99_ms'])} ({a['succeeded_per_s']:.0f}/s)"
    )
    c = r["cpu"]
    print(
        f"  CPU during the load: the machine {c['box_cores']:.2f} cores busy of "
        f"{os.cpu_count()}; {r['proxy']} {c['proxy_cores']:.2f} cores, "
        f"{c['proxy_us_per_request']:,.0f} µs per request (streams and not, together)"
    )
    det, rep = r["detection_s"], r["replacement_s"]
    print(
        f"  control plane: offline after {det:.2f} s, replacement ready after {rep:.2f} s"
        if det is not None and rep is not None
        else f"  control plane: offline {det}, replacement {rep}"
    )
    if r["proxy"] == "gateway":
        for e in r.get("ejections", []):
            print(
                f"  gateway ejected {e['replica']} at +{e['at_s']:.3f} s ({e['reason']}, "
                f"{e['failures']} failures)"
            )
        for e in r["suspected"]:
            print(
                f"  replica.suspected.v1 {e['replica_id']} recorded at +{e['at_s']:.3f} s "
                f"({e['reason']}, {e['failures']} failures)"
            )
        if not r["suspected"]:
            print("  replica.suspected.v1: none recorded")
        counters = []
        for key, value in sorted(r.get("gateway_metrics", {}).items()):
            name, _, reason = key.partition(":")
            short = name.removeprefix("gpumesh_gateway_").removesuffix("_total")
            counters.append(f"{short}{' ' + reason if reason else ''} {value:g}")
        if counters:
            print(f"  gateway counters: {', '.join(counters)}")
    for ex in r["examples"][:3]:
        print(
            f"  e.g. {ex['id']} stream={ex['stream']} status={ex['status']} {ex['error']!r} "
            f"chunks={ex['chunks']} tail={ex['tail'][-120:]!r}"
        )


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):+.2f}..{max(values):+.2f} s from the kill"


def _print_table(result: dict[str, Any]) -> None:
    summary = result["summary"]
    if not summary:
        return

    def per_run(values: list[Any]) -> str:
        return " / ".join(str(v) for v in values)

    print()
    print(
        f"{result['clients']} clients ({result['streaming_clients']} streaming), SIGKILL of 1 of "
        f"{REPLICAS} replicas at {result['kill_at_s']:g} s of {result['seconds']:g} s; counts are "
        "per run, latencies the median over runs"
    )
    print(
        "| proxy | sent | succeeded | failed before 1st byte (target 0) | streams cut with "
        "an error event | streams cut silently | in flight on the killed replica | "
        "p99 before | p99 failover window | proxy CPU per request | box busy |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, s in summary.items():
        sent = statistics.median(s["sent"])
        rates = [100.0 * o / max(n, 1) for o, n in zip(s["succeeded"], s["sent"], strict=True)]
        ok = statistics.median(rates)
        print(
            f"| {name} | {sent:,.0f} | {ok:.2f} % | {per_run(s['failed_before_first_byte'])} | "
            f"{per_run(s['streams_cut_error_event'])} | {per_run(s['streams_cut_silent'])} | "
            f"{per_run(s['in_flight_on_killed_replica'])} | {_ms(s['p99_before_ms'])} ms | "
            f"{_ms(s['p99_failover_ms'])} ms | {_us(s['proxy_cpu_us_per_request'])} | "
            f"{s['box_cores']:.2f} cores |"
        )
    for name, why in result["skipped"].items():
        print(f"| {name} | skipped: {why} | | | | | | | | | |")
    gateway = summary.get("gateway")
    if gateway:
        times = ", ".join(
            "-" if t is None else f"+{t * 1000:.0f} ms" for t in gateway["ejection_s"]
        )
        print(f"gateway: dead replica ejected after {times} (kill -> `replica_ejected`)")


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} µs"


def _ha_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`--classes`: exit 1 when a target is missed (not with --quick: its figures are not
    comparable, it checks that the code runs)."""
    named = [c.strip() for c in args.classes.split(",") if c.strip()]
    classes = list(_failover_ha.CLASSES) if named == ["all"] else named
    if args.quick and named == ["all"]:
        classes = ["controller-stop"]
    unknown = sorted(set(classes) - set(_failover_ha.CLASSES))
    if unknown or not classes:
        parser.error(f"--classes: unknown {', '.join(unknown) or '(none)'}")
    if not 0 < args.fault_at < args.class_seconds:
        parser.error("--fault-at must fall inside --class-seconds")
    settings = _failover_ha.Settings(
        classes=classes,
        runs=args.runs or 3,
        clients=args.clients or 64,
        class_seconds=args.class_seconds,
        fault_at=args.fault_at,
        hold=args.hold,
        json=args.json,
        keep=args.keep,
        controller_log=args.event_log or _failover_ha.controller_log_option(),
    )
    result = mark(args, asyncio.run(_failover_ha.ha_failover(settings)))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _failover_ha_report.print_table(result)
    _plot(args, result)
    return 0 if args.quick or _failover_ha_report.met(result) else 1


def _plot(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """`--plot FILE`: the result's PNG; where its mode has none, one line saying so."""
    if args.plot is None:
        return
    try:
        plot_result(result, args.plot)
    except ValueError as exc:
        print(f"--plot: {exc}", file=sys.stderr)
        return
    print(f"plot in {args.plot}", file=sys.stderr)


def _plot_from_json(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`--from-json FILE --plot PNG`: a saved `--json` result drawn, nothing run."""
    if args.plot is None:
        parser.error("--from-json needs --plot FILE.png")
    try:
        result = json.loads(Path(args.from_json).read_text())
        plot_result(result, args.plot)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"--from-json {args.from_json}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"plot in {args.plot}", file=sys.stderr)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=int, default=None, help="failover runs (default 5; 1 with --clients)"
    )
    parser.add_argument("--agents", type=int, default=None, help="default 4, or 20 with --soak")
    parser.add_argument("--soak", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--seed", type=int, default=1, help="for the pause before each kill")
    parser.add_argument(
        "--keep", metavar="DIR", help="keep the stacks' data and logs in this directory"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="also draw the figures as a PNG (needs matplotlib: pip install 'gpumesh[plot]')",
    )
    parser.add_argument(
        "--from-json",
        metavar="FILE",
        help="with --plot: draw a result saved with --json instead of running anything",
    )
    proxied_mode = parser.add_argument_group("client-side failover through a proxy")
    proxied_mode.add_argument(
        "--clients", type=int, default=0, help="concurrent clients, half streaming (turns it on)"
    )
    proxied_mode.add_argument("--seconds", type=float, default=20.0, help="load (default 20)")
    proxied_mode.add_argument(
        "--kill-at", type=float, default=5.0, help="s into the load (default 5)"
    )
    proxied_mode.add_argument(
        "--controller-down",
        type=float,
        default=0.0,
        metavar="S",
        help="kill the controller (not a node) at --kill-at, and start it again S s later",
    )
    proxied_mode.add_argument(
        "--proxies",
        default=",".join(PROXIES),
        help=f"comma-separated, of {', '.join(PROXIES)} (default all)",
    )
    proxied_mode.add_argument(
        "--peers-venv", metavar="DIR", help="a virtual environment with vllm-router installed"
    )
    proxied_mode.add_argument(
        "--install-peers",
        action="store_true",
        help=f"pip install vllm-router into --peers-venv (default {DEFAULT_PEERS_VENV})",
    )
    ha_mode = parser.add_argument_group("the control plane's failover, per failure class")
    ha_mode.add_argument(
        "--classes",
        default="",
        help=f"`all` or a comma-separated list of {', '.join(_failover_ha.CLASSES)} (turns it "
        "on; --clients defaults to 64, --runs to 3)",
    )
    ha_mode.add_argument(
        "--class-seconds", type=float, default=20.0, help="load per class (default 20)"
    )
    ha_mode.add_argument(
        "--fault-at", type=float, default=3.0, help="s into a class's load (default 3)"
    )
    ha_mode.add_argument(
        "--hold",
        type=float,
        default=8.0,
        help="the killed process is started again (the stopped one continued) this long after "
        "the fault, or 1 s after a controller accepted `cluster scale` if later (default 8)",
    )
    ha_mode.add_argument(
        "--event-log",
        choices=("sqlite", "jetstream"),
        default=None,
        help="the controllers' log: jetstream (each its own data directory) where `gpumesh "
        "controller` has --event-log, else sqlite (one file in a data directory they share)",
    )
    sharded_mode = parser.add_argument_group("a sharded group's failover")
    sharded_mode.add_argument(
        "--sharded",
        action="store_true",
        help="2 groups of 2 pipeline stages on 5 agents (turns it on; --clients defaults to 16, "
        "--runs to 3 per victim)",
    )
    sharded_mode.add_argument(
        "--victim",
        choices=("worker", "head", "both"),
        default="both",
        help="whose node is killed: a group's worker stage, its head, or each in turn",
    )
    sharded_mode.add_argument(
        "--worker-probe", choices=("tcp", "http", "none"), default="tcp", help="default tcp"
    )
    sharded_mode.add_argument(
        "--head-needs-workers",
        action="store_true",
        help="the head fails its requests (503, streams cut) once a worker's port refuses, as "
        "a real pipeline's does; default: the plain echo, which does not need its worker",
    )
    add_quick(
        parser,
        "--runs 1, --agents 4 in every mode, --seconds 3 --kill-at 1.5; with --classes: "
        "controller-stop only, --class-seconds 7 --fault-at 1.5 --hold 4",
    )
    args = parser.parse_args()
    if args.plot is not None:
        from sim.plot import PlotUnavailable, pyplot

        try:
            pyplot()  # before any run: without matplotlib, one line and nothing run
        except PlotUnavailable as exc:
            print(exc, file=sys.stderr)
            return 2
    if args.from_json:
        return _plot_from_json(parser, args)
    apply_quick(parser, args, **QUICK)
    configure_logging(level="warning", json=False, stream=sys.stderr)
    announce(args, json_output=args.json)
    if args.classes:
        return _ha_main(parser, args)
    if args.sharded:
        return _failover_sharded.main(parser, args)
    if args.clients > 0 and args.controller_down > 0:
        args.agents = args.agents or 3
        args.runs = args.runs or 1
        if args.kill_at + args.controller_down >= args.seconds:
            parser.error("--kill-at + --controller-down must fall inside --seconds")
        result = mark(args, asyncio.run(controller_outages(args)))
        if args.json:
            print(json.dumps(result, indent=2))
        _plot(args, result)
        met = all(
            r["all"]["failed_before_first_byte"] == 0 and r["all"]["streams_cut"] == 0
            for r in result["runs"]
        )
        return 0 if met else 1
    if args.clients > 0:
        args.agents = args.agents or 4
        args.runs = args.runs or 1
        args.proxies = [p.strip() for p in args.proxies.split(",") if p.strip()]
        unknown = sorted(set(args.proxies) - set(PROXIES))
        if unknown:
            parser.error(f"--proxies: unknown {', '.join(unknown)}")
        if not 0 < args.kill_at < args.seconds:
            parser.error("--kill-at must fall inside --seconds")
        result = mark(args, asyncio.run(proxied(args)))
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            _print_table(result)
        _plot(args, result)
        gateway = next((r for r in result["runs"] if r["proxy"] == "gateway"), None)
        met = gateway is None or (
            gateway["failed_before_first_byte"] == 0 and gateway["streams_cut_silent"] == 0
        )
        return 0 if met else 1
    if args.soak > 0:
        args.agents = args.agents or 20
        result = mark(args, asyncio.run(soak(args)))
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            _print_soak(result)
        _plot(args, result)
        return 0 if result["offline_verdicts"] == 0 else 1
    args.agents = args.agents or 4
    args.runs = args.runs or 5
    if not args.json:
        _print_header(args.agents)
    result = mark(args, asyncio.run(failover(args)))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_summary(result)
    _plot(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
