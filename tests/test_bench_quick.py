"""bench/run_quick.sh (CI's quick run of every benchmark) lists every bench script, and each
of them takes --quick. The benchmarks themselves are not run here: .ci/run runs them."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

from bench._quick import add_quick

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DRIVER = BENCH / "run_quick.sh"


def _has_main(path: Path) -> bool:
    """An `if __name__ == "__main__":` at the top level of the module."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if not isinstance(node, ast.If):
            continue
        test = node.test
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
        ):
            return True
    return False


def bench_scripts() -> list[str]:
    """bench/*.py with a __main__ entry, less the helpers (their names begin with `_`)."""
    return sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_") and _has_main(p))


def quick_runs() -> list[list[str]]:
    """The QUICK=( ... ) array of run_quick.sh: per entry, the script and its arguments (the
    driver splits each entry on whitespace, as `read -a` does)."""
    found = re.search(r"^QUICK=\(\n(.*?)^\)", DRIVER.read_text(), re.MULTILINE | re.DOTALL)
    assert found, "bench/run_quick.sh has no QUICK=( ... ) array"
    return [entry.split() for entry in shlex.split(found.group(1), comments=True)]


def test_the_scan_finds_the_bench_scripts() -> None:
    scripts = bench_scripts()
    assert "eventstore.py" in scripts and "gateway.py" in scripts
    assert not any(name.startswith("_") for name in scripts)
    assert "rebuild.py" not in scripts  # part (c) of eventstore.py: no entry of its own


def test_every_bench_script_is_in_the_quick_list() -> None:
    listed = {argv[0] for argv in quick_runs()}
    missing = sorted(set(bench_scripts()) - listed)
    assert not missing, f"add these to QUICK in bench/run_quick.sh: {missing}"
    unknown = sorted(name for name in listed if not (BENCH / name).is_file())
    assert not unknown, f"bench/run_quick.sh lists scripts that do not exist: {unknown}"


def test_the_driver_adds_quick_to_every_run() -> None:
    # The driver adds --quick to every entry: an entry does not repeat it.
    assert all("--quick" not in argv for argv in quick_runs())
    assert re.search(
        r'"\$PYTHON" "bench/\$\{argv\[0\]\}" .*--quick \\$', DRIVER.read_text(), re.MULTILINE
    )


def _declares_quick(path: Path) -> bool:
    """The script adds --quick to its parser: bench._quick.add_quick, or add_argument("--quick")."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "add_quick":
            return True
        first = node.args[0] if node.args else None
        if name == "add_argument" and isinstance(first, ast.Constant) and first.value == "--quick":
            return True
    return False


def test_every_listed_script_describes_quick_in_its_help() -> None:
    # Read from the source, not by running 11 interpreters: --help alone imports a lot.
    without = sorted(n for n in {a[0] for a in quick_runs()} if not _declares_quick(BENCH / n))
    assert not without, f"no --quick in the parser of: {without}"
    parser = argparse.ArgumentParser()
    add_quick(parser, "--requests 200")
    assert "--quick" in parser.format_help() and "--requests 200" in parser.format_help()


def test_one_script_help_end_to_end() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "scheduler.py"), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "--quick" in out
