"""A real gpumesh stack for end-to-end tests and benchmarks: every part its own OS process.

    async with Stack(tmp_path / "stack", agents=3) as stack:
        await stack.create_cluster(echo_spec(3))
        await stack.wait_until(lambda: ..., timeout=20, why="3 ready")
        killed = await stack.kill_agent("node-1")        # power loss: agent and its workloads
        offline = await stack.wait_for_event("node.health_changed.v1", node_id="node-1")

What runs: an embedded nats-server (JetStream, loopback), one `gpumesh controller` process and
N `gpumesh agent --fake-gpus` processes, all with the data directory `root`. Each child starts
in its own session (its own process group), logs to a file under `root/logs` (never to a pipe
nobody drains), and carries `GPUMESH_TEST_STACK=<id>` in its environment; the agents' workloads
inherit that variable, so teardown finds and kills every process the stack caused, workloads
that outlived a SIGKILLed agent included, even when a test fails half-way.

The test process talks to the stack only the way an operator would: the control API over NATS
request/reply, the chaos CLI (`gpumesh agent fault`), signals, /proc, and the event log, which
it reads read-only with plain sqlite3 while the controller writes it (SQLite WAL).

Polling (`wait_until`, every 0.1 s with an overall timeout) is deliberate here: these are other
processes, and the event log and the API are what they announce through.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar, overload

import msgspec

from events import ClusterSpec
from events.codec import decode_payload
from events.contract import subjects
from events.contract.messages import ApiReply
from events.envelope import Envelope
from runtime.env import BusError
from wire.nats_bus import NatsBus
from wire.nats_cluster import NatsCluster
from wire.nats_server import EmbeddedNats

T = TypeVar("T")

STACK_ENV = "GPUMESH_TEST_STACK"  # marks every process a Stack caused, workloads included
HEARTBEAT = "node.heartbeat.v1"
REGIONS = ("eu-west", "us-east", "ap-south")
_COLUMNS = "position, event_id, stream, version, type, recorded_at, correlation_id, causation_id"


def echo_spec(replicas: int = 3, name: str = "echo") -> dict[str, Any]:
    """A cluster of the reference echo workload, run by this interpreter."""
    return {
        "name": name,
        "replicas": replicas,
        "model": name,
        "command": f"{shlex.quote(sys.executable)} -m gpumesh workload echo "
        "--port {port} --model {model}",
    }


class ApiError(Exception):
    """The control API answered ok=false."""


@dataclass(frozen=True, slots=True)
class Workload:
    """One workload process found in /proc (its environment names the replica it runs)."""

    pid: int
    ppid: int
    replica_id: str
    epoch: int
    port: int


@dataclass(frozen=True, slots=True)
class Killed:
    """What kill_agent did: when (wall clock, ns, like an event's recorded_at) and to whom."""

    node_id: str
    at_ns: int
    agent_pid: int
    workloads: tuple[Workload, ...]


@dataclass
class _Child:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]
    started_ns: int = field(default_factory=time.time_ns)

    @property
    def pid(self) -> int:
        return self.popen.pid


# -- /proc ------------------------------------------------------------------------------


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:  # gone, a zombie, or not ours
        return b""


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name may hold spaces and parentheses: the fields after the last ')' are safe.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[1])


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] != b"Z"


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def marked_pids(marker: str) -> list[int]:
    """Every live process whose environment carries STACK_ENV=marker."""
    needle = f"{STACK_ENV}={marker}\0".encode()
    return [pid for pid in _pids() if pid != os.getpid() and needle in _environ(pid)]


def workloads(marker: str) -> list[Workload]:
    """Every live workload process of the stack marked `marker`."""
    needle = f"{STACK_ENV}={marker}\0".encode()
    found = []
    for pid in _pids():
        raw = _environ(pid)
        if needle not in raw or b"GPUMESH_REPLICA_ID=" not in raw:
            continue
        env = dict(
            item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item
        )  # a process may have changed its own environment: parse what is there
        try:
            found.append(
                Workload(
                    pid=pid,
                    ppid=_ppid(pid),
                    replica_id=env[b"GPUMESH_REPLICA_ID"].decode(),
                    epoch=int(env.get(b"GPUMESH_EPOCH", b"0")),
                    port=int(env.get(b"GPUMESH_PORT", b"0")),
                )
            )
        except (KeyError, ValueError):
            continue
    return sorted(found, key=lambda w: (w.replica_id, w.epoch, w.pid))


def _kill_group(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal the process group `pid` leads (every child here leads its own), else `pid`."""
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_marked(marker: str, *, timeout: float = 5.0) -> list[int]:
    """SIGKILL every process carrying `marker` (and its group) until none is left; returns
    the pids still alive after `timeout` (empty when all went)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid in marked_pids(marker) if pid_alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        for pid in left:
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                continue
            if pgid != os.getpgid(0):  # never our own group
                _kill_group(pgid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


# -- the stack ----------------------------------------------------------------------------


class Stack:
    """NATS, one controller process and N agent processes under `root`.

    Health settings are the controller's flags (`heartbeat_interval`, `offline_after`); the
    agents take the interval from the controller's RegisterReply. Node ids are `node-0`...
    """

    def __init__(
        self,
        root: Path,
        *,
        agents: int = 3,
        heartbeat_interval: float = 1.0,
        offline_after: int = 3,
        fake_gpus: str = "RTX4090:24GiB:2",
        controller_args: Sequence[str] = (),
        agent_args: Sequence[str] = (),
        nats_binary: Path | None = None,
        python: str = sys.executable,
        nats_servers: int = 1,
    ) -> None:
        """`nats_servers`: 1, or a cluster of that many (`self.nats_cluster`) that every process
        dials by the list of their URLs."""
        self.root = Path(root)
        self.logs = self.root / "logs"
        self.db_path = self.root / "events.db"
        self.node_ids = [f"node-{i}" for i in range(agents)]
        self.heartbeat_interval = heartbeat_interval
        self.offline_after = offline_after
        self.fake_gpus = fake_gpus
        self.controller_args = list(controller_args)
        self.agent_args = list(agent_args)
        self.python = python
        self.marker = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.nats_cluster = (
            NatsCluster(self.root / "nats", size=nats_servers, binary=nats_binary)
            if nats_servers > 1
            else None
        )
        self.nats = (
            self.nats_cluster.servers[0]
            if self.nats_cluster is not None
            else EmbeddedNats(self.root / "nats", binary=nats_binary)
        )
        self.controller: _Child | None = None
        self.agents: dict[str, _Child] = {}
        self._reaped: list[_Child] = []  # killed children, waited for
        self._bus: NatsBus | None = None
        self._events: list[Envelope] = []  # non-heartbeat events read so far, in order
        self._read_to = 0  # highest position in _events
        self._controller_starts = 0
        self.standbys: list[_Child] = []  # controllers started by start_standby
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def url(self) -> str:
        return self.nats_cluster.urls if self.nats_cluster is not None else self.nats.url

    @property
    def bus(self) -> NatsBus:
        if self._bus is None:
            raise RuntimeError("the stack is not started")
        return self._bus

    async def start(self, *, timeout: float = 45.0) -> None:
        """NATS, the controller, the agents; returns once every node is registered and
        healthy. On failure the caller must still close() (the context manager does)."""
        atexit.register(self._emergency_kill)
        self.logs.mkdir(parents=True, exist_ok=True)
        await (self.nats_cluster.start() if self.nats_cluster else self.nats.start())
        self._bus = await NatsBus.connect(self.url, name="gpumesh-test-stack", reconnect_wait=0.1)
        await self.start_controller(timeout=timeout)
        for node_id in self.node_ids:
            self.start_agent(node_id)
        await self.wait_until(
            self._all_nodes_healthy, timeout=timeout, why=f"{len(self.node_ids)} nodes healthy"
        )

    async def _all_nodes_healthy(self) -> bool:
        nodes = {n["node_id"]: n for n in await self.nodes()}
        return all(
            node_id in nodes and nodes[node_id]["health"] == "healthy" for node_id in self.node_ids
        )

    async def close(self) -> list[int]:
        """Kill every process the stack caused (SIGKILL to each process group, then to any
        process still carrying the stack's marker), stop NATS. Returns the pids that would not
        die (empty on success). Safe to call twice."""
        if self._closed:
            return []
        self._closed = True
        children = [
            c for c in (self.controller, *self.standbys, *self.agents.values()) if c is not None
        ]
        # Workloads first found while their agents still live (afterwards they are orphans,
        # still found by the marker).
        doomed = [w.pid for w in workloads(self.marker)]
        for child in children:
            _kill_group(child.pid)
        for pid in doomed:
            _kill_group(pid)
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(child.popen.wait, 10)
        left = await asyncio.to_thread(kill_marked, self.marker)
        if self._bus is not None:
            with contextlib.suppress(Exception):
                await self._bus.close()
            self._bus = None
        await (self.nats_cluster.stop() if self.nats_cluster else self.nats.stop())
        atexit.unregister(self._emergency_kill)
        return left

    def _emergency_kill(self) -> None:
        """atexit: the test process is going down without close() (a hard interrupt)."""
        for child in (self.controller, *self.standbys, *self.agents.values()):
            if child is not None:
                _kill_group(child.pid)
        kill_marked(self.marker, timeout=2.0)
        servers = self.nats_cluster.servers if self.nats_cluster else [self.nats]
        for server in servers:  # in our own process group: not marked, not a leader
            if server.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.pid, signal.SIGKILL)

    def _spawn(self, name: str, argv: list[str], log_name: str) -> _Child:
        log_path = self.logs / log_name
        env = {**os.environ, "PYTHONUNBUFFERED": "1", STACK_ENV: self.marker}
        with log_path.open("ab") as log:  # the child keeps its own descriptor
            log.write(f"# {time.strftime('%H:%M:%S')} {shlex.join(argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.root,
                start_new_session=True,  # its own process group: signals reach only it
            )
        return _Child(name=name, argv=argv, log_path=log_path, popen=popen)

    # -- the controller -------------------------------------------------------------------

    async def start_controller(self, *, timeout: float = 30.0) -> None:
        """Start a controller process on the stack's data dir; returns once its API answers."""
        if self.controller is not None and self.controller.popen.poll() is None:
            raise RuntimeError("a controller is already running")
        self._controller_starts += 1
        argv = [
            self.python, "-m", "gpumesh", "controller",
            "--nats", self.url,
            "--data-dir", str(self.root),
            "--log-format", "json",
            "--heartbeat-interval", f"{self.heartbeat_interval:g}",
            "--offline-after", str(self.offline_after),
            *self.controller_args,
        ]  # fmt: skip
        self.controller = self._spawn(
            "controller", argv, f"controller-{self._controller_starts}.log"
        )
        await self.wait_until(self._controller_answers, timeout=timeout, why="controller API")

    def start_standby(self, name: str, *, data_dir: Path | None = None) -> _Child:
        """A second controller named `name`, on the stack's data dir unless `data_dir` says
        otherwise: it stands by while the first holds the leader lease, and leads when it
        cannot. Killed with the stack."""
        argv = [
            self.python, "-m", "gpumesh", "controller",
            "--nats", self.url,
            "--data-dir", str(data_dir or self.root),
            "--controller-id", name,
            "--log-format", "json",
            "--heartbeat-interval", f"{self.heartbeat_interval:g}",
            "--offline-after", str(self.offline_after),
            *self.controller_args,
        ]  # fmt: skip
        child = self._spawn("controller", argv, f"controller-{name}.log")
        self.standbys.append(child)
        return child

    async def kill_standby(self, child: _Child) -> int:
        """SIGKILL a controller that start_standby started (its process group); returns when it
        is reaped (wall ns, the moment of the kill), after which it is no longer a standby of
        the stack."""
        at = time.time_ns()
        _kill_group(child.pid)
        await asyncio.to_thread(child.popen.wait, 10)
        if child in self.standbys:
            self.standbys.remove(child)
        self._reaped.append(child)
        return at

    async def stop_controller(self, *, timeout: float = 30.0) -> None:
        """SIGTERM the first controller (it stops its work, then releases the leader lease for
        a standby to take at once) and wait until it has exited; the stack then has none of
        its own (start_controller starts one again)."""
        child = self.controller
        if child is None:
            raise RuntimeError("no controller")
        with contextlib.suppress(ProcessLookupError):
            child.popen.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(child.popen.wait, timeout)
        except subprocess.TimeoutExpired:
            _kill_group(child.pid)
            await asyncio.to_thread(child.popen.wait, 10)
        self._reaped.append(child)
        self.controller = None

    async def _controller_answers(self) -> bool:
        if self.controller is not None and self.controller.popen.poll() is not None:
            raise AssertionError(
                f"the controller exited with {self.controller.popen.returncode}: "
                f"{self.log_tail(self.controller.log_path)}"
            )
        await self.api("node.list", {}, timeout=2.0)
        return True

    async def kill_controller(self) -> int:
        """SIGKILL the controller's process group; returns when it is reaped (wall ns)."""
        child = self.controller
        if child is None:
            raise RuntimeError("no controller")
        at = time.time_ns()
        _kill_group(child.pid)
        await asyncio.to_thread(child.popen.wait, 10)
        self._reaped.append(child)
        return at

    # -- agents ---------------------------------------------------------------------------

    def start_agent(self, node_id: str) -> None:
        """Start (or start again, after a kill) the agent of `node_id`."""
        old = self.agents.get(node_id)
        if old is not None and old.popen.poll() is None:
            raise RuntimeError(f"agent {node_id} is already running")
        index = int(node_id.rsplit("-", 1)[-1]) if node_id[-1:].isdigit() else 0
        argv = [
            self.python, "-m", "gpumesh", "agent",
            "--nats", self.url,
            "--node-id", node_id,
            "--fake-gpus", self.fake_gpus,
            "--region", REGIONS[index % len(REGIONS)],
            "--data-dir", str(self.root),
            "--log-format", "json",
            *self.agent_args,
        ]  # fmt: skip
        if node_id not in self.node_ids:
            self.node_ids.append(node_id)
        self.agents[node_id] = self._spawn(f"agent:{node_id}", argv, f"agent-{node_id}.log")

    def agent_pid(self, node_id: str) -> int:
        return self.agents[node_id].pid

    def workloads(self, node_id: str | None = None) -> list[Workload]:
        """Live workload processes, all or those whose parent is `node_id`'s agent."""
        found = workloads(self.marker)
        if node_id is None:
            return found
        pid = self.agents[node_id].pid
        return [w for w in found if w.ppid == pid]

    async def kill_agent(self, node_id: str, *, with_workloads: bool = True) -> Killed:
        """Power loss: SIGKILL the agent's process group and (by default) every workload it
        runs, found in /proc as its children carrying GPUMESH_REPLICA_ID."""
        child = self.agents[node_id]
        victims = tuple(self.workloads(node_id)) if with_workloads else ()
        at = time.time_ns()
        _kill_group(child.pid)
        for w in victims:
            _kill_group(w.pid)
        await asyncio.to_thread(child.popen.wait, 10)
        self._reaped.append(child)
        await self.wait_until(
            lambda: not any(pid_alive(w.pid) for w in victims),
            timeout=10,
            why=f"workloads of {node_id} gone",
        )
        return Killed(node_id=node_id, at_ns=at, agent_pid=child.pid, workloads=victims)

    def stop_agent(self, node_id: str) -> int:
        """SIGSTOP the agent process only (a hang, or a partition): its workloads run on."""
        at = time.time_ns()
        os.kill(self.agents[node_id].pid, signal.SIGSTOP)
        return at

    def cont_agent(self, node_id: str) -> int:
        at = time.time_ns()
        os.kill(self.agents[node_id].pid, signal.SIGCONT)
        return at

    async def fault(self, node_id: str, kind: str, value: float | None = None) -> str:
        """`gpumesh agent fault NODE KIND [VALUE] --nats URL`, the real chaos CLI."""
        argv = [self.python, "-m", "gpumesh", "agent", "fault", node_id, kind]
        if value is not None:
            argv.append(f"{value:g}")
        argv += ["--nats", self.url, "--log-format", "json"]
        done = await asyncio.to_thread(
            subprocess.run, argv, capture_output=True, timeout=30, check=False, cwd=self.root
        )
        if done.returncode != 0:
            raise AssertionError(
                f"{shlex.join(argv[2:])} failed ({done.returncode}): "
                f"{done.stderr.decode(errors='replace').strip()}"
            )
        return done.stdout.decode().strip()

    # -- the control API ------------------------------------------------------------------

    async def api(self, verb: str, body: object, *, timeout: float = 10.0) -> Any:
        raw = await self.bus.request(subjects.api(verb), msgspec.json.encode(body), timeout=timeout)
        reply = msgspec.json.decode(raw.data, type=ApiReply)
        if not reply.ok:
            raise ApiError(f"{verb}: {reply.error}")
        return reply.data

    async def create_cluster(self, spec: Mapping[str, Any] | ClusterSpec) -> dict[str, Any]:
        data: dict[str, Any] = await self.api("cluster.create", spec, timeout=30.0)
        return data

    async def cluster(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = await self.api("cluster.get", {"name": name})
        return data

    async def nodes(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = await self.api("node.list", {})
        return data

    async def node(self, node_id: str) -> dict[str, Any]:
        return next(n for n in await self.nodes() if n["node_id"] == node_id)

    async def routing(self) -> dict[str, Any]:
        data: dict[str, Any] = await self.api("routing.get", {})
        return data

    # -- the event log --------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection | None:
        if not self.db_path.exists():
            return None
        conn = sqlite3.connect(
            f"file:{self.db_path}?mode=ro", uri=True, isolation_level=None, timeout=5.0
        )
        conn.execute("PRAGMA query_only = ON")
        return conn

    @staticmethod
    def _envelopes(rows: Iterable[tuple[Any, ...]]) -> list[Envelope]:
        out = []
        for position, event_id, stream, version, type_, recorded_at, corr, cause, data in rows:
            out.append(
                Envelope(
                    event_id=event_id,
                    stream=stream,
                    version=version,
                    position=position,
                    type=type_,
                    recorded_at=recorded_at,
                    correlation_id=corr or "",
                    causation_id=cause or "",
                    payload=decode_payload(type_, bytes(data or b"")),
                )
            )
        return out

    def events(self, *types: str, heartbeats: bool = False, **match: Any) -> list[Envelope]:
        """Committed events in log order, read-only from the SQLite file. Without `types`
        every kind except heartbeats (pass heartbeats=True, or the heartbeat type, for those);
        `match` keeps the events whose payload has those field values (`node_id="node-1"`)."""
        conn = self._connect()
        if conn is None:
            return []
        try:
            rows = conn.execute(
                f"SELECT {_COLUMNS}, data FROM events WHERE position > ? AND type != ? "
                "ORDER BY position",
                (self._read_to, HEARTBEAT),
            ).fetchall()
            self._events += self._envelopes(rows)
            if self._events:
                self._read_to = self._events[-1].position
            found = list(self._events)
            if heartbeats or HEARTBEAT in types:
                rows = conn.execute(
                    f"SELECT {_COLUMNS}, data FROM events WHERE type = ?", (HEARTBEAT,)
                ).fetchall()
                found = sorted(found + self._envelopes(rows), key=lambda e: e.position)
        finally:
            conn.close()
        if types:
            found = [e for e in found if e.type in types]
        if match:
            found = [e for e in found if _matches(e, match)]
        return found

    async def wait_for_event(
        self, *types: str, after: int = 0, timeout: float = 20.0, **match: Any
    ) -> Envelope:
        """The first event of `types` past position `after` whose payload matches `match`."""

        def first() -> Envelope | None:
            return next((e for e in self.events(*types, **match) if e.position > after), None)

        return await self.wait_until(
            first, timeout=timeout, why=f"event {'|'.join(types)} {match} after #{after}"
        )

    # -- waiting --------------------------------------------------------------------------

    @overload
    async def wait_until(
        self,
        predicate: Callable[[], Awaitable[T | None]],
        *,
        timeout: float,
        interval: float = 0.1,
        why: str = "",
    ) -> T: ...

    @overload
    async def wait_until(
        self,
        predicate: Callable[[], T | None],
        *,
        timeout: float,
        interval: float = 0.1,
        why: str = "",
    ) -> T: ...

    async def wait_until(
        self,
        predicate: Callable[[], Any],
        *,
        timeout: float,
        interval: float = 0.1,
        why: str = "",
    ) -> Any:
        """Poll `predicate` (sync or async) every `interval` s until it returns something
        truthy, and return that; AssertionError after `timeout` s, with the last value, the
        last error, the processes that died and the tail of the log. Bus errors (no
        controller answering, a timeout) count as 'not yet'."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: Any = None
        error: BaseException | None = None
        while True:
            try:
                value = predicate()
                if inspect.isawaitable(value):
                    value = await value
                if value:
                    return value
                last, error = value, None
            except (BusError, ApiError) as exc:
                error = exc
            if loop.time() >= deadline:
                raise AssertionError(
                    f"not within {timeout:g} s: {why or predicate!r}; last value {last!r}; "
                    f"last error {error!r}\n{self.diagnostics()}"
                )
            await asyncio.sleep(interval)

    def diagnostics(self, events: int = 25) -> str:
        """Dead processes and the last events, for failure messages."""
        lines = []
        for child in (self.controller, *self.agents.values()):
            if child is not None and child.popen.poll() is not None and child not in self._reaped:
                lines.append(
                    f"  {child.name} exited {child.popen.returncode}: "
                    f"{self.log_tail(child.log_path)}"
                )
        try:
            tail = self.events()[-events:]
        except sqlite3.Error as exc:
            tail = []
            lines.append(f"  (event log unreadable: {exc})")
        lines += [f"  #{e.position} {e.type} {describe(e)}" for e in tail]
        return "stack:\n" + "\n".join(lines)

    @staticmethod
    def log_tail(path: Path, lines: int = 5) -> str:
        try:
            text = path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:])


def payload(envelope: Envelope) -> dict[str, Any]:
    """The event's payload as plain JSON-ish data (its `type` tag dropped)."""
    data: dict[str, Any] = msgspec.to_builtins(envelope.payload)
    data.pop("type", None)
    return data


def describe(envelope: Envelope) -> str:
    p = payload(envelope)
    keep = ("node_id", "replica_id", "epoch", "state", "reason", "status", "detail", "address")
    return " ".join(f"{k}={p[k]}" for k in keep if k in p)


def _matches(envelope: Envelope, match: Mapping[str, Any]) -> bool:
    p = envelope.payload
    return all(getattr(p, key, _MISSING) == value for key, value in match.items())


_MISSING = object()


@asynccontextmanager
async def started_stack(
    root: Path, agents: int, nats_binary: Path, *, controller_args: Sequence[str] = ()
) -> AsyncIterator[Stack]:
    """A Stack started with `agents` agents, all healthy; on exit, every process it started
    must be gone (the teardown asserts it)."""
    stack = Stack(root, agents=agents, nats_binary=nats_binary, controller_args=controller_args)
    try:
        await stack.start()
        yield stack
    finally:
        left = await stack.close()
        assert left == [], f"processes survived the teardown: {left}"
