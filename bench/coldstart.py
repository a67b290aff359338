"""Scale from zero on real processes: how long a request held at zero replicas waits, and where
the time goes.

    python bench/coldstart.py [--runs 5] [--json] [--keep DIR]

One fresh stack on 127.0.0.1 (tests/integration/stack.py: nats-server, `gpumesh controller`, 2
agents with fake GPUs, the echo workload; the gateway process of bench/_failover_common.py in
front), and one cluster `echo` created through the control API with `replicas = 0` and

    [autoscale]
    min = 0, max = 2, up_window_s = 1, down_window_s = 3, scale_to_zero_after_s = 4,
    cold_start_timeout_s = 60

Then, --runs times: wait until the cluster is at zero (no replica wanted, none running, no
workload process, the gateway routing to none), send one chat completion through the gateway
(non-streaming) and time it on the client: sent -> response head -> whole answer. The gateway
holds the request on arrival ("held" below is the send: the hold begins a loopback hop later).
From the event log (the controller's `recorded_at`, the same wall clock as the send):

    held -> decision     the `cluster.scaled` event whose cause says "cold start"
    decision -> ready    its replica's `replica.ready` (split: -> replica.placed, ->
                         replica.starting (the agent launched it), -> ready (the echo process
                         answered /health))
    ready -> 1st byte    the routing update reaching the gateway, the request sent on, the answer
    held -> 1st byte     the cold start as the client sees it

plus the gateway's own figure (its gpumesh_gateway_cold_start_seconds histogram: from the start
of the hold to the replica's first byte). After each answer it waits for the scale back to zero
(a `cluster.scaled` event with cause "no request for ...") and for the replica's
`replica.stopped`, and prints how long after the answer each came; a run whose scale-back never
comes fails the bench (exit 1).

--quick: one run (the scale-back after it is still awaited), about 20 s in all.

A benchmark that prints figures (median and range over the runs), not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._failover_common import _metric_sums, _Proxy, _scrape, _start_gateway  # noqa: E402
from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from events.envelope import Envelope  # noqa: E402
from gpumesh.logconfig import configure_logging  # noqa: E402
from tests.integration.stack import Stack, echo_spec, payload  # noqa: E402

AGENTS = 2
CLUSTER = "echo"
AUTOSCALE: dict[str, float] = {
    "min": 0,
    "max": 2,
    "up_window_s": 1,
    "down_window_s": 3,
    "scale_to_zero_after_s": 4,
    "cold_start_timeout_s": 60,
}
COLD_CAUSE = "cold start"
ZERO_CAUSE = "no request for"
BODY = {"model": CLUSTER, "messages": [{"role": "user", "content": "wake up the echo cluster"}]}
COLD_METRIC = "gpumesh_gateway_cold_start_seconds"
ROUTED_METRIC = "gpumesh_gateway_in_flight_requests"  # one line per replica the gateway routes to
# The scale-back: the idle time and the window, plus the gateway's last report of the request
# (a second), plus slack for a loaded 2-core machine.
BACK_TIMEOUT_S = AUTOSCALE["scale_to_zero_after_s"] + AUTOSCALE["down_window_s"] + 20
QUICK: dict[str, Any] = {"runs": 1}

# The figures of a run, in seconds, as (key, label); every one has a median and a range.
FIGURES = (
    ("held_to_first_byte_s", "held -> first byte (the cold start)"),
    ("held_to_decision_s", "held -> scale decision recorded"),
    ("decision_to_ready_s", "decision -> replica ready"),
    ("ready_to_first_byte_s", "ready -> first byte"),
    ("decision_to_placed_s", "decision -> replica.placed"),
    ("placed_to_starting_s", "placed -> replica.starting (launched)"),
    ("starting_to_ready_s", "starting -> replica.ready (echo start)"),
    ("first_byte_to_whole_s", "first byte -> whole answer"),
    ("gateway_hold_to_first_byte_s", "the gateway's own: hold -> first byte"),
    ("answer_to_scaled_to_zero_s", "answer -> scaled to zero (recorded)"),
    ("answer_to_stopped_s", "answer -> replica.stopped"),
)


def _s(ns: int) -> float:
    return ns / 1e9


def _head(stack: Stack) -> int:
    events = stack.events()
    return events[-1].position if events else 0


async def _at_zero(stack: Stack, gateway: _Proxy) -> bool:
    """No replica wanted, none but stopped ones in the read model, no workload process, and the
    gateway routing to none."""
    cluster = await stack.cluster(CLUSTER)
    if cluster["desired"] != 0 or any(r["status"] != "stopped" for r in cluster["replicas"]):
        return False
    if stack.workloads():
        return False
    metrics = await _scrape(gateway.url)
    return bool(metrics) and f"\n{ROUTED_METRIC}{{" not in metrics


async def _gateway_ready(gateway: _Proxy) -> bool:
    """/readyz answers 200 (it has a routing table) and /v1/models names the cluster."""
    if gateway.popen.poll() is not None:
        tail = Stack.log_tail(gateway.log_path)
        raise RuntimeError(f"the gateway exited {gateway.popen.returncode}: {tail}")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(f"{gateway.url}/readyz") as resp:
                if resp.status != 200:
                    return False
            async with session.get(f"{gateway.url}/v1/models") as resp:
                models = (await resp.json())["data"] if resp.status == 200 else []
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False
    return any(m.get("id") == CLUSTER for m in models)


async def _cold_histogram(gateway: _Proxy) -> tuple[float, float]:
    sums = _metric_sums(await _scrape(gateway.url), (f"{COLD_METRIC}_sum", f"{COLD_METRIC}_count"))
    return sums.get(f"{COLD_METRIC}_sum", 0.0), sums.get(f"{COLD_METRIC}_count", 0.0)


async def _scaled(stack: Stack, after: int, cause: str, timeout: float) -> Envelope:
    """The first `cluster.scaled` of the cluster past position `after` whose cause contains
    `cause`."""

    def first() -> Envelope | None:
        return next(
            (
                e
                for e in stack.events("cluster.scaled.v1", name=CLUSTER)
                if e.position > after and cause in payload(e).get("cause", "")
            ),
            None,
        )

    return await stack.wait_until(first, timeout=timeout, why=f"cluster.scaled ({cause})")


async def one_run(
    index: int, stack: Stack, gateway: _Proxy, http: aiohttp.ClientSession
) -> dict[str, Any]:
    await stack.wait_until(
        lambda: _at_zero(stack, gateway), timeout=60, why="echo at zero replicas, none running"
    )
    mark_pos = _head(stack)
    cold_sum, cold_count = await _cold_histogram(gateway)

    sent_ns = time.time_ns()
    t0 = time.perf_counter()
    async with http.post(f"{gateway.url}/v1/chat/completions", json=BODY) as resp:
        head_s = time.perf_counter() - t0
        status = resp.status
        body = await resp.read()
        whole_s = time.perf_counter() - t0
    answered_ns = sent_ns + int(whole_s * 1e9)
    content = ""
    if status == 200:
        content = json.loads(body)["choices"][0]["message"]["content"]

    timeout = AUTOSCALE["cold_start_timeout_s"]
    decision = await _scaled(stack, mark_pos, COLD_CAUSE, timeout)
    decided = payload(decision)
    placed = await stack.wait_for_event(
        "replica.placed.v1", after=decision.position, timeout=timeout, cluster=CLUSTER
    )
    rid, epoch = payload(placed)["replica_id"], payload(placed)["epoch"]
    key = {"replica_id": rid, "epoch": epoch}
    starting = await stack.wait_for_event(
        "replica.starting.v1", after=placed.position, timeout=timeout, **key
    )
    ready = await stack.wait_for_event(
        "replica.ready.v1", after=starting.position, timeout=timeout, **key
    )
    new_sum, new_count = await _cold_histogram(gateway)
    gateway_s = (new_sum - cold_sum) / (new_count - cold_count) if new_count > cold_count else None

    # The scale back to zero, and the replica's end.
    back: Envelope | None = None
    stopped: Envelope | None = None
    try:
        back = await _scaled(stack, ready.position, ZERO_CAUSE, BACK_TIMEOUT_S)
        stopped = await stack.wait_for_event(
            "replica.stopped.v1", after=back.position, timeout=30, **key
        )
    except AssertionError as exc:
        print(
            f"run {index + 1}: no scale back to zero: {str(exc).splitlines()[0]}", file=sys.stderr
        )
    at = {
        "decision": _s(decision.recorded_at - sent_ns),
        "placed": _s(placed.recorded_at - sent_ns),
        "starting": _s(starting.recorded_at - sent_ns),
        "ready": _s(ready.recorded_at - sent_ns),
    }
    return {
        "run": index + 1,
        "status": status,
        "answer": content,
        "replica": rid,
        "epoch": epoch,
        "node": payload(placed)["node_id"],
        "decision_cause": decided.get("cause", ""),
        "decision_replicas": decided.get("replicas"),
        "decision_inputs": decided.get("inputs"),
        # from the send, in seconds: the client's clock for the HTTP, recorded_at for events
        "at": {**at, "first_byte": head_s, "whole": whole_s},
        "held_to_first_byte_s": head_s,
        "held_to_decision_s": at["decision"],
        "decision_to_ready_s": at["ready"] - at["decision"],
        "ready_to_first_byte_s": head_s - at["ready"],
        "decision_to_placed_s": at["placed"] - at["decision"],
        "placed_to_starting_s": at["starting"] - at["placed"],
        "starting_to_ready_s": at["ready"] - at["starting"],
        "first_byte_to_whole_s": whole_s - head_s,
        "gateway_hold_to_first_byte_s": gateway_s,
        "scaled_to_zero": back is not None,
        "scale_back_cause": payload(back).get("cause", "") if back is not None else None,
        "answer_to_scaled_to_zero_s": (
            _s(back.recorded_at - answered_ns) if back is not None else None
        ),
        "answer_to_stopped_s": (
            _s(stopped.recorded_at - answered_ns) if stopped is not None else None
        ),
    }


async def coldstart(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpumesh-coldstart-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        async with Stack(workdir / "stack", agents=AGENTS) as stack:
            spec = {**echo_spec(0, CLUSTER), "autoscale": AUTOSCALE}
            await stack.create_cluster(spec)
            # After the cluster: the table the gateway asks for at its start names the cold start.
            gateway = _start_gateway(stack, workdir, sys.executable)
            try:
                await stack.wait_until(
                    lambda: _gateway_ready(gateway), timeout=60, why="the gateway routes echo"
                )
                timeout = aiohttp.ClientTimeout(total=AUTOSCALE["cold_start_timeout_s"] + 30)
                async with aiohttp.ClientSession(timeout=timeout) as http:
                    for i in range(args.runs):
                        run = await one_run(i, stack, gateway, http)
                        runs.append(run)
                        if not args.json:
                            _print_run(run)
            finally:
                gateway.stop()
    summary: dict[str, dict[str, float]] = {}
    for key, _ in FIGURES:
        values = [r[key] for r in runs if r["status"] == 200 and r[key] is not None]
        if values:
            summary[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "n": len(values),
            }
    return {
        "mode": "coldstart",
        "agents": AGENTS,
        "cluster": CLUSTER,
        "autoscale": AUTOSCALE,
        "runs": runs,
        "summary": summary,
        "answered": sum(r["status"] == 200 for r in runs),
        "scaled_back_to_zero": sum(r["scaled_to_zero"] for r in runs),
    }


_COLUMNS = (
    ("held_to_decision_s", "held>decision", 13),
    ("decision_to_ready_s", "decision>ready", 14),
    ("ready_to_first_byte_s", "ready>1st byte", 14),
    ("held_to_first_byte_s", "held>1st byte", 13),
    ("first_byte_to_whole_s", "1st byte>whole", 14),
    ("gateway_hold_to_first_byte_s", "gateway's own", 13),
    ("answer_to_scaled_to_zero_s", "answer>zero", 11),
    ("answer_to_stopped_s", "answer>stopped", 14),
)


def _fmt(value: float | None, width: int) -> str:
    return f"{value:{width - 1}.3f}s" if value is not None else f"{'-':>{width}}"


def _print_header() -> None:
    knobs = ", ".join(f"{k} = {v:g}" for k, v in AUTOSCALE.items())
    print(
        f"coldstart: {AGENTS} agents, cluster {CLUSTER} (echo workload) from 0 replicas, "
        f"[autoscale] {knobs}; one chat completion per run through the gateway"
    )
    print(f"{'run':>6} " + " ".join(f"{label:>{w}}" for _, label, w in _COLUMNS) + "  split")


def _split(run: dict[str, Any]) -> str:
    return (
        f"placed {run['decision_to_placed_s'] * 1e3:.0f} ms, "
        f"launched {run['placed_to_starting_s'] * 1e3:.0f} ms, "
        f"echo start {run['starting_to_ready_s']:.2f} s"
    )


def _print_run(run: dict[str, Any]) -> None:
    cells = " ".join(_fmt(run[key], w) for key, _, w in _COLUMNS)
    note = "" if run["status"] == 200 else f"  HTTP {run['status']}"
    print(f"{run['run']:>6} {cells}  {_split(run)}{note}", flush=True)


def _print_summary(result: dict[str, Any]) -> None:
    summary = result["summary"]
    for row in ("median", "min", "max"):
        cells = " ".join(_fmt(summary.get(k, {}).get(row), w) for k, _, w in _COLUMNS)
        print(f"{row:>6} {cells}")
    n = len(result["runs"])
    print(f"answered 200: {result['answered']}/{n}")
    causes = sorted({r["decision_cause"] for r in result["runs"]})
    print(f"scale-up cause: {' | '.join(causes)}")
    backs = sorted({r["scale_back_cause"] for r in result["runs"] if r["scale_back_cause"]})
    print(
        f"scaled back to zero after each answer: {result['scaled_back_to_zero']}/{n}"
        + (f" (cause: {' | '.join(backs)})" if backs else "")
    )
    print()
    for key, label in FIGURES:
        s = summary.get(key)
        if s is not None:
            print(
                f"  {label:40} median {s['median']:7.3f} s   "
                f"range {s['min']:.3f}-{s['max']:.3f} s  (n={s['n']:g})"
            )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="cold starts (default 5)")
    parser.add_argument("--json", action="store_true", help="every figure of every run, as JSON")
    parser.add_argument("--keep", metavar="DIR", help="keep the stack's logs and event log here")
    add_quick(parser, "--runs 1")
    args = parser.parse_args()
    apply_quick(parser, args, **QUICK)
    if args.runs < 1:
        parser.error("--runs: at least 1")
    configure_logging(level="warning", json=False, stream=sys.stderr)
    announce(args, json_output=args.json)
    if not args.json:
        _print_header()
    result = mark(args, asyncio.run(coldstart(args)))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_summary(result)
    n = len(result["runs"])
    return 0 if result["answered"] == n and result["scaled_back_to_zero"] == n else 1


if __name__ == "__main__":
    sys.exit(main())
