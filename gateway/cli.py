"""`gpumesh gateway`: the OpenAI-compatible edge in front of every cluster."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from wire.commandline import add_trace_arguments
from wire.stack import find_nats_url

from .dispatch import MAX_HELD
from .retry import RetryPolicy
from .router import RouterConfig

DEFAULT_PORT = 8080


def register(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    gw = commands.add_parser(
        "gateway",
        parents=list(parents),
        help="run the OpenAI-compatible gateway",
        description="Serve /v1/chat/completions, /v1/completions, /v1/embeddings and "
        "/v1/models for every cluster (the `model` is the cluster's name), /c/<cluster>/... "
        "for any other API of a cluster, the control API under /api/v1, and /metrics. It "
        "follows the controller's routing table over NATS and retries around failed replicas.",
    )
    add_arguments(gw)
    gw.set_defaults(handler=run_gateway, daemon=True)


def add_arguments(gw: argparse.ArgumentParser) -> None:
    gw.add_argument(
        "--nats",
        metavar="URL",
        help="NATS to follow (default: the local stack's, found through the data directory)",
    )
    gw.add_argument(
        "--nats-creds",
        type=Path,
        metavar="FILE",
        help="the gateway's NATS credentials (`gpumesh certs issue --role gateway NAME`); "
        "default: the data directory's 'gateway' credentials when the local NATS is secured",
    )
    gw.add_argument(
        "--listen",
        default=f"127.0.0.1:{DEFAULT_PORT}",
        metavar="HOST:PORT",
        help=f"where to serve (default 127.0.0.1:{DEFAULT_PORT}; port 0 picks a free one)",
    )
    gw.add_argument(
        "--transport",
        choices=["direct", "overlay"],
        default="direct",
        help="direct: HTTP to each replica's address; overlay: tunnel requests over NATS to "
        "the node's agent (for nodes behind NAT). Default: direct",
    )
    gw.add_argument(
        "--keys",
        type=Path,
        metavar="FILE",
        help="API keys per tenant, rate limits and admin keys (TOML; docs/gateway.md). Read "
        "again when it changes, or on SIGHUP. Without it every inference client is admitted, "
        "and /api/v1 takes the data directory's admin-key (what `gpumesh up` makes) or is "
        "closed",
    )
    gw.add_argument(
        "--insecure-api",
        action="store_true",
        help="without --keys: serve /api/v1 to anyone, without a key (a local development "
        "stack only)",
    )
    gw.add_argument("--gateway-id", help="this gateway's name in logs and events")
    gw.add_argument(
        "--max-body-mb", type=float, default=16.0, help="bigger bodies get 413 (default 16)"
    )
    gw.add_argument(
        "--header-timeout",
        type=float,
        default=15.0,
        metavar="S",
        help="close a connection that has not sent a whole request head within S seconds of "
        "opening or of its last response: slow-loris and idle keep-alive (default 15)",
    )
    gw.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="answer 408 and close when a request body takes longer than S seconds (default 30)",
    )
    retry = RetryPolicy()
    gw.add_argument(
        "--request-timeout",
        type=float,
        default=retry.deadline_s,
        metavar="S",
        help="overall time for a request to get an answer started, retries included "
        f"(default {retry.deadline_s:g})",
    )
    gw.add_argument(
        "--first-byte-timeout",
        type=float,
        default=retry.first_byte_timeout_s,
        metavar="S",
        help="a replica that sends nothing this long counts as failed "
        f"(default {retry.first_byte_timeout_s:g})",
    )
    gw.add_argument(
        "--queue-timeout",
        type=float,
        default=retry.queue_timeout_s,
        metavar="S",
        help="how long a request waits for a cluster with no ready replica before 503 "
        f"(default {retry.queue_timeout_s:g})",
    )
    gw.add_argument(
        "--max-held",
        type=int,
        default=MAX_HELD,
        metavar="N",
        help="requests held per cluster while it starts from zero replicas (autoscale min 0); "
        f"more are refused at once with 503 hold_full (default {MAX_HELD})",
    )
    gw.add_argument(
        "--attempts",
        type=int,
        default=retry.max_attempts,
        help=f"replicas tried per request (default {retry.max_attempts})",
    )
    router = RouterConfig()
    gw.add_argument(
        "--eject-after",
        type=int,
        default=router.eject_after,
        help=f"consecutive failures that eject a replica (default {router.eject_after})",
    )
    gw.add_argument(
        "--affinity",
        choices=["off", "prefix", "user"],
        default="off",
        help="keep requests with the same prompt prefix (or `user`) on one replica, bounded "
        "by load, so it can reuse its KV cache (default off: power of two choices)",
    )
    gw.add_argument(
        "--insecure-front",
        action="store_true",
        help="reach nodes' fronts (the direct transport) in plain HTTP even when NATS is "
        "secured, for agents run with --insecure-front (by default it is then mutual TLS "
        "with the certificate in the gateway's credentials; with NATS unsecured, plain)",
    )
    gw.add_argument("--tls-cert", type=Path, help="serve HTTPS with this certificate (PEM)")
    gw.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    gw.add_argument("--no-access-log", action="store_true", help="do not log a line per request")
    gw.add_argument(
        "--routes-wait",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="listen only once a first routing table is in (from the controller, or the last "
        "one kept on JetStream), waiting at most this long (default 10; 0: listen at once)",
    )
    add_trace_arguments(gw, "a span per inference request, continuing a client's W3C traceparent")


def request_tracer(args: argparse.Namespace) -> Any:
    """The gateway's RequestTracer when `--trace` is on, else None (nothing imported)."""
    if not getattr(args, "trace", False):
        return None
    from wire.errors import CommandFailed

    try:
        from wire.tracing import TracingUnavailable

        from .tracing import RequestTracer
    except ImportError:
        raise CommandFailed("--trace needs OpenTelemetry: pip install 'gpumesh[tracing]'") from None
    try:
        return RequestTracer.configure(console=getattr(args, "trace_console", False))
    except TracingUnavailable as exc:
        raise CommandFailed(f"--trace: {exc}") from None


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--listen: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def config_from(args: argparse.Namespace) -> Any:
    from .server import GatewayConfig

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    host, port = parse_listen(args.listen)
    if args.max_held < 1:
        raise ValueError(f"--max-held: expected at least 1, got {args.max_held}")
    return GatewayConfig(
        gateway_id=args.gateway_id or f"gw-{socket.gethostname()}-{os.getpid()}",
        host=host,
        port=port,
        transport=args.transport,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        retry=RetryPolicy(
            max_attempts=args.attempts,
            deadline_s=args.request_timeout,
            first_byte_timeout_s=min(args.first_byte_timeout, args.request_timeout),
            queue_timeout_s=args.queue_timeout,
        ),
        max_held=args.max_held,
        router=RouterConfig(eject_after=args.eject_after),
        affinity=args.affinity,
        access_log=not args.no_access_log,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        header_timeout_s=args.header_timeout,
        request_body_timeout_s=args.body_timeout,
        routes_wait_s=args.routes_wait,
    )


def front_tls(args: argparse.Namespace, creds: Any, transport: str) -> Any:
    """The client TLS context the direct transport dials nodes' fronts with: the gateway's
    certificate from its credentials (`creds`) when NATS is secured; None (plain HTTP, said
    once in the log) when it is not, or with --insecure-front. CommandFailed when credentials
    hold no certificate."""
    import structlog

    from wire.errors import CommandFailed

    if transport != "direct":
        return None
    log = structlog.get_logger("gpumesh.gateway")
    if creds is None or getattr(args, "insecure_front", False):
        why = "--insecure-front" if creds is not None else "NATS is not secured"
        log.warning("fronts_plain", reason=why, detail="nodes' fronts are reached in plain HTTP")
        return None
    if not creds.tls_pem:
        raise CommandFailed(
            f"gateway {creds.name!r}'s credentials hold no certificate for nodes' fronts: run "
            f"`gpumesh certs tls {creds.name} --out FILE` where they were issued and use FILE "
            "(or --insecure-front, for agents run with --insecure-front)"
        )
    from wire.nats_access import CredentialsError

    try:
        return creds.tls_context(server=False)
    except CredentialsError as exc:
        raise CommandFailed(str(exc)) from None


def real_gateway(
    args: argparse.Namespace, bus: Any, config: Any, keys: Any, *, fronts_tls: Any = None
) -> Any:
    """A Gateway on the real clock, a random seed, the access log the command's log options
    ask for, and the routing log on JetStream (`gpumesh gateway` and `gpumesh up` alike).
    `fronts_tls`: dial nodes' fronts over mutual TLS with this client context (`front_tls`)."""
    import structlog

    from runtime.real_env import LoopClock, seeded_rng_factory
    from wire.routing_log import last_routing_table

    from .access_log import access_log_for
    from .server import Gateway
    from .transport.direct import DirectTransport

    rng = seeded_rng_factory(int.from_bytes(os.urandom(8), "big"))("gateway")
    access_log = access_log_for(
        getattr(args, "log_format", "auto"),
        getattr(args, "log_level", "info"),
        structlog.get_logger("gpumesh.gateway").bind(gateway=config.gateway_id),
        {"gateway": config.gateway_id},
    )
    gateway = Gateway(
        bus,
        config,
        keys,
        clock=LoopClock(),
        rng=rng,
        access_log=access_log,
        routing_log=partial(last_routing_table, bus),
        tracer=request_tracer(args),
    )
    if fronts_tls is not None and isinstance(gateway.transport, DirectTransport):
        # Before any request: the Gateway builds its transport without a certificate.
        gateway.transport.secure(fronts_tls)
    return gateway


async def run_gateway(args: argparse.Namespace) -> int:
    import sys

    from runtime.shutdown import run_until_signal
    from wire.commandline import credentials
    from wire.errors import CommandFailed
    from wire.nats_bus import NatsBus

    from .auth import KeyFileError

    try:
        config = config_from(args)
        keys = key_ring(args)
    except (ValueError, KeyFileError) as exc:
        raise CommandFailed(str(exc)) from None
    url = find_nats_url(args.data_dir, args.nats)
    creds = credentials(args, url, "gateway")
    fronts = front_tls(args, creds, config.transport)
    bus = await NatsBus.connect(url, name=f"gpumesh-gateway-{config.gateway_id}", credentials=creds)
    try:
        gateway = real_gateway(args, bus, config, keys, fronts_tls=fronts)
        print(
            f"gateway: {config.transport} transport, NATS {url}, serving on "
            f"{'https' if config.tls_cert else 'http'}://{config.host}:{config.port}",
            file=sys.stderr,
        )
        if fronts is not None and creds is not None:
            print(f"gateway: nodes' fronts over mutual TLS, as {creds.name}", file=sys.stderr)
        print(f"gateway: /api/v1 {api_mode(keys)}", file=sys.stderr)
        loop = asyncio.get_running_loop()
        # SIGHUP: read the key file again now (it is also read again when it changes).
        hup = bool(keys.path) and _on_signal(loop, signal.SIGHUP, keys.reload)
        try:
            await run_until_signal(gateway.run())
        finally:
            if hup:
                loop.remove_signal_handler(signal.SIGHUP)
    finally:
        await bus.close()
    return 0


def key_ring(args: argparse.Namespace) -> Any:
    """`--keys FILE`; else the data directory's admin key (tenant auth off); else no keys, the
    control API closed, or open with `--insecure-api`."""
    from .auth import ADMIN_KEY_FILE, KeyRing

    insecure_api = getattr(args, "insecure_api", False)
    if args.keys:
        if insecure_api:
            raise ValueError("--insecure-api goes without --keys (the key file has admin keys)")
        return KeyRing.load(args.keys)
    admin_key = Path(args.data_dir) / ADMIN_KEY_FILE
    if not insecure_api and admin_key.exists():
        return KeyRing.load_admin_key(admin_key)
    return KeyRing.open(insecure_api=insecure_api)


def api_mode(keys: Any) -> str:
    """How /api/v1 is guarded, in words."""
    if keys.api_open:
        return "is open to anyone (--insecure-api)"
    if keys.has_admin_keys:
        return f"takes the admin keys in {keys.path}"
    if keys.path:
        return f"is closed: {keys.path} has no admin keys"
    return "is closed: no admin keys (give --keys FILE, or --insecure-api)"


def _on_signal(loop: asyncio.AbstractEventLoop, signum: int, callback: Any) -> bool:
    try:
        loop.add_signal_handler(signum, callback)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
        return False
    return True
