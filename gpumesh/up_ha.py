"""`gpumesh up --ha`: the whole stack in its high-availability shape, on one machine.

Three nats-servers clustered by routes, two controllers (one leads by the JetStream lease, the
other stands by), the gateway and N agents with fake GPUs: each its own process, so that any
one can be killed the way a machine dies, and the rest carry on. Security is on as in
`gpumesh up`: clients reach NATS over TLS with one NKEY identity per process, and the routes
between the servers are mutual TLS with the cluster's own certificate and password
(gpumesh/security/routes.py). `--insecure` turns both off (loopback only).

`up` watches every process it started and starts one that died again after a back-off (1 s,
doubling while it keeps dying, at most 30 s), printing its new pid. The first Ctrl-C (or
SIGTERM) stops the gateway, the agents (which stop their workloads), the standby, the leader
and the servers, in that order; a second one kills what is left.

The controllers keep the event log of record on JetStream (`gpumesh controller --event-log
jetstream`: the GPUMESH_LOG stream, three copies on the three servers), so they share no disk,
and a standby follows the log as it is written.

Each controller reaches the servers only through relays `up` owns (wire/tcp_relay.py: one port
on 127.0.0.1 per controller per server; its `--nats` lists them), as if across a network of its
own, so that one can be cut off from NATS without root: `ControllerLinks`. Whoever connects to
the control socket DATA_DIR/up-ha.sock and sends one JSON line `{"cut": "ctl-0"}` is answered
`{"ok": true, ...}` and holds that controller cut off (a blackhole: its connections stay open
and carry nothing; new ones are held) for as long as it keeps the connection open; when it
closes (or shuts its side down, or dies), the cut heals and, if it still listens, it is
answered `{"ok": true, "healed": "ctl-0"}`. `gpumesh chaos` does this for `controller_partition`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import msgspec

from events.contract import subjects
from events.contract.messages import ApiReply

from .up import DEFAULT_FAKE_GPUS

NATS_DIR = "nats-ha"  # the three servers' directories (nats-0, nats-1, nats-2) in DATA_DIR
PROCESSES_FILE = "up-ha.json"  # who runs where, rewritten on every restart; removed at the end
CONTROL_SOCKET = "up-ha.sock"  # cuts a controller off from NATS (ControllerLinks); removed at end
CONTROL_LINE_MAX = 4096
CONTROLLERS = ("ctl-0", "ctl-1")
GATEWAY_ID = "gw-0"
RESTART_AFTER_S = 1.0
RESTART_MAX_S = 30.0
STABLE_S = 10.0  # a process that ran this long is restarted after RESTART_AFTER_S again
STOP_GRACE_S = 15.0
START_TIMEOUT_S = 90.0


class Child(Protocol):
    """One supervised process: a nats-server or a gpumesh command."""

    role: str
    name: str
    port: int | None

    @property
    def pid(self) -> int | None: ...

    @property
    def log(self) -> Path: ...

    @property
    def alive(self) -> bool: ...

    async def start(self) -> None: ...

    async def wait(self) -> int | None: ...

    async def stop(self, grace: float) -> None: ...


class Program:
    """`python -P -m gpumesh ARGV...`, in its own session (a terminal's Ctrl-C reaches only
    `up`, which stops it in order), its output appended to `log`."""

    def __init__(
        self,
        role: str,
        name: str,
        argv: Sequence[str],
        log: Path,
        port: int | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.role = role
        self.name = name
        self.port = port
        # Where it serves GET /metrics (`--metrics-listen 127.0.0.1:PORT`, in argv), if it does:
        # picked once by `up`, so that a restart serves on the same port.
        self.metrics_port = metrics_port
        self.argv = list(argv)
        self._log = log
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log(self) -> Path:
        return self._log

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        # Opening a local log file is instant; the child inherits the descriptor.
        log: IO[bytes] = open(self._log, "ab")  # noqa: SIM115, ASYNC230
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                # -P: the user's working directory is not on the child's import path, so a
                # stray `nats.py` (or the like) there cannot shadow a real package.
                "-P",
                "-m",
                "gpumesh",
                *self.argv,
                stdout=log,
                stderr=log,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        finally:
            log.close()

    async def wait(self) -> int | None:
        if self._proc is None:
            return None
        return await self._proc.wait()

    async def stop(self, grace: float) -> None:
        """SIGTERM; after `grace` seconds SIGKILL of its process group (workloads included)."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace):
                await proc.wait()
        except TimeoutError:
            self.kill()
            await proc.wait()

    def kill(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)


class NatsMember:
    """One nats-server of the cluster. A restart reuses its ports, store and configuration, so
    it rejoins the cluster and its clients find it at the same URL."""

    role = "nats-server"

    def __init__(self, server: Any, name: str, route_port: int) -> None:
        self.server = server  # wire.nats_server.EmbeddedNats
        self.name = name
        self.route_port = route_port
        self.port: int | None = server.port

    @property
    def pid(self) -> int | None:
        pid: int | None = self.server.pid
        return pid

    @property
    def log(self) -> Path:
        path: Path = self.server.log_path
        return path

    @property
    def alive(self) -> bool:
        running: bool = self.server.running
        return running

    async def start(self) -> None:
        await self.server.stop()  # a dead process's log file is closed; a no-op otherwise
        await self.server.start()

    async def wait(self) -> int | None:
        # EmbeddedNats writes its log to a file and exposes no exit to await: poll, cheaply.
        while self.server.running:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        return None

    async def stop(self, grace: float) -> None:
        await self.server.stop()

    def kill(self) -> None:
        pid = self.server.pid
        if pid is not None and self.server.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class ControllerLinks:
    """Each controller's way to the NATS servers: one TcpRelay per server, and the control
    socket that cuts a controller off (module docstring). `listen()` binds the relays' ports
    (the controllers' `--nats`); `serve()` relays and answers until cancelled."""

    def __init__(self, data_dir: Path, controllers: Sequence[str], servers: Sequence[Any]) -> None:
        from wire.tcp_relay import TcpRelay

        self.socket_path = data_dir / CONTROL_SOCKET
        self.control = ""  # the socket's path once it listens
        self.serving = asyncio.Event()  # serve() runs: the relays relay, the socket listens
        self._schemes = {server.name: server.server.url.partition("://")[0] for server in servers}
        self.relays: dict[str, dict[str, TcpRelay]] = {
            name: {
                server.name: TcpRelay(("127.0.0.1", server.port), name=f"{name}->{server.name}")
                for server in servers
            }
            for name in controllers
        }
        self._holds: dict[str, int] = {}  # controller -> control connections holding its cut
        self._tasks: asyncio.TaskGroup | None = None
        self._clients: set[asyncio.StreamWriter] = set()

    async def listen(self) -> None:
        for relays in self.relays.values():
            for relay in relays.values():
                await relay.listen()

    def urls(self, controller: str) -> str:
        """The controller's `--nats`: its relays, one per server, in the servers' order."""
        return ",".join(
            f"{self._schemes[server]}://127.0.0.1:{relay.port}"
            for server, relay in self.relays[controller].items()
        )

    def ports(self, controller: str) -> dict[str, int]:
        return {server: relay.port for server, relay in self.relays[controller].items()}

    def is_cut(self, controller: str) -> bool:
        return self._holds.get(controller, 0) > 0

    async def serve(self) -> None:
        """Relay, and answer the control socket, until cancelled; then close every connection
        and remove the socket."""
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            for relays in self.relays.values():
                for relay in relays.values():
                    tasks.create_task(relay.serve(), name=f"up-ha:relay:{relay.name}")
            server = await self._control_server()
            self.serving.set()
            try:
                await asyncio.Future()  # until cancelled
            finally:
                self._tasks = None
                if server is not None:
                    server.close()
                for writer in list(self._clients):
                    writer.transport.abort()
                self.socket_path.unlink(missing_ok=True)
                self.control = ""

    async def _control_server(self) -> asyncio.AbstractServer | None:
        self.socket_path.unlink(missing_ok=True)  # left by an `up` that was killed
        try:
            server = await asyncio.start_unix_server(self._accepted, path=str(self.socket_path))
            os.chmod(self.socket_path, 0o600)  # who may cut: this user, as with up-ha.json
        except OSError as exc:  # a path too long for a socket, say
            _progress(f"no control socket at {self.socket_path} ({exc}): controllers cannot be "
                      "cut off from NATS (gpumesh chaos skips controller_partition)")  # fmt: skip
            return None
        self.control = str(self.socket_path)
        return server

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback: the connection's task is the TaskGroup's, cancelled with it.
        if self._tasks is None:
            writer.transport.abort()
            return
        self._tasks.create_task(self._answer(reader, writer), name="up-ha:control")

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client: `{"cut": NAME}`, held until it closes its side (module docstring)."""
        self._clients.add(writer)
        try:
            try:
                async with asyncio.timeout(10.0):
                    line = await reader.readline()
                asked = json.loads(line) if line.strip() else {}
                name = asked.get("cut") if isinstance(asked, dict) else None
            except (TimeoutError, ValueError, OSError):
                name = None
            if not isinstance(name, str) or name not in self.relays:
                known = ", ".join(self.relays)
                await _reply(writer, {"ok": False, "error": f'say {{"cut": NAME}}, NAME one of '
                                      f"{known}"})  # fmt: skip
                return
            held = self._cut(name)
            try:
                await _reply(writer, {"ok": True, "cut": name, "connections": held,
                                      "relays": self.ports(name)})  # fmt: skip
                with contextlib.suppress(OSError):
                    while await reader.read(CONTROL_LINE_MAX):
                        pass  # anything said meanwhile is ignored: the cut lasts until EOF
            finally:
                self._heal(name)
            await _reply(writer, {"ok": True, "healed": name})
        finally:
            self._clients.discard(writer)
            writer.transport.abort()

    def _cut(self, name: str) -> int:
        """One more hold on `name`'s cut; how many connections its relays hold."""
        self._holds[name] = self._holds.get(name, 0) + 1
        relays = self.relays[name].values()
        if self._holds[name] == 1:
            for relay in relays:
                relay.cut()
            _progress(f"controller {name} cut off from NATS: its relays carry nothing until "
                      "the control connection that asked closes")  # fmt: skip
        return sum(relay.connections for relay in relays)

    def _heal(self, name: str) -> None:
        if name not in self._holds:
            return  # healed already (stopping: heal_all)
        self._holds[name] -= 1
        if self._holds[name] > 0:
            return
        del self._holds[name]
        for relay in self.relays[name].values():
            relay.heal()
        _progress(f"controller {name} reaches NATS again (partition healed)")

    def heal_all(self) -> None:
        """Stopping: every controller reaches NATS again, so that the leader can hand its lease
        over (the control connections are closed with the rest)."""
        for name in list(self._holds):
            self._holds[name] = 1
            self._heal(name)


async def _reply(writer: asyncio.StreamWriter, data: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        writer.write(json.dumps(data).encode() + b"\n")
        await writer.drain()


def _progress(text: str) -> None:
    print(f"gpumesh up: {text}", file=sys.stderr, flush=True)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is gone"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class StartFailed(Exception):
    """A process of the stack died, or did not come up, while the stack was starting."""


class RelayFailed(StartFailed):
    """The controllers' relays (ControllerLinks) stopped with an error: a bug, said at the end."""


class HaStack:
    """The processes of `up --ha`, started in order, watched, and stopped in order."""

    def __init__(self, args: argparse.Namespace, *, secure: bool) -> None:
        from wire.nats_access import SecurityLayout, load_credentials
        from wire.nats_cluster import NatsCluster

        from .security import routes

        self.args = args
        self.data_dir: Path = args.data_dir
        self.logs = self.data_dir / "logs"
        self.secure = secure
        self.stopping = asyncio.Event()
        self.forced = False
        layout = SecurityLayout(self.data_dir)
        self.admin = load_credentials(layout.creds("admin")) if secure else None
        self.cluster = NatsCluster(
            self.data_dir / NATS_DIR,
            config_file=layout.server_config if secure else None,
            credentials=self.admin,
            routes=routes.route_security(layout) if secure else None,
            # Every process here is given every server (its relays, for a controller): a
            # server advertising the others would let a controller dial one directly, past
            # the relays a `controller_partition` cuts.
            advertise=False,
        )
        self.nats = [
            NatsMember(server, member.server_name, member.route_port)
            for server, member in zip(self.cluster.servers, self.cluster.members, strict=True)
        ]
        self.links = ControllerLinks(self.data_dir, CONTROLLERS, self.nats)
        self.controllers: list[Program] = []
        self.gateway: Program | None = None
        self.gateway_url = ""
        self.agents: list[Program] = []
        self.bus: Any = None
        self._lease: Any = None  # actors.leader_kv.KvLease, once connected
        self.leader = ""
        self.term = 0
        self._serve_began = time.monotonic()
        self.ready_s = 0.0

    @property
    def urls(self) -> str:
        return self.cluster.urls

    @property
    def children(self) -> list[Child]:
        found: list[Child] = [*self.nats, *self.controllers]
        if self.gateway is not None:
            found.append(self.gateway)
        return [*found, *self.agents]

    # -- the whole life ------------------------------------------------------------------

    async def run(self) -> None:
        """Start everything, print where it is, watch it until told to stop; stop in order. The
        controllers' relays (and the control socket) live from before the first controller
        starts until after the last one stopped."""
        await self.links.listen()
        links = asyncio.create_task(self.links.serve(), name="up-ha:links")
        try:
            await self._run()
        finally:
            links.cancel()
            await asyncio.wait({links})
            if not links.cancelled() and links.exception() is not None:
                raise RelayFailed(f"the controllers' relays failed: {links.exception()!r}")

    async def _run(self) -> None:
        starting = asyncio.ensure_future(self._start())
        stopped = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                return
            starting.result()
            self.ready_s = time.monotonic() - self._serve_began
            self._write_processes()
            self._summary()
            async with asyncio.TaskGroup() as tasks:
                watchers = [
                    tasks.create_task(self._watch(child), name=f"watch-{child.name}")
                    for child in self.children
                ]
                await self.stopping.wait()
                for watcher in watchers:
                    watcher.cancel()
        finally:
            for task in (starting, stopped):
                task.cancel()
            await asyncio.wait({starting, stopped})
            await self.shutdown()

    def force(self) -> None:
        """A second signal: kill every process at once, without waiting for anyone."""
        self.forced = True
        self.stopping.set()
        for child in self.children:
            child_kill = getattr(child, "kill", None)
            if child_kill is not None:
                child_kill()

    async def _start(self) -> None:
        from wire.nats_bus import NatsBus
        from wire.stack import write_nats_url

        self.logs.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        _progress(
            "starting 3 nats-servers clustered by routes "
            + (
                "(routes: mutual TLS and the cluster's own password; clients: TLS and one "
                "NKEY identity per process)"
                if self.secure
                else "(no TLS, no credentials: --insecure, loopback only)"
            )
        )
        await self.cluster.start(timeout=60.0)
        for member in self.nats:
            member.port = member.server.port
        write_nats_url(self.data_dir, self.urls)
        _progress(f"NATS cluster ready in {time.monotonic() - began:.1f} s: {self.urls}")
        self.bus = await NatsBus.connect(
            self.urls, name="gpumesh-up-ha", credentials=self.admin, reconnect_wait=0.1
        )
        await self._start_controllers()
        if not self.args.no_gateway:
            await self._start_gateway()
        await self._start_agents()
        if self.args.demo:
            await self._demo()

    def _metrics_ports(self, count: int) -> list[int | None]:
        """Free 127.0.0.1 ports for `count` processes' metrics; None each with --no-metrics."""
        from wire.nats_cluster import free_ports

        if self.args.no_metrics:
            return [None] * count
        return list(free_ports(count))

    async def _start_controllers(self) -> None:
        metrics = self._metrics_ports(len(CONTROLLERS))
        for name, metrics_port in zip(CONTROLLERS, metrics, strict=True):
            # Through its own relays (ControllerLinks): what `gpumesh chaos` may cut.
            argv = ["controller", "--nats", self.links.urls(name), "--controller-id", name]
            # The log of record on a stream of three copies: the controllers share no disk,
            # and a standby follows the log as it is written.
            argv += ["--event-log", "jetstream"]
            if metrics_port is not None:
                argv += ["--metrics-listen", f"127.0.0.1:{metrics_port}"]
            log = self.logs / f"controller-{name}.log"
            program = Program(
                "controller", name, [*argv, *self._common()], log, metrics_port=metrics_port
            )
            self.controllers.append(program)
            await program.start()
        _progress(f"controllers {', '.join(CONTROLLERS)} started; waiting for one to lead")
        await self._until(self._leads, "a controller to hold the leader lease")
        standby = [c.name for c in self.controllers if c.name != self.leader]
        _progress(
            f"controller {self.leader} leads (term {self.term}); {', '.join(standby)} stands by"
        )
        await self._until(lambda: self._api_ok("node.list"), "the leader to answer its API")

    async def _start_gateway(self) -> None:
        from gateway.cli import parse_listen
        from wire.errors import CommandFailed
        from wire.nats_cluster import free_ports

        try:
            host, port = parse_listen(self.args.gateway)
        except ValueError as exc:
            raise CommandFailed(str(exc)) from None
        if port == 0:  # picked here, so that a restart serves on the same port
            port = free_ports(1, host if host not in ("0.0.0.0", "::") else "127.0.0.1")[0]
        argv = ["gateway", "--nats", self.urls, "--listen", f"{host}:{port}"]
        argv += ["--transport", self.args.transport, "--gateway-id", GATEWAY_ID]
        if self.args.keys:
            argv += ["--keys", str(self.args.keys)]
        else:
            # As `gpumesh up`: the control API is keyed, by a key kept in the data directory
            # that the gateway finds there on its own.
            from .up import admin_key_path, ensure_admin_key

            key = admin_key_path(self.data_dir)
            made = ensure_admin_key(key)
            _progress(f"control API admin key {'created in' if made else 'kept in'} {key}")
        self.gateway = Program("gateway", GATEWAY_ID, [*argv, *self._common()],
                               self.logs / "gateway.log", port=port)  # fmt: skip
        await self.gateway.start()
        dial = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.gateway_url = f"http://{dial}:{port}"
        await self._until(lambda: _listens(dial, port), "the gateway to listen")
        _progress(f"gateway serving on {self.gateway_url} ({self.args.transport} transport)")

    async def _start_agents(self) -> None:
        from wire.nats_cluster import free_ports

        from .up import REGIONS

        ports = free_ports(self.args.nodes)
        metrics = self._metrics_ports(self.args.nodes)
        for index in range(self.args.nodes):
            node_id = f"node-{index}"
            argv = ["agent", "--nats", self.urls]
            if self.secure:
                from wire.nats_access import SecurityLayout

                creds = SecurityLayout(self.data_dir).creds(node_id)
                argv += ["--nats-creds", str(creds)]
            gpus = self.args.fake_gpus or DEFAULT_FAKE_GPUS
            argv += ["--node-id", node_id, "--fake-gpus", gpus]
            argv += ["--region", REGIONS[index % len(REGIONS)]]
            argv += ["--front-port", str(ports[index])]
            metrics_port = metrics[index]
            if metrics_port is not None:
                argv += ["--metrics-listen", f"127.0.0.1:{metrics_port}"]
            program = Program("agent", node_id, [*argv, *self._common()],
                              self.logs / f"agent-{node_id}.log", port=ports[index],
                              metrics_port=metrics_port)  # fmt: skip
            self.agents.append(program)
            await program.start()
        seen = -1

        async def registered() -> bool:
            nonlocal seen
            count = await self._registered()
            if count != seen:
                _progress(f"nodes registered: {count}/{self.args.nodes}")
                seen = count
            return count >= int(self.args.nodes)

        await self._until(registered, "every agent to register", interval=0.3)

    async def _demo(self) -> None:
        from .up import DEMO_CLUSTER, demo_spec

        clusters = await self._api("cluster.list", {})
        if not any(c.get("name") == DEMO_CLUSTER for c in clusters):
            await self._api("cluster.create", msgspec.to_builtins(demo_spec()))
        seen = -1

        async def ready() -> bool:
            nonlocal seen
            cluster = await self._api("cluster.get", {"name": DEMO_CLUSTER})
            # As many as it wants: an earlier run on this data directory may have scaled it.
            count, wanted = int(cluster.get("ready", 0)), int(cluster.get("desired", 3))
            if count != seen:
                _progress(f"demo cluster '{DEMO_CLUSTER}': {count}/{wanted} replicas ready")
                seen = count
            return count >= max(wanted, 1)

        await self._until(ready, "the demo cluster's replicas to be ready", interval=0.3)
        if self.gateway is not None:
            await self._until(self._gateway_serves, "the gateway to serve the demo cluster")

    # -- waiting -------------------------------------------------------------------------

    def _common(self) -> list[str]:
        return ["--data-dir", str(self.data_dir), "--log-format", "json"]

    async def _until(
        self,
        check: Callable[[], Awaitable[bool]],
        what: str,
        *,
        interval: float = 0.2,
        timeout: float = START_TIMEOUT_S,
    ) -> None:
        """Poll `check` until it holds; fail at once, naming the log, if a process died."""
        deadline = time.monotonic() + timeout
        while True:
            for child in self.children:
                if not child.alive:
                    raise StartFailed(
                        f"{child.role} {child.name} stopped while the stack was starting "
                        f"(waiting for {what}); see {child.log}"
                    )
            if await check():
                return
            if time.monotonic() > deadline:
                raise StartFailed(f"not within {timeout:g} s: {what}; logs in {self.logs}")
            await asyncio.sleep(interval)

    async def _api(self, verb: str, body: object, timeout: float = 5.0) -> Any:
        raw = await self.bus.request(subjects.api(verb), msgspec.json.encode(body), timeout=timeout)
        reply = msgspec.json.decode(raw.data, type=ApiReply)
        if not reply.ok:
            raise StartFailed(f"{verb}: {reply.error}")
        return reply.data

    async def _api_ok(self, verb: str) -> bool:
        from runtime.errors import BusError

        try:
            await self._api(verb, {}, timeout=2.0)
        except BusError:  # no responders yet, or a timeout: the leader is still starting
            return False
        return True

    async def _leads(self) -> bool:
        import nats.errors

        from actors.errors import ControllerError
        from actors.leader_kv import KvLease
        from runtime.errors import BusError
        from wire.errors import WireError

        if self._lease is None:
            self._lease = KvLease(self.bus)
        try:
            found = await self._lease.leader()
        except (ControllerError, BusError, WireError, nats.errors.Error):
            return False
        if found is None:
            return False
        record, revision = found
        self.leader, self.term = record.controller_id, record.term or revision
        return True

    async def _registered(self) -> int:
        from runtime.errors import BusError

        wanted = {agent.name for agent in self.agents}
        try:
            nodes = await self._api("node.list", {}, timeout=2.0)
        except BusError:
            return 0
        return sum(1 for n in nodes if n.get("node_id") in wanted and n.get("health") != "offline")

    async def _gateway_serves(self) -> bool:
        from .up import DEMO_CLUSTER

        body = json.dumps(
            {"model": DEMO_CLUSTER, "messages": [{"role": "user", "content": "ready?"}]}
        ).encode()
        return await asyncio.to_thread(_post_ok, f"{self.gateway_url}/v1/chat/completions", body)

    # -- watching ------------------------------------------------------------------------

    async def _watch(self, child: Child) -> None:
        """Start `child` again whenever it dies, after a back-off that doubles while it keeps
        dying young; say so, with its new pid."""
        from wire.errors import WireError

        delay = RESTART_AFTER_S
        while True:
            began = time.monotonic()
            code = await child.wait()
            if self.stopping.is_set():
                return
            if time.monotonic() - began >= STABLE_S:
                delay = RESTART_AFTER_S
            _progress(
                f"{child.role} {child.name} (pid {child.pid}) {_exit_text(code)}; starting it "
                f"again in {delay:g} s"
            )
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self.stopping.wait()
                if self.stopping.is_set():
                    return
                try:
                    await child.start()
                    break
                except (OSError, WireError) as exc:  # said, and tried again later
                    delay = min(2 * delay, RESTART_MAX_S)
                    _progress(f"{child.role} {child.name} did not start: {exc}; next try in "
                              f"{delay:g} s")  # fmt: skip
            delay = min(2 * delay, RESTART_MAX_S)
            _progress(
                f"{child.role} {child.name} started again: pid {child.pid} (to try again: "
                f"kill -9 {child.pid})"
            )
            self._write_processes()

    # -- stopping ------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """The gateway, the agents (they stop their workloads), the standby controller, the
        leader, the servers; each waited for. Safe to call twice."""
        from wire.stack import clear_nats_url

        self.stopping.set()
        grace = 0.0 if self.forced else STOP_GRACE_S
        if any(c.alive for c in self.children):
            _progress(
                "stopping: the gateway, the agents (they stop their workloads), the "
                "controllers (standby first), the nats-servers"
            )
        if self.gateway is not None:
            await self.gateway.stop(grace)
        await asyncio.gather(*(agent.stop(grace) for agent in self.agents))
        self.links.heal_all()  # a controller cut off could not hand its lease over
        leader = await self._current_leader()
        standbys = [c for c in self.controllers if c.name != leader]
        await asyncio.gather(*(c.stop(grace) for c in standbys))
        await asyncio.gather(*(c.stop(grace) for c in self.controllers if c.name == leader))
        if self.bus is not None:
            bus, self.bus = self.bus, None
            await bus.close()
        await self.cluster.stop()
        clear_nats_url(self.data_dir, self.urls)
        (self.data_dir / PROCESSES_FILE).unlink(missing_ok=True)

    async def _current_leader(self) -> str:
        if self.bus is None or self.forced:
            return ""
        try:
            async with asyncio.timeout(2.0):
                if await self._leads():
                    return self.leader
        except TimeoutError:
            pass
        return ""

    # -- what is printed -----------------------------------------------------------------

    def processes(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for child in self.children:
            row: dict[str, Any] = {
                "role": child.role,
                "name": child.name,
                "pid": child.pid,
                "port": child.port,
                "kill": f"kill -9 {child.pid}",
                "log": str(child.log),
            }
            if isinstance(child, NatsMember):
                row["route_port"] = child.route_port
            if isinstance(child, Program) and child.role in ("controller", "agent"):
                port = child.metrics_port
                row["metrics"] = f"http://127.0.0.1:{port}/metrics" if port is not None else None
            elif child.role == "gateway":
                row["metrics"] = f"{self.gateway_url}/metrics"
            if child.role == "controller":
                row["leads"] = child.name == self.leader
                row["nats"] = self.links.urls(child.name)  # its relays, one per server
                row["relays"] = self.links.ports(child.name)
                row["cut"] = self.links.is_cut(child.name)
            rows.append(row)
        return rows

    def metrics(self) -> dict[str, str]:
        """The controllers' and the agents' /metrics URLs, by name (none with --no-metrics)."""
        return {
            child.name: f"http://127.0.0.1:{child.metrics_port}/metrics"
            for child in [*self.controllers, *self.agents]
            if child.metrics_port is not None
        }

    def scrape_configs(self) -> dict[str, Any]:
        from .up import scrape_configs

        return scrape_configs(self.metrics(), self.gateway_url)

    def _write_processes(self) -> None:
        from .security.pki import write_private

        data = {
            "nats": self.urls,
            "gateway": self.gateway_url,
            "control": self.links.control,  # "" when the socket could not be made
            "processes": self.processes(),
            "scrape_configs": self.scrape_configs()["scrape_configs"],
        }
        write_private(self.data_dir / PROCESSES_FILE, json.dumps(data, indent=2).encode())

    def _summary(self) -> None:
        from .up import DEMO_CLUSTER

        rows = self.processes()
        if self.args.json:
            data = {
                "gateway": f"{self.gateway_url}/v1" if self.gateway_url else "",
                "nats": self.urls,
                "secure": self.secure,
                "data_dir": str(self.data_dir),
                "leader": self.leader,
                "term": self.term,
                "ready_s": round(self.ready_s, 2),
                "processes": rows,
                # For prometheus.yml as it is (JSON is YAML): every process that serves metrics.
                "scrape_configs": self.scrape_configs()["scrape_configs"],
            }
            print(json.dumps(data), flush=True)
            return
        table = [("ROLE", "NAME", "PID", "PORT", "TO TRY A FAILURE")]
        for row in rows:
            port = "-" if row["port"] is None else str(row["port"])
            if "route_port" in row:
                port += f" (routes {row['route_port']})"
            note = ""
            if row["role"] == "controller":
                note = "  (leads)" if row["leads"] else "  (standby)"
            table.append((row["role"], row["name"], str(row["pid"]), port, row["kill"] + note))
        widths = [max(len(line[i]) for line in table) for i in range(4)]
        lines = [
            "",
            f"gpumesh is up, in HA shape ({self.ready_s:.1f} s).",
        ]
        if self.gateway_url:
            lines.append(f"  gateway:     {self.gateway_url}/v1  (OpenAI-compatible; /metrics)")
            from .up import admin_key_path

            keys = self.args.keys or admin_key_path(self.data_dir)
            lines.append(f"  control API: {self.gateway_url}/api/v1  (admin key in {keys})")
            lines.append(f"  dashboard:   {self.gateway_url}/ui  (sign in with the admin key)")
        lines += [
            f"  NATS:        {self.urls}",
            "               "
            + (
                "(TLS, one NKEY identity per process; routes: mutual TLS and the cluster's own "
                f"password, in {self.data_dir / 'security'})"
                if self.secure
                else "(no TLS, no credentials: loopback only)"
            ),
            "  event log:   JetStream stream GPUMESH_LOG, 3 copies (the controllers share no disk)",
            f"  data dir:    {self.data_dir}",
            f"  logs:        {self.logs}",
            "",
        ]
        lines += [
            "  "
            + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line[:4]))
            + "  "
            + line[4]
            for line in table
        ]
        metrics = self.metrics()
        if metrics:
            from .up import scrape_yaml

            width = max(len(name) for name in metrics)
            lines.append("")
            labels = iter(["  metrics:     "])
            for name, where in metrics.items():
                lines.append(f"{next(labels, ' ' * 15)}{name.ljust(width)}  {where}")
            lines.append("  prometheus:  a scrape configuration for all of them (prometheus.yml):")
            lines += [f"               {line}" for line in scrape_yaml(self.scrape_configs())]
        lines += [
            "",
            "  kill any of them for a try: requests keep being served, a standby leads within "
            "the lease (3 s),",
            "  and `up` starts the killed process again (it prints the new pid).",
            "  partition:   the controllers reach NATS through relays of `up`; `gpumesh chaos` "
            "cuts the leader off",
            f'               (controller_partition; or hold {{"cut": "ctl-0"}} open on '
            f"{self.data_dir / CONTROL_SOCKET})",
            "  watch:       gpumesh controller status   |   gpumesh nodes   |   "
            "gpumesh events tail -f",
        ]
        if self.gateway_url and self.args.demo:
            lines.append(
                f"  ask it:      curl -s {self.gateway_url}/v1/chat/completions -H "
                "'Content-Type: application/json' -d '{\"model\": \""
                + DEMO_CLUSTER
                + '", "messages": [{"role": "user", "content": "hello gpumesh"}]}\''
            )
        lines.append("  stop:        Ctrl-C")
        print("\n".join(lines), flush=True)


async def _listens(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _post_ok(url: str, body: bytes) -> bool:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


async def run_ha(args: argparse.Namespace) -> int:
    from runtime.shutdown import run_until_signal
    from wire.errors import CommandFailed

    from .up import _secure

    if args.nats:
        raise CommandFailed("--ha starts its own three nats-servers: drop --nats")
    if args.nats_listen:
        raise CommandFailed(
            "--ha runs on this machine only (127.0.0.1): drop --nats-listen; "
            "docs/operations.md has the recipe for several machines"
        )
    secure = not args.insecure
    if secure:
        _secure(args.data_dir, args.nodes)
        from wire.nats_access import SecurityLayout

        from .security import routes

        try:
            created = routes.ensure(SecurityLayout(args.data_dir))
        except (OSError, ValueError) as exc:
            raise CommandFailed(str(exc)) from None
        if created:
            _progress(f"security: created the routes' certificate and password ({created[0]})")
    stack = HaStack(args, secure=secure)
    try:
        await run_until_signal(
            stack.run(), on_signal=stack.stopping.set, cancel=False, on_second=stack.force
        )
    except StartFailed as exc:
        raise CommandFailed(str(exc)) from None
    _progress("stopped")
    return 0
