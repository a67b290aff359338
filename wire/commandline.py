"""What every command that joins a stack shares: its NATS credentials and, for commands that
may run one, an embedded nats-server."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from .errors import CommandFailed
from .nats_access import Credentials, CredentialsError
from .stack import clear_nats_url, credentials_for, write_nats_url


def add_trace_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """`--trace` and `--trace-console` (docs/tracing.md), for the gateway, the agent and `up`
    alike; `what` says what a process traces, the start of its help."""
    parser.add_argument(
        "--trace",
        action="store_true",
        default=os.environ.get("GPUMESH_TRACE", "") not in ("", "0"),
        help=f"OpenTelemetry: {what} (needs pip install 'gpumesh[tracing]'; docs/tracing.md; "
        "default: GPUMESH_TRACE=1 in the environment turns it on). Exporter: "
        "OTEL_TRACES_EXPORTER (otlp, console, none); else --trace-console; else OTLP "
        "(opentelemetry-exporter-otlp, OTEL_EXPORTER_OTLP_*)",
    )
    parser.add_argument(
        "--trace-console",
        action="store_true",
        help="with --trace: write the spans to stderr, one JSON object a line",
    )


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
async def nats_for(
    data_dir: Path, url: str | None, *, secure: bool = True, listen: str | None = None
) -> AsyncIterator[str]:
    """Yield a NATS URL: the given one, or an embedded server's that lives for the block.

    The embedded server requires TLS and NKEY credentials when the data directory has them
    (`gpumesh certs init`) and `secure` is true; its URL then starts with tls://. It listens
    on 127.0.0.1 (a free port) unless `listen` (`--nats-listen HOST:PORT`) says otherwise,
    and beyond loopback only when it is secured: an open NATS on a network would let anyone
    register as a node. The URL yielded is the one processes on this machine dial."""
    if url:
        if listen:
            raise CommandFailed(
                "--nats-listen sets where the embedded nats-server listens, and --nats URL "
                "means none is started: drop one of them"
            )
        yield url
        return
    from .nats_access import SecurityLayout
    from .nats_server import (
        LOOPBACK,
        EmbeddedNats,
        certificate_covers,
        is_loopback,
        is_wildcard,
        parse_listen,
    )

    host, port = LOOPBACK, 0
    if listen:
        try:
            host, port = parse_listen(listen)
        except ValueError as exc:
            raise CommandFailed(f"--nats-listen: {exc}") from None
    layout = SecurityLayout(data_dir)
    config = layout.server_config if secure and layout.initialised else None
    if config is None and not is_loopback(host):
        raise CommandFailed(
            f"--nats-listen {listen}: the embedded nats-server listens beyond loopback only "
            "with TLS and credentials; run `gpumesh certs init --host NAME` (NAME: what nodes "
            "will dial) and do not pass --insecure"
        )
    # On one address, processes here dial that address and verify the certificate against it.
    if (
        listen
        and config is not None
        and not is_wildcard(host)
        and not certificate_covers(layout.server_cert, host)
    ):
        raise CommandFailed(
            f"--nats-listen {listen}: the server certificate {layout.server_cert} is not "
            f"valid for {host}; listen on 0.0.0.0, or delete the certificate and run "
            f"`gpumesh certs init --host {host}` with every other --host again"
        )
    async with EmbeddedNats(data_dir / "nats", host=host, port=port, config_file=config) as server:
        write_nats_url(data_dir, server.url)
        try:
            yield server.url
        finally:
            clear_nats_url(data_dir, server.url)
