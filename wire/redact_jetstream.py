"""`gpumesh events redact --event-log jetstream`: events/jetstream_store/redact.py on the
stack's NATS, with the operator's credentials, the secret values going to the controllers'
bucket (GPUMESH_SECRETS, wire/secret_kv.py). events/cli.py parses the command; this is the
part that needs a NATS connection, which the events package does not make itself."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from events.errors import StoreIOError
from events.jetstream_store import JetStreamOptions
from events.jetstream_store.redact import redact_jetstream, restore_jetstream

from .commandline import credentials
from .errors import CommandFailed
from .nats_bus import BusUnavailable, NatsBus
from .secret_kv import JetStreamSecretStore
from .stack import find_nats_url


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def run(args: argparse.Namespace) -> int:
    from events.cli import emit_redact_report

    url = find_nats_url(args.data_dir, getattr(args, "nats", None))
    try:
        bus = await NatsBus.connect(
            url, name="gpumesh-redact", credentials=credentials(args, url, "admin")
        )
    except BusUnavailable as exc:
        raise CommandFailed(f"NATS at {url}: {exc}") from None
    options = JetStreamOptions()
    try:
        if args.restore is not None:
            count = await restore_jetstream(bus.client, options, Path(args.restore), progress=_say)
            print(f"restored {count} messages to NATS stream {options.stream} from {args.restore}")
            return 0
        stamp = str(args.redact_stamp)  # events/cli.py's, the time it was asked
        secrets = JetStreamSecretStore(bus)
        backup_dir = Path(args.backup_dir or args.data_dir)
        await asyncio.to_thread(backup_dir.mkdir, parents=True, exist_ok=True)
        report = await redact_jetstream(
            bus.client,
            options,
            backup_dir=backup_dir,
            stamp=stamp,
            store_value=secrets.put,
            dry_run=args.dry_run,
            progress=_say,
        )
    except StoreIOError as exc:
        raise CommandFailed(str(exc)) from None
    finally:
        await bus.close()
    return emit_redact_report(args, report)
