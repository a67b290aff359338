"""`gpumesh agent`, `gpumesh agent fault` and `gpumesh workload` (echo; the real models' llm,
embeddings and fetch are in nodeagent/workload/commands.py).

gpumesh/cli.py wires them with `nodeagent.cli.register(commands, [common])`, which adds the
top-level `agent` and `workload` commands. The NATS adapters are imported inside the handlers,
so building the parser (and the unit tests) never loads nats-py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import socket
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from events.contract import subjects
from events.contract.messages import Fault, FaultReply
from events.ids import valid_id
from runtime.env import BusError, NoResponders, RequestTimeout
from runtime.shutdown import run_until_signal
from wire.commandline import add_trace_arguments

from .config import AgentConfig
from .gpu.nvml import throttle_mask, throttle_names
from .link_probe import LinkProbing, TcpDialer, TcpResponder
from .workload import commands as real_models, echo

FAULT_KINDS = ("thermal", "driver", "ecc", "xid", "throttle", "clear")


def register(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    """Add the `agent` (with its `fault` action) and `workload` commands to `commands`."""
    register_agent(commands, parents)
    register_workload(commands, parents)


def register_agent(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    agent = commands.add_parser(
        "agent",
        parents=list(parents),
        help="run the node agent on a GPU machine",
        description="Register this machine's GPUs with the controller, heartbeat their health "
        "and run the replicas it is told to. `gpumesh agent fault` injects faults into an "
        "agent running with --fake-gpus.",
    )
    agent.add_argument("--nats", metavar="URL", help=_NATS_HELP)
    agent.add_argument(
        "--nats-creds",
        type=Path,
        metavar="FILE",
        help="this node's NATS credentials (`gpumesh node issue ID` writes them: one file "
        "with the node's key and the CA); default: the data directory's, when the local "
        "NATS is secured",
    )
    agent.add_argument("--node-id", metavar="ID", help="this node's id ([A-Za-z0-9_-]); required")
    agent.add_argument(
        "--fake-gpus",
        metavar="SPEC",
        help="declare fake GPUs instead of reading NVML, e.g. RTX4090:24GiB:2,A100:80GiB:1",
    )
    agent.add_argument("--region", default="")
    agent.add_argument("--zone", default="")
    agent.add_argument(
        "--label",
        action="append",
        type=_label,
        default=[],
        metavar="KEY=VALUE",
        help="a node label placement can require (repeatable)",
    )
    agent.add_argument("--price", type=float, default=0.0, help="cost per hour, for placement")
    agent.add_argument(
        "--allow-volume",
        action="append",
        default=[],
        metavar="DIR",
        help="a host directory a spec's [docker] volumes may mount (repeatable); besides it, "
        "only the model cache and named volumes: a spec is written by whoever may apply one, "
        "and mounting / would give them the node",
    )
    agent.add_argument(
        "--model-cache",
        metavar="DIR",
        default="",
        help="this node's model cache directory: what it holds is reported for placement (a "
        "spec's model_files prefers a node that has them), and {model_cache} in a spec's "
        "command and docker volumes is this path (docs/workloads.md)",
    )
    agent.add_argument(
        "--address",
        default="127.0.0.1",
        help="host where this node's workloads are reachable (default 127.0.0.1)",
    )
    agent.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds, until the controller sets it (default 1)",
    )
    agent.add_argument(
        "--no-direct-fence",
        action="store_true",
        help="advertise workloads' own ports instead of this node's fencing front; a stale "
        "gateway on the direct transport can then reach a superseded replica (docs/security.md)",
    )
    agent.add_argument(
        "--front-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port of this node's HTTP front for the direct transport (default: any free one)",
    )
    agent.add_argument(
        "--front-listen",
        metavar="HOST",
        help="where the front listens (default: --address, the address it is advertised at; "
        "0.0.0.0: every interface, e.g. behind NAT, where --address is not this machine's)",
    )
    agent.add_argument(
        "--front-crl",
        type=Path,
        metavar="FILE",
        help="the CA's revocation list, re-read when it changes: a revoked gateway's "
        "connections to the front are closed (default: DATA_DIR/security/crl.pem, which "
        "`gpumesh certs revoke` writes; copy it to nodes on other machines)",
    )
    agent.add_argument(
        "--insecure-front",
        action="store_true",
        help="serve the front in plain HTTP to anyone who reaches it, even when NATS is "
        "secured (by default it is then mutual TLS, gateways only, with the certificate in "
        "the node's credentials; with NATS unsecured it is always plain)",
    )
    agent.add_argument(
        "--link-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port of this node's link responder, which peers dial to measure their links to "
        "it for pipeline placement (default: any free one; docs/sharding.md, Measuring links)",
    )
    agent.add_argument(
        "--no-link-probe",
        action="store_true",
        help="run no link responder and measure no links (pipelines placed with this node use "
        "the spec's assumed link_gbps and link_rtt_ms)",
    )
    agent.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (PORT alone: 127.0.0.1; "
        "default: none; docs/metrics.md)",
    )
    agent.add_argument("--workload-driver", choices=["process", "docker"], default="process")
    agent.add_argument(
        "--stop-grace",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping workloads at shutdown",
    )
    agent.add_argument(
        "--leave-grace",
        type=float,
        default=0.0,
        metavar="S",
        help="on SIGTERM (a spot preemption, a reboot), tell the controller this node is "
        "leaving and serve up to S seconds while its replicas are replaced elsewhere, then "
        "stop; a second SIGTERM stops at once. Give it the notice your provider gives (30 on "
        "most spot offers) and let the service manager wait that long; 0: stop at once "
        "(default)",
    )
    add_trace_arguments(
        agent, "a span per request through this node's fencing front, a child of the gateway's"
    )
    agent.set_defaults(handler=run_agent, daemon=True)

    actions = agent.add_subparsers(dest="agent_command", metavar="ACTION")
    fault = actions.add_parser(
        "fault",
        parents=list(parents),
        help="inject a fault into an agent's fake GPUs",
        description="Drive a --fake-gpus agent's GPUs: thermal VALUE sets the temperature (C); "
        "driver makes the probe fail; ecc adds VALUE errors (default 1); xid reports XID VALUE "
        "(default 79, fallen off the bus; 13, 31, 43 and 45 are an application's and leave the "
        "node healthy: docs/gpus.md); throttle REASON holds the clocks down (hw_slowdown, "
        "hw_thermal_slowdown, hw_power_brake_slowdown, sw_thermal_slowdown, ...; none or 0 "
        "lets them go); clear resets all.",
    )
    fault.add_argument("node", help="the agent's node id")
    fault.add_argument("kind", choices=FAULT_KINDS)
    fault.add_argument("value", nargs="?", type=_fault_value, default=0.0)
    fault.add_argument("--gpu", type=int, default=-1, help="GPU index (default: every GPU)")
    # SUPPRESS: `agent --nats X fault ...` keeps X instead of this parser's default.
    fault.add_argument("--nats", metavar="URL", default=argparse.SUPPRESS, help=_NATS_HELP)
    fault.add_argument(
        "--nats-creds",
        type=Path,
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="NATS credentials allowed to send faults (default: the data directory's 'admin')",
    )
    fault.add_argument("--timeout", type=float, default=5.0, metavar="S")
    fault.set_defaults(handler=send_fault)


def register_workload(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    workload = commands.add_parser(
        "workload",
        parents=list(parents),
        help="run a reference workload",
        description="Reference workloads for demos, tests and benchmarks.",
    )
    kinds = workload.add_subparsers(dest="workload_command", metavar="WORKLOAD", required=True)
    echo_parser = kinds.add_parser(
        "echo",
        parents=list(parents),
        help="an OpenAI-compatible server that echoes the prompt",
        description="An OpenAI-compatible server (/v1/models, /v1/chat/completions, "
        "/v1/completions with streaming, /health) whose answer is the prompt's words.",
    )
    echo.add_arguments(echo_parser)
    echo_parser.set_defaults(handler=run_echo)
    real_models.register(kinds, parents)  # llm, embeddings, fetch


_NATS_HELP = (
    "NATS server URL (default: the local stack's, from <data-dir>/nats.url, "
    "else nats://127.0.0.1:4222)"
)


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def _error(message: str) -> None:
    print(f"gpumesh: error: {message}", file=sys.stderr)


def _nats_url(args: argparse.Namespace) -> str:
    from wire.stack import find_nats_url

    return find_nats_url(Path(getattr(args, "data_dir", None) or "."), getattr(args, "nats", None))


_T = TypeVar("_T")


def _credentials(args: argparse.Namespace, url: str, identity: str) -> Any:
    """Raises CredentialsError (one line) for a missing or malformed file."""
    from wire.stack import credentials_for

    data_dir = Path(getattr(args, "data_dir", None) or ".")
    return credentials_for(data_dir, url, identity, getattr(args, "nats_creds", None))


def _agent_version() -> str:
    try:
        return importlib.metadata.version("gpumesh")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


async def run_agent(args: argparse.Namespace) -> int:
    if not args.node_id:
        _error("agent needs --node-id ID (e.g. --node-id gpu-1)")
        return 2
    try:
        config = AgentConfig(
            node_id=args.node_id,
            hostname=socket.gethostname(),
            address=args.address,
            region=args.region,
            zone=args.zone,
            labels=dict(args.label),
            price_per_hour=args.price,
            heartbeat_interval=args.heartbeat_interval,
            stop_grace_s=args.stop_grace,
            leave_grace_s=args.leave_grace,
            agent_version=_agent_version(),
            direct_front=not args.no_direct_fence,
            front_port=args.front_port,
            model_cache=_cache_dir(args),
        )
    except ValueError as exc:
        _error(str(exc))
        return 2
    closing = contextlib.AsyncExitStack()  # what must be closed however we leave
    try:
        try:
            _open_tracer(args, closing)
            probe = await _open_probe(args, closing)
            driver = await _open_driver(args)
        except _Unusable as exc:
            _error(str(exc))
            return 2
        return await _serve(args, config, probe, driver)
    finally:
        await closing.aclose()


class _Unusable(Exception):
    """A one-line reason the agent cannot run on this machine as asked."""


def _open_tracer(args: argparse.Namespace, stack: contextlib.AsyncExitStack) -> None:
    """`--trace`: the fencing front's spans (its module's TRACER), flushed when the agent
    stops. Nothing of opentelemetry is imported without it."""
    if not getattr(args, "trace", False):
        return
    try:
        from wire.tracing import FrontTracer, TracingUnavailable, provider
    except ImportError:
        raise _Unusable("--trace needs OpenTelemetry: pip install 'gpumesh[tracing]'") from None
    from . import fencing_front

    try:
        tracer = FrontTracer(provider("gpumesh-agent", console=args.trace_console))
    except TracingUnavailable as exc:
        raise _Unusable(f"--trace: {exc}") from None
    fencing_front.TRACER = tracer

    def stop() -> None:
        fencing_front.TRACER = None
        tracer.shutdown()

    stack.callback(stop)


async def _open_probe(args: argparse.Namespace, stack: contextlib.AsyncExitStack) -> Any:
    from .gpu import FakeGpuProbe, NoGpuError, NvmlProbe

    if args.fake_gpus:
        try:
            return FakeGpuProbe.parse(args.fake_gpus, node_id=args.node_id)
        except ValueError as exc:
            raise _Unusable(str(exc)) from None
    try:
        probe = await NvmlProbe.open()
    except NoGpuError as exc:
        raise _Unusable(str(exc)) from None
    stack.push_async_callback(probe.close)
    return probe


async def _open_driver(args: argparse.Namespace) -> Any:
    from .workload.base import DriverUnavailable

    log_dir = Path(getattr(args, "data_dir", None) or ".") / "logs" / "replicas" / args.node_id
    if args.workload_driver == "docker":
        from .workload.docker import DockerDriver

        driver = DockerDriver(
            log_dir,
            node_id=args.node_id,
            model_cache=_cache_dir(args),
            allowed_volumes=[str(Path(d).resolve()) for d in args.allow_volume],
        )
        try:
            await driver.check()
        except DriverUnavailable as exc:
            raise _Unusable(str(exc)) from None
        await driver.stop_leftovers()
        return driver
    from .workload.leftovers import Records, stop_leftovers
    from .workload.process import ProcessDriver

    data_dir = Path(getattr(args, "data_dir", None) or ".")
    records = Records(data_dir / "workloads" / args.node_id)
    await stop_leftovers(records)
    return ProcessDriver(log_dir, records=records, model_cache=_cache_dir(args))


def _cache_dir(args: argparse.Namespace) -> str:
    return str(Path(args.model_cache).resolve()) if args.model_cache else ""


async def _serve(args: argparse.Namespace, config: AgentConfig, probe: Any, driver: Any) -> int:
    from functools import partial

    from events import MemoryEventStore
    from runtime.real_env import real_env
    from wire.lease_read import read_lease
    from wire.nats_access import CredentialsError
    from wire.nats_bus import BusUnavailable, NatsBus
    from wire.nats_commands import JetStreamCommandQueue
    from wire.sealing import NodeKey, SealingError

    from .agent import Agent
    from .metrics import run_agent as run_with_metrics

    url = _nats_url(args)
    try:
        creds = _credentials(args, url, config.node_id)
        front = _front(args, config, creds)
        bus = await NatsBus.connect(url, name=f"gpumesh-agent-{config.node_id}", credentials=creds)
    except (BusUnavailable, CredentialsError) as exc:
        _error(str(exc))
        return 1
    try:
        # The commands stream is the controller's to create: a node may only bind its own
        # consumer (docs/security.md).
        commands = await JetStreamCommandQueue.create(bus, manage_stream=False)
        # The agent keeps no events of its own; the Env's store is a placeholder.
        env = real_env(MemoryEventStore(), bus=bus)
        # The node's sealing key pair, made on first start: secrets reach it sealed to it.
        data_dir = Path(getattr(args, "data_dir", None) or ".")
        key = await asyncio.to_thread(
            NodeKey.load_or_create, NodeKey.path(data_dir, config.node_id)
        )
        agent = Agent(
            env,
            commands,
            probe,
            driver,
            config,
            read_lease=partial(read_lease, bus),
            key=key,
            links=_link_probing(args, config),
        )
        if agent.front is not None and front is not None:
            agent.front.configure(host=front[0], tls=front[1])
        bus.add_reconnect_callback(agent.on_reconnect)
        leaves = config.leave_grace_s > 0
        revoked = await run_until_signal(
            _until_refused(run_with_metrics(agent, args.metrics_listen), bus.credentials_refused),
            on_signal=agent.leave if leaves else None,
            cancel=not leaves,
            on_second=agent.force_stop,
        )
    except BusError as exc:
        _error(f"NATS at {url}: {exc}")
        return 1
    except SealingError as exc:
        _error(exc.reason)
        return 1
    finally:
        await bus.close()
    if revoked:
        _error(
            f"NATS at {url} refuses node {config.node_id}'s credentials (revoked?): its "
            "replicas are stopped and the agent exits"
        )
        return 1
    return 0


def _link_probing(args: argparse.Namespace, config: AgentConfig) -> LinkProbing | None:
    """The node's link responder, on its --address (every interface where that is not a
    loopback address, as the front), and the TCP prober; None with --no-link-probe."""
    if getattr(args, "no_link_probe", False):
        return None
    address = config.address
    loopback = address.startswith("127.") or address in ("localhost", "::1")
    bind = address if loopback else "0.0.0.0"
    port = getattr(args, "link_port", 0) or 0
    return LinkProbing(dialer=TcpDialer(), responder=TcpResponder(bind, port, address))


def _front(args: argparse.Namespace, config: AgentConfig, creds: Any) -> tuple[str, Any] | None:
    """Where the node's front listens and its FrontTLS (None: plain), or None without a front.
    With NATS secured (credentials), mutual TLS with the credentials' certificate, unless
    --insecure-front; else plain, said once in the log. Raises CredentialsError (one line)."""
    if not config.direct_front:
        return None
    import structlog

    from wire.nats_access import CredentialsError, SecurityLayout

    from .fencing_front import FrontTLS

    host = args.front_listen or config.address
    log = structlog.get_logger("gpumesh.front").bind(node=config.node_id)
    if creds is None or args.insecure_front:
        why = "--insecure-front" if creds is not None else "NATS is not secured"
        log.warning("front_plain", reason=why, host=host, served="anyone who reaches it")
        return host, None
    data_dir = Path(getattr(args, "data_dir", None) or ".")
    where = args.nats_creds or SecurityLayout(data_dir).creds(config.node_id)
    if not creds.tls_pem:
        raise CredentialsError(
            f"{where} holds no certificate for node {config.node_id}'s front: run `gpumesh "
            f"certs tls {config.node_id} --address {config.address} --out FILE` where its "
            "credentials were issued and copy FILE here (or serve the front in plain HTTP with "
            "--insecure-front)"
        )
    names = _certificate_names(creds.tls_pem)
    if not _covers(names, config.address):
        raise CredentialsError(
            f"node {config.node_id}'s front certificate ({where}) names {', '.join(names)}, "
            f"not --address {config.address}: run `gpumesh certs tls {config.node_id} "
            f"--address {config.address} --out FILE` where its credentials were issued"
        )
    crl = args.front_crl or SecurityLayout(data_dir).crl
    return host, FrontTLS(creds.tls_context(server=True), creds.ca_pem, crl)


def _certificate_names(pem: str) -> list[str]:
    """The host names and addresses the certificate in `pem` (key and certificate) is for."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem[pem.index("-----BEGIN CERTIFICATE-----") :].encode())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(n) for n in sans.get_values_for_type(x509.IPAddress)] + list(
        sans.get_values_for_type(x509.DNSName)
    )


def _covers(names: Sequence[str], address: str) -> bool:
    import ipaddress

    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return address.lower() in (n.lower() for n in names)
    for name in names:
        try:
            if ipaddress.ip_address(name) == wanted:
                return True
        except ValueError:
            continue
    return False


async def _until_refused(main: Coroutine[Any, Any, None], refused: asyncio.Event) -> bool:
    """Run `main` until it ends, or until the server keeps refusing our credentials: a revoked
    node must stop serving, so `main` is cancelled, which stops its workloads. True if so."""
    async with asyncio.TaskGroup() as group:
        work = group.create_task(main, name="agent")
        watch = group.create_task(refused.wait(), name="credentials-watch")
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done():
            work.cancel()
            return True
        watch.cancel()
        return False


def _fault_value(text: str) -> float:
    """A number, or clock event reasons by NVML's names (`hw_slowdown`, `a,b`; `none`) as
    their bit mask, for `throttle`."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return float(throttle_mask(n for n in text.split(",") if n and n != "none"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; {exc}") from None


async def send_fault(args: argparse.Namespace) -> int:
    from wire.nats_access import CredentialsError
    from wire.nats_bus import BusUnavailable, NatsBus

    if not valid_id(args.node):
        _error(f"invalid node id {args.node!r}")
        return 2
    fault = Fault(kind=args.kind, value=args.value, gpu=args.gpu)
    url = _nats_url(args)
    try:
        bus = await NatsBus.connect(
            url, name="gpumesh-fault", credentials=_credentials(args, url, "admin")
        )
    except (BusUnavailable, CredentialsError) as exc:
        _error(str(exc))
        return 1
    try:
        answer = await bus.request(
            subjects.fault(args.node), msgspec.json.encode(fault), timeout=args.timeout
        )
        reply = msgspec.json.decode(answer.data, type=FaultReply)
    except NoResponders:
        _error(f"no agent answers for node {args.node!r} at {url} (is it running?)")
        return 1
    except RequestTimeout:
        _error(f"agent {args.node!r} did not answer within {args.timeout:g} s")
        return 1
    except (BusError, msgspec.DecodeError) as exc:
        _error(f"fault for {args.node!r} failed: {exc}")
        return 1
    finally:
        await bus.close()
    if not reply.ok:
        _error(f"agent {args.node!r} refused the fault: {reply.error}")
        return 1
    value = f" {args.value:g}" if args.kind in ("thermal", "ecc", "xid") and args.value else ""
    if args.kind == "throttle":
        value = " " + (",".join(throttle_names(int(args.value))) or "none")
    where = "every GPU" if args.gpu == -1 else f"GPU {args.gpu}"
    print(f"{args.node}: {args.kind}{value} applied to {where}")
    return 0


async def run_echo(args: argparse.Namespace) -> int:
    await echo.serve(
        args.port,
        host=args.host,
        model=args.model,
        ttft_ms=args.ttft_ms,
        tokens_per_s=args.tokens_per_s,
    )
    return 0
