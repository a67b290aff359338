"""`gpumesh workload llm|embeddings|fetch` are wired into the CLI (nodeagent/cli.py)."""

from __future__ import annotations

import subprocess
import sys

from gpumesh.cli import build_parser
from nodeagent.workload import commands


def test_the_real_model_workloads_are_subcommands() -> None:
    parser = build_parser()
    args = parser.parse_args(["workload", "llm", "--port", "0", "--ctx", "1024"])
    assert (args.handler, args.ctx, args.threads, args.model) == (
        commands.run_llm,
        1024,
        2,
        "smollm2",
    )
    args = parser.parse_args(["workload", "embeddings", "--port", "0", "--model", "e5"])
    assert (args.handler, args.model) == (commands.run_embeddings, "e5")
    args = parser.parse_args(["workload", "fetch", "smollm2"])
    assert (args.handler, args.name) == (commands.run_fetch, "smollm2")


def test_fetch_skips_what_is_installed() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpumesh", "workload", "fetch", "smollm2"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    if not commands.pip_commands("smollm2"):
        assert done.stdout == "smollm2: everything it needs is installed\n"
