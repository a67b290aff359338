"""`gpumesh sim run|fuzz|replay`: failure scenarios on virtual time, replayable by seed."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from wire.errors import CommandFailed

from .scenario import FaultPlan, Scenario, ScenarioError, load

T = TypeVar("T")

REPLAY_SHARE = 0.05  # of passing fuzz seeds, run twice: a difference is a determinism bug


def register(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    sim = commands.add_parser(
        "sim",
        parents=list(parents),
        help="run failure scenarios on virtual time (deterministic, by seed)",
        description="The real controller, agents and gateway routing logic on a virtual-time "
        "loop, with faults injected from a scenario file. The same seed gives the same run, "
        "byte for byte.",
    )
    sub = sim.add_subparsers(dest="sim_command", metavar="SUBCOMMAND", required=True)

    run = sub.add_parser("run", parents=list(parents), help="run one scenario with one seed")
    run.add_argument("scenario", help="a TOML file, or a name in sim/scenarios/")
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--json", action="store_true", help="the result as JSON")
    run.add_argument("--events-out", type=Path, metavar="FILE", help="write the event log (JSONL)")
    run.add_argument(
        "--record", type=Path, metavar="FILE", help="write a record `gpumesh sim replay` re-runs"
    )
    run.add_argument(
        "--html",
        type=Path,
        metavar="FILE",
        help="write a self-contained HTML report: timeline, incidents, charts (sim/report_html.py)",
    )
    run.add_argument(
        "--plot",
        type=Path,
        metavar="FILE",
        help="write a PNG: requests answered and failed per second per cluster, faults shaded, "
        "and detection and replacement times per failure class (needs gpumesh[plot])",
    )
    run.set_defaults(handler=run_command)

    fuzz = sub.add_parser("fuzz", parents=list(parents), help="run many seeds until one fails")
    fuzz.add_argument("scenario")
    fuzz.add_argument("--seeds", type=int, default=100, help="how many seeds (default 100)")
    fuzz.add_argument("--start", type=int, default=1, help="first seed (default 1)")
    fuzz.add_argument(
        "--jobs", type=int, default=2, help="processes (default 2; 0: all in this process)"
    )
    fuzz.add_argument("--json", action="store_true")
    fuzz.add_argument(
        "--record", type=Path, metavar="FILE", help="where to write the failing run's record"
    )
    fuzz.add_argument(
        "--progress",
        action="store_true",
        help="show progress on stderr (seeds done, rate, violations, ETA) even when stderr is "
        "not a terminal, one line per update; on a terminal it is shown anyway",
    )
    fuzz.set_defaults(handler=fuzz_command)

    replay = sub.add_parser("replay", parents=list(parents), help="re-run a recorded run")
    replay.add_argument("record", type=Path, help="a file written by `sim run --record`")
    replay.add_argument("--json", action="store_true")
    replay.set_defaults(handler=replay_command)


def git_commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
            check=False,
        )
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def _scenario(name: str, faults: list[dict[str, Any]] | None = None) -> tuple[Path, Scenario]:
    from .run import faults_from, find_scenario

    path = find_scenario(name)
    scenario = load(path)
    if faults is not None:
        scenario = scenario.with_faults(faults_from(faults))
    return path, scenario


def execute(name: str, seed: int, faults: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run in this process (or a worker) and return the result as plain data."""
    from .run import run_scenario

    _, scenario = _scenario(name, faults)
    result, _ = run_scenario(scenario, seed)
    return result.to_json()


async def run_command(args: argparse.Namespace) -> int:
    from .run import render, run_scenario

    try:
        path, scenario = _scenario(args.scenario)
    except ScenarioError as exc:
        raise CommandFailed(str(exc)) from None
    if args.plot:
        from .plot import PlotUnavailable, pyplot

        try:
            pyplot()  # before the run: without matplotlib, one line and nothing run
        except PlotUnavailable as exc:
            raise CommandFailed(str(exc)) from None
    commit = git_commit()
    print(f"gpumesh sim: scenario {path}, seed {args.seed}, commit {commit}", file=sys.stderr)
    if args.html or args.plot:
        from .report_html import report, run_recorded

        result, world, traffic = _in_thread(run_recorded, scenario, args.seed)
        if args.html:
            args.html.write_text(report(result, world, traffic, commit=commit), encoding="utf-8")
            print(f"gpumesh sim: report in {args.html}", file=sys.stderr)
        if args.plot:
            from .plot import plot_run

            timings = world.checker.timings
            samples = {"detection": timings.detection, "replacement": timings.replacement}
            plot_run(result, scenario, traffic, samples, args.plot, commit=commit)
            print(f"gpumesh sim: plot in {args.plot}", file=sys.stderr)
    else:
        result, world = _in_thread(run_scenario, scenario, args.seed)
    if args.events_out:
        with args.events_out.open("wb") as out:
            for envelope in world.store.read_all_now():
                out.write(msgspec.json.encode(envelope) + b"\n")
    if args.record:
        _write_record(args.record, str(path), args.seed, commit, result.to_json())
    if args.json:
        print(json.dumps({"commit": commit, **result.to_json()}, indent=2, sort_keys=True))
    else:
        print(render(result, commit=commit))
        if args.record:
            print(f"\nreplay: gpumesh sim replay {args.record}")
    return 0 if result.ok else 1


async def replay_command(args: argparse.Namespace) -> int:
    from .run import render

    try:
        record = json.loads(args.record.read_text())
        name, seed, expected = record["scenario_file"], record["seed"], record["result"]
    except (OSError, ValueError, KeyError) as exc:
        raise CommandFailed(f"{args.record}: not a run record ({exc})") from None
    got = _in_thread(execute, name, seed, expected["faults"])
    same = got == expected
    if args.json:
        print(json.dumps({"identical": same, "result": got}, indent=2, sort_keys=True))
    else:
        from .run import RunResult

        print(render(RunResult(**got), commit=git_commit()))
        recorded = record.get("commit", "?")
        print(
            f"\nreplay of {args.record} (recorded at commit {recorded}): "
            + ("identical, byte for byte" if same else "DIFFERENT from the record")
        )
    return 0 if same else 1


async def fuzz_command(args: argparse.Namespace) -> int:
    try:
        path, scenario = _scenario(args.scenario)
    except ScenarioError as exc:
        raise CommandFailed(str(exc)) from None
    commit = git_commit()
    seeds = list(range(args.start, args.start + args.seeds))
    print(
        f"gpumesh sim fuzz: {path}, seeds {seeds[0]}..{seeds[-1]}, {args.jobs} jobs, "
        f"commit {commit}",
        file=sys.stderr,
    )
    progress: FuzzProgress | None = None
    if args.progress or sys.stderr.isatty():
        progress = FuzzProgress(len(seeds), sys.stderr, tty=sys.stderr.isatty())
    failing, checked, mismatched = _in_thread(_fuzz, str(path), seeds, args.jobs, progress)
    if progress is not None:
        progress.end()
    for seed in mismatched:
        print(f"NONDETERMINISM: seed {seed} gave two different runs", file=sys.stderr)
    if failing is None:
        print(f"{checked} seeds passed ({len(seeds) - checked} not run); no violation")
        return 1 if mismatched else 0
    seed, result = failing
    first = result["violations"][0]
    print(f"seed {seed}: {first['invariant']} at t={first['at']:.3f}: {first['detail']}")
    print("shrinking the fault schedule...", file=sys.stderr)
    shrunk = _in_thread(_shrink, str(path), seed, result["faults"], first["invariant"])
    record = args.record or Path(f"sim-{scenario.name}-seed{seed}.json")
    final = _in_thread(execute, str(path), seed, shrunk)
    _write_record(record, str(path), seed, commit, final)
    print(f"shrunk from {len(result['faults'])} to {len(shrunk)} fault(s):")
    for fault in shrunk:
        print("  " + json.dumps({k: v for k, v in fault.items() if v is not None}, sort_keys=True))
    print(f"replay: gpumesh sim replay {record}")
    print(f"full run: gpumesh sim run {path} --seed {seed}")
    return 1


class FuzzProgress:
    """Where a fuzz stands, on stderr: `seeds done/total, rate, violations, ETA`. On a terminal
    one line redrawn in place, at most every half second; otherwise (`--progress` into a file
    or a pipe) a line a second at most. Told of each seed's end by the fuzz loop; adds nothing
    to the runs themselves."""

    def __init__(self, total: int, stream: Any, *, tty: bool) -> None:
        self.total = total
        self.stream = stream
        self.tty = tty
        self.started = time.perf_counter()
        self.done = 0
        self.violations = 0
        self._shown_at = -math.inf
        self._drawn = False

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = self.total - self.done
        eta = f"ETA {left / rate:.0f} s" if rate > 0 and left > 0 else "ETA -"
        if left <= 0 or self.violations:
            eta = f"{elapsed:.1f} s"
        return (
            f"fuzz: {self.done}/{self.total} seeds, {rate:.2f} seeds/s, "
            f"{self.violations} violation(s), {eta}"
        )

    def seed_done(self, violated: bool) -> None:
        self.done += 1
        self.violations += violated
        now = time.perf_counter()
        if now - self._shown_at >= (0.5 if self.tty else 1.0):
            self._shown_at = now
            self._show()

    def end(self) -> None:
        self._show()
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()

    def _show(self) -> None:
        if self.tty:
            self.stream.write(f"\r{self.line()}\x1b[K")
            self._drawn = True
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()


def _fuzz(
    path: str, seeds: list[int], jobs: int, progress: FuzzProgress | None = None
) -> tuple[tuple[int, dict[str, Any]] | None, int, list[int]]:
    """Run seeds until the first violation; run a share of them twice and compare.

    The second runs go into the queue right behind the first ones, not after every seed is
    done, so the workers stay busy to the end (a tail of re-runs on one worker cost a whole
    run's time in a short fuzz)."""
    from .run import faults_from  # noqa: F401  (imported for workers' module cache)

    checked = 0
    failing: tuple[int, dict[str, Any]] | None = None
    pool: Executor = ProcessPoolExecutor(max_workers=jobs) if jobs > 0 else _InProcess()
    in_flight = jobs * 2 if jobs > 0 else 1
    twice = set(seeds[:: max(1, round(1 / REPLAY_SHARE))])
    queue: list[tuple[int, bool]] = []  # (seed, is the second run)
    for seed in seeds:
        queue.append((seed, False))
        if seed in twice:
            queue.append((seed, True))
    queue.reverse()  # popped from the end
    results: dict[int, dict[str, Any]] = {}
    again: dict[int, dict[str, Any]] = {}
    with pool:
        pending: dict[Future[dict[str, Any]], tuple[int, bool]] = {}
        while (queue or pending) and failing is None:
            while queue and len(pending) < in_flight:
                seed, second = queue.pop()
                pending[pool.submit(execute, path, seed)] = (seed, second)
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: pending[f]):
                seed, second = pending.pop(future)
                result = future.result()
                if second:
                    again[seed] = result
                    continue
                checked += 1
                results[seed] = result
                if progress is not None:
                    progress.seed_done(bool(result["violations"]))
                if result["violations"] and (failing is None or seed < failing[0]):
                    failing = (seed, result)
        for future in pending:
            future.cancel()
    mismatched = sorted(
        seed
        for seed, result in again.items()
        if seed in results and not results[seed]["violations"] and result != results[seed]
    )
    return failing, checked, mismatched


class _InProcess(Executor):
    """`--jobs 0`: every run in this process, one after the other (what a test that patches
    the code under test needs: a worker process would not see the patch)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:
            future.set_exception(exc)
        return future


def _shrink(
    path: str, seed: int, faults: list[dict[str, Any]], invariant: str
) -> list[dict[str, Any]]:
    """Delta debugging, one fault at a time: drop each fault whose removal keeps the violation."""
    current = list(faults)
    changed = True
    while changed and current:
        changed = False
        for i in range(len(current)):
            trial = current[:i] + current[i + 1 :]
            result = execute(path, seed, trial)
            if any(v["invariant"] == invariant for v in result["violations"]):
                current = trial
                changed = True
                break
    return current


def _write_record(
    path: Path, scenario_file: str, seed: int, commit: str, result: dict[str, Any]
) -> None:
    record = {"scenario_file": scenario_file, "seed": seed, "commit": commit, "result": result}
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _in_thread(fn: Any, *args: Any) -> Any:
    # The simulation runs its own (virtual-time) event loop; the CLI's loop must not be the
    # running one in this thread while it does.
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


__all__ = ["FaultPlan", "register"]
