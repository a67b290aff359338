"""`python -m tests.nodeagent.cli_main agent ...`: nodeagent's commands as gpumesh/cli.py wires
them (`nodeagent.cli.register(commands, [common])`), for tests that need a real process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from nodeagent import cli


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    parser = argparse.ArgumentParser(prog="gpumesh", parents=[common])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    cli.register(commands, [common])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.data_dir = getattr(args, "data_dir", None) or Path(".")
    code: int = asyncio.run(args.handler(args))
    return code


if __name__ == "__main__":
    sys.exit(main())
