"""Keeps the package layering and the determinism rules true, cheaply, by reading the source."""

from __future__ import annotations

import ast
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "events",
    "projections",
    "runtime",
    "wire",
    "actors",
    "nodeagent",
    "gateway",
    "sim",
    "gpumesh",
)

# Which of our packages each package may import (docs/architecture.md explains why).
ALLOWED: dict[str, set[str]] = {
    "events": set(),
    "projections": {"events"},
    "runtime": {"events"},
    "wire": {"events", "runtime"},
    "actors": {"events", "projections", "runtime", "wire"},
    "nodeagent": {"events", "runtime", "wire"},
    "gateway": {"events", "runtime", "wire"},
    "sim": {"events", "projections", "runtime", "wire", "actors", "nodeagent", "gateway"},
    "gpumesh": set(PACKAGES) - {"gpumesh"},
}

# Actor, event and projection code takes these from the injected Env, never from the process.
BANNED_MODULES = {"random", "socket", "secrets"}
BANNED_CALLS = {
    ("time", "time"),
    ("time", "time_ns"),
    ("time", "monotonic"),
    ("time", "monotonic_ns"),
    ("time", "perf_counter"),
    ("datetime", "now"),
    ("datetime", "utcnow"),
    ("uuid", "uuid1"),
    ("uuid", "uuid4"),
    ("os", "urandom"),
}
DETERMINISTIC = ("runtime", "actors", "events", "projections")
# The real adapters and the entry points are where the outside world is allowed in.
EXEMPT = {"runtime/real_env.py"}


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_packages(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


def determinism_violations(tree: ast.AST) -> list[str]:
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            problems += [
                f"import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module.split(".")[0]
            if base in BANNED_MODULES:
                problems.append(f"from {node.module} import ...")
            problems += [
                f"from {node.module} import {a.name}"
                for a in node.names
                if (base, a.name) in BANNED_CALLS
            ]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name | ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            if (owner, node.attr) in BANNED_CALLS:
                problems.append(f"{owner}.{node.attr}")
    return problems


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_the_layering_allows(package: str) -> None:
    bad = []
    for path in sources(package):
        forbidden = imported_packages(ast.parse(path.read_text())) - ALLOWED[package] - {package}
        bad += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(forbidden)]
    assert bad == []


@pytest.mark.parametrize("package", DETERMINISTIC)
def test_no_ambient_time_randomness_or_sockets(package: str) -> None:
    bad = []
    for path in sources(package):
        rel = str(path.relative_to(ROOT))
        if rel in EXEMPT or path.name == "cli.py":
            continue
        bad += [f"{rel}: {p}" for p in determinism_violations(ast.parse(path.read_text()))]
    assert bad == []


def modules_the_simulator_runs(scenarios: Sequence[str]) -> set[str]:
    """Our modules (outside sim/) with code that runs during these scenarios, as paths."""
    from sim.run import find_scenario, quiet_logger, run_scenario
    from sim.scenario import load

    ran: set[str] = set()

    def note(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            ran.add(frame.f_code.co_filename)

    for name in scenarios:
        scenario = load(find_scenario(name))
        sys.setprofile(note)
        try:
            run_scenario(scenario, 1, log=quiet_logger())
        finally:
            sys.setprofile(None)
    ours = {Path(f).resolve() for f in ran if Path(f).resolve().is_relative_to(ROOT)}
    return {
        str(path.relative_to(ROOT))
        for path in ours
        if path.relative_to(ROOT).parts[0] in PACKAGES and path.relative_to(ROOT).parts[0] != "sim"
    }


def test_every_module_the_simulator_runs_keeps_the_determinism_rules() -> None:
    """gateway/ and nodeagent/ are not deterministic packages, yet their routing, dispatch and
    agent code run inside the simulator: every module that does is held to the same rules,
    found by running scenarios that crash the controller, cut NATS and partition nodes."""
    ran = modules_the_simulator_runs(["controller-crash-deploy", "nats-outage", "partition-heal"])
    assert {"gateway/dispatch.py", "gateway/router.py", "nodeagent/agent.py"} <= ran
    bad = []
    for rel in sorted(ran - EXEMPT):
        bad += [f"{rel}: {p}" for p in determinism_violations(ast.parse((ROOT / rel).read_text()))]
    assert bad == []


def test_the_checks_catch_a_planted_violation() -> None:
    snippet = ast.parse(
        "import random\nimport time\nfrom uuid import uuid4\nimport sim.loop\n"
        "x = time.monotonic()\ny = datetime.datetime.now()\n"
    )
    assert determinism_violations(snippet) == [
        "import random",
        "from uuid import uuid4",
        "time.monotonic",
        "datetime.now",
    ]
    assert imported_packages(snippet) == {"sim"}
