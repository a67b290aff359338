"""Processes that bench/gateway.py's gateway-front rows start (not a benchmark itself).

    python bench/_tls_fronts.py front --port P --upstream http://... [--creds FILE [--crl FILE]]
                                      [--stats FILE]
        A node's fencing front alone (nodeagent/fencing_front.py's DirectFront, as the agent
        runs it), in front of one upstream: /replica/<id>/<epoch>/... is forwarded to
        --upstream, every replica id and epoch resolves to it and none is fenced. With
        --creds (a node's credentials file, `gpumesh node issue`), mutual TLS as the agent
        serves it on a secured stack: the node's certificate, gateways' certificates of the
        stack's CA required, the CA's revocation list (--crl) re-read as the agent does.
        --stats: on SIGTERM, write {"tls_handshakes": N} there (TLS connections accepted).

    python bench/_tls_fronts.py routing --nats tls://... --creds FILE --route C,ID,NODE,ADDRESS
        bench/_upstream.py's stand-in for the controller's routing feed, connecting to a
        secured NATS with credentials (the controller's): answers `routing.get` and publishes
        the table on `gpumesh.v1.routing` every 2 s.

Each prints `ready` on stdout once it serves, and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from _upstream import _until_stopped, raise_fd_limit, routing  # noqa: E402


async def front(args: argparse.Namespace) -> None:
    from nodeagent.fencing_front import DirectFront, FrontTLS
    from wire.nats_access import load_credentials

    tls = None
    if args.creds is not None:
        creds = load_credentials(args.creds)
        tls = FrontTLS(creds.tls_context(server=True), creds.ca_pem, args.crl)
    upstream = args.upstream.rstrip("/")
    served = DirectFront(
        "127.0.0.1", args.port, lambda _r, _e: upstream, lambda _r, _e: "", tls=tls
    )
    task = asyncio.create_task(served.run())
    try:
        await asyncio.wait_for(served.listening.wait(), 10)
        print("ready", flush=True)
        await _until_stopped()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if args.stats is not None:
            args.stats.write_text(json.dumps({"tls_handshakes": served.handshakes}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    f = commands.add_parser("front")
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--upstream", required=True, metavar="URL")
    f.add_argument("--creds", type=Path, help="a node's credentials: mutual TLS")
    f.add_argument("--crl", type=Path, help="with --creds: the CA's revocation list")
    f.add_argument("--stats", type=Path, help="on SIGTERM: the TLS handshakes, as JSON, here")
    r = commands.add_parser("routing")
    r.add_argument("--nats", required=True)
    r.add_argument("--creds", type=Path, required=True)
    r.add_argument("--route", action="append", default=[], metavar="CLUSTER,ID,NODE,ADDRESS")
    args = parser.parse_args()
    raise_fd_limit()
    from gpumesh.logconfig import configure_logging

    configure_logging(level="warning", json=True)
    handler: Any = {"front": front, "routing": routing}[args.command]
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(handler(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
