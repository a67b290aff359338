"""One simulated run of a scenario with a seed, and the summary it prints.

The summary and the event log's digest are functions of (scenario, seed, code) only: the same
inputs give byte-identical output in any process, whatever its PYTHONHASHSEED.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog

from .clock import stamp_sim_time
from .loop import run_simulation
from .scenario import FaultPlan, Scenario
from .world import RequestLog, World

SCENARIOS = Path(__file__).resolve().parent / "scenarios"


@dataclass
class RunResult:
    scenario: str
    seed: int
    duration_s: float
    events: int
    digest: str
    availability: dict[str, dict[str, Any]]
    requests_failed: int
    detection: dict[str, dict[str, float]]
    replacement: dict[str, dict[str, float]]
    violations: list[dict[str, Any]]
    timeline: list[str]
    faults: list[dict[str, Any]] = field(default_factory=list)
    buggified: dict[str, int] = field(default_factory=dict)  # site -> times it misbehaved

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def find_scenario(name: str) -> Path:
    """A path, or the name of a file in sim/scenarios/ (with or without `.toml`)."""
    path = Path(name)
    if path.exists():
        return path
    candidate = SCENARIOS / (name if name.endswith(".toml") else f"{name}.toml")
    if candidate.exists():
        return candidate
    known = ", ".join(sorted(p.stem for p in SCENARIOS.glob("*.toml"))) or "none"
    from .scenario import ScenarioError

    raise ScenarioError(f"no scenario {name!r}: not a file, and not one of {known}")


def quiet_logger(level: int = logging.CRITICAL) -> Any:
    """The world's logger: virtual-time stamps, sorted keys, and nothing below `level`."""
    return structlog.wrap_logger(
        structlog.PrintLogger(),
        processors=[
            structlog.processors.add_log_level,
            stamp_sim_time,
            structlog.processors.KeyValueRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
    )


def run_scenario(scenario: Scenario, seed: int, *, log: Any = None) -> tuple[RunResult, World]:
    world = World(scenario, seed, log=log if log is not None else quiet_logger())
    run_simulation(world.run())
    return summarize(world), world


def summarize(world: World) -> RunResult:
    log = world.store.read_all_now()
    digest = hashlib.sha256()
    for envelope in log:
        digest.update(msgspec.msgpack.encode(envelope))
    availability, failed = request_summary(world.requests)
    checker = world.checker
    return RunResult(
        scenario=world.scenario.name,
        seed=world.seed,
        duration_s=world.scenario.duration_s + world.scenario.settle_s,
        events=len(log),
        digest=digest.hexdigest(),
        availability=availability,
        requests_failed=failed,
        detection=percentiles(checker.timings.detection),
        replacement=percentiles(checker.timings.replacement),
        violations=[v._asdict() for v in checker.violations],
        timeline=list(world.timeline),
        faults=[asdict(f) for f in world.scenario.faults],
        buggified=dict(sorted(world.buggify.fired.items())),
    )


def faults_from(records: list[dict[str, Any]]) -> tuple[FaultPlan, ...]:
    return tuple(FaultPlan(**record) for record in records)


def request_summary(
    requests: Mapping[str, RequestLog],
) -> tuple[dict[str, dict[str, Any]], int]:
    """Availability per cluster (answered over ended requests; those still in flight count
    neither way) and the number of failed requests: the simulator's and chaos's summaries."""
    availability = {}
    failed = 0
    for name, log in sorted(requests.items()):
        lost = sum(log.failed.values())
        failed += lost
        availability[name] = {
            "sent": log.sent,
            "ok": log.ok,
            "failed": dict(sorted(log.failed.items())),
            "availability": round(log.ok / (log.ok + lost), 6) if log.ok + lost else 1.0,
        }
    return availability, failed


def percentiles(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    out = {}
    for kind, values in sorted(samples.items()):
        ordered = sorted(values)
        out[kind] = {
            "count": len(ordered),
            "p50": round(_quantile(ordered, 0.5), 3),
            "p99": round(_quantile(ordered, 0.99), 3),
        }
    return out


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return math.nan
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def render(result: RunResult, *, commit: str = "") -> str:
    lines = [
        f"scenario {result.scenario}  seed {result.seed}" + (f"  commit {commit}" if commit else "")
    ]
    lines.append("")
    lines.append("timeline (virtual seconds)")
    lines += [f"  {line}" for line in result.timeline]
    lines.append("")
    lines.append(
        f"summary ({result.duration_s:g} s simulated, {result.events} events, "
        f"digest {result.digest[:16]})"
    )
    for name, a in result.availability.items():
        failed = ", ".join(f"{k} {v}" for k, v in a["failed"].items()) or "none"
        lines.append(
            f"  {name}: availability {a['availability'] * 100:.3f}% "
            f"({a['ok']}/{a['sent']} requests; failed: {failed})"
        )
    lines.append(f"  requests failed: {result.requests_failed}")
    if result.buggified:
        fired = ", ".join(f"{site} x{n}" for site, n in result.buggified.items())
        lines.append(f"  buggify fired: {fired}")
    for title, table in (("detection", result.detection), ("replacement", result.replacement)):
        for kind, t in table.items():
            lines.append(
                f"  {title:<11} {kind:<18} p50 {t['p50']:.3f} s  p99 {t['p99']:.3f} s"
                f"  (n={t['count']:g})"
            )
    if result.violations:
        lines.append(f"  invariant violations: {len(result.violations)}")
        lines += [f"    t={v['at']:.3f} {v['invariant']}: {v['detail']}" for v in result.violations]
    else:
        lines.append("  invariant violations: none")
    return "\n".join(lines)
