"""What every command that joins a stack shares: its NATS credentials and, for commands that
may run one, an embedded nats-server."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from .errors import CommandFailed
from .nats_access import Credentials, CredentialsError
from .stack import clear_nats_url, credentials_for, write_nats_url


def add_creds_argument(parser: argparse.ArgumentParser, identity: str) -> None:
    parser.add_argument(
        "--nats-creds",
        type=Path,
        metavar="FILE",
        help="this process's NATS credentials (`gpumesh certs issue`/`gpumesh node issue` "
        f"write them); default: the data directory's '{identity}' credentials when the local "
        "NATS is secured",
    )


def credentials(args: argparse.Namespace, url: str, identity: str) -> Credentials | None:
    """The Credentials to connect with, or None; a bad file is a CommandFailed."""

    try:
        return credentials_for(args.data_dir, url, identity, getattr(args, "nats_creds", None))
    except CredentialsError as exc:
        raise CommandFailed(str(exc)) from None


@contextlib.asynccontextmanager
async def nats_for(data_dir: Path, url: str | None, *, secure: bool = True) -> AsyncIterator[str]:
    """Yield a NATS URL: the given one, or an embedded server's that lives for the block.

    The embedded server requires TLS and NKEY credentials when the data directory has them
    (`gpumesh certs init`) and `secure` is true; its URL then starts with tls://."""
    if url:
        yield url
        return
    from .nats_access import SecurityLayout
    from .nats_server import EmbeddedNats

    layout = SecurityLayout(data_dir)
    config = layout.server_config if secure and layout.initialised else None
    async with EmbeddedNats(data_dir / "nats", config_file=config) as server:
        write_nats_url(data_dir, server.url)
        try:
            yield server.url
        finally:
            clear_nats_url(data_dir, server.url)
