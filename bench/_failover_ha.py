"""`bench/failover.py --classes ...`: the control plane's own failover, per failure class, on a
stack in high-availability shape (a helper of bench/failover.py, not a benchmark of its own).

The stack, every part its own process on 127.0.0.1: 3 nats-servers joined by routes
(wire/nats_cluster.py), 2 `gpumesh controller`s campaigning for the leader lease (`ctl-a`,
`ctl-b`; the event log on JetStream, `--event-log jetstream`, each controller with a data
directory of its own, where the controller has that option, else one SQLite file in a data
directory both share; `--event-log sqlite` forces the latter), 3 agents serving a cluster
`echo` of 3 paced, traced replicas through their fencing fronts, a cluster `probe` of 1 or 2
replicas that takes no traffic (what `cluster scale` changes), and `gpumesh gateway`.

Per class, a fresh load of N closed-loop clients through the gateway (half streaming, no
retries; bench/_failover_clients.py) and, --fault-at s into it:

    controller-kill   SIGKILL the leading controller; start it again (a standby now) once a
                      standby leads and --hold s have passed
    controller-stop   SIGSTOP the leading controller; SIGCONT it after the same; the old
                      leader, continued, must write nothing: strace, attached while it is
                      stopped, records its write system calls from SIGCONT on (the event log's
                      files; NATS publishes by subject; its own log), and its log says why it
                      stepped down
    nats-kill         SIGKILL the nats-server the leading controller is connected to (found
                      from /proc: its TCP connection's peer port); start it again after --hold
    nats-kill-lease   SIGKILL the nats-server that leads the lease's stream (GPUMESH_LEADER),
                      whose renewals then need a new stream leader; start it again likewise

Measured: the lease, read every 50 ms (as actors.leader_kv.KvLease reads it, less its making
sure of the stream, which would shrink it to two copies while a server is down): when one leads
again (a new term; for a NATS kill, a renewal written after the kill); `cluster scale probe`
sent from the fault on (1 s timeout an attempt) until a controller accepts it; the requests
that failed before their first byte and after it; offline verdicts and replicas moved (from the
event log), the gateway's retry counters. Between classes the killed process is back and the
stack steady again (two controllers, one leading; three servers, JetStream able to place three
copies; echo 3/3 and probe ready; the gateway answering), so that classes are independent.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats.errors

from actors.leader_kv import STREAM as LEASE_STREAM, SUBJECT as LEASE_SUBJECT
from actors.leadership import LeaderRecord
from bench._failover_clients import read_load
from bench._failover_common import (
    CLIENT_TIMEOUT_S,
    HELPER,
    REPLICAS,
    _log_events,
    _metric_sums,
    _ok,
    _pct,
    _Proxy,
    _proxy_answers,
    _scrape,
    _sleep_until,
    _spawn,
    _start_gateway,
    _traced_spec,
)
from bench._failover_ha_report import TARGET_S, _old_leader_writes, print_class, summarise
from runtime.errors import BusError
from tests.integration.stack import ApiError, Stack, echo_spec
from wire.nats_cluster import wait_for_jetstream
from wire.nats_server import EmbeddedNats

_LEADER_RECORD = msgspec.json.Decoder(LeaderRecord)
CLASSES = ("controller-kill", "controller-stop", "nats-kill", "nats-kill-lease")
CONTROLLERS = ("ctl-a", "ctl-b")
PROBE = "probe"  # the cluster `cluster scale` changes: it takes no client traffic
LEASE_POLL_S = 0.05
SCALE_TIMEOUT_S = 1.0
OBSERVE_S = 3.0  # the continued old leader is traced at least this long
WATCH_LIMIT_S = 30.0  # a class whose controller does not lead again by then is reported so
STEADY_TIMEOUT_S = 90.0
COUNTERS = (
    "gpumesh_gateway_retries_total",
    "gpumesh_gateway_ejections_total",
    "gpumesh_gateway_stream_errors_total",
)
_TRACED = "write,writev,pwrite64,pwritev,pwritev2,sendto,sendmsg,fsync,fdatasync,ftruncate"


@dataclass
class Settings:
    classes: list[str]
    runs: int
    clients: int
    class_seconds: float  # the load per class
    fault_at: float  # s into it
    hold: float  # the fault lasts at least this long (and until a controller leads again)
    json: bool
    keep: str | None
    controller_log: str  # "sqlite" (one shared file) or "jetstream"


@dataclass
class _Controller:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]
    starts: int = 1


@dataclass
class _Ha:
    """The stack's HA parts the bench drives itself."""

    stack: Stack
    workdir: Path
    controllers: dict[str, _Controller] = field(default_factory=dict)
    gateway: _Proxy | None = None
    probe_replicas: int = 1
    helpers: list[subprocess.Popen[bytes]] = field(default_factory=list)  # strace, the load

    @property
    def servers(self) -> list[EmbeddedNats]:
        assert self.stack.nats_cluster is not None
        return self.stack.nats_cluster.servers

    def start_controller(self, name: str) -> _Controller:
        old = self.controllers.get(name)
        if old is not None and old.popen.poll() is None:
            raise RuntimeError(f"controller {name} is already running")
        log_path = self.stack.logs / f"controller-{name}.log"
        # On a JetStream log each controller has a data directory of its own (nothing shared
        # but NATS); on SQLite they share the stack's, and so its one event log file.
        shared = "--event-log" not in self.stack.controller_args
        data_dir = self.stack.root if shared else self.workdir / f"data-{name}"
        argv = [
            sys.executable, "-m", "gpumesh", "controller",
            "--nats", self.stack.url,
            "--data-dir", str(data_dir),
            "--controller-id", name,
            "--log-format", "json",
            *self.stack.controller_args,
        ]  # fmt: skip
        ctl = _Controller(name, argv, log_path, _spawn(self.stack, argv, log_path))
        if old is not None:
            ctl.starts = old.starts + 1
        self.controllers[name] = ctl
        return ctl

    def stop_everything(self) -> None:
        """What the bench started beside the Stack (which reaps the rest by its marker): the
        helpers, the controllers (continued first, if stopped), the gateway."""
        for proc in self.helpers:
            _signal_group(proc, signal.SIGKILL)
        for ctl in self.controllers.values():
            _signal_group(ctl.popen, signal.SIGCONT)
            _signal_group(ctl.popen, signal.SIGKILL)
        for proc in [*self.helpers, *(c.popen for c in self.controllers.values())]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        if self.gateway is not None:
            self.gateway.stop()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def controller_log_option() -> str:
    """`jetstream` when `gpumesh controller` takes `--event-log jetstream`, else `sqlite`."""
    out = subprocess.run(
        [sys.executable, "-m", "gpumesh", "controller", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    return "jetstream" if re.search(r"--event-log \{[a-z,]*jetstream", out) else "sqlite"


# -- the lease, the control API, the NATS servers ---------------------------------------------


class _LeaseReader:
    """The lease as actors.leader_kv.KvLease reads it (the last message on its subject), but
    read only: KvLease makes sure of its stream first, with as many copies as the server this
    client is on says the cluster has, which while a server is down is two (a stream of two
    copies then has no quorum once it loses one more)."""

    def __init__(self, stack: Stack, *, timeout: float) -> None:
        self._js = stack.bus.jetstream(timeout=timeout)

    async def read(self) -> tuple[str, int, int, int] | None:
        """(leader, term, since ns, renewed ns), or None when nobody leads or it cannot be
        read."""
        try:
            found = await self._js.get_last_msg(LEASE_STREAM, LEASE_SUBJECT)
        except (nats.errors.Error, TimeoutError):
            return None
        if not found.data or found.seq is None:
            return None
        record = _LEADER_RECORD.decode(found.data)
        return record.controller_id, record.term or found.seq, record.since_ns, record.renewed_ns


async def _lease(lease: _LeaseReader) -> tuple[str, int, int, int] | None:
    return await lease.read()


async def _scale(stack: Stack, replicas: int, timeout: float = SCALE_TIMEOUT_S) -> str:
    """'' once the control API accepted `cluster scale probe`, else why not."""
    try:
        await stack.api("cluster.scale", {"name": PROBE, "replicas": replicas}, timeout=timeout)
    except (BusError, ApiError) as exc:
        return f"{type(exc).__name__}: {exc}"[:160]
    return ""


def _socket_peers(pid: int) -> set[int]:
    """The remote ports of `pid`'s TCP connections to 127.0.0.1 (from /proc)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[9] in inodes and cols[3] == "01":  # ESTABLISHED
                host, _, port = cols[2].partition(":")
                if host == "0100007F":
                    ports.add(int(port, 16))
    return ports


async def _stream_place(stack: Stack, stream: str) -> dict[str, Any]:
    """Where a stream lives: its copies, the server leading it, the others."""
    with contextlib.suppress(nats.errors.Error, TimeoutError):
        info = await stack.bus.jetstream(timeout=2.0).stream_info(stream)
        cluster = info.cluster
        return {
            "replicas": info.config.num_replicas,
            "leader": cluster.leader if cluster is not None else None,
            "followers": [r.name for r in (cluster.replicas or [])] if cluster else [],
        }
    return {"replicas": None, "leader": None, "followers": []}


# -- one class ---------------------------------------------------------------------------------


@dataclass
class _Watch:
    """What the lease and the control API said from the fault on."""

    leads_again_ns: int | None = None
    leader: str | None = None
    term: int | None = None
    since_ns: int = 0
    lease_absent_ns: int | None = None  # first read that found no lease (expired, unreadable)
    lease_unreadable: int = 0
    scale_ns: int | None = None
    scale_attempts: int = 0
    scale_errors: Counter[str] = field(default_factory=Counter)


async def _watch_lease(
    lease: _LeaseReader, kind: str, fault_ns: int, old_term: int, watch: _Watch
) -> None:
    deadline = fault_ns + int(WATCH_LIMIT_S * 1e9)
    while time.time_ns() < deadline:
        now = time.time_ns()
        found = await _lease(lease)
        if found is None:
            watch.lease_unreadable += 1
            watch.lease_absent_ns = watch.lease_absent_ns or now
        else:
            leader, term, since_ns, renewed_ns = found
            again = renewed_ns > fault_ns if kind.startswith("nats") else term != old_term
            if again:
                watch.leads_again_ns = time.time_ns()
                watch.leader, watch.term, watch.since_ns = leader, term, since_ns
                return
        await asyncio.sleep(LEASE_POLL_S)


async def _watch_scale(stack: Stack, replicas: int, fault_ns: int, watch: _Watch) -> None:
    deadline = fault_ns + int(WATCH_LIMIT_S * 1e9)
    while time.time_ns() < deadline:
        watch.scale_attempts += 1
        why = await _scale(stack, replicas)
        if not why:
            watch.scale_ns = time.time_ns()
            return
        watch.scale_errors[why.split(":")[0]] += 1
        await asyncio.sleep(0.05)


def _strace_argv(pid: int, out: Path) -> list[str] | None:
    binary = shutil.which("strace")
    if binary is None:
        return None
    return [binary, "-f", "-ttt", "-y", "-s", "4096", "-e", f"trace={_TRACED}",
            "-e", "signal=none", "-o", str(out), "-p", str(pid)]  # fmt: skip


async def _steady(ha: _Ha, timeout: float = STEADY_TIMEOUT_S) -> float:
    """Until the stack is whole again; returns how long that took."""
    began = time.monotonic()
    stack = ha.stack
    lease = _LeaseReader(stack, timeout=2.0)

    missing = ["(not looked at yet)"]

    async def whole() -> bool:
        for ctl in ha.controllers.values():
            if ctl.popen.poll() is not None:
                tail = Stack.log_tail(ctl.log_path)
                raise RuntimeError(f"controller {ctl.name} exited {ctl.popen.returncode}: {tail}")
        found = await _lease(lease)
        if found is None or time.time_ns() - found[3] > 1.5e9:
            missing[0] = "a lease renewed within 1.5 s"
            return False
        if not all(s.running for s in ha.servers):
            missing[0] = "3 nats-servers"
            return False
        for name, want in (("echo", REPLICAS), (PROBE, ha.probe_replicas)):
            ready = (await stack.cluster(name))["ready"]
            if ready != want:
                missing[0] = f"{name} {ready}/{want} ready"
                return False
        return True

    try:
        await stack.wait_until(whole, timeout=timeout, interval=0.25, why="the stack whole")
    except AssertionError:
        raise NotSteady(f"not whole again within {timeout:g} s: {missing[0]}") from None
    await wait_for_jetstream(stack.url, replicas=3, timeout=timeout)
    await stack.wait_until(
        lambda: _streams_current(stack), timeout=timeout, interval=0.25, why="streams current"
    )
    assert ha.gateway is not None
    await _proxy_answers(ha.gateway, timeout=timeout)
    return time.monotonic() - began


class NotSteady(RuntimeError):
    """The stack did not become whole again after a class: the next would not be independent."""


async def _events_after(stack: Stack, position: int) -> list[dict[str, Any]]:
    """The log's events past `position`, heartbeats left out, through the control API (the
    leader's store: SQLite or JetStream alike)."""
    found: list[dict[str, Any]] = []
    cursor = position
    while True:
        page = await stack.api("events.list", {"after": cursor, "limit": 500})
        found += page["events"]
        if page["next"] <= cursor or page["next"] >= page["head"]:
            return found
        cursor = page["next"]


async def _streams_current(stack: Stack) -> bool:
    """Every stream has a leader and every copy of it is current: a restarted server has
    caught up, so that the next class's loss of a server leaves each stream a quorum."""
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


async def _short_streams(stack: Stack) -> dict[str, int]:
    """Streams that keep fewer than three copies (each should keep three on three servers)."""
    with contextlib.suppress(nats.errors.Error, TimeoutError):
        streams = await stack.bus.jetstream(timeout=2.0).streams_info()
        return {
            i.config.name or "?": i.config.num_replicas or 1
            for i in streams
            if (i.config.num_replicas or 1) < 3
        }
    return {"(streams unreadable)": 0}


async def _run_class(ha: _Ha, kind: str, settings: Settings, tag: str) -> dict[str, Any]:
    stack = ha.stack
    workdir = ha.workdir / tag
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    lease = _LeaseReader(stack, timeout=1.0)
    before = await _lease(lease)
    if before is None:
        raise RuntimeError("nobody leads before the fault")
    old_leader, old_term = before[0], before[1]
    victim_ctl = ha.controllers[old_leader]
    assert ha.gateway is not None
    counters_before = _metric_sums(await _scrape(ha.gateway.url), COUNTERS)
    head_before = int((await stack.api("events.list", {"after": 0, "limit": 1}))["head"])

    out = workdir / "load.jsonl"
    start_ns = time.time_ns() + 1_500_000_000  # the client process's imports
    argv = [sys.executable, str(HELPER), "load", "--url", ha.gateway.url]
    argv += ["--clients", str(settings.clients), "--seconds", f"{settings.class_seconds:g}"]
    argv += ["--timeout", f"{CLIENT_TIMEOUT_S:g}", "--start-at", str(start_ns), "--out", str(out)]
    load = _spawn(stack, argv, workdir / "load.log")
    ha.helpers.append(load)
    await _sleep_until(start_ns + int(settings.fault_at * 1e9))

    result: dict[str, Any] = {"class": kind, "leader_before": old_leader, "term_before": old_term}
    victim_server: EmbeddedNats | None = None
    if kind.startswith("nats"):
        victim_server, why = await _nats_victim(ha, kind, victim_ctl)
        result["victim"] = victim_server.cluster.server_name if victim_server.cluster else "?"
        result["victim_why"] = why
    else:
        result["victim"] = old_leader
    fault_ns = time.time_ns()
    if kind == "controller-kill":
        _signal_group(victim_ctl.popen, signal.SIGKILL)
        await asyncio.to_thread(victim_ctl.popen.wait, 10)
    elif kind == "controller-stop":
        os.kill(victim_ctl.popen.pid, signal.SIGSTOP)
    else:
        assert victim_server is not None and victim_server.pid is not None
        os.kill(victim_server.pid, signal.SIGKILL)
        await victim_server.stop()  # reaps it
    result["fault_at_s"] = round((fault_ns - start_ns) / 1e9, 3)

    watch = _Watch()
    ha.probe_replicas = 2 if ha.probe_replicas == 1 else 1
    await asyncio.gather(
        _watch_lease(lease, kind, fault_ns, old_term, watch),
        _watch_scale(stack, ha.probe_replicas, fault_ns, watch),
    )
    if watch.term is not None and watch.term != old_term and kind.startswith("nats"):
        # The leader lost its lease after it had accepted the scale: ask the new term.
        ha.probe_replicas = 2 if ha.probe_replicas == 1 else 1
        watch.scale_ns = None
        await _watch_scale(stack, ha.probe_replicas, fault_ns, watch)

    # Restore: the killed process back (a controller as a standby), the stopped one continued.
    done_ns = max(watch.leads_again_ns or 0, watch.scale_ns or 0)
    restore_ns = max(fault_ns + int(settings.hold * 1e9), done_ns + 1_000_000_000)
    await _sleep_until(restore_ns)
    trace = workdir / "old-leader.strace"
    strace: subprocess.Popen[bytes] | None = None
    if kind == "controller-kill":
        ha.start_controller(old_leader)
    elif kind == "controller-stop":
        strace = await _attach_strace(ha, victim_ctl.popen.pid, trace, workdir)
        restore_ns = time.time_ns()  # from here on the old leader may run
        os.kill(victim_ctl.popen.pid, signal.SIGCONT)
    else:
        assert victim_server is not None
        await victim_server.start()
    restored_ns = restore_ns if kind == "controller-stop" else time.time_ns()

    code = await asyncio.to_thread(load.wait, settings.class_seconds + CLIENT_TIMEOUT_S + 60)
    ha.helpers.remove(load)
    if code != 0:
        raise RuntimeError(f"the load exited {code}: {Stack.log_tail(workdir / 'load.log')}")
    if kind == "controller-stop":
        result["old_leader"] = await _old_leader_after(victim_ctl, restored_ns, trace, strace, ha)
    try:
        steady_s: float | None = await _steady(ha)
    except NotSteady as exc:
        steady_s, result["not_steady"] = None, str(exc)
    counters_after = _metric_sums(await _scrape(ha.gateway.url), COUNTERS)
    header, records = read_load(out)

    def rel(ns: int | None) -> float | None:
        return None if ns is None else round((ns - fault_ns) / 1e9, 3)

    events = await _events_after(stack, head_before)
    result |= {
        "fault_rel_load_s": rel(header["started_ns"]),
        "leads_again_s": rel(watch.leads_again_ns),
        "new_leader_since_s": rel(watch.since_ns) if watch.term != old_term else None,
        "leader_after": watch.leader,
        "term_after": watch.term,
        "leader_changed": watch.leader is not None and watch.term != old_term,
        "lease_absent_first_s": rel(watch.lease_absent_ns),
        "lease_reads_failed_or_absent": watch.lease_unreadable,
        "scale_accepted_s": rel(watch.scale_ns),
        "scale_attempts": watch.scale_attempts,
        "scale_errors": dict(watch.scale_errors),
        "restored_s": rel(restored_ns),
        "steady_after_load_s": None if steady_s is None else round(steady_s, 2),
        "requests": _requests(records, fault_ns),
        "gateway_counters": {
            k.removeprefix("gpumesh_gateway_"): v - counters_before.get(k, 0.0)
            for k, v in counters_after.items()
            if v - counters_before.get(k, 0.0)
        },
        "offline_verdicts": sum(
            1
            for e in events
            if e["type"] == "node.health_changed.v1" and e["payload"]["state"] == "offline"
        ),
        "replicas_placed_again": sum(
            1
            for e in events
            if e["type"] == "replica.placed.v1"
            and e["payload"]["cluster"] == "echo"
            and e["payload"]["epoch"] > 1
        ),
        "grace_events": sum(1 for e in events if e["type"] == "controller.grace.v1"),
        "leadership_log": _leadership_log(ha, fault_ns),
        "without_leader_s": _without_leader(ha, kind, fault_ns, old_leader),
        "streams_short_of_copies_after": await _short_streams(stack),
    }
    return result


def _without_leader(ha: _Ha, kind: str, fault_ns: int, old_leader: str) -> float | None:
    """How long no controller led: from when the old leader stopped acting (the fault for a
    controller class; its `leadership_lost` line, if any, for a NATS class) to the next
    `leadership_won`, from the controllers' logs; 0 when it led on."""
    began: int | None = fault_ns if kind.startswith("controller") else None
    if began is None:
        lost = [
            e["at_ns"]
            for e in _log_events(ha.controllers[old_leader].log_path, "leadership_lost")
            if e["at_ns"] >= fault_ns
        ]
        began = min(lost, default=None)
    if began is None:
        return 0.0
    won = [
        e["at_ns"]
        for ctl in ha.controllers.values()
        for e in _log_events(ctl.log_path, "leadership_won")
        if e["at_ns"] >= began
    ]
    return round((min(won) - began) / 1e9, 3) if won else None


async def _nats_victim(ha: _Ha, kind: str, leader: _Controller) -> tuple[EmbeddedNats, str]:
    """The server to kill, and what it held."""
    place = await _stream_place(ha.stack, LEASE_STREAM)
    lease_leader = place["leader"]
    peers = _socket_peers(leader.popen.pid)
    conn = next((s for s in ha.servers if s.port in peers), None)
    by_name = {s.cluster.server_name: s for s in ha.servers if s.cluster is not None}
    if kind == "nats-kill":
        if conn is None:
            raise RuntimeError(f"cannot tell which server {leader.name} is connected to")
        victim = conn
    else:
        if lease_leader not in by_name:
            raise RuntimeError(f"cannot tell which server leads {LEASE_STREAM}")
        victim = by_name[lease_leader]
    name = victim.cluster.server_name if victim.cluster is not None else "?"
    held = []
    if victim is conn:
        held.append(f"the leader {leader.name}'s connection")
    if name == lease_leader:
        held.append(f"the {LEASE_STREAM} stream's leader")
    held.append(f"{LEASE_STREAM}: R{place['replicas']}, led by {lease_leader}")
    return victim, "; ".join(held)


async def _attach_strace(
    ha: _Ha, pid: int, trace: Path, workdir: Path
) -> subprocess.Popen[bytes] | None:
    argv = _strace_argv(pid, trace)
    if argv is None:
        return None
    proc = _spawn(ha.stack, argv, workdir / "strace.log")
    ha.helpers.append(proc)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = await asyncio.to_thread(Stack.log_tail, workdir / "strace.log", 50)
        if "attached" in text or proc.poll() is not None:
            break
        await asyncio.sleep(0.02)
    if proc.poll() is not None:
        ha.helpers.remove(proc)
        return None
    await asyncio.sleep(0.2)  # -f: the process's other threads
    return proc


async def _old_leader_after(
    ctl: _Controller,
    cont_ns: int,
    trace: Path,
    strace: subprocess.Popen[bytes] | None,
    ha: _Ha,
) -> dict[str, Any]:
    """What the continued old leader did: its log's word on stepping down, and (strace) what
    it wrote from SIGCONT until it has said so and OBSERVE_S have passed (a lease's time to
    live: any write it still had in hand would have been made by then)."""

    def lost_lines() -> list[dict[str, Any]]:
        return [e for e in _log_events(ctl.log_path, "leadership_lost") if e["at_ns"] >= cont_ns]

    with contextlib.suppress(AssertionError):  # not said: reported as None
        await ha.stack.wait_until(lost_lines, timeout=WATCH_LIMIT_S, why="leadership_lost")
    await _sleep_until(cont_ns + int(OBSERVE_S * 1e9))
    lost = lost_lines()
    out: dict[str, Any] = {
        "leadership_lost_after_cont_s": round((lost[0]["at_ns"] - cont_ns) / 1e9, 3)
        if lost
        else None,
        "reason": lost[0].get("reason") if lost else None,
        "refusals_logged": sum(
            1
            for line in _log_lines_after(ctl.log_path, cont_ns)
            if "deposed" in line.lower() or "writes nothing" in line
        ),
    }
    if strace is None:
        return out | {"method": "log only (no strace)"}
    _signal_group(strace, signal.SIGINT)  # detaches from the controller
    with contextlib.suppress(subprocess.TimeoutExpired):
        await asyncio.to_thread(strace.wait, 10)
    _signal_group(strace, signal.SIGKILL)
    ha.helpers.remove(strace)
    return out | _old_leader_writes(trace, cont_ns, ha.stack.db_path.name)


def _log_lines_after(path: Path, at_ns: int) -> list[str]:
    """The JSON log lines of `path` stamped at or after `at_ns`, as text."""
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                stamp = dt.datetime.fromisoformat(json.loads(line)["timestamp"])
                if stamp.timestamp() * 1e9 >= at_ns:
                    out.append(line)
    return out


def _leadership_log(ha: _Ha, since_ns: int) -> list[str]:
    """The controllers' leadership lines from `since_ns` on, in order."""
    found = []
    for ctl in ha.controllers.values():
        for name in ("leadership_won", "leadership_lost", "leadership_released"):
            for e in _log_events(ctl.log_path, name):
                if e["at_ns"] >= since_ns:
                    why = f" ({e['reason']})" if e.get("reason") else ""
                    found.append((e["at_ns"], f"+{(e['at_ns'] - since_ns) / 1e9:.2f}s {ctl.name} "
                                  f"{name} term {e.get('term')}{why}"))  # fmt: skip
    return [line for _, line in sorted(found)]


def _requests(records: list[dict[str, Any]], fault_ns: int) -> dict[str, Any]:
    early = [r for r in records if r["status"] != 200]
    late = [r for r in records if r["status"] == 200 and not _ok(r)]
    kinds: Counter[str] = Counter(
        str(r["status"]) if r["status"] else r["error"].split(":")[0] for r in early
    )
    after = [r for r in records if r["end_ns"] > fault_ns]
    lat = [r["latency_s"] * 1000 for r in after if _ok(r)]
    starts = sorted((r["start_ns"] - fault_ns) / 1e9 for r in early + late)
    return {
        "sent": len(records),
        "succeeded": sum(1 for r in records if _ok(r)),
        "failed_before_first_byte": len(early),
        "failed_after_first_byte": len(late),
        "failed_kinds": dict(kinds),
        "failed_started_s": [round(starts[0], 3), round(starts[-1], 3)] if starts else [],
        "p50_ms_from_fault": _pct(lat, 0.5),
        "p99_ms_from_fault": _pct(lat, 0.99),
        "max_ms_from_fault": max(lat, default=None),
        "examples": [
            {k: r[k] for k in ("id", "stream", "status", "error", "chunks", "tail")}
            for r in (early + late)[:3]
        ],
    }


# -- the runs ----------------------------------------------------------------------------------


async def _one_run(index: int, workdir: Path, settings: Settings) -> list[dict[str, Any]]:
    jetstream = settings.controller_log == "jetstream"
    controller_args = ["--event-log", "jetstream"] if jetstream else []
    stack = Stack(workdir / "stack", agents=3, nats_servers=3, controller_args=controller_args)
    ha = _Ha(stack, workdir)
    try:
        await stack.start(timeout=90)
        # The Stack's own controller hands over (SIGTERM releases the lease) to the bench's two,
        # so that each has a name and a restart keeps it.
        for name in CONTROLLERS:
            ha.start_controller(name)
        assert stack.controller is not None
        stack.controller.popen.send_signal(signal.SIGTERM)
        await asyncio.to_thread(stack.controller.popen.wait, 30)
        lease = _LeaseReader(stack, timeout=2.0)

        async def named_leader() -> bool:
            found = await _lease(lease)
            return found is not None and found[0] in CONTROLLERS

        await stack.wait_until(named_leader, timeout=30, why="ctl-a or ctl-b leads")
        await stack.wait_until(stack.nodes, timeout=30, why="the control API answers")
        await stack.create_cluster(_traced_spec(workdir / "traces"))
        await stack.create_cluster(echo_spec(1, name=PROBE))
        ha.gateway = _start_gateway(stack, workdir, sys.executable)
        await _steady(ha)
        results = []
        for i, kind in enumerate(settings.classes):
            result = await _run_class(ha, kind, settings, f"run{index + 1}-{i + 1}-{kind}")
            result["run"] = index + 1
            results.append(result)
            if not settings.json:
                print_class(result)
            if "not_steady" in result:  # the rest of this run would not be independent
                skipped = settings.classes[i + 1 :]
                print(
                    f"run {index + 1}: {result['not_steady']}; skipped {skipped}", file=sys.stderr
                )
                break
        return results
    finally:
        await asyncio.to_thread(ha.stop_everything)
        left = await stack.close()
        if left:
            print(f"processes that would not die: {left}", file=sys.stderr)


async def ha_failover(settings: Settings) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    # SIGTERM (a CI timeout, say) as Ctrl-C: cancel, so that every process is stopped.
    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpumesh-failover-ha-") as tmp:
        workdir = Path(settings.keep) if settings.keep else Path(tmp)
        for i in range(settings.runs):
            runs += await _one_run(i, workdir / f"run-{i + 1}", settings)
    return {
        "mode": "ha",
        "clients": settings.clients,
        "streaming_clients": round(settings.clients / 2),
        "class_seconds": settings.class_seconds,
        "fault_at_s": settings.fault_at,
        "hold_s": settings.hold,
        "controller_log": settings.controller_log,
        "lease": "TTL 3 s, renewed every 1 s, standbys look every 0.25 s",
        "target_s": TARGET_S,
        "runs": runs,
        "summary": summarise(runs, settings.classes),
    }
