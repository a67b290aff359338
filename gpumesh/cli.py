"""The `gpumesh` command: parses arguments and hands each subcommand to the package it drives.

This is the composition root, the one place allowed to import every package. Each package owns
its subcommands in its own cli module (`events/cli.py`, `projections/cli.py`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from events import EventStoreError
from runtime.task_dump import with_task_dump

from . import __version__
from .gc_tuning import tune_collector
from .logconfig import configure_logging

Handler = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def default_data_dir() -> Path:
    """$GPUMESH_DATA_DIR, else $XDG_DATA_HOME/gpumesh, else ~/.local/share/gpumesh."""
    explicit = os.environ.get("GPUMESH_DATA_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "gpumesh"


def build_parser() -> argparse.ArgumentParser:
    # Common options are accepted before or after the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--data-dir",
        type=Path,
        default=argparse.SUPPRESS,
        help="where the stack keeps its event log, read model and logs "
        f"(default: $GPUMESH_DATA_DIR or {default_data_dir()})",
    )
    common.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        choices=["debug", "info", "warning", "error"],
        help="default: info",
    )
    common.add_argument(
        "--log-format",
        default=argparse.SUPPRESS,
        choices=["auto", "json", "console"],
        help="auto: JSON unless stderr is a terminal",
    )

    parser = argparse.ArgumentParser(
        prog="gpumesh",
        description="gpumesh: one fault-tolerant inference service from many unreliable GPUs.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"gpumesh {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from events import cli as events_cli
    from projections import cli as projections_cli

    events_group = commands.add_parser(
        "events",
        help="inspect, generate and rebuild the event log",
        parents=[common],
        description="The event log is the truth: every heartbeat, failure and placement.",
    )
    events_commands = events_group.add_subparsers(
        dest="events_command", metavar="SUBCOMMAND", required=True
    )
    events_cli.register(events_commands, [common])
    projections_cli.register(events_commands, [common])
    # `events redact --event-log jetstream` needs a NATS connection, which events/ does not
    # make: the handler from wire/ (lazily imported, as every command's).
    events_group.set_defaults(redact_jetstream=_redact_jetstream)

    from actors import cli as actors_cli

    actors_cli.register(commands, [common])

    from nodeagent import cli as nodeagent_cli

    nodeagent_cli.register(commands, [common])

    from gateway import cli as gateway_cli

    gateway_cli.register(commands, [common])

    from sim import cli as sim_cli

    sim_cli.register(commands, [common])

    from . import up

    up.register(commands, [common])

    from . import chaos

    chaos.register(commands, [common])

    from . import status

    status.register(commands, [common])

    from .security import cli as security_cli

    security_cli.register(commands, [common])
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Failures a user can act on: printed as one line, no traceback. Each package's root
    stands for all of its errors."""
    from actors.errors import ControllerError
    from nodeagent.errors import AgentError
    from projections.projector import ReadModelError
    from runtime.errors import BusError
    from sim.scenario import ScenarioError
    from wire.errors import WireError

    return (
        EventStoreError,
        OSError,
        WireError,
        BusError,
        ControllerError,
        AgentError,
        ReadModelError,
        ScenarioError,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.data_dir = getattr(args, "data_dir", None) or default_data_dir()
    args.events_db = args.data_dir / "events.db"
    args.read_model_db = args.data_dir / "projections.db"
    fmt = getattr(args, "log_format", "auto")
    configure_logging(
        level=getattr(args, "log_level", "info"), json=None if fmt == "auto" else fmt == "json"
    )
    handler: Handler = args.handler
    if getattr(args, "daemon", False):  # set by the long-running commands' parsers
        tune_collector()
    try:
        return asyncio.run(with_task_dump(handler(args)))
    except KeyboardInterrupt:
        return 130
    except _user_errors() as exc:
        # Expected failures (no log, full disk, no NATS, a bad spec) are one line, no traceback.
        print(f"gpumesh: error: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        # The same failure raised inside a TaskGroup (`gpumesh up`) arrives wrapped.
        expected, rest = group.split(_user_errors())
        if expected is None or rest is not None:
            raise
        print(f"gpumesh: error: {_first_leaf(expected)}", file=sys.stderr)
        return 1


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


async def _redact_jetstream(args: argparse.Namespace) -> int:
    from wire.redact_jetstream import run

    return await run(args)
