"""`bench/failover.py --sharded`: a sharded group loses one of its nodes under load (issue 18).

    python bench/failover.py --sharded [--runs 3] [--clients 16] [--seconds 30] [--kill-at 5]
            [--victim worker|head|both] [--worker-probe tcp|http|none] [--head-needs-workers]
            [--keep DIR] [--json]

Per run a fresh real stack (tests/integration/stack.py): nats-server, the controller, 5 agents
with one fake 24 GiB GPU each (21.6 GiB usable), and cluster `echo` of 2 replicas whose
`[sharding]` section (30 GiB of weights, 32 layers, pipeline allowed) no single GPU holds: each
replica is a group of 2 pipeline stages on 2 nodes (docs/sharding.md), 4 nodes in all, one
spare. Head and worker both run the paced, traced echo workload of the other --clients modes
(bench/_failover_clients.py workload: 20 ms to the first token, 200 tokens/s, every request
traced per process); the worker is probed as --worker-probe says (default tcp, the llama.cpp
RPC case). Then the gateway (`gpumesh gateway` on the stack's NATS, defaults) and N closed-loop
clients through it (half streaming, no retries, 10 s timeout). At --kill-at s, SIGKILL the
agent of the node holding one group's WORKER stage (--victim worker) or its HEAD (--victim
head), and its workloads' process groups (`Stack.kill_agent`); `both` (the default) runs each
variant --runs times, the groups taken in turn.

From the event log's recorded_at, relative to the kill:
    detection     the victim node's node.health_changed(offline)
    failed        the group's replica.failed at epoch 1
    placed        its replica.placed at epoch 2 (both stages, one event)
    worker up     its replica.stage_ready at epoch 2
    serving       its replica.ready at epoch 2 (the head ready: routable again)
From the clients: requests failed before their first byte (target 0: the other group serves),
streams cut mid-way with and without the gateway's SSE `event: error`, and from the traces the
requests the broken group's head still began after the kill: an echo head does not need its
worker, so it answers until the group is failed and stopped, where a real pipeline's head would
fail them (or die) at once. --head-needs-workers runs such a head (`_serve_head` below: every
50 ms it connects to its workers' ports; once one refuses, it cuts its requests in flight and
answers 503 to the rest, /health included), so that the clients see what a broken pipeline does.

Checked at the end of each run: the group serves at epoch 2 on 2 nodes without the victim, no
process of its epoch 1 is left (the surviving stage was stopped), the other group never moved.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aiohttp import web  # noqa: E402

from bench._failover_clients import (  # noqa: E402
    MARK_HEADER,
    _MarkedEcho,
    _tracer,
    read_load,
    read_traces,
)
from bench._failover_common import (  # noqa: E402
    CLIENT_TIMEOUT_S,
    HELPER,
    PACE,
    _log_events,
    _metric_sums,
    _ok,
    _pct,
    _proxy_answers,
    _scrape,
    _sleep_until,
    _spawn,
    _start_gateway,
    plot_result,
)
from bench._quick import mark  # noqa: E402
from nodeagent.workload import echo  # noqa: E402
from tests.integration.stack import Stack, payload, pid_alive  # noqa: E402

AGENTS = 5
GPU = "RTX4090:24GiB:1"  # 21.6 GiB usable: 30 GiB needs 2 of them, on 2 nodes
GROUPS = 2
CLUSTER = "echo"
# The stack's agents take the regions in turn (tests/integration/stack.py), all on one machine.
SHARDING = {"weights_gib": 30, "layers": 32, "parallelism": ["pipeline"], "cross_region": True}
VICTIMS = ("worker", "head")
DEFAULTS = {"runs": 3, "clients": 16}


def sharded_spec(trace_dir: Path, worker_probe: str, coupled: bool = False) -> dict[str, Any]:
    """2 groups of 2 stages, head and worker both the traced, paced echo workload; `coupled`:
    the head is this module's `head` (it fails without its workers, see `_serve_head`)."""
    argv = [sys.executable, str(HELPER), "workload", "--port", "{port}", "--model", "{model}"]
    argv += [*PACE, "--trace-dir", str(trace_dir)]
    sharding: dict[str, Any] = {**SHARDING, "worker_probe": worker_probe}
    command = shlex.join(argv)
    if coupled:
        sharding["worker_command"] = command
        head = [sys.executable, str(Path(__file__).resolve()), "head", *argv[3:]]
        command = shlex.join([*head, "--peers", "{peers}"])
    return {
        "name": CLUSTER,
        "model": CLUSTER,
        "replicas": GROUPS,
        "command": command,
        "sharding": sharding,
    }


def _s(ns: int) -> float:
    return round(ns / 1e9, 3)


async def _groups_serving(stack: Stack, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """Per replica, its current replica.placed payload, once every group is ready, placed as 2
    stages, and exactly its 2 stage processes run (none of another epoch)."""

    async def check() -> dict[str, dict[str, Any]] | None:
        cluster = await stack.cluster(CLUSTER)
        replicas = cluster["replicas"]
        if cluster["ready"] != GROUPS or any(r["status"] != "ready" for r in replicas):
            return None
        placed: dict[str, dict[str, Any]] = {}
        for e in stack.events("replica.placed.v1"):
            placed[payload(e)["replica_id"]] = payload(e)
        wanted: collections.Counter[tuple[str, int]] = collections.Counter()
        for r in replicas:
            p = placed.get(r["replica_id"])
            if p is None or p["epoch"] != r["epoch"] or len(p.get("stages", ())) != 2:
                return None
            wanted[(r["replica_id"], r["epoch"])] = 2
        running = collections.Counter((w.replica_id, w.epoch) for w in stack.workloads())
        if running != wanted:
            return None
        return {r["replica_id"]: placed[r["replica_id"]] for r in replicas}

    return await stack.wait_until(check, timeout=timeout, why=f"{GROUPS} groups of 2 serving")


async def one_run(index: int, role: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    trace_dir = workdir / "traces"
    async with Stack(workdir / "stack", agents=AGENTS, fake_gpus=GPU) as stack:
        await stack.create_cluster(
            sharded_spec(trace_dir, args.worker_probe, args.head_needs_workers)
        )
        groups = await _groups_serving(stack)
        rid = sorted(groups)[index % GROUPS]
        other = next(r for r in sorted(groups) if r != rid)
        stages = groups[rid]["stages"]
        head_node, worker_node = stages[0]["node_id"], stages[1]["node_id"]
        victim = worker_node if role == "worker" else head_node
        # The group's processes at epoch 1, by stage: the head's serves the clients.
        head_pids = {w.pid for w in stack.workloads(head_node) if w.replica_id == rid}
        group_pids = head_pids | {
            w.pid for w in stack.workloads(worker_node) if w.replica_id == rid
        }
        gateway = _start_gateway(stack, workdir, sys.executable)
        try:
            await _proxy_answers(gateway)
            out = workdir / "load.jsonl"
            start_at = time.time_ns() + 1_500_000_000  # the client process's imports
            argv = [sys.executable, str(HELPER), "load", "--url", gateway.url]
            argv += ["--clients", str(args.clients), "--seconds", f"{args.seconds:g}"]
            argv += ["--timeout", f"{CLIENT_TIMEOUT_S:g}", "--start-at", str(start_at)]
            argv += ["--out", str(out)]
            load = _spawn(stack, argv, workdir / "load.log")
            await _sleep_until(start_at + int(args.kill_at * 1e9))
            killed = await stack.kill_agent(victim, with_workloads=True)
            await _sleep_until(start_at + int(args.seconds * 1e9))
            code = await asyncio.to_thread(load.wait, CLIENT_TIMEOUT_S + 60)
            if code != 0:
                raise RuntimeError(
                    f"the load exited {code}: {Stack.log_tail(workdir / 'load.log')}"
                )
            metrics = await _scrape(gateway.url)
        finally:
            gateway.stop()
        kill = killed.at_ns

        async def at(*types: str, **match: Any) -> int | None:
            try:
                e = await stack.wait_for_event(*types, timeout=30, **match)
            except AssertionError:
                return None
            return e.recorded_at - kill

        offline = await at("node.health_changed.v1", node_id=victim, state="offline")
        failed = await at("replica.failed.v1", replica_id=rid, epoch=1)
        placed = await at("replica.placed.v1", replica_id=rid, epoch=2)
        worker_up = await at("replica.stage_ready.v1", replica_id=rid, epoch=2)
        ready = await at("replica.ready.v1", replica_id=rid, epoch=2)
        failure = next(iter(stack.events("replica.failed.v1", replica_id=rid, epoch=1)), None)
        try:
            again = await _groups_serving(stack, timeout=30)
        except AssertionError as exc:  # reported as a failed check, the next run goes on
            print(f"  not serving again: {str(exc).splitlines()[0]}", file=sys.stderr)
            again = {}
        new_nodes = [s["node_id"] for s in again[rid]["stages"]] if again else []
        checks = {
            "serving_again_on_2_nodes_without_the_victim": victim not in new_nodes
            and len(set(new_nodes)) == 2,
            "no_process_of_epoch_1_left": not any(pid_alive(pid) for pid in group_pids),
            "other_group_untouched": bool(again)
            and again[other]["epoch"] == 1
            and not stack.events("replica.failed.v1", replica_id=other),
        }
    header, records = read_load(workdir / "load.jsonl")
    traces = read_traces(trace_dir)
    window_end = kill + ready if ready is not None else kill + int(10e9)
    return {
        "run": index + 1,
        "victim": role,
        "victim_node": victim,
        "group": rid,
        "stages_before": [head_node, worker_node],
        "stages_after": new_nodes,
        "kill_at_s": _s(kill - header["started_ns"]),
        "detection_s": _opt(offline),
        "failed_s": _opt(failed),
        "placed_s": _opt(placed),
        "worker_up_s": _opt(worker_up),
        "serving_s": _opt(ready),
        "failure": f"{payload(failure)['reason']}: {payload(failure).get('detail', '')}"
        if failure is not None
        else None,
        "checks": checks,
        **_clients(header, records, traces, kill, window_end, head_pids, group_pids),
        "ejections": [
            {
                "replica": e.get("replica"),
                "reason": e.get("reason"),
                "at_s": _s(e["at_ns"] - kill),
            }
            for e in _log_events(gateway.log_path, "replica_ejected")
        ],
        "gateway_metrics": _metric_sums(
            metrics,
            (
                "gpumesh_gateway_retries_total",
                "gpumesh_gateway_ejections_total",
                "gpumesh_gateway_stream_errors_total",
            ),
        ),
    }


def _opt(ns: int | None) -> float | None:
    return None if ns is None else _s(ns)


def _clients(
    header: dict[str, int],
    records: list[dict[str, Any]],
    traces: dict[int, dict[str, Any]],
    kill: int,
    window_end: int,
    head_pids: set[int],
    group_pids: set[int],
) -> dict[str, Any]:
    """What the clients saw, and what the broken group's head did after the kill."""
    by_id = {r["id"]: r for r in records}
    early = [r for r in records if r["status"] != 200]
    cut = [r for r in records if r["stream"] and r["status"] == 200 and not _ok(r)]
    truncated = [r for r in records if not r["stream"] and r["status"] == 200 and not _ok(r)]
    kinds: collections.Counter[str] = collections.Counter(
        str(r["status"]) if r["status"] else r["error"].split(":")[0] for r in early
    )
    # The head's trace: requests it began after the kill (it had lost its pipeline), the last
    # one, and those left without an end when it was killed or stopped.
    began_after = [
        ns
        for pid in head_pids
        if pid in traces
        for ns in traces[pid]["starts"].values()
        if ns > kill
    ]
    unfinished = [
        rid
        for pid in group_pids
        if pid in traces
        for rid in traces[pid]["starts"]
        if rid not in traces[pid]["ends"]
    ]
    fates: collections.Counter[str] = collections.Counter(
        _fate(by_id.get(rid)) for rid in unfinished
    )
    lat_before = [
        r["latency_s"] * 1000
        for r in records
        if _ok(r) and header["started_ns"] + 1_000_000_000 < r["end_ns"] <= kill
    ]
    lat_window = [
        r["latency_s"] * 1000
        for r in records
        if _ok(r) and r["end_ns"] > kill and r["start_ns"] < window_end
    ]
    return {
        "sent": len(records),
        "succeeded": sum(1 for r in records if _ok(r)),
        "failed_before_first_byte": len(early),
        "failed_before_first_byte_kinds": dict(kinds),
        "failed_before_first_byte_start_rel_kill_s": [_s(r["start_ns"] - kill) for r in early],
        "streams_cut": len(cut),
        "streams_cut_error_event": sum(1 for r in cut if r["error_event"]),
        "streams_cut_silent": sum(1 for r in cut if not r["error_event"]),
        "streams_cut_start_rel_kill_s": [_s(r["start_ns"] - kill) for r in cut],
        "non_streaming_truncated": len(truncated),
        "head_began_after_kill": len(began_after),
        "head_last_began_s": _s(max(began_after) - kill) if began_after else None,
        "unfinished_on_group": len(unfinished),
        "unfinished_fates": dict(fates),
        "p50_before_ms": _pct(lat_before, 0.50),
        "p99_before_ms": _pct(lat_before, 0.99),
        "p50_failover_ms": _pct(lat_window, 0.50),
        "p99_failover_ms": _pct(lat_window, 0.99),
        "examples": [
            {k: r[k] for k in ("id", "stream", "status", "error", "chunks", "tail")}
            for r in (early + cut + truncated)[:4]
        ],
    }


def _fate(r: dict[str, Any] | None) -> str:
    if r is None:
        return "unknown"
    if _ok(r):
        return "answered"
    if r["status"] != 200:
        return "failed before the first byte"
    if not r["stream"]:
        return "truncated body"
    return "cut, SSE error event" if r["error_event"] else "cut silently"


TIMES = ("detection_s", "failed_s", "placed_s", "worker_up_s", "serving_s")
COUNTS = (
    "sent",
    "failed_before_first_byte",
    "streams_cut_error_event",
    "streams_cut_silent",
    "head_began_after_kill",
)


def _summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for role in dict.fromkeys(r["victim"] for r in runs):
        mine = [r for r in runs if r["victim"] == role]
        entry: dict[str, Any] = {"runs": len(mine)}
        for key in TIMES:
            values = [r[key] for r in mine if r[key] is not None]
            entry[key] = {
                "each": [r[key] for r in mine],
                "median": round(statistics.median(values), 3) if values else None,
                "max": max(values, default=None),
            }
        for key in COUNTS:
            entry[key] = [r[key] for r in mine]
        entry["checks_failed"] = [name for r in mine for name, ok in r["checks"].items() if not ok]
        out[role] = entry
    return out


async def sharded(args: argparse.Namespace) -> dict[str, Any]:
    roles = list(VICTIMS) if args.victim == "both" else [args.victim]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpumesh-failover-sharded-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        for role in roles:
            for i in range(args.runs):
                if not args.json:
                    print(f"victim {role}, run {i + 1}/{args.runs}:", flush=True)
                run = await one_run(i, role, workdir / f"{role}-{i + 1}", args)
                runs.append(run)
                if not args.json:
                    _print_run(run)
    return {
        "mode": "sharded",
        "agents": AGENTS,
        "fake_gpu": GPU,
        "groups": GROUPS,
        "sharding": SHARDING,
        "worker_probe": args.worker_probe,
        "head_needs_workers": args.head_needs_workers,
        "clients": args.clients,
        "streaming_clients": round(args.clients / 2),
        "seconds": args.seconds,
        "kill_at_s": args.kill_at,
        "workload": f"echo {' '.join(PACE)} (head and worker)"
        + (", the head failing without its workers" if args.head_needs_workers else ""),
        "runs": runs,
        "summary": _summary(runs),
    }


def _t(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _print_run(r: dict[str, Any]) -> None:
    print(
        f"  killed {r['victim_node']} ({r['victim']} of {r['group']}, stages "
        f"{'+'.join(r['stages_before'])} -> {'+'.join(r['stages_after'])}) at "
        f"{r['kill_at_s']:.1f} s: offline {_t(r['detection_s'])}, group failed "
        f"{_t(r['failed_s'])}, placed again {_t(r['placed_s'])}, worker up "
        f"{_t(r['worker_up_s'])}, serving {_t(r['serving_s'])}"
    )
    print(f"  failure recorded: {r['failure']}")
    kinds = ", ".join(f"{n}x {k}" for k, n in r["failed_before_first_byte_kinds"].items())
    print(
        f"  {r['sent']:,} sent, {r['succeeded']:,} ok; failed before the first byte: "
        f"{r['failed_before_first_byte']} (target 0){': ' + kinds if kinds else ''}; streams "
        f"cut {r['streams_cut']} ({r['streams_cut_error_event']} with an SSE error event, "
        f"{r['streams_cut_silent']} silent); non-streaming truncated "
        f"{r['non_streaming_truncated']}"
    )
    fates = ", ".join(f"{n} {k}" for k, n in sorted(r["unfinished_fates"].items()))
    print(
        f"  the broken group's head began {r['head_began_after_kill']} requests after the kill "
        f"(last at {_t(r['head_last_began_s'])}); left unfinished on the group's processes: "
        f"{r['unfinished_on_group']}{': ' + fates if fates else ''}"
    )
    print(
        f"  latency p50/p99 ms: before the kill {_ms(r['p50_before_ms'])}/"
        f"{_ms(r['p99_before_ms'])}, kill -> serving again {_ms(r['p50_failover_ms'])}/"
        f"{_ms(r['p99_failover_ms'])}"
    )
    if r["ejections"]:
        first = min(e["at_s"] for e in r["ejections"])
        print(f"  gateway ejections: {len(r['ejections'])}, the first at +{first:.3f} s")
    counters = ", ".join(
        f"{k.removeprefix('gpumesh_gateway_').removesuffix('_total')} {v:g}"
        for k, v in sorted(r["gateway_metrics"].items())
    )
    if counters:
        print(f"  gateway counters: {counters}")
    bad = [name for name, ok in r["checks"].items() if not ok]
    print(f"  checks: {'all passed' if not bad else 'FAILED ' + ', '.join(bad)}", flush=True)
    for ex in r["examples"][:2]:
        print(
            f"  e.g. {ex['id']} stream={ex['stream']} status={ex['status']} {ex['error']!r} "
            f"chunks={ex['chunks']} tail={ex['tail'][-100:]!r}"
        )


def print_table(result: dict[str, Any]) -> None:
    print()
    print(
        f"{result['clients']} clients ({result['streaming_clients']} streaming) through the "
        f"gateway, {result['groups']} groups of 2 pipeline stages ({result['agents']} agents, one "
        f"fake {result['fake_gpu']} each, worker probe {result['worker_probe']}); SIGKILL at "
        f"{result['kill_at_s']:g} s of {result['seconds']:g} s; seconds from the kill, each run "
        "then the median"
    )
    print(
        "| victim | offline | group failed | placed again | worker up | serving again | "
        "failed before 1st byte (target 0) | streams cut, error event / silent | "
        "head began after the kill |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for role, s in result["summary"].items():

        def times(key: str, s: dict[str, Any] = s) -> str:
            each = " ".join("-" if v is None else f"{v:.2f}" for v in s[key]["each"])
            med = s[key]["median"]
            return f"{each} (**{'-' if med is None else f'{med:.2f}'}**)"

        cut = " ".join(
            f"{e}/{q}"
            for e, q in zip(s["streams_cut_error_event"], s["streams_cut_silent"], strict=True)
        )
        print(
            f"| {role} | {times('detection_s')} | {times('failed_s')} | {times('placed_s')} | "
            f"{times('worker_up_s')} | {times('serving_s')} | "
            f"{' '.join(map(str, s['failed_before_first_byte']))} | {cut} | "
            f"{' '.join(map(str, s['head_began_after_kill']))} |"
        )
    sent = [r["sent"] for r in result["runs"]]
    if sent:
        print(f"requests per run: {min(sent):,}-{max(sent):,}")
    failed = {
        role: s["checks_failed"] for role, s in result["summary"].items() if s["checks_failed"]
    }
    if failed:
        print(f"CHECKS FAILED: {failed}")


def met(result: dict[str, Any]) -> bool:
    return all(
        r["failed_before_first_byte"] == 0
        and r["streams_cut_silent"] == 0
        and r["serving_s"] is not None
        and all(r["checks"].values())
        for r in result["runs"]
    )


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`--sharded`: exit 1 when a target is missed (not with --quick)."""
    args.runs = args.runs or DEFAULTS["runs"]
    args.clients = args.clients or DEFAULTS["clients"]
    if args.quick and args.victim == "both":
        args.victim = "worker"
    if not 0 < args.kill_at < args.seconds:
        parser.error("--kill-at must fall inside --seconds")
    result = mark(args, asyncio.run(sharded(args)))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    if args.plot is not None:
        try:
            plot_result(result, args.plot)
        except ValueError as exc:
            print(f"--plot: {exc}", file=sys.stderr)
    return 0 if args.quick or met(result) else 1


# -- `--head-needs-workers`: a head that cannot serve without its pipeline ------------------

PEER_CHECK_S = 0.05  # how often the head tries its workers' ports


def _needs_peers(peers: list[str], lost: list[str], inflight: dict[int, web.Request]) -> Any:
    @web.middleware
    async def guard(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if lost and (request.path.startswith("/v1/") or request.path == "/health"):
            return web.json_response(
                {"error": {"message": f"pipeline broken: {lost[0]}", "code": "stage_lost"}},
                status=503,
            )
        if not request.path.startswith("/v1/"):
            return await handler(request)
        inflight[id(request)] = request
        try:
            return await handler(request)
        finally:
            inflight.pop(id(request), None)

    return guard


async def _watch_peers(peers: list[str], lost: list[str], inflight: dict[int, web.Request]) -> None:
    """Until a worker's port refuses a connection: then `lost` says which, and every request
    in flight has its connection closed (a stream is cut, an answer not yet sent is reset)."""
    while True:
        for peer in peers:
            host, _, port = peer.rpartition(":")
            try:
                async with asyncio.timeout(1.0):
                    _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
                writer.close()
            except (OSError, TimeoutError) as exc:
                lost.append(f"stage {peer} unreachable ({type(exc).__name__})")
                print(f"head: {lost[0]}; failing {len(inflight)} in flight", flush=True)
                for request in list(inflight.values()):
                    if request.transport is not None:
                        request.transport.close()
                return
        await asyncio.sleep(PEER_CHECK_S)


async def _serve_head(args: argparse.Namespace) -> None:
    """The traced echo workload (bench/_failover_clients.py) as a pipeline's head that needs
    its workers, as a real engine's does (llama.cpp's RPC client, vLLM's pipeline): every
    PEER_CHECK_S it connects to each worker in --peers; once one refuses, it closes the
    connections of the requests in flight and answers 503 to every request and to /health
    from then on. The gateway retries a 503 elsewhere; the agent's liveness probe sees it."""
    peers = [p for p in args.peers.split(",") if p]
    path = os.path.join(args.trace_dir, f"replica-{args.port}-{os.getpid()}.trace")
    os.makedirs(args.trace_dir, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    settings = echo.EchoSettings(
        model=args.model, ttft_ms=args.ttft_ms, tokens_per_s=args.tokens_per_s
    )
    lost: list[str] = []
    inflight: dict[int, web.Request] = {}
    app = _MarkedEcho(settings, args.port).build()
    app.middlewares.append(_needs_peers(peers, lost, inflight))  # outside the trace: a 503
    app.middlewares.append(_tracer(fd))  # is no request the head began

    async def mark_port(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[MARK_HEADER] = str(args.port)

    app.on_response_prepare.append(mark_port)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    watcher = asyncio.create_task(_watch_peers(peers, lost, inflight))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"head: serving {args.model!r} on {args.host}:{args.port}, peers {peers}", flush=True)
    try:
        await stop.wait()
    finally:
        watcher.cancel()
        await runner.cleanup()
        os.close(fd)


def _head_main() -> int:
    parser = argparse.ArgumentParser(description="a pipeline head that needs its workers")
    commands = parser.add_subparsers(dest="command", required=True)
    head = commands.add_parser("head")
    echo.add_arguments(head)
    head.add_argument("--trace-dir", required=True)
    head.add_argument("--peers", default="", help="the workers' host:port, comma-separated")
    asyncio.run(_serve_head(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(_head_main())
