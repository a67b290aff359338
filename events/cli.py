"""`gpumesh events tail` and `gpumesh events generate`."""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from .codec import encode_envelope
from .envelope import Envelope, Undecodable
from .errors import EventStoreError, LogNotFound
from .replica import Candidate
from .secret_store import SENSITIVE_NAME
from .synthetic import fleet_history

POLL_SECONDS = 0.2  # another process owns the log, so following it means polling the file


def register(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    tail = commands.add_parser(
        "tail",
        parents=list(parents),
        help="print events, optionally following new ones",
        description="Print committed events in commit order.",
    )
    tail.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    tail.add_argument("--json", action="store_true", help="one JSON envelope per line")
    tail.add_argument("--stream", help="only this stream, e.g. node/gpu-1 or cluster/llama")
    tail.add_argument(
        "--type",
        dest="type_prefix",
        help="only types starting with this, e.g. node.health or replica.",
    )
    tail.add_argument(
        "--from-position",
        type=int,
        default=None,
        help="start here (default: the last --limit events)",
    )
    tail.add_argument(
        "--limit",
        type=int,
        default=50,
        help="how many past events to show before following (default 50)",
    )
    tail.set_defaults(handler=tail_events)

    gen = commands.add_parser(
        "generate",
        parents=list(parents),
        help="write a synthetic, deterministic fleet history (demos and benchmarks)",
        description="Append a plausible fleet history: nodes heartbeat, fail and recover; "
        "replicas are placed and re-placed. The same seed writes the same history.",
    )
    gen.add_argument("--nodes", type=int, default=20)
    gen.add_argument("--clusters", type=int, default=3)
    gen.add_argument("--events", type=int, default=10_000, help="how many events to write")
    gen.add_argument("--seed", type=int, default=1)
    gen.add_argument("--json", action="store_true", help="print the summary as JSON")
    gen.set_defaults(handler=generate_events)

    compact = commands.add_parser(
        "compact",
        parents=list(parents),
        help="delete heartbeats older than an age, keeping each node's latest",
        description="Heartbeats are most of the log. Compaction deletes those recorded before "
        "the cutoff, except each node's latest, which is all any projection keeps: a rebuild "
        "gives the same state before and after.",
    )
    compact.add_argument(
        "--older-than", type=parse_duration, required=True, metavar="AGE", help="e.g. 30m, 6h, 7d"
    )
    compact.add_argument("--json", action="store_true")
    compact.set_defaults(handler=compact_events)

    redact = commands.add_parser(
        "redact",
        parents=list(parents),
        help="move secrets written in clear in stored specs' env to secret_env references",
        description="Rewrite every stored cluster spec whose env has names that look like "
        "secrets (TOKEN, SECRET, KEY, PASSWORD, any case): each moves to secret_env as a "
        "reference, its value to the secret store beside the log. Keeps a copy of the log "
        "first (it holds the values in clear: delete it once satisfied). Stop the controller "
        "first. Values already read from the log (the GPUMESH_EVENTS stream, read models, "
        "backups) are not reached: rotate those secrets.",
    )
    redact.add_argument(
        "--dry-run", action="store_true", help="say what would change; write nothing"
    )
    redact.add_argument("--json", action="store_true", help="the report as one JSON object")
    redact.add_argument(
        "--event-log",
        choices=["sqlite", "jetstream"],
        default="sqlite",
        help="sqlite (default: DATA_DIR/events.db, rewritten in place) or jetstream (the NATS "
        "stream GPUMESH_LOG of `gpumesh controller --event-log jetstream`: written again "
        "whole, every event at its position; values to the controllers' secret bucket)",
    )
    redact.add_argument(
        "--nats",
        metavar="URL",
        help="with --event-log jetstream: the stack's NATS (default: "
        "the URL `gpumesh up`/`controller` wrote in the data directory)",
    )
    redact.add_argument(
        "--backup-dir",
        metavar="DIR",
        help="with --event-log jetstream: where the stream's backup goes (default: DATA_DIR)",
    )
    redact.add_argument(
        "--restore",
        metavar="FILE",
        help="with --event-log jetstream: write the stream back from this backup instead",
    )
    redact.set_defaults(handler=redact_events)


async def _open(path: Path, *, create: bool = False) -> Any:
    from .sqlite_store import SqliteEventStore

    if not create and not path.exists():
        raise LogNotFound(str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    return await SqliteEventStore.open(path)


def _matches(envelope: Envelope, args: argparse.Namespace) -> bool:
    if args.stream and envelope.stream != args.stream:
        return False
    return not (args.type_prefix and not envelope.type.startswith(args.type_prefix))


def _render(envelope: Envelope, as_json: bool) -> str:
    return (encode_envelope(envelope).decode() if as_json else format_line(envelope)) + "\n"


# Fields that explain a decision (a placement's `why`, an unschedulable cluster's `reason`):
# printed whole, since a cut explanation explains nothing. Other free text (a workload's exit
# detail can be long) is cut so an event stays a readable line.
_EXPLANATIONS = frozenset({"why", "reason"})
_CUT = 80
# A fleet of hundreds of nodes would make the candidate lines pages long; --json has them all.
MAX_CANDIDATES_SHOWN = 12
_INDENT = " " * 11  # under the timestamp, past the position column


def format_line(envelope: Envelope) -> str:
    """A readable line: position, time, stream@version, type, the payload's salient fields.

    An event that records a scheduling decision (`replica.placed`, `cluster.unschedulable`) is
    followed by indented lines naming the candidates: the ranked ones in order, then each
    rejected node with why it was rejected.
    """
    at = datetime.fromtimestamp(envelope.recorded_at / 1e9, tz=UTC)
    stamp = at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"
    extra: list[str] = []
    if isinstance(envelope.payload, Undecodable):
        detail = f"UNDECODABLE ({envelope.payload.error}) raw={envelope.payload.raw[:60]!r}"
    else:
        detail = _summarise(msgspec.structs.asdict(envelope.payload))
        candidates = getattr(envelope.payload, "candidates", None)
        if isinstance(candidates, tuple) and candidates:
            extra = [_INDENT + line for line in candidate_lines(candidates)]
    head = (
        f"{envelope.position:>9}  {stamp}  {envelope.stream}@{envelope.version}  "
        f"{envelope.type}  {detail}"
    )
    return "\n".join([head, *extra])


def candidate_lines(candidates: tuple[Candidate, ...]) -> list[str]:
    """`ranked: a (chosen), b, c` and `rejected: d: why; e: why`, each cut to a readable size."""
    ranked = [c.node_id for c in candidates if not c.rejected]
    rejected = [c for c in candidates if c.rejected]
    lines = []
    if ranked:
        # The scheduler lists accepted nodes best first, so the first is the one it chose.
        names = [f"{ranked[0]} (chosen)", *ranked[1:]]
        lines.append("ranked: " + _capped(names))
    if rejected:
        lines.append("rejected: " + _capped([f"{c.node_id}: {c.rejected}" for c in rejected], "; "))
    return [" ".join(line.splitlines()) for line in lines]


def _capped(items: list[str], sep: str = ", ") -> str:
    shown = sep.join(items[:MAX_CANDIDATES_SHOWN])
    hidden = len(items) - MAX_CANDIDATES_SHOWN
    return shown + (f"{sep}... {hidden} more (--json lists all recorded)" if hidden > 0 else "")


def _summarise(fields: dict[str, Any]) -> str:
    parts = []
    for key, value in fields.items():
        if value in ("", (), {}, None):
            continue
        if key == "env" and isinstance(value, dict):
            # A log older than secret_env may hold secrets here: never print what looks like
            # one (`gpumesh events redact` takes them out of the log).
            value = {k: "<redacted>" if SENSITIVE_NAME.search(k) else v for k, v in value.items()}
        if isinstance(value, tuple | list | dict) and not all(
            isinstance(v, str | int | float) for v in value
        ):
            parts.append(f"{key}=[{len(value)}]")
        elif isinstance(value, msgspec.Struct):
            parts.append(f"{key}={_summarise(msgspec.structs.asdict(value))}")
        else:
            text = ",".join(map(str, value)) if isinstance(value, tuple | list) else str(value)
            text = text if key in _EXPLANATIONS else text[:_CUT]
            parts.append(f"{key}={' '.join(text.splitlines())}")
    return " ".join(parts)


async def tail_events(args: argparse.Namespace) -> int:
    store = await _open(args.events_db)
    out = sys.stdout
    try:
        head = await store.head()
        if args.from_position is not None:
            position = args.from_position
        elif args.stream or args.type_prefix:
            # The last --limit *matching* events: heartbeats would crowd out everything else.
            recent: collections.deque[Envelope] = collections.deque(maxlen=args.limit)
            position = 1
            while page := await store.read_all(position, 20_000):
                recent.extend(e for e in page if _matches(e, args))
                position = page[-1].position + 1
            for envelope in recent:
                out.write(_render(envelope, args.json))
            if not args.follow:
                return 0
        else:
            position = max(1, head - args.limit + 1)
        while True:
            page = await store.read_all(position, 5_000)
            for envelope in page:
                if _matches(envelope, args):
                    out.write(_render(envelope, args.json))
            out.flush()
            if page:
                position = page[-1].position + 1
                continue
            if not args.follow:
                return 0
            await asyncio.sleep(POLL_SECONDS)
    finally:
        await store.close()


async def generate_events(args: argparse.Namespace) -> int:
    store = await _open(args.events_db, create=True)
    started = time.perf_counter()
    written = 0
    try:
        if await store.head() > 0:
            print(
                f"gpumesh: note: {args.events_db} already has events; appending a new history "
                "needs an empty log, so nothing was written",
                file=sys.stderr,
            )
            return 1
        pending: list[Any] = []
        for step in fleet_history(
            random.Random(args.seed), nodes=args.nodes, clusters=args.clusters, limit=args.events
        ):
            pending.append(store.append(step.stream, [step.event], step.expected_version))
            if len(pending) >= 1_000:
                await asyncio.gather(*pending)
                written += len(pending)
                pending.clear()
                if sys.stderr.isatty():
                    print(f"\r{written}/{args.events} events", end="", file=sys.stderr)
        await asyncio.gather(*pending)
        written += len(pending)
    finally:
        await store.close()
    elapsed = time.perf_counter() - started
    summary = {
        "events": written,
        "seconds": round(elapsed, 3),
        "path": str(args.events_db),
        "seed": args.seed,
    }
    if args.json:
        print(msgspec.json.encode(summary).decode())
    else:
        if sys.stderr.isatty():
            print(file=sys.stderr)
        print(f"wrote {written} events to {args.events_db} in {elapsed:.2f} s (seed {args.seed})")
    return 0


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """`90s`, `30m`, `6h`, `7d` (or plain seconds) -> seconds."""
    unit = text[-1:]
    number = text[:-1] if unit in _UNITS else text
    try:
        value = float(number) * _UNITS.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 30m, 6h or 7d)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be positive, got {text!r}")
    return value


async def compact_events(args: argparse.Namespace) -> int:
    store = await _open(args.events_db)
    try:
        cutoff = time.time_ns() - int(args.older_than * 1e9)
        started = time.perf_counter()
        removed = await store.compact_heartbeats(cutoff)
        elapsed = time.perf_counter() - started
    finally:
        await store.close()
    if args.json:
        print(msgspec.json.encode({"removed": removed, "seconds": round(elapsed, 3)}).decode())
    else:
        print(f"removed {removed} heartbeats older than {args.older_than:g} s in {elapsed:.2f} s")
    return 0


async def redact_events(args: argparse.Namespace) -> int:
    from .redact import redact_log

    stamp = datetime.now(tz=UTC).strftime("%Y%m%dT%H%M%SZ")
    args.redact_stamp = stamp  # names the backup, whichever log
    if getattr(args, "event_log", "sqlite") == "jetstream":
        # It needs a NATS connection, which this package does not make: gpumesh/cli.py gives
        # the handler (wire/redact_jetstream.py).
        jetstream: Any = getattr(args, "redact_jetstream", None)
        if jetstream is None:
            raise EventStoreError("events redact: this build has no JetStream support")
        result: int = await jetstream(args)
        return result
    if getattr(args, "restore", None):
        raise EventStoreError(
            "events redact --restore: for --event-log jetstream (a SQLite log's backup is a "
            "copy of the file: put it back in place)"
        )
    report = await asyncio.to_thread(
        redact_log, Path(args.events_db), stamp=stamp, dry_run=args.dry_run
    )
    return emit_redact_report(args, report)


def emit_redact_report(args: argparse.Namespace, report: Any) -> int:
    """The redaction's report: one line per spec rewritten, or one JSON object."""
    if args.json:
        print(msgspec.json.encode(report.as_json()).decode())
        return 0
    for change in report.changes:
        print(("would change: " if report.dry_run else "") + change.line())
    if not report.changes:
        print(f"no stored spec of {report.log} has an env entry that looks like a secret")
    elif not report.dry_run:
        print(
            f"rewrote {len(report.changes)} stored specs; values in {report.secrets}; "
            f"the log as it was in {report.backup} (it holds the values in clear: delete it "
            "once satisfied, and rotate the secrets: they were readable before)"
        )
    return 0
