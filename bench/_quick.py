"""`--quick`, the same for every bench script (a helper, not a benchmark).

`--quick` runs a script's own code paths at a tiny size (a few hundred operations, a second or
two of load, the smallest fleet) so that the whole set runs in CI in a couple of minutes
(bench/run_quick.sh, from .ci/run): a benchmark that no longer runs is then noticed the day it
breaks. Its figures are marked as quick: they are not comparable with a full run's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

NOTE = "QUICK RUN (--quick): tiny sizes that check the code paths; figures not comparable"


def add_quick(parser: argparse.ArgumentParser, sizes: str) -> None:
    """Add `--quick`; `sizes` says what it shrinks, e.g. "--requests 200"."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a tiny run of the same code paths, for CI ({sizes}); an option given "
        "explicitly still wins; the figures are marked quick and are not comparable",
    )


def apply_quick(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    argv: Sequence[str] | None = None,
    **sizes: Any,
) -> None:
    """With --quick, each of `sizes` (by argparse dest) replaces its option's default; an option
    given on the command line keeps its value. Without --quick, nothing changes."""
    if not args.quick:
        return
    unset = object()
    # argparse fills in a default only where the namespace has no such attribute yet: parsed
    # again into a namespace holding `unset`, an option not given on the command line shows.
    given = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(sizes, unset)))
    for dest, value in sizes.items():
        if getattr(given, dest) is unset:
            setattr(args, dest, value)


def announce(args: argparse.Namespace, *, json_output: bool = False) -> None:
    """With --quick, say so first: on stdout before the figures, or on stderr beside JSON."""
    if args.quick:
        print(NOTE, file=sys.stderr if json_output else sys.stdout, flush=True)


def mark(args: argparse.Namespace, result: Any) -> Any:
    """A JSON result of a quick run carries `"quick": true`."""
    if args.quick and isinstance(result, dict):
        result["quick"] = True
    return result
