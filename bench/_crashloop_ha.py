"""`bench/crashloop.py --ha`: the crash loop on a stack in high-availability shape (a helper of
bench/crashloop.py, not a benchmark of its own).

The stack, every part its own process on 127.0.0.1: 3 nats-servers joined by routes
(wire/nats_cluster.py), 2 `gpumesh controller --event-log jetstream` (`ctl-a`, `ctl-b`, each
with a data directory of its own: they share nothing but NATS, and the log of record is the
R3 JetStream stream GPUMESH_LOG), N agents with fake GPUs, and two `gpumesh gateway`s. Client
load through the gateways (closed-loop clients, half streaming; half of them send to one
gateway first, half to the other, and a request whose gateway refused the connection or closed
it before any byte of an answer goes to the other, as a load balancer in front of them
retries: nothing else is retried) and the control API workload of bench/_crashloop_common.py
run throughout.

The killer draws a victim among {the leading controller, the standby, one nats-server, an
agent, one of the gateways}, SIGKILLs it, and starts it again after 0-1 s. Only one nats-server is
ever down: before it kills a server it waits until the last one it killed is back and every
stream's copies are current again (bounded; the wait is reported).

Then it lets everything settle and checks:

  - the JetStream log: positions strictly rising, every event id once, every stream's
    versions 1..n with no gap or repeat (heartbeat streams, which compaction trims, apart);
    every event the workload saw committed is there at its position; every acknowledged
    operation has its event, once, in the order acknowledged (check_ops_in_order);
  - the events stream (GPUMESH_EVENTS, the outbox's copy): every log position once, in order,
    once it holds the log's head (waited for, up to OUTBOX_TIMEOUT_S: outbox_caught_up_s);
  - live state equals a rebuild of the log on every controller: the leader's through its
    control API (clusters, replicas and their epochs and states, node health), and then the
    standby's: its roster entry has applied the log's head, and after the leader is stopped
    cleanly (SIGTERM: it releases the lease) the standby leads from the state it followed, and
    its API is compared with a rebuild the same way;
  - no two leaders: from each controller process's JSON log, the intervals from
    `leadership_won` to `leadership_lost` / `leadership_released` / its SIGKILL never overlap
    between processes (one machine, one wall clock); terms rise with time; every event is
    stamped (recorded_at) inside some leader's interval, and in log order the terms those
    intervals belong to never go down (no event of a term after a later term's first event);
    each term's `controller.grace.v1` names the controller that led it;
  - requests failed before their first byte (a status other than 200, or no gateway took
    it), counted and attributed to the victim of the last kill before each failure; and how
    many were sent to the other gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import json
import os
import random
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import msgspec
import nats.errors
from nats.js import JetStreamContext

import projections
from actors.errors import ControllerError
from actors.roster import Roster
from bench._crashloop_common import Ledger, check_ops_in_order, operations, ops_problems, say
from bench._gateway_process import GatewayProcess
from events.contract import subjects
from events.contract.subjects import POSITION_HEADER
from events.envelope import Envelope
from events.jetstream_store import JetStreamEventStore, JetStreamOptions
from runtime.env import BusError
from tests.integration.stack import ApiError, Stack, _Child, echo_spec
from wire.nats_cluster import wait_for_jetstream
from wire.nats_server import EmbeddedNats

T = TypeVar("T")
CONTROLLERS = ("ctl-a", "ctl-b")
GATEWAYS = ("gateway-a", "gateway-b")
VICTIMS = ("leader", "standby", "nats", "agent", "gateway")
HEARTBEAT = "node.heartbeat.v1"
LEADERSHIP = ("leadership_won", "leadership_lost", "leadership_released")
LEADER_WAIT_S = 15.0  # a "leader" victim drawn while none leads: wait this long for one
NATS_READY_S = 30.0  # before a server is killed, the last one back and every stream current
SETTLE_TIMEOUT_S = 120.0
COMPARE_TIMEOUT_S = 30.0
OUTBOX_TIMEOUT_S = 30.0  # settled: the events stream holds the log's head within this long
ATTRIBUTE_WINDOW_S = 15.0  # a failed request is put down to a kill this recent at most


@dataclass
class Proc:
    """One controller process: its log file and where its lines begin there."""

    name: str
    child: _Child | None
    log_path: Path
    offset: int
    started_ns: int
    ended_ns: int | None = None  # reaped after SIGKILL, or exited


@dataclass
class Kill:
    n: int
    victim: str  # its class, one of VICTIMS
    detail: str
    at_ns: int
    back_ns: int = 0
    waited_s: float = 0.0  # before the kill: for a leader, or for NATS to be whole
    serving_ns: int = 0  # a gateway: when the restarted one accepted connections again


@dataclass
class Request:
    stream: bool
    start_ns: int
    end_ns: int = 0
    status: int = 0
    error: str = ""
    done: bool = False
    error_event: bool = False
    other_gateway: bool = False  # its first gateway had gone: sent to the other

    @property
    def before_first_byte(self) -> bool:
        return self.status != 200

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error_event and not self.error


@dataclass
class Ha:
    stack: Stack
    workdir: Path
    # Two, as a production setup runs them behind a load balancer or DNS: a client whose
    # gateway is gone (or went away before answering) sends to the other (client, below).
    gateways: list[GatewayProcess]
    procs: list[Proc] = field(default_factory=list)  # every controller process, in start order
    kills: list[Kill] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    # Processes that exited on their own (not killed): (what, when, the last log line).
    exits: list[tuple[str, int, str]] = field(default_factory=list)
    # Held while the killer kills and restarts, and while the supervisor looks.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    watchers: list[asyncio.Task[None]] = field(default_factory=list)
    keep: bool = False  # --keep: write what the checks saw beside the logs

    @property
    def servers(self) -> list[EmbeddedNats]:
        assert self.stack.nats_cluster is not None
        return self.stack.nats_cluster.servers

    def current(self, name: str) -> Proc:
        return next(p for p in reversed(self.procs) if p.name == name)

    def start_controller(self, name: str) -> Proc:
        log_path = self.stack.logs / f"controller-{name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        child = self.stack.start_standby(name, data_dir=self.workdir / f"data-{name}")
        proc = Proc(name, child, log_path, offset, time.time_ns())
        self.procs.append(proc)
        return proc

    async def kill_controller(self, proc: Proc) -> None:
        assert proc.child is not None
        await self.stack.kill_standby(proc.child)
        proc.ended_ns = time.time_ns()

    def leading(self) -> str | None:
        """The live controller whose own log says it leads now."""
        for name in CONTROLLERS:
            proc = self.current(name)
            if proc.ended_ns is None and _leads_now(proc):
                return name
        return None


def _lines(proc: Proc) -> list[dict[str, Any]]:
    """The JSON log lines of one process (its part of the file), each with `at_ns`."""
    out: list[dict[str, Any]] = []
    try:
        with proc.log_path.open("rb") as f:
            f.seek(proc.offset)
            raw = f.read()
    except OSError:
        return out
    for i, line in enumerate(raw.decode(errors="replace").splitlines()):
        if not line.startswith("{"):
            if line.startswith("# ") and i > 0:
                break  # the next process's header (a restart of the same name)
            continue
        with contextlib.suppress(ValueError, KeyError, TypeError):
            entry = json.loads(line)
            stamp = dt.datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00"))
            entry["at_ns"] = int(stamp.timestamp() * 1e9)
            out.append(entry)
    return out


def _leads_now(proc: Proc) -> bool:
    events = [e["event"] for e in _lines(proc) if e.get("event") in LEADERSHIP]
    return bool(events) and events[-1] == "leadership_won"


# -- the stack ---------------------------------------------------------------------------------


async def start_ha(stack: Stack, workdir: Path) -> Ha:
    """Start the Stack (its own controller on a JetStream log), then the two named ones, and
    hand over from the Stack's controller to them (SIGTERM releases the lease), so that each
    controller has a name that a restart keeps."""
    await stack.start(timeout=90)
    assert stack.controller is not None
    first = Proc("initial", stack.controller, stack.controller.log_path, 0, time.time_ns())
    gateways = [GatewayProcess(stack, name=name) for name in GATEWAYS]
    ha = Ha(stack, workdir, gateways, procs=[first])
    for name in CONTROLLERS:
        ha.start_controller(name)
    await asyncio.sleep(1.0)  # they open and follow the log, and campaign
    await stack.stop_controller()
    first.ended_ns = time.time_ns()
    await stack.wait_until(ha.leading, timeout=30, why="ctl-a or ctl-b leads")
    await stack.wait_until(stack.nodes, timeout=30, why="the control API answers")
    return ha


# -- client load -------------------------------------------------------------------------------


# What a load balancer in front of the gateways retries on another one (haproxy's
# `retry-on conn-failure empty-response`): the connection failed, or closed before any byte of
# an answer. As the gateway itself retries a replica: only a request that had not begun.
# ClientOSError covers a refused connect (ClientConnectorError) and one reset before any answer.
_NOT_BEGUN = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)


async def client(ha: Ha, index: int, stop: asyncio.Event) -> None:
    stream = index % 2 == 1
    body = {
        "model": "stable",
        "messages": [{"role": "user", "content": "crash loop " * 4}],
        "stream": stream,
    }
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while not stop.is_set():
            r = Request(stream=stream, start_ns=time.time_ns())
            first = index // 2 % len(ha.gateways)  # each gateway first for half the clients
            order = ha.gateways[first:] + ha.gateways[:first]
            for gateway in order:
                r.error = ""
                try:
                    url = f"{gateway.url}/v1/chat/completions"
                    async with http.post(url, json=body) as resp:
                        r.status = resp.status
                        data = await resp.read()
                        if resp.status == 200:
                            r.done = b"[DONE]" in data if stream else b'"choices"' in data
                            r.error_event = b"event: error" in data
                except _NOT_BEGUN as exc:
                    r.error = type(exc).__name__
                    if r.status == 0:
                        r.other_gateway = gateway is not order[-1]
                        continue
                except (aiohttp.ClientError, TimeoutError) as exc:
                    r.error = type(exc).__name__
                break
            r.end_ns = time.time_ns()
            ha.requests.append(r)
            if r.error and r.status == 0:
                await asyncio.sleep(0.05)  # no gateway answers: do not spin


# -- the killer --------------------------------------------------------------------------------


async def _nats_ready(ha: Ha) -> str:
    """Until the server killed last is back and every stream's copies are current (bounded:
    what was not is said)."""
    try:
        await wait_for_jetstream(ha.stack.url, replicas=3, timeout=NATS_READY_S)
        await ha.stack.wait_until(
            lambda: _streams_current(ha.stack), timeout=NATS_READY_S, interval=0.25
        )
    except (AssertionError, TimeoutError, nats.errors.Error) as exc:
        return f" (NATS not whole after {NATS_READY_S:g} s: {type(exc).__name__})"
    return ""


async def supervise(ha: Ha, stop: asyncio.Event) -> None:
    """What a service manager does (systemd Restart=always, RestartSec=1): a controller, agent
    or gateway that exited on its own, not by the killer's hand, is started again after 1 s.
    Each such exit is recorded with the last line it logged."""
    stack = ha.stack
    while not stop.is_set():
        await asyncio.sleep(0.25)
        async with ha.lock:
            gone: list[tuple[str, Any]] = []
            for name in CONTROLLERS:
                proc = ha.current(name)
                if proc.ended_ns is None and proc.child and proc.child.popen.poll() is not None:
                    proc.ended_ns = time.time_ns()
                    gone.append((f"controller {name}", proc.log_path))
            for node, child in stack.agents.items():
                if child.popen.poll() is not None:
                    gone.append((f"agent {node}", child.log_path))
            for gw in ha.gateways:
                if gw.proc is not None and gw.proc.poll() is not None:
                    gone.append((f"gateway {gw.name}", stack.logs / f"{gw.name}.log"))
            if not gone:
                continue
            for what, log_path in gone:
                tail = Stack.log_tail(log_path, 1)
                ha.exits.append((what, time.time_ns(), tail[:300]))
                say(f"{what} exited on its own: {tail[:200]}")
            await asyncio.sleep(1.0)
            for what, _ in gone:
                kind, _, name = what.partition(" ")
                if kind == "controller":
                    ha.start_controller(name)
                elif kind == "agent":
                    stack.start_agent(name)
                else:
                    next(gw for gw in ha.gateways if gw.name == name).start()


async def killer(ha: Ha, rng: random.Random, count: int) -> None:
    for n in range(1, count + 1):
        await asyncio.sleep(rng.uniform(0.3, 2.0))
        victim = rng.choice(VICTIMS)
        pause = rng.uniform(0.0, 1.0)
        # Which agent, server or controller: drawn here, so that the sequence of victims a seed
        # gives does not depend on what the stack was doing.
        pick = rng.random()
        began = time.monotonic()
        if victim == "leader" and ha.leading() is None:
            with contextlib.suppress(AssertionError):
                await ha.stack.wait_until(ha.leading, timeout=LEADER_WAIT_S, why="a leader")
        async with ha.lock:
            await _kill_one(ha, pick, n, count, victim, pause, began)


async def _kill_one(
    ha: Ha, pick: float, n: int, count: int, victim: str, pause: float, began: float
) -> None:
    """SIGKILL one victim and start it again after `pause` s."""
    stack = ha.stack
    kill = Kill(n, victim, "", 0)
    if victim in ("leader", "standby"):
        leader = ha.leading()
        if victim == "leader":
            name = leader or _one(CONTROLLERS, pick)
            kill.detail = name if leader else f"{name} (none led)"
        else:
            name = next((c for c in CONTROLLERS if c != leader), CONTROLLERS[0])
            if leader is None:
                name = _one(CONTROLLERS, pick)
            kill.detail = name if leader else f"{name} (none led)"
        proc = ha.current(name)
        kill.waited_s = time.monotonic() - began
        kill.at_ns = time.time_ns()
        await ha.kill_controller(proc)
        await asyncio.sleep(pause)
        ha.start_controller(name)
    elif victim == "nats":
        whole = await _nats_ready(ha)
        kill.waited_s = time.monotonic() - began
        server = _one(ha.servers, pick)
        log_leader = await _stream_leader(stack, "GPUMESH_LOG")
        server_name = server.cluster.server_name if server.cluster is not None else "?"
        led = " (led GPUMESH_LOG)" if log_leader == server_name else ""
        kill.detail = f"{server_name}{led}{whole}"
        assert server.pid is not None
        kill.at_ns = time.time_ns()
        os.kill(server.pid, signal.SIGKILL)
        await server.stop()  # reaps it; the port is kept for the restart
        await asyncio.sleep(pause)
        await server.start()
    elif victim == "agent":
        node = _one(sorted(stack.agents), pick)
        kill.detail = node
        kill.at_ns = time.time_ns()
        await stack.kill_agent(node)
        await asyncio.sleep(pause)
        stack.start_agent(node)
    else:
        gateway = _one(ha.gateways, pick)
        kill.detail = gateway.name
        kill.at_ns = time.time_ns()
        await gateway.kill()
        await asyncio.sleep(pause)
        gateway.start()
        ha.watchers.append(asyncio.create_task(_until_listening(gateway, kill)))
    kill.back_ns = time.time_ns()
    ha.kills.append(kill)
    stamp = dt.datetime.fromtimestamp(kill.at_ns / 1e9, dt.UTC).strftime("%H:%M:%S.%f")[:-3]
    say(f"kill {n}/{count} at {stamp}: {victim} {kill.detail} (back after {pause:.2f} s)")


async def _streams_current(stack: Stack) -> bool:
    """Every stream has a leader and every copy of it is current."""
    try:
        streams = await stack.bus.jetstream(timeout=2.0).streams_info()
    except (nats.errors.Error, TimeoutError):
        return False
    for info in streams:
        cluster = info.cluster
        if cluster is None or cluster.leader is None:
            return False
        if any(not r.current or r.offline or r.lag for r in cluster.replicas or []):
            return False
    return True


async def _stream_leader(stack: Stack, stream: str) -> str | None:
    """The server leading `stream`, if it can be told now."""
    with contextlib.suppress(nats.errors.Error, TimeoutError):
        info = await stack.bus.jetstream(timeout=2.0).stream_info(stream)
        return info.cluster.leader if info.cluster is not None else None
    return None


def _one(options: Sequence[T], pick: float) -> T:
    return options[min(len(options) - 1, int(pick * len(options)))]


async def _until_listening(gateway: GatewayProcess, kill: Kill) -> None:
    """Sets kill.serving_ns once the restarted gateway accepts a connection (for 60 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.close()
        kill.serving_ns = time.time_ns()
        return


async def settle(ha: Ha) -> float:
    """Until every process is up, one controller leads and answers, JetStream can place three
    copies and every stream is current, and the gateway answers."""
    began = time.monotonic()
    stack = ha.stack
    await wait_for_jetstream(stack.url, replicas=3, timeout=SETTLE_TIMEOUT_S)
    await stack.wait_until(ha.leading, timeout=SETTLE_TIMEOUT_S, why="a leader")
    await stack.wait_until(stack.nodes, timeout=SETTLE_TIMEOUT_S, why="the control API")
    await stack.wait_until(
        lambda: _streams_current(stack), timeout=SETTLE_TIMEOUT_S, interval=0.25, why="streams"
    )

    async def healthy() -> bool:
        nodes = await stack.nodes()
        return len(nodes) >= len(stack.node_ids) and all(
            n["health"] == "healthy" for n in nodes if n["node_id"] in stack.node_ids
        )

    await stack.wait_until(healthy, timeout=SETTLE_TIMEOUT_S, why="every node healthy")
    # The outbox catching up with the log is waited for in check_all (outbox_caught_up), for
    # the head of the very log that check_outbox compares.
    return round(time.monotonic() - began, 1)


# -- the checks --------------------------------------------------------------------------------


async def read_log(stack: Stack) -> list[Envelope]:
    """The whole JetStream log, in position order, through a store of the bench's own."""
    options = JetStreamOptions(replicas=stack.bus.stream_replicas)
    store = await JetStreamEventStore.open(stack.bus.client, options)
    try:
        log: list[Envelope] = []
        position = 1
        while True:
            page = await store.read_all(position, 5000)
            if not page:
                return log
            log += page
            position = page[-1].position + 1
    finally:
        await store.close()


def check_log(log: list[Envelope], ledger: Ledger) -> list[str]:
    problems: list[str] = []
    positions = [e.position for e in log]
    if any(b <= a for a, b in itertools.pairwise(positions)):
        problems.append("log positions do not rise")
    ids = Counter(e.event_id for e in log)
    twice = [i for i, c in ids.items() if c > 1]
    if twice:
        problems.append(f"{len(twice)} event ids more than once: {twice[:3]}")
    versions: dict[str, list[int]] = {}
    for e in log:
        versions.setdefault(e.stream, []).append(e.version)
    gaps = [
        s
        for s, vs in versions.items()
        if not s.startswith("heartbeat/") and vs != list(range(1, len(vs) + 1))
    ]
    if gaps:
        problems.append(f"{len(gaps)} streams whose versions are not 1..n: {gaps[:3]}")
    by_id = {e.event_id: e.position for e in log}
    lost = [i for i, pos in ledger.seen_events.items() if by_id.get(i) != pos]
    if lost:
        problems.append(f"{len(lost)} events seen committed are gone or moved: {lost[:3]}")
    return problems


async def _events_head(js: JetStreamContext) -> int:
    """The log position on the events stream's last message (0: none, or no stream yet)."""
    info = await js.stream_info(subjects.EVENTS_STREAM)
    if not info.state.messages:
        return 0
    raw = await js.get_msg(subjects.EVENTS_STREAM, int(info.state.last_seq))
    return int((raw.headers or {}).get(POSITION_HEADER, 0))


async def outbox_caught_up(stack: Stack, head: int) -> dict[str, Any]:
    """Until the events stream holds log position `head` (its last message's position is at
    least that), for up to OUTBOX_TIMEOUT_S: the outbox, in the leading controller, follows the
    log and may be paused (backing off) after an outage. Not caught up by then is not hidden:
    check_outbox reports what is missing."""
    began = time.monotonic()
    js = stack.bus.jetstream(timeout=2.0)
    seen = 0
    while True:
        with contextlib.suppress(nats.errors.Error, TimeoutError, ValueError):
            seen = await _events_head(js)
        waited = round(time.monotonic() - began, 2)
        if seen >= head:
            return {"caught_up": True, "waited_s": waited, "head": head}
        if waited > OUTBOX_TIMEOUT_S:
            return {"caught_up": False, "waited_s": waited, "head": head, "events_head": seen}
        await asyncio.sleep(0.2)


async def check_outbox(stack: Stack, log: list[Envelope]) -> tuple[int, list[str]]:
    """GPUMESH_EVENTS, the outbox's copy of the log: each log position once, in order."""
    js = stack.bus.jetstream(timeout=10.0)
    published: list[int] = []
    info = await js.stream_info(subjects.EVENTS_STREAM)
    sub = await js.subscribe(subjects.EVENTS_ALL, ordered_consumer=True)
    try:
        while len(published) < info.state.messages:
            msg = await sub.next_msg(timeout=10.0)
            published.append(int(msg.headers["Gpumesh-Position"]) if msg.headers else -1)
    finally:
        await sub.unsubscribe()
    positions = [e.position for e in log]
    head = positions[-1] if positions else 0
    problems = []
    if any(b <= a for a, b in itertools.pairwise(published)):
        problems.append("the events stream's positions do not rise (a repeat or a reorder)")
    missing = sorted(set(positions) - set(published))
    # Past the head read a moment ago: written since (heartbeats go on), not extra.
    extra = sorted(p for p in set(published) - set(positions) if p <= head)
    if missing or extra:
        problems.append(
            f"the events stream lacks {len(missing)} log positions {missing[:3]} and has "
            f"{len(extra)} the log does not {extra[:3]}"
        )
    return len(published), problems


def _state_view(state: Any) -> dict[str, Any]:
    """What the API shows of a fold, heartbeat-driven fields left out."""
    clusters = {}
    for name, view in state.clusters.clusters.items():
        replicas = sorted(
            (r for r in state.replicas.replicas.values() if r.cluster == name),
            key=lambda r: r.replica_id,
        )
        clusters[name] = {
            "desired": view.spec.replicas,
            "unschedulable": view.unschedulable,
            "replicas": [
                [r.replica_id, r.node_id, r.epoch, r.status, r.address, r.failure_reason]
                for r in replicas
            ],
        }
    nodes = {
        n.node_id: [n.health, n.health_reason, n.drained, n.version]
        for n in state.nodes.nodes.values()
    }
    return {"clusters": clusters, "nodes": nodes}


async def _api_view(stack: Stack) -> dict[str, Any]:
    clusters = {}
    for c in await stack.api("cluster.list", {}, timeout=10.0):
        clusters[c["name"]] = {
            "desired": c["desired"],
            "unschedulable": c["unschedulable"],
            "replicas": [
                [r["replica_id"], r["node_id"], r["epoch"], r["status"], r["address"], r["failure"]]
                for r in c["replicas"]
            ],
        }
    nodes = {
        n["node_id"]: [n["health"], n["health_reason"], n["drained"], n["version"]]
        for n in await stack.api("node.list", {}, timeout=10.0)
    }
    return {"clusters": clusters, "nodes": nodes}


def _non_heartbeat_head(log: list[Envelope]) -> int:
    return max((e.position for e in log if e.type != HEARTBEAT), default=0)


async def live_equals_rebuild(stack: Stack) -> dict[str, Any]:
    """The leader's state through its API against a rebuild of the log; taken when no event
    but heartbeats was written around the API's answer (read the log, ask, read again), and
    asked again for up to COMPARE_TIMEOUT_S while they differ or the log moves."""
    deadline = time.monotonic() + COMPARE_TIMEOUT_S
    tries = 0
    last: dict[str, Any] = {}
    while True:
        tries += 1
        before = await read_log(stack)
        live = await _api_view(stack)
        after = await read_log(stack)
        still = _non_heartbeat_head(before) == _non_heartbeat_head(after)
        rebuilt = _state_view(projections.rebuild(before))
        if still and live == rebuilt:
            return {"equal": True, "tries": tries, "position": _non_heartbeat_head(before)}
        if still:
            last = _diff(live, rebuilt)
        if time.monotonic() > deadline:
            return {"equal": False, "tries": tries, "difference": last or "the log kept moving"}
        await asyncio.sleep(1.0)


def _diff(live: dict[str, Any], rebuilt: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in ("clusters", "nodes"):
        a, b = live[part], rebuilt[part]
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                out[f"{part}/{key}"] = {"live": a.get(key), "rebuilt": b.get(key)}
    return dict(list(out.items())[:4])


async def standby_applied(stack: Stack, standby: str) -> dict[str, Any]:
    """The standby's roster entry reaches the log's head as it stood when asked."""
    head = (await read_log(stack))[-1].position
    roster = Roster(stack.bus)

    async def reached() -> dict[str, Any] | None:
        try:
            entries = {e.controller_id: e for e in await roster.entries()}
        except ControllerError:
            return None
        entry = entries.get(standby)
        if entry is not None and entry.role == "standby" and entry.applied >= head:
            return msgspec.to_builtins(entry)  # type: ignore[no-any-return]
        return None

    try:
        entry = await stack.wait_until(reached, timeout=20, why=f"{standby} applied {head}")
    except AssertionError:
        return {"reached_head": False, "head": head}
    return {"reached_head": True, "head": head, "applied": entry["applied"]}


async def every_controller(ha: Ha) -> dict[str, Any]:
    """Live equals rebuild on the leader; then on the standby, once the leader has handed
    over to it (SIGTERM: the leader stops and releases the lease)."""
    stack = ha.stack
    leader = ha.leading()
    assert leader is not None
    standby = next(c for c in CONTROLLERS if c != leader)
    out: dict[str, Any] = {"leader": leader, "standby": standby}
    out["leader_state"] = await live_equals_rebuild(stack)
    out["standby_roster"] = await standby_applied(stack, standby)
    proc = ha.current(leader)
    assert proc.child is not None
    proc.child.popen.send_signal(signal.SIGTERM)
    await asyncio.to_thread(proc.child.popen.wait, 30)
    proc.ended_ns = time.time_ns()
    if proc.child in stack.standbys:
        stack.standbys.remove(proc.child)
    await stack.wait_until(
        lambda: ha.leading() == standby, timeout=30, why=f"{standby} leads after the hand-over"
    )
    await stack.wait_until(stack.nodes, timeout=30, why="the control API answers")
    out["standby_state_after_handover"] = await live_equals_rebuild(stack)
    return out


# -- no two leaders ----------------------------------------------------------------------------


@dataclass
class Term:
    controller: str  # the process's name (ctl-a, ctl-b, initial)
    controller_id: str
    term: int
    won_ns: int
    end_ns: int  # lost/released, else the process's death, else now
    ended_by: str


def terms(ha: Ha, now_ns: int) -> list[Term]:
    found: list[Term] = []
    for proc in ha.procs:
        open_term: Term | None = None
        for e in _lines(proc):
            kind = e.get("event")
            if kind == "leadership_won":
                cid = str(e.get("controller", proc.name))
                open_term = Term(proc.name, cid, int(e["term"]), e["at_ns"], 0, "")
            elif kind in ("leadership_lost", "leadership_released") and open_term is not None:
                open_term.end_ns, open_term.ended_by = e["at_ns"], f"{kind}: {e.get('reason', '')}"
                found.append(open_term)
                open_term = None
        if open_term is not None:
            open_term.end_ns = proc.ended_ns or now_ns
            open_term.ended_by = "SIGKILL" if proc.ended_ns else "still leading"
            found.append(open_term)
    return sorted(found, key=lambda t: t.won_ns)


def check_leaders(ha: Ha, log: list[Envelope]) -> tuple[dict[str, Any], list[str]]:
    now_ns = time.time_ns()
    found = terms(ha, now_ns)
    problems: list[str] = []
    overlaps = [
        f"{a.controller} term {a.term} and {b.controller} term {b.term} overlap by "
        f"{(min(a.end_ns, b.end_ns) - b.won_ns) / 1e6:.0f} ms ({a.ended_by})"
        for i, a in enumerate(found)
        for b in found[i + 1 :]
        if b.won_ns < a.end_ns and a.won_ns < b.end_ns
    ]
    if overlaps:
        problems.append(f"{len(overlaps)} leadership intervals overlap: {overlaps[:3]}")
    falling = [(a.term, b.term) for a, b in itertools.pairwise(found) if b.term <= a.term]
    if falling:
        problems.append(f"terms do not rise with time: {falling[:3]}")
    # Each event to the interval its stamp falls in; in log order, those terms never go down.
    unattributed: list[int] = []
    back_in_time: list[str] = []
    grace_mismatch: list[str] = []
    highest: Term | None = None
    per_term: Counter[int] = Counter()
    for e in log:
        owner = next((t for t in found if t.won_ns <= e.recorded_at <= t.end_ns), None)
        if owner is None:
            unattributed.append(e.position)
            continue
        per_term[owner.term] += 1
        if highest is not None and owner.term < highest.term:
            back_in_time.append(
                f"#{e.position} {e.type} stamped in term {owner.term} ({owner.controller}) "
                f"after term {highest.term}'s first event"
            )
        if highest is None or owner.term > highest.term:
            highest = owner
        if e.type == "controller.grace.v1":
            cid = getattr(e.payload, "controller_id", "")
            if cid != owner.controller_id:
                grace_mismatch.append(f"#{e.position} by {cid} in term {owner.term}")
    if back_in_time:
        problems.append(f"{len(back_in_time)} events of a term after a later term's: "
                        f"{back_in_time[:3]}")  # fmt: skip
    if unattributed:
        problems.append(
            f"{len(unattributed)} events stamped outside every leader's interval: "
            f"{unattributed[:5]}"
        )
    if grace_mismatch:
        problems.append(f"grace events by a controller that did not lead: {grace_mismatch[:3]}")
    summary = {
        "terms": len(found),
        "terms_by_end": dict(Counter(t.ended_by.split(":")[0] for t in found)),
        "overlaps": len(overlaps),
        "events_attributed": sum(per_term.values()),
        "events_unattributed": len(unattributed),
        "events_after_a_later_term": len(back_in_time),
        "shortest_gap_between_terms_ms": min(
            ((b.won_ns - a.end_ns) / 1e6 for a, b in itertools.pairwise(found)),
            default=None,
        ),
    }
    return summary, problems


# -- requests ----------------------------------------------------------------------------------


def request_figures(ha: Ha) -> dict[str, Any]:
    reqs = ha.requests
    early = [r for r in reqs if r.before_first_byte]
    late = [r for r in reqs if not r.before_first_byte and not r.ok]
    by_victim: dict[str, Counter[str]] = {}
    gateway_down = [
        (k.at_ns, k.serving_ns or k.back_ns + 60_000_000_000)
        for k in ha.kills
        if k.victim == "gateway"
    ]
    down_s = sum(b - a for a, b in gateway_down) / 1e9
    for r in early + late:
        if r.status == 0 and any(a <= r.end_ns <= b + 100_000_000 for a, b in gateway_down):
            by_victim.setdefault("gateway (not listening)", Counter())[r.error] += 1
            continue
        kill = next(
            (
                k
                for k in reversed(ha.kills)
                if k.at_ns <= r.end_ns <= k.back_ns + int(ATTRIBUTE_WINDOW_S * 1e9)
            ),
            None,
        )
        where = kill.victim if kill is not None else "no kill near"
        what = (str(r.status) if r.status else r.error) if r in early else "after first byte"
        by_victim.setdefault(where, Counter())[what] += 1
    return {
        "sent": len(reqs),
        "streaming": sum(1 for r in reqs if r.stream),
        "succeeded": sum(1 for r in reqs if r.ok),
        "failed_before_first_byte": len(early),
        "failed_after_first_byte": len(late),
        "sent_to_the_other_gateway": sum(1 for r in reqs if r.other_gateway),
        "failed_before_first_byte_while_no_gateway_listened": sum(
            by_victim.get("gateway (not listening)", Counter()).values()
        ),
        "gateway_not_listening_s": round(down_s, 1),
        "failures_by_last_victim": {k: dict(v) for k, v in sorted(by_victim.items())},
    }


# -- the run -----------------------------------------------------------------------------------


async def run_ha(
    *, kills: int, seed: int, agents: int, clients: int, keep: str | None
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    # SIGTERM (a CI timeout, say) as Ctrl-C: cancel, so that every process is stopped.
    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    rng = random.Random(seed)
    ledger = Ledger()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpumesh-crashloop-ha-") as tmp:
        workdir = Path(keep) if keep else Path(tmp)
        stack = Stack(
            workdir / "stack",
            agents=agents,
            nats_servers=3,
            controller_args=["--event-log", "jetstream"],
        )
        ha: Ha | None = None
        try:
            ha = await start_ha(stack, workdir)
            ha.keep = bool(keep)
            say(f"stack up: 3 nats-servers, {' and '.join(CONTROLLERS)}, {agents} agents")
            await stack.create_cluster(echo_spec(2, name="stable"))
            for gateway in ha.gateways:
                gateway.start()
            await stack.wait_until(
                lambda: _gateway_serves(ha), timeout=60, why="both gateways serve `stable`"
            )
            stop, unsupervised = asyncio.Event(), asyncio.Event()
            supervisor = asyncio.create_task(supervise(ha, unsupervised))
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(operations(stack, rng, ledger, stop))
                    for i in range(clients):
                        tasks.create_task(client(ha, i, stop))
                    await killer(ha, random.Random(seed + 1), kills)
                    say("kills done; settling")
                    await asyncio.sleep(3.0)  # the load sees the stack after the last kill
                    stop.set()
                settled_s = await settle(ha)
            finally:
                unsupervised.set()
                await supervisor
            say(f"settled in {settled_s} s; checking")
            result = await check_all(ha, ledger)
            result["settle_s"] = settled_s
        finally:
            if ha is not None:
                for task in ha.watchers:
                    task.cancel()
                for gateway in ha.gateways:
                    await gateway.kill()
                if keep:
                    _write_timeline(ha, workdir / "timeline.json")
            left = await stack.close()
            if left:
                say(f"processes that would not die: {left}")
    result.update(
        mode="ha",
        kills=dict(Counter(k.victim for k in ha.kills)),
        kills_total=len(ha.kills),
        kill_details=dict(Counter(f"{k.victim} {k.detail}" for k in ha.kills)),
        waited_before_kills_s=round(sum(k.waited_s for k in ha.kills), 1),
        exited_on_their_own=dict(Counter(what for what, _, _ in ha.exits)),
        exit_reasons=dict(Counter(f"{w.split()[0]}: {tail[-160:]}" for w, _, tail in ha.exits)),
        wall_s=round(time.perf_counter() - started, 1),
        seed=seed,
        clients=clients,
    )
    return result


def _write_operations(ledger: Ledger, log: list[Envelope], path: Path) -> None:
    """--keep: every operation the workload sent (sent, answered, what, outcome) and every
    cluster event of the log, each with wall-clock stamps, to match them by hand."""
    sent = [
        {"sent_ns": a, "answered_ns": b, "verb": v, "cluster": c, "replicas": r, "outcome": o}
        for a, b, v, c, r, o in ledger.trail
    ]
    events = [msgspec.to_builtins(e) for e in log if e.stream.startswith("cluster/")]
    path.write_text(json.dumps({"operations": sent, "cluster_events": events}, indent=1))


def _write_timeline(ha: Ha, path: Path) -> None:
    """--keep: the kills and the exits, with wall-clock stamps, beside the stack's logs."""
    rows = [
        {
            "at_ns": k.at_ns,
            "kill": k.n,
            "victim": k.victim,
            "detail": k.detail,
            "back_ns": k.back_ns,
            "serving_ns": k.serving_ns or None,
        }
        for k in ha.kills
    ] + [{"at_ns": at, "exited": what, "last_line": tail} for what, at, tail in ha.exits]
    rows.sort(key=lambda r: int(r["at_ns"] or 0))
    path.write_text(json.dumps(rows, indent=1))  # fmt: skip


async def _gateway_serves(ha: Ha) -> bool:
    body = {"model": "stable", "messages": [{"role": "user", "content": "up?"}]}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
            for gateway in ha.gateways:
                url = f"{gateway.url}/v1/chat/completions"
                async with http.post(url, json=body) as resp:
                    if resp.status != 200:
                        return False
        return True
    except (aiohttp.ClientError, TimeoutError):
        return False


async def check_all(ha: Ha, ledger: Ledger) -> dict[str, Any]:
    stack = ha.stack
    problems: list[str] = []
    log = await read_log(stack)
    if ha.keep:
        _write_operations(ledger, log, ha.workdir / "operations.json")
    problems += check_log(log, ledger)
    ops = check_ops_in_order(log, ledger)
    problems += ops_problems(ops)
    # Before check_outbox, and before the hand-over below stops the leader and its outbox.
    caught_up = await outbox_caught_up(stack, log[-1].position if log else 0)
    published, outbox = await check_outbox(stack, log)
    problems += outbox
    _leaders, leader_problems = check_leaders(ha, log)
    problems += leader_problems
    try:
        controllers = await every_controller(ha)
    except (AssertionError, BusError, ApiError, nats.errors.Error, TimeoutError) as exc:
        controllers = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        problems.append(f"live against rebuild not checked: {controllers['error']}")
    else:
        for key in ("leader_state", "standby_state_after_handover"):
            if not controllers[key]["equal"]:
                problems.append(f"{key}: live state differs from the rebuild: {controllers[key]}")
        if not controllers["standby_roster"]["reached_head"]:
            problems.append(f"the standby's roster entry did not reach the head: {controllers}")
    # The hand-over wrote a new term: its events and the stopped leader's end count too.
    after = await read_log(stack)
    leaders_after, late_problems = check_leaders(ha, after)
    problems += [p for p in late_problems if p not in leader_problems]
    return {
        "log_events": len(log),
        "log_head": log[-1].position if log else 0,
        "heartbeats_in_log": sum(1 for e in log if e.type == HEARTBEAT),
        "events_stream_messages": published,
        # How long the outbox took to publish the log's head once settled (None: it did not,
        # within OUTBOX_TIMEOUT_S; check_outbox says what is missing).
        "outbox_caught_up_s": caught_up["waited_s"] if caught_up["caught_up"] else None,
        "outbox_wait": caught_up,
        "ops_acknowledged": len(ledger.ops),
        "ops_by_verb": dict(Counter(v for v, _, _ in ledger.ops)),
        "ops_matched": ops["matched"],
        "unanswered_ops": sum(ledger.unanswered.values()),
        "refused": dict(ledger.refused.most_common(6)),
        "events_seen_committed": len(ledger.seen_events),
        "controllers": controllers,
        "leaders": leaders_after,
        "requests": request_figures(ha),
        "lost": problems,
    }
