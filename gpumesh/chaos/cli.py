"""`gpumesh chaos SCENARIO`: its options, the run from start to clean-up, and its report.

Everything heavy (NATS, aiohttp, the simulator's world) is imported when the command runs, so
building the CLI's parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .kinds import KIND_ACTIONS

DEFAULT_GATEWAY = "http://127.0.0.1:8080"  # where `gpumesh up` serves

if TYPE_CHECKING:
    from sim.run import RunResult
    from sim.scenario import Scenario

    from .run import ChaosRun


def register(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    from wire.commandline import add_creds_argument

    chaos = commands.add_parser(
        "chaos",
        parents=list(parents),
        help="apply a simulator scenario to the running local stack",
        description=_fill(
            "Play a scenario file (the ones `gpumesh sim run` plays on virtual time) against "
            "the running local stack, on wall time: create its clusters (echo workloads), send "
            "its client traffic through the gateway, apply its faults to real processes, and "
            "print the simulator's summary from the real event log."
        ),
        epilog=help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chaos.add_argument("scenario", help="a TOML file, or a name in sim/scenarios/")
    chaos.add_argument(
        "--nats",
        metavar="URL",
        help="the stack's NATS (default: the URL `gpumesh up` wrote in the data directory)",
    )
    add_creds_argument(chaos, "admin")
    chaos.add_argument(
        "--gateway",
        metavar="URL",
        help="the gateway the client traffic goes through (default: the one `gpumesh up --ha` "
        f"wrote in the data directory, else {DEFAULT_GATEWAY})",
    )
    chaos.add_argument("--api-key", metavar="KEY", help="the gateway's API key, if it needs one")
    chaos.add_argument(
        "--seed", type=int, default=1, help="draws victims and arrivals, as `sim run` (default 1)"
    )
    chaos.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="divide the scenario's times (faults, durations, periods, settle) by this; the "
        "request rate stays per wall second (default 1)",
    )
    chaos.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="stop after S wall seconds at most (default: duration_s + settle_s, over --speed); "
        "liveness is then not judged",
    )
    chaos.add_argument("--json", action="store_true", help="the result as JSON")
    chaos.add_argument(
        "--dry-run",
        action="store_true",
        help="print the processes found and what each fault would do to whom; change nothing",
    )
    chaos.set_defaults(handler=run_chaos)


def _fill(text: str, indent: str = "") -> str:
    return textwrap.fill(
        text, width=88, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
    )


def help_epilog() -> str:
    """What each fault kind does on the real stack, one paragraph per kind."""
    lines = ["what each fault kind does on the real stack:"]
    for kind, text in KIND_ACTIONS.items():
        lines.append(
            textwrap.fill(
                text,
                width=88,
                initial_indent=f"  {kind:<18} ",
                subsequent_indent=" " * 21,
                break_on_hyphens=False,
            )
        )
    lines.append("")
    lines.append(
        _fill(
            "Victims and request arrivals are drawn from --seed as the simulator draws them. "
            "Ctrl-C stops the run cleanly: what was stopped is continued, what was killed is "
            "started again, then the summary so far is printed. docs/chaos.md has more."
        )
    )
    return "\n".join(lines)


def _progress(text: str) -> None:
    print(f"gpumesh chaos: {text}", file=sys.stderr, flush=True)


def _gateway_url(text: str) -> str:
    return text if "://" in text else f"http://{text}"


async def run_chaos(args: argparse.Namespace) -> int:
    """0: a clean run; 1: an invariant violated, or the run failed (a task of it raised);
    130: interrupted."""
    from sim.run import find_scenario
    from sim.scenario import load
    from wire.commandline import credentials
    from wire.errors import CommandFailed
    from wire.nats_bus import NatsBus
    from wire.stack import find_nats_url

    from .ha import read_layout

    if args.speed <= 0:
        raise CommandFailed("--speed must be > 0")
    if args.duration is not None and args.duration <= 0:
        raise CommandFailed("--duration must be > 0")
    path = find_scenario(args.scenario)
    scenario = load(path)
    url = find_nats_url(args.data_dir, args.nats)
    ha = read_layout(args.data_dir, url)  # a stack of `gpumesh up --ha`, else None
    gateway = _gateway_url(args.gateway or (ha.gateway if ha and ha.gateway else DEFAULT_GATEWAY))
    if args.dry_run:
        from .plan import dry_run

        return dry_run(args, scenario, path, url, gateway)
    bus = await NatsBus.connect(
        url,
        name="gpumesh-chaos",
        credentials=credentials(args, url, "admin"),
        # On `up --ha` a nats-server may die under chaos's own connection: move at once.
        **({"reconnect_wait": 0.1} if ha is not None else {}),
    )
    run: ChaosRun | None = None
    try:
        run = _new_run(args, scenario, bus, url, gateway)
        await _play(run, path, gateway)
    finally:
        if run is not None:
            try:
                await run.restore()
            finally:
                for line in run.restored:
                    _progress(f"restored: {line}")
                await run.close()
        await bus.close()
    return report(run, json_out=args.json)


def _new_run(
    args: argparse.Namespace, scenario: Scenario, bus: Any, url: str, gateway: str
) -> ChaosRun:
    from .run import ChaosRun

    return ChaosRun(
        scenario,
        args.seed,
        bus=bus,
        nats_url=url,
        data_dir=args.data_dir,
        gateway=gateway,
        api_key=args.api_key or "",
        speed=args.speed,
        cap=args.duration,
        echo=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
    )


async def _play(run: ChaosRun, path: Path, gateway: str) -> None:
    from wire.errors import CommandFailed

    from .errors import ChaosError

    scenario = run.scenario
    nodes = run.nodes
    _progress(
        f"scenario {path}, seed {run.seed}; NATS {run.nats_url}; gateway {gateway}; "
        f"{len(nodes)} agents found ({', '.join(nodes) or 'none'})"
    )
    if run.stack.ha is not None:
        _progress("a stack of `gpumesh up --ha`: " + ", ".join(
            f"{p.role} {p.name} (pid {p.pid})"
            for p in run.stack.ha.processes if p.role in ("controller", "nats-server")
        ))  # fmt: skip
    if len(nodes) != scenario.fleet.nodes:
        _progress(
            f"the scenario's fleet has {scenario.fleet.nodes} nodes, the stack "
            f"{len(nodes)}: victims are drawn among the stack's"
        )
    try:
        await run.prepare()
    except ChaosError as exc:
        raise CommandFailed(str(exc)) from None
    _progress(f"running for {run.end:g} s (Ctrl-C stops cleanly)")
    await _interruptible(run)


def report(run: ChaosRun, *, json_out: bool) -> int:
    """Print the result (and, on stderr, the traceback of each task that failed the run)."""
    from sim.cli import git_commit

    result = run.result()
    for name, exc in run.crashes:
        _progress(f"{name} failed:")
        traceback.print_exception(exc, file=sys.stderr)
    commit = git_commit()
    if json_out:
        print(json.dumps({"commit": commit, **result.to_json()}, indent=2, sort_keys=True))
    else:
        print(render_real(result, commit=commit))
        if run.interrupted:
            print(f"  (interrupted at {result.duration_s:g} s: liveness not judged)")
    if run.interrupted:
        return 130
    return 0 if result.ok else 1


def render_real(result: RunResult, *, commit: str = "") -> str:
    """sim.run.render, with its two words about virtual time made true of a real run, and the
    tasks that failed the run, if any."""
    from sim.run import render

    from .run import ChaosResult

    text = render(result, commit=commit)
    text = text.replace("timeline (virtual seconds)", "timeline (wall seconds since the start)", 1)
    text = text.replace(" s simulated, ", " s on the real stack, ", 1)
    if isinstance(result, ChaosResult):
        text += render_failovers(result.failovers)
        text += "\n  invariants checked: " + ", ".join(result.invariants_checked)
    if isinstance(result, ChaosResult) and result.crashed:
        text += f"\n  run FAILED: {len(result.crashed)} of its tasks raised"
        text += "".join(f"\n    {c['task']}: {c['error']}" for c in result.crashed)
    return text


def render_failovers(failovers: Sequence[dict[str, Any]]) -> str:
    """One line per failover: who led, what was done, who leads after how long, and the
    requests of its window that failed."""
    if not failovers:
        return ""
    lines = [
        "",
        "  failovers (until a controller leads again; requests from the fault to the next)",
    ]
    for f in failovers:
        after = f"{f['leads_again_s']:.3f} s" if f["leads_again_s"] is not None else "-"
        requests = f["requests"]
        kinds = ", ".join(f"{k} {n}" for k, n in requests.get("failed_by_kind", {}).items())
        lines.append(
            f"    t={f['at_s']:.3f} {f['kind']:<16} {f['target']}: leads again after {after}: "
            f"{f['outcome']}; requests {requests.get('sent', 0)} sent, "
            f"{requests.get('failed', 0)} failed ({requests.get('failed_before_first_byte', 0)} "
            f"before the first byte)"
            + (f": {kinds}" if kinds else "")
            + (
                "; sent {:g}-{:g} s after the fault".format(*requests["failed_sent_s"])
                if requests.get("failed_sent_s")
                else ""
            )
        )
    return "\n".join(lines)


async def _interruptible(run: ChaosRun) -> None:
    """Run until the end or the first SIGINT/SIGTERM; a second one waits for the clean-up."""
    import asyncio

    from runtime.shutdown import run_until_signal

    def interrupted() -> None:
        run.interrupted = True
        run.note("interrupted: continuing what is stopped, starting what was killed")

    async def run_then_restore() -> None:
        try:
            await run.run()
        except asyncio.CancelledError:
            if not run.interrupted:
                raise
            await run.finish(judge=False)
        finally:
            await run.restore()  # with the handlers still in place: a second Ctrl-C waits

    await run_until_signal(
        run_then_restore(),
        on_signal=interrupted,
        on_second=lambda: _progress("cleaning up, please wait"),
    )
