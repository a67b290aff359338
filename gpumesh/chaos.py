"""`gpumesh chaos SCENARIO`: a simulator scenario applied to the running local stack.

The TOML files `gpumesh sim run` plays on virtual time (sim/scenario.py) are played here on wall
time against real processes: the clusters are created (echo workloads), client traffic goes
through the gateway at the scenario's rate, and each fault is applied at its time by signals to
the stack's processes (found in /proc) or through the fake-GPU fault subject. The event log is
followed (`events.list`, heartbeats included) and folded by the simulator's own Checker, so the
detection and replacement times and the per-event invariants are computed the same way, and the
summary is printed by the simulator's `render`: a simulated run and a real one read alike.

Victims and request arrivals are drawn from `--seed` with the simulator's streams and rules, so
on a stack with the scenario's node names and count, a seed picks the same victims as in
`gpumesh sim run`. Times in the summary are wall seconds since the start of the run.

What each fault kind does on the real stack is KIND_ACTIONS (also in --help and docs/chaos.md).
A run always leaves the stack as it found it: what it stopped is continued and what it killed is
started again, at the fault's end, at the end of the run (faults with no end, churn), and on
Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec

from events import ClusterSpec, Envelope, GpuRequirement
from events.contract import subjects
from events.contract.messages import ApiReply, EventsRequest, Fault, FaultReply
from sim.env import SeededStreams
from sim.scenario import NODE_FAULTS, FaultPlan, Scenario
from sim.world import RequestLog

if TYPE_CHECKING:
    import aiohttp

    from runtime.env import Bus, RandomSource
    from sim.invariants import Checker
    from sim.run import RunResult

NETWORK_ONLY = "skipped: needs network control (simulator only)"
IN_UP = "skipped: controller runs inside gpumesh up"

# What each fault kind does on the real stack (--help, --dry-run, docs/chaos.md).
KIND_ACTIONS: dict[str, str] = {
    "power_loss": "SIGKILL the agent's process group and every workload's (a machine losing "
    "power); after duration_s the agent is started again with the command line, environment, "
    "working directory and log file read from /proc before the kill",
    "hang": "SIGSTOP the agent process (its workloads keep serving); SIGCONT after duration_s",
    "partition": "approximation: SIGSTOP the agent and its workloads, so nothing from the node "
    "arrives (but the kernel still accepts TCP connections and NATS keeps the session); "
    "SIGCONT after duration_s",
    "one_way_partition": NETWORK_ONLY,
    "flap": "approximation: the partition above, on and off every period_s, for duration_s "
    "(default 60 s)",
    "slow": NETWORK_ONLY,
    "thermal": "the fake-GPU fault subject, as `gpumesh agent fault NODE thermal VALUE`; "
    "`clear` after duration_s (agents with --fake-gpus only)",
    "ecc": "the fake-GPU fault subject, as `gpumesh agent fault NODE ecc 1`; `clear` after "
    "duration_s",
    "driver": "the fake-GPU fault subject, as `gpumesh agent fault NODE driver`; `clear` after "
    "duration_s",
    "crash_loop": "SIGKILL every workload of the node at once and again every 0.5 s, for "
    "duration_s (or until the faults stop)",
    "controller_crash": "SIGKILL a separate `gpumesh controller --nats URL` process, started "
    f"again after duration_s; with `gpumesh up` the controller is in-process: {IN_UP}",
    "nats_outage": "approximation: SIGSTOP the stack's nats-server (every client's connection "
    "goes silent); SIGCONT after duration_s",
    "churn": "every period_s for duration_s (default 60 s): power_loss of `count` nodes (started "
    "again when the run ends) and `count` new agents node-N with an existing agent's command line",
}

CRASH_LOOP_EVERY_S = 0.5
EVENTS_POLL_S = 0.25
REQUEST_TIMEOUT_S = 30.0  # the gateway gives up after its own deadline first
OWNER_ENV = "GPUMESH_CHAOS_OWNER"  # "pid:start" of the process a restarted one lives with
_VALUED = {"--data-dir", "--log-level", "--log-format"}  # common options before a subcommand


def register(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    from wire.commandline import add_creds_argument

    chaos = commands.add_parser(
        "chaos",
        parents=list(parents),
        help="apply a simulator scenario to the running local stack",
        description=_fill(
            "Play a scenario file (the ones `gpumesh sim run` plays on virtual time) against "
            "the running local stack, on wall time: create its clusters (echo workloads), send "
            "its client traffic through the gateway, apply its faults to real processes, and "
            "print the simulator's summary from the real event log."
        ),
        epilog=help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chaos.add_argument("scenario", help="a TOML file, or a name in sim/scenarios/")
    chaos.add_argument(
        "--nats",
        metavar="URL",
        help="the stack's NATS (default: the URL `gpumesh up` wrote in the data directory)",
    )
    add_creds_argument(chaos, "admin")
    chaos.add_argument(
        "--gateway",
        default="http://127.0.0.1:8080",
        metavar="URL",
        help="the gateway the client traffic goes through (default http://127.0.0.1:8080)",
    )
    chaos.add_argument("--api-key", metavar="KEY", help="the gateway's API key, if it needs one")
    chaos.add_argument(
        "--seed", type=int, default=1, help="draws victims and arrivals, as `sim run` (default 1)"
    )
    chaos.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="divide the scenario's times (faults, durations, periods, settle) by this; the "
        "request rate stays per wall second (default 1)",
    )
    chaos.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="stop after S wall seconds at most (default: duration_s + settle_s, over --speed); "
        "liveness is then not judged",
    )
    chaos.add_argument("--json", action="store_true", help="the result as JSON")
    chaos.add_argument(
        "--dry-run",
        action="store_true",
        help="print the processes found and what each fault would do to whom; change nothing",
    )
    chaos.set_defaults(handler=run_chaos)


def _fill(text: str, indent: str = "") -> str:
    return textwrap.fill(
        text, width=88, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
    )


def help_epilog() -> str:
    """What each fault kind does on the real stack, one paragraph per kind."""
    lines = ["what each fault kind does on the real stack:"]
    for kind, text in KIND_ACTIONS.items():
        lines.append(
            textwrap.fill(
                text,
                width=88,
                initial_indent=f"  {kind:<18} ",
                subsequent_indent=" " * 21,
                break_on_hyphens=False,
            )
        )
    lines.append("")
    lines.append(
        _fill(
            "Victims and request arrivals are drawn from --seed as the simulator draws them. "
            "Ctrl-C stops the run cleanly: what was stopped is continued, what was killed is "
            "started again, then the summary so far is printed. docs/chaos.md has more."
        )
    )
    return "\n".join(lines)


# -- /proc --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    """A process as /proc shows it: enough to signal it, and to start it again the same way."""

    pid: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict, compare=False)
    cwd: str = ""
    stdout: str = ""  # the regular file its stdout goes to, "" if none
    ppid: int = 0
    pgid: int = 0

    @property
    def args(self) -> list[str]:
        """The arguments after `gpumesh` (or after `-m gpumesh`)."""
        return gpumesh_args(self.argv) or []


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours
        return b""


def _stat(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name: [state, ppid, pgrp, ...]."""
    raw = _read(f"/proc/{pid}/stat")
    return raw[raw.rindex(b")") + 2 :].split() if raw else []


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != b"Z"


def start_time(pid: int) -> str:
    fields = _stat(pid)
    return fields[19].decode() if len(fields) > 19 else ""


def cmdline(pid: int) -> list[str]:
    raw = _read(f"/proc/{pid}/cmdline")
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] if raw else []


def environ(pid: int) -> dict[str, str]:
    out = {}
    for item in _read(f"/proc/{pid}/environ").split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def read_proc(pid: int) -> Proc | None:
    argv = cmdline(pid)
    fields = _stat(pid)
    if not argv or not fields or fields[0] == b"Z":
        return None
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        cwd = ""
    try:
        out = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        out = ""
    if not (out.startswith("/") and os.path.isfile(out)):
        out = ""
    return Proc(
        pid=pid,
        argv=tuple(argv),
        env=environ(pid),
        cwd=cwd,
        stdout=out,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
    )


def pids() -> list[int]:
    return sorted(int(name) for name in os.listdir("/proc") if name.isdigit())


def gpumesh_args(argv: Sequence[str]) -> list[str] | None:
    """`python -m gpumesh ARGS...` or `.../gpumesh ARGS...` -> ARGS; else None."""
    for i, arg in enumerate(argv[:4]):
        if arg == "-m" and i + 1 < len(argv):
            return list(argv[i + 2 :]) if argv[i + 1] == "gpumesh" else None
        if os.path.basename(arg) == "gpumesh":
            return list(argv[i + 1 :])
    return None


def subcommand(args: Sequence[str]) -> str:
    """The first word that is neither an option nor a common option's value."""
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in _VALUED:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return ""


def flag(args: Sequence[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` (the last one given), else None."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg[len(name) + 1 :]
    return found


def with_flag(argv: Sequence[str], name: str, value: str) -> list[str]:
    """`argv` with the value of `--name` replaced (it must be there)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == name and i + 1 < len(out):
            out[i + 1] = value
        elif arg.startswith(name + "="):
            out[i] = f"{name}={value}"
    return out


def data_dir_of(proc: Proc) -> Path:
    """The data directory a gpumesh process uses: --data-dir, else the CLI's defaults as its
    own environment resolves them (gpumesh.cli.default_data_dir)."""
    given = flag(proc.args, "--data-dir")
    if given is not None:
        return _resolve(Path(proc.cwd or "/") / given)
    env = proc.env
    if env.get("GPUMESH_DATA_DIR"):
        return _resolve(Path(proc.cwd or "/") / env["GPUMESH_DATA_DIR"])
    xdg = env.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path(env.get("HOME", "/")) / ".local" / "share"
    return _resolve(base / "gpumesh")


def _resolve(path: Path) -> Path:
    with contextlib.suppress(OSError):
        return path.resolve()
    return path


@dataclass
class Found:
    """The processes of one stack on this machine."""

    agents: dict[str, Proc] = field(default_factory=dict)  # node id -> agent
    controller: Proc | None = None
    up: Proc | None = None
    nats: Proc | None = None


def scan(data_dir: Path, nats_url: str) -> Found:
    """Find the stack's processes: gpumesh agents, controller and up whose --nats is `nats_url`
    (or, with no --nats, whose data directory is `data_dir`), and its nats-server (its -sd is
    `data_dir`/nats, or its -p is the URL's port)."""
    found = Found()
    here = _resolve(data_dir)
    port = nats_url.rsplit(":", 1)[-1].strip("/")
    me = os.getpid()
    for pid in pids():
        if pid == me:
            continue
        argv = cmdline(pid)
        if not argv:
            continue
        if os.path.basename(argv[0]).startswith("nats-server"):
            store = flag(argv, "-sd")
            if (store and _resolve(Path(store)) == here / "nats") or flag(argv, "-p") == port:
                found.nats = read_proc(pid)
            continue
        args = gpumesh_args(argv)
        command = subcommand(args) if args else ""
        if command not in ("agent", "controller", "up"):
            continue
        proc = read_proc(pid)
        if proc is None or not _ours(proc, here, nats_url):
            continue
        if command == "agent":
            node_id = flag(proc.args, "--node-id")
            if node_id and (node_id not in found.agents or pid > found.agents[node_id].pid):
                found.agents[node_id] = proc
        elif command == "controller":
            found.controller = proc
        else:
            found.up = proc
    return found


def _ours(proc: Proc, data_dir: Path, nats_url: str) -> bool:
    url = flag(proc.args, "--nats")
    if url is not None:
        return url.rstrip("/") == nats_url.rstrip("/")
    return data_dir_of(proc) == data_dir


def workloads_of(agent_pid: int) -> list[int]:
    """The agent's workload processes: its children that carry GPUMESH_REPLICA_ID."""
    found = []
    for pid in pids():
        fields = _stat(pid)
        ours = len(fields) > 1 and fields[0] != b"Z" and int(fields[1]) == agent_pid
        if ours and b"GPUMESH_REPLICA_ID=" in _read(f"/proc/{pid}/environ"):
            found.append(pid)
    return found


def machine_group(proc: Proc) -> int | None:
    """The process group that is this agent's machine: its own (it was started in a new
    session, as `gpumesh up` and the test stack do) or its keeper's. None when it shares
    someone else's group (a shell job): then only the process itself is signalled."""
    if proc.pgid in (0, os.getpgrp()):
        return None
    if proc.pgid == proc.pid:
        return proc.pgid
    parent = cmdline(proc.ppid)
    if "gpumesh.keeper" in parent and _stat(proc.ppid)[2:3] == [str(proc.pgid).encode()]:
        return proc.pgid
    return None


def _signal(pid: int, sig: signal.Signals, *, group: int | None = None) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group is not None:
            os.killpg(group, sig)
        else:
            os.kill(pid, sig)


def _kill_workload(pid: int) -> None:
    """Workloads lead their own session (nodeagent/workload/process.py): the whole group."""
    group = pid if _stat(pid)[2:3] == [str(pid).encode()] else None
    _signal(pid, signal.SIGKILL, group=group)


# -- the run --------------------------------------------------------------------------------


def draw(nodes: dict[str, NodeState], spec: str, rng: RandomSource) -> list[NodeState]:
    """The simulator's own draw of a fault's victims (sim.world.draw_victims), so a seed picks
    what `gpumesh sim run` picks on a fleet with the same names."""
    from sim.world import draw_victims

    return draw_victims(nodes, spec, rng, up=lambda n: n.powered and not n.hung)


@dataclass
class NodeState:
    node_id: str
    agent: Proc | None  # the latest agent process seen: how to start it again
    powered: bool = True
    hung: bool = False
    gpu_fault: bool = False


class _Page(msgspec.Struct):
    events: list[Envelope]
    next: int
    head: int


class _PageReply(msgspec.Struct):
    ok: bool
    error: str = ""
    data: _Page | None = None


_page_reply = msgspec.json.Decoder(_PageReply)

Undo = Callable[[], Awaitable[None]]
_SPAWN_ERRORS = (OSError, subprocess.SubprocessError)  # starting a process again can fail


class ChaosError(Exception):
    """A run that cannot start: one line."""


class ChaosRun:
    """One scenario on the real stack, on wall time. `t` everywhere is wall seconds since the
    start; the scenario's own times are divided by `speed`."""

    def __init__(
        self,
        scenario: Scenario,
        seed: int,
        *,
        bus: Bus,
        nats_url: str,
        data_dir: Path,
        gateway: str,
        api_key: str = "",
        speed: float = 1.0,
        cap: float | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        from sim.invariants import Checker

        self.scenario = scenario
        self.seed = seed
        self.bus = bus
        self.nats_url = nats_url
        self.data_dir = data_dir
        self.gateway = gateway.rstrip("/")
        self.api_key = api_key
        self.speed = speed
        self.derive = SeededStreams(seed)
        self.rng = self.derive("faults")
        self.echo = echo or (lambda line: None)
        full = (scenario.duration_s + scenario.settle_s) / speed
        self.end = min(full, cap) if cap is not None else full
        self.fault_end = min(scenario.duration_s / speed, self.end)
        self.judged = self.end >= full  # liveness is judged only after the whole settle
        self.found = scan(data_dir, nats_url)
        self.nodes = {
            node_id: NodeState(node_id, proc) for node_id, proc in sorted(self.found.agents.items())
        }
        self.timeline: list[str] = []
        self.requests: dict[str, RequestLog] = {}
        self.checker: Checker = Checker(cast(Any, self))  # it calls back only note()
        self.interrupted = False
        self.ended_at: float | None = None
        self.restored: list[str] = []  # what restore() did
        self.controller_down: Proc | None = None
        self._stopped: dict[int, int] = {}  # pid -> how many faults hold it stopped
        self._undo: list[tuple[float, int, str, Undo]] = []  # (when, order, what, undo)
        self._order = 0
        self._background: list[asyncio.Task[None]] = []
        self._loop_t0 = 0.0
        self.start_ns = time.time_ns()
        self._history = True  # folding the log as it was before the run
        self._cursor = 0
        self._last = 0
        self._run_events = 0
        self._digest = hashlib.sha256()
        self._session: aiohttp.ClientSession | None = None

    # -- clock and timeline ----------------------------------------------------------------

    def now(self) -> float:
        if not self._loop_t0:
            return 0.0
        return asyncio.get_running_loop().time() - self._loop_t0

    def at(self, scenario_s: float) -> float:
        return scenario_s / self.speed

    def _stamp(self) -> float:
        """The current wall time in the checker's frame (seconds since the start)."""
        return (time.time_ns() - self.start_ns) / 1e9

    def note(self, text: str) -> None:
        if self._history:
            return  # a violation in the history before the run: not this run's
        line = f"{self.now():9.3f}  {text}"
        self.timeline.append(line)
        self.echo(line)

    # -- the event log ---------------------------------------------------------------------

    async def catch_up(self, *, timeout: float = 10.0) -> None:
        """Read `events.list` (heartbeats included) from the cursor to the head it reports, and
        fold every event into the checker. Safe to run concurrently: an event at or below the
        last one folded is skipped, and every page starts right after a cursor at or below it."""
        while True:
            body = msgspec.json.encode(
                EventsRequest(after=self._cursor, limit=1000, heartbeats=True)
            )
            raw = await self.bus.request(subjects.api("events.list"), body, timeout=timeout)
            reply = _page_reply.decode(raw.data)
            if not reply.ok or reply.data is None:
                raise ChaosError(f"events.list: {reply.error or 'no data'}")
            page = reply.data
            for envelope in page.events:
                self._fold(envelope)
            moved = page.next > self._cursor
            self._cursor = max(self._cursor, page.next)
            if self._cursor >= page.head or not moved:
                return

    def _fold(self, envelope: Envelope) -> None:
        from sim.clock import SIM_EPOCH_NS

        if envelope.position <= self._last:
            return
        self._last = envelope.position
        if not self._history:
            self._run_events += 1
            self._digest.update(msgspec.msgpack.encode(envelope))
        # The checker measures from SIM_EPOCH_NS: put the start of this run there.
        shifted = msgspec.structs.replace(
            envelope, recorded_at=envelope.recorded_at - self.start_ns + SIM_EPOCH_NS
        )
        self.checker.check_event(shifted)

    async def _follow(self) -> None:
        from runtime.env import BusError

        while True:
            # The controller restarting, or NATS stopped: try again at the next tick.
            with contextlib.suppress(BusError, ChaosError, msgspec.DecodeError):
                await self.catch_up(timeout=2.0)
            await asyncio.sleep(EVENTS_POLL_S)

    # -- preparing ---------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Check the gateway, fold the log so far, and start the clock."""
        import aiohttp

        if self.scenario.rate_per_s > 0 and self.scenario.clusters:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            )
            try:
                async with self._session.get(
                    f"{self.gateway}/healthz", timeout=aiohttp.ClientTimeout(total=3.0)
                ) as response:
                    if response.status != 200:
                        raise ChaosError(f"the gateway at {self.gateway} answers {response.status}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise ChaosError(
                    f"no gateway answers at {self.gateway} ({type(exc).__name__}); pass "
                    "--gateway URL (gpumesh up serves one on 127.0.0.1:8080)"
                ) from None
        from runtime.env import NoResponders

        try:
            await self.catch_up()
        except NoResponders:
            raise ChaosError(
                f"no controller answers on {self.nats_url} (is `gpumesh up` running?)"
            ) from None
        self.checker.violations.clear()
        self._history = False
        self.start_ns = time.time_ns()
        self._loop_t0 = asyncio.get_running_loop().time()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Deploys, traffic and faults on schedule, then the settle and the liveness check."""
        scenario = self.scenario
        jobs = [
            asyncio.create_task(self._follow(), name="chaos:events"),
            asyncio.create_task(self._create_clusters(), name="chaos:deploys"),
        ]
        if scenario.rate_per_s > 0 and self._session is not None:
            jobs += [
                asyncio.create_task(self._traffic(c.name, c.at_s), name=f"chaos:traffic:{c.name}")
                for c in scenario.clusters
            ]
        try:
            await self._faults()
            self.note(f"faults over; settling {scenario.settle_s / self.speed:g} s")
            await self._end_all()
            await asyncio.sleep(max(0.0, self.end - self.now()))
        finally:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
        await self.finish(judge=self.judged)

    async def finish(self, *, judge: bool) -> None:
        """Read the log to its head and, if `judge`, check liveness as the simulator does."""
        from runtime.env import BusError
        from sim.invariants import Violation

        self.ended_at = self.now()
        with contextlib.suppress(BusError, ChaosError, msgspec.DecodeError):
            await self.catch_up(timeout=5.0)
        if not judge:
            self.note("liveness not judged: the run did not reach the end of the settle")
            return
        state = self.checker.state
        healthy = [n for n in state.nodes.nodes.values() if n.health == "healthy" and not n.drained]
        clusters = sorted(state.clusters.clusters.items())
        demand = sum(c.spec.replicas * c.spec.gpu.count for _, c in clusters)
        if demand > sum(len(n.gpus) for n in healthy):
            return  # capacity does not allow every cluster to be whole: nothing to demand
        for name, cluster in clusters:
            ready = sum(
                1
                for r in state.replicas.replicas.values()
                if r.cluster == name and r.status == "ready"
            )
            if ready < cluster.spec.replicas:
                detail = (
                    f"{name}: {ready}/{cluster.spec.replicas} ready "
                    f"{self.scenario.settle_s / self.speed:g} s after the faults stopped, with "
                    f"{len(healthy)} healthy nodes"
                )
                self.checker.violations.append(
                    Violation(round(self._stamp(), 6), "liveness", detail)
                )
                self.note(f"VIOLATION liveness: {detail}")

    # -- clusters and traffic ------------------------------------------------------------------

    async def _create_clusters(self) -> None:
        python = shlex.quote(sys.executable)
        for plan in sorted(self.scenario.clusters, key=lambda c: c.at_s):
            await asyncio.sleep(max(0.0, self.at(plan.at_s) - self.now()))
            if plan.name in self.checker.state.clusters.clusters:
                have = self.checker.state.clusters.clusters[plan.name].spec.replicas
                self.note(f"cluster {plan.name} exists ({have} replicas): left as it is")
                continue
            spec = ClusterSpec(
                name=plan.name,
                replicas=plan.replicas,
                model=plan.name,
                command=f"{python} -m gpumesh workload echo --port {{port}} --model {{model}}",
                gpu=GpuRequirement(
                    models=(plan.gpu_model,) if plan.gpu_model else (), count=plan.gpu_count
                ),
            )
            reply = await self._api("cluster.create", spec, timeout=30.0)
            error = f" ({reply.error})" if reply.error else ""
            self.note(f"cluster {plan.name} created ({plan.replicas} replicas): {reply.ok}{error}")

    async def _api(self, verb: str, body: object, *, timeout: float) -> ApiReply:
        from runtime.env import BusError

        try:
            raw = await self.bus.request(
                subjects.api(verb), msgspec.json.encode(body), timeout=timeout
            )
            return msgspec.json.decode(raw.data, type=ApiReply)
        except (BusError, msgspec.DecodeError) as exc:
            return ApiReply(ok=False, error=f"{verb}: {exc}")

    async def _traffic(self, cluster: str, start: float) -> None:
        rng = self.derive(f"traffic:{cluster}")
        log = self.requests.setdefault(cluster, RequestLog())
        await asyncio.sleep(max(0.0, self.at(start + 1.0) - self.now()))
        async with asyncio.TaskGroup() as requests:
            while True:
                # Poisson arrivals from the cluster's own stream, as in the simulator.
                gap = -math.log(1.0 - rng.random()) / self.scenario.rate_per_s
                await asyncio.sleep(gap)
                log.sent += 1
                requests.create_task(self._request(cluster, log))

    async def _request(self, cluster: str, log: RequestLog) -> None:
        import aiohttp

        assert self._session is not None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": cluster, "messages": [{"role": "user", "content": "gpumesh chaos"}]}
        try:
            async with self._session.post(
                f"{self.gateway}/v1/chat/completions", json=body, headers=headers
            ) as response:
                data = await response.read()
                status = response.status
        except TimeoutError:
            kind = "ClientTimeout"
        except aiohttp.ClientConnectorError:
            kind = "GatewayUnreachable"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            kind = type(exc).__name__
        else:
            if 200 <= status < 300:
                log.ok += 1
                return
            kind = failure_kind(status, data)
        log.failed[kind] = log.failed.get(kind, 0) + 1

    # -- faults --------------------------------------------------------------------------------

    async def _faults(self) -> None:
        for fault in self.scenario.faults:
            if self.at(fault.at_s) >= self.fault_end:
                break
            await self._sleep_until(self.at(fault.at_s))
            try:
                await self._apply(fault)
            except _SPAWN_ERRORS as exc:  # a run goes on, and still prints its summary
                self.note(f"fault  {fault.kind} FAILED: {exc}")
        await self._sleep_until(self.fault_end)

    async def _sleep_until(self, t: float) -> None:
        while True:
            due = sorted(u for u in self._undo if u[0] <= t)
            if not due:
                break
            when, _, what, undo = entry = due[0]
            await asyncio.sleep(max(0.0, when - self.now()))
            self._undo.remove(entry)
            await self._end(what, undo)
        await asyncio.sleep(max(0.0, t - self.now()))

    async def _end_all(self) -> None:
        """The faults stop: end everything still in effect (liveness is judged after this)."""
        await self._stop_background()
        for entry in sorted(self._undo):
            self._undo.remove(entry)
            await self._end(entry[2], entry[3])

    async def _end(self, what: str, undo: Undo) -> None:
        self.note(f"end    {what}")
        try:
            await undo()
        except _SPAWN_ERRORS as exc:  # restore() tries again at the end of the run
            self.note(f"end    {what} FAILED: {exc}")

    async def _stop_background(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()

    def _later(self, fault: FaultPlan, what: str, undo: Undo) -> None:
        # From the fault's planned time, as on virtual time: an end and a fault due at the same
        # second come in the simulator's order (the end first), whatever the wall clock's drift.
        if fault.duration_s is not None:
            self._order += 1
            when = self.at(fault.at_s + fault.duration_s)
            self._undo.append((when, self._order, what, undo))

    def victims(self, fault: FaultPlan) -> list[NodeState]:
        return draw(self.nodes, fault.nodes, self.rng)

    async def _apply(self, fault: FaultPlan) -> None:
        from runtime.env import BusError

        # The checker snapshots the victims' replicas: let it see the log as it is now.
        with contextlib.suppress(BusError, ChaosError, msgspec.DecodeError):
            await self.catch_up(timeout=1.0)
        kind = fault.kind
        if kind == "controller_crash":
            await self._controller_crash(fault)
        elif kind == "nats_outage":
            self._nats_outage(fault)
        elif kind == "churn":
            task = asyncio.create_task(self._churn(fault), name="chaos:churn")
            self._background.append(task)
            self.note(f"fault  churn ({fault.count} nodes every {fault.period_s:g} s)")
        else:
            for node in self.victims(fault):
                await self._node_fault(fault, node, f"{kind} {node.node_id}")

    def _fault_at(self, kind: str, node: NodeState) -> None:
        self.checker.fault(kind, cast(Any, node), self._stamp())

    def _agent(self, node: NodeState) -> Proc | None:
        """The node's live agent process (found again: it may have been started again)."""
        for pid in pids():
            argv = cmdline(pid)
            args = gpumesh_args(argv) if argv else None
            if not args or subcommand(args) != "agent" or flag(args, "--node-id") != node.node_id:
                continue
            proc = read_proc(pid)
            if proc is not None and _ours(proc, _resolve(self.data_dir), self.nats_url):
                node.agent = proc
                return proc
        return None

    async def _node_fault(self, fault: FaultPlan, node: NodeState, what: str) -> None:
        kind = fault.kind
        if kind in ("one_way_partition", "slow"):
            self.note(f"skip   {what}: {NETWORK_ONLY}")
            return
        if kind in ("thermal", "ecc", "driver"):
            value = fault.value if kind == "thermal" else 1.0
            at = self._stamp()
            error = await self._gpu_fault(node, Fault(kind=kind, value=value))
            if error:
                self.note(f"skip   {what}: {error}")
                return
            self.checker.fault(kind, cast(Any, node), at)
            node.gpu_fault = True
            self.note(
                f"fault  {what}: fake GPUs {kind}" + (f" {value:g}" if kind == "thermal" else "")
            )

            async def clear() -> None:
                if not await self._gpu_fault(node, Fault(kind="clear")):
                    node.gpu_fault = False

            self._later(fault, what, clear)
            return
        agent = self._agent(node) if node.powered else None
        if agent is None:
            self.note(f"skip   {what}: no agent process of {node.node_id} is running")
            return
        if kind == "power_loss":
            self._fault_at(kind, node)
            killed = self.power_off(node, agent)
            self.note(f"fault  {what}: SIGKILL agent {agent.pid} and {killed} workload(s)")

            async def power_on() -> None:
                await self.power_on(node)

            self._later(fault, what, power_on)
        elif kind == "hang":
            self._fault_at(kind, node)
            node.hung = True
            self._stop([agent.pid])
            self.note(f"fault  {what}: SIGSTOP agent {agent.pid}")

            async def thaw() -> None:
                node.hung = False
                self._cont([agent.pid])

            self._later(fault, what, thaw)
        elif kind == "partition":
            self._fault_at(kind, node)
            frozen = [agent.pid, *workloads_of(agent.pid)]
            self._stop(frozen)
            self.note(f"fault  {what}: SIGSTOP agent {agent.pid} and {len(frozen) - 1} workload(s)")

            async def heal() -> None:
                self._cont(frozen)

            self._later(fault, what, heal)
        elif kind == "flap":
            self._fault_at(kind, node)
            self.note(f"fault  {what}: SIGSTOP/SIGCONT every {self.at(fault.period_s):g} s")
            self._background.append(
                asyncio.create_task(self._flap(fault, node, agent), name=f"chaos:{what}")
            )
        elif kind == "crash_loop":
            self._fault_at(kind, node)
            self.note(f"fault  {what}: SIGKILL its workloads every {CRASH_LOOP_EVERY_S:g} s")
            task = asyncio.create_task(self._crash_loop(agent), name=f"chaos:{what}")
            self._background.append(task)

            async def cured() -> None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

            self._later(fault, what, cured)

    async def _gpu_fault(self, node: NodeState, fault: Fault) -> str:
        """Send a fake-GPU fault; "" on success, else why not."""
        from runtime.env import BusError, NoResponders

        try:
            raw = await self.bus.request(
                subjects.fault(node.node_id), msgspec.json.encode(fault), timeout=5.0
            )
            reply = msgspec.json.decode(raw.data, type=FaultReply)
        except NoResponders:
            return f"no agent answers the fault subject of {node.node_id}"
        except (BusError, msgspec.DecodeError) as exc:
            return f"fault subject of {node.node_id}: {exc}"
        return "" if reply.ok else f"{node.node_id} refused: {reply.error}"

    async def _flap(self, fault: FaultPlan, node: NodeState, agent: Proc) -> None:
        end = self.now() + self.at(fault.duration_s or 60.0)
        period = self.at(fault.period_s)
        while self.now() < end:
            frozen = [agent.pid, *workloads_of(agent.pid)]
            self._stop(frozen)
            try:
                await asyncio.sleep(period)
            finally:
                self._cont(frozen)
            await asyncio.sleep(period)

    async def _crash_loop(self, agent: Proc) -> None:
        while True:
            for pid in workloads_of(agent.pid):
                _kill_workload(pid)
            await asyncio.sleep(CRASH_LOOP_EVERY_S)

    async def _churn(self, fault: FaultPlan) -> None:
        end = self.now() + self.at(fault.duration_s or 60.0)
        while self.now() < end:
            leaving = FaultPlan(at_s=0.0, kind="power_loss", nodes=str(fault.count))
            for node in self.victims(leaving):
                agent = self._agent(node)
                self.note(f"churn  {node.node_id} leaves")
                self.checker.fault("churn", cast(Any, node), self._stamp())
                if agent is not None:
                    self.power_off(node, agent)
            for _ in range(fault.count):
                joined = await self._join()
                if joined is not None:
                    self.note(f"churn  {joined.node_id} joins")
            await asyncio.sleep(self.at(fault.period_s))

    async def _join(self) -> NodeState | None:
        template = next((n.agent for n in self.nodes.values() if n.agent is not None), None)
        if template is None:
            self.note("churn  no agent to copy: nobody joins")
            return None
        known = {*self.nodes, *self.checker.state.nodes.nodes}
        index = 1 + max(
            (int(m[1]) for n in known if (m := re.fullmatch(r"node-(\d+)", n))), default=-1
        )
        node_id = f"node-{index}"
        argv = with_flag(template.argv, "--node-id", node_id)
        proc = Proc(
            pid=0,
            argv=tuple(argv),
            env=template.env,
            cwd=template.cwd,
            stdout="",
            ppid=template.ppid,
        )
        node = NodeState(node_id, proc)
        self.nodes[node_id] = node
        await self._spawn(proc, f"agent-{node_id}.log")
        return node

    async def _controller_crash(self, fault: FaultPlan) -> None:
        ctl = self.found.controller
        if ctl is not None and not alive(ctl.pid):
            ctl = scan(self.data_dir, self.nats_url).controller
        if ctl is None:
            reason = (
                IN_UP
                if self.found.up is not None
                else "skipped: no `gpumesh controller` process of this stack on this machine"
            )
            self.note(f"skip   controller_crash: {reason}")
            return
        if flag(ctl.args, "--nats") is None:
            self.note("skip   controller_crash: the controller runs the stack's own NATS")
            return
        _signal(ctl.pid, signal.SIGKILL)
        self.controller_down = ctl
        self.found.controller = None
        self.note(f"fault  controller_crash: SIGKILL controller {ctl.pid}")

        async def restart() -> None:
            await self._restart_controller()

        self._later(fault, "controller_crash (restarted)", restart)

    async def _restart_controller(self) -> None:
        if self.controller_down is not None:
            await self._spawn(self.controller_down, "controller.log")
            self.controller_down = None

    def _nats_outage(self, fault: FaultPlan) -> None:
        server = self.found.nats
        if server is None or not alive(server.pid):
            self.note("skip   nats_outage: no nats-server of this stack on this machine")
            return
        self._stop([server.pid])
        self.note(f"fault  nats_outage: SIGSTOP nats-server {server.pid}")

        async def back() -> None:
            self._cont([server.pid])

        self._later(fault, "nats_outage", back)

    # -- processes -----------------------------------------------------------------------------

    def power_off(self, node: NodeState, agent: Proc) -> int:
        """SIGKILL the agent (its machine's process group) and its workloads; how many."""
        doomed = workloads_of(agent.pid)
        _signal(agent.pid, signal.SIGKILL, group=machine_group(agent))
        for pid in doomed:
            _kill_workload(pid)
        node.powered = False
        node.agent = agent
        for pid in (agent.pid, *doomed):
            self._stopped.pop(pid, None)  # a killed process needs no SIGCONT
        return len(doomed)

    async def power_on(self, node: NodeState) -> None:
        if node.powered or node.agent is None:
            return
        await self._spawn(node.agent, f"agent-{node.node_id}.log")
        node.powered = True

    async def _spawn(self, proc: Proc, log_name: str) -> None:
        """Start `proc`'s command again, with its environment, directory and log file, under a
        keeper (gpumesh/keeper.py) that stops it when the process that started the original
        (gpumesh up, a test harness) is gone."""
        env = dict(proc.env)
        owner = env.get(OWNER_ENV, "")
        if not owner:
            owner = f"{proc.ppid}:{start_time(proc.ppid)}" if proc.ppid > 1 else "0:"
            env[OWNER_ENV] = owner
        owner_pid, _, owner_start = owner.partition(":")
        log_path = Path(proc.stdout) if proc.stdout else self.data_dir / "logs" / log_name
        argv = [sys.executable, "-m", "gpumesh.keeper", owner_pid, owner_start, "--", *proc.argv]

        def start() -> None:
            cwd = proc.cwd if proc.cwd and os.path.isdir(proc.cwd) else str(self.data_dir)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with log_path.open("ab") as log:
                keeper = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,  # its own group: a later power loss takes it all
                )
            keeper.wait(timeout=30)  # it forks and exits at once

        await asyncio.to_thread(start)

    def _stop(self, targets: Sequence[int]) -> None:
        for pid in targets:
            self._stopped[pid] = self._stopped.get(pid, 0) + 1
            _signal(pid, signal.SIGSTOP)

    def _cont(self, targets: Sequence[int]) -> None:
        for pid in targets:
            held = self._stopped.get(pid, 0) - 1
            if held > 0:
                self._stopped[pid] = held
                continue
            self._stopped.pop(pid, None)
            _signal(pid, signal.SIGCONT)

    async def restore(self) -> None:
        """Leave the stack as it was found: continue what is stopped, start what was killed
        (churn victims and faults with no end included), clear fake-GPU faults. Idempotent;
        what it did is added to `restored`."""
        done = self.restored
        await self._stop_background()
        self._undo.clear()
        for pid in sorted(self._stopped):
            _signal(pid, signal.SIGCONT)
            done.append(f"SIGCONT {pid}")
        self._stopped.clear()
        if self.controller_down is not None:
            what = f"controller started again ({shlex.join(self.controller_down.args)})"
            try:
                await self._restart_controller()
            except _SPAWN_ERRORS as exc:
                what += f" FAILED: {exc}"
            done.append(what)
        for node in self.nodes.values():
            node.hung = False
            if not node.powered and node.agent is not None:
                try:
                    await self.power_on(node)
                    done.append(f"{node.node_id}: agent started again")
                except _SPAWN_ERRORS as exc:
                    done.append(f"{node.node_id}: agent NOT started again: {exc}")
        for node in self.nodes.values():
            if node.gpu_fault:
                error = await self._gpu_fault(node, Fault(kind="clear"))
                node.gpu_fault = bool(error)
                done.append(
                    f"{node.node_id}: fake GPUs cleared" + (f" FAILED: {error}" if error else "")
                )

    # -- the result ------------------------------------------------------------------------------

    def result(self) -> RunResult:
        from sim.run import RunResult, percentiles, request_summary

        availability, failed = request_summary(self.requests)
        timings = self.checker.timings
        return RunResult(
            scenario=self.scenario.name,
            seed=self.seed,
            duration_s=round(self.ended_at if self.ended_at is not None else self.now(), 3),
            events=self._run_events,
            digest=self._digest.hexdigest(),
            availability=availability,
            requests_failed=failed,
            detection=percentiles(timings.detection),
            replacement=percentiles(timings.replacement),
            violations=[v._asdict() for v in self.checker.violations],
            timeline=list(self.timeline),
            faults=[asdict(f) for f in self.scenario.faults],
        )


def failure_kind(status: int, body: bytes) -> str:
    """A failed request in the simulator's words (gateway/proxy.py's answers), else `http_N`."""
    code = ""
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
        code = str(msgspec.json.decode(body)["error"]["code"])
    if status == 404 and code == "model_not_found":
        return "UnknownCluster"
    if status == 503 and code == "no_ready_replica":
        return "NoReadyReplica"
    if status in (502, 504):
        return "AttemptsExhausted"
    return f"http_{status}" + (f"_{code}" if code else "")


def render_real(result: RunResult, *, commit: str = "") -> str:
    """sim.run.render, with its two words about virtual time made true of a real run."""
    from sim.run import render

    text = render(result, commit=commit)
    text = text.replace("timeline (virtual seconds)", "timeline (wall seconds since the start)", 1)
    return text.replace(" s simulated, ", " s on the real stack, ", 1)


# -- the command ----------------------------------------------------------------------------------


def _progress(text: str) -> None:
    print(f"gpumesh chaos: {text}", file=sys.stderr, flush=True)


def _gateway_url(text: str) -> str:
    return text if "://" in text else f"http://{text}"


async def run_chaos(args: argparse.Namespace) -> int:
    from sim.cli import git_commit
    from sim.run import find_scenario
    from sim.scenario import load
    from wire.commandline import credentials
    from wire.errors import CommandFailed
    from wire.nats_bus import NatsBus
    from wire.stack import find_nats_url

    if args.speed <= 0:
        raise CommandFailed("--speed must be > 0")
    if args.duration is not None and args.duration <= 0:
        raise CommandFailed("--duration must be > 0")
    path = find_scenario(args.scenario)
    scenario = load(path)
    url = find_nats_url(args.data_dir, args.nats)
    gateway = _gateway_url(args.gateway)
    if args.dry_run:
        return await _dry_run(args, scenario, path, url, gateway)
    bus = await NatsBus.connect(
        url, name="gpumesh-chaos", credentials=credentials(args, url, "admin")
    )
    run: ChaosRun | None = None
    try:
        run = ChaosRun(
            scenario,
            args.seed,
            bus=bus,
            nats_url=url,
            data_dir=args.data_dir,
            gateway=gateway,
            api_key=args.api_key or "",
            speed=args.speed,
            cap=args.duration,
            echo=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
        )
        _progress(
            f"scenario {path}, seed {args.seed}; NATS {url}; gateway {gateway}; "
            f"{len(run.nodes)} agents found ({', '.join(run.nodes) or 'none'})"
        )
        if len(run.nodes) != scenario.fleet.nodes:
            _progress(
                f"the scenario's fleet has {scenario.fleet.nodes} nodes, the stack "
                f"{len(run.nodes)}: victims are drawn among the stack's"
            )
        try:
            await run.prepare()
        except ChaosError as exc:
            raise CommandFailed(str(exc)) from None
        _progress(f"running for {run.end:g} s (Ctrl-C stops cleanly)")
        await _interruptible(run)
    finally:
        if run is not None:
            try:
                await run.restore()
            finally:
                for line in run.restored:
                    _progress(f"restored: {line}")
                await run.close()
        await bus.close()
    result = run.result()
    commit = git_commit()
    if args.json:
        data = {"commit": commit, "interrupted": run.interrupted, **result.to_json()}
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(render_real(result, commit=commit))
        if run.interrupted:
            print(f"  (interrupted at {result.duration_s:g} s: liveness not judged)")
    if run.interrupted:
        return 130
    return 0 if result.ok else 1


async def _interruptible(run: ChaosRun) -> None:
    """Run until the end or the first SIGINT/SIGTERM; a second one waits for the clean-up."""
    from runtime.shutdown import run_until_signal

    def interrupted() -> None:
        run.interrupted = True
        run.note("interrupted: continuing what is stopped, starting what was killed")

    await run_until_signal(
        _run_then_restore(run),
        on_signal=interrupted,
        on_second=lambda: _progress("cleaning up, please wait"),
    )


async def _run_then_restore(run: ChaosRun) -> None:
    try:
        await run.run()
    except asyncio.CancelledError:
        if not run.interrupted:
            raise
        await run.finish(judge=False)
    finally:
        await run.restore()  # with the handlers still in place: a second Ctrl-C waits


# -- the plan (--dry-run) ------------------------------------------------------------------------


def plan(
    scenario: Scenario, seed: int, found: Found, *, speed: float = 1.0
) -> list[dict[str, Any]]:
    """What each fault would do to whom, victims drawn as a run draws them at those times if
    every fault does what it says (a real run draws among the nodes up when it fires)."""
    rng = SeededStreams(seed)("faults")
    nodes = {n: NodeState(n, p) for n, p in sorted(found.agents.items())}
    ends: list[tuple[float, str, str]] = []  # (when, node, flag)
    out = []
    for fault in scenario.faults:
        for when, node_id, what in sorted(e for e in ends if e[0] <= fault.at_s):
            setattr(nodes[node_id], what, what == "powered")
            ends.remove((when, node_id, what))
        step: dict[str, Any] = {"at_s": round(fault.at_s / speed, 3), "kind": fault.kind}
        action = KIND_ACTIONS[fault.kind]
        if fault.kind in NODE_FAULTS:
            picked = [n.node_id for n in draw(nodes, fault.nodes, rng)]
            step["victims"] = picked
            for name in picked:
                mark = {"power_loss": "powered", "hang": "hung"}.get(fault.kind)
                if mark is None:
                    continue
                setattr(nodes[name], mark, mark == "hung")
                if fault.duration_s is not None:
                    ends.append((fault.at_s + fault.duration_s, name, mark))
        elif fault.kind == "controller_crash":
            if found.controller is None:
                action = IN_UP if found.up is not None else "skipped: no controller process found"
            elif flag(found.controller.args, "--nats") is None:
                action = "skipped: the controller runs the stack's own NATS"
            else:
                action = (
                    f"SIGKILL controller {found.controller.pid}, started again after duration_s"
                )
        elif fault.kind == "nats_outage" and found.nats is None:
            action = "skipped: no nats-server of this stack on this machine"
        if fault.duration_s is not None:
            step["duration_s"] = round(fault.duration_s / speed, 3)
        step["action"] = action
        out.append(step)
    return out


async def _dry_run(
    args: argparse.Namespace, scenario: Scenario, path: Path, url: str, gateway: str
) -> int:
    found = scan(args.data_dir, url)
    steps = plan(scenario, args.seed, found, speed=args.speed)
    processes = {
        "agents": {n: p.pid for n, p in sorted(found.agents.items())},
        "controller": found.controller.pid if found.controller else None,
        "up": found.up.pid if found.up else None,
        "nats_server": found.nats.pid if found.nats else None,
    }
    if args.json:
        data = {
            "scenario": scenario.name,
            "file": str(path),
            "seed": args.seed,
            "nats": url,
            "gateway": gateway,
            "processes": processes,
            "clusters": [asdict(c) for c in scenario.clusters],
            "rate_per_s": scenario.rate_per_s,
            "faults": steps,
        }
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    where = (
        f"inside gpumesh up (pid {found.up.pid})"
        if found.controller is None and found.up is not None
        else f"pid {found.controller.pid}"
        if found.controller is not None
        else "not found on this machine"
    )
    agents = ", ".join(f"{n} (pid {p.pid})" for n, p in sorted(found.agents.items())) or "none"
    lines = [
        f"scenario {scenario.name} ({path})  seed {args.seed}  speed {args.speed:g}  dry run",
        f"  NATS:        {url}" + (f" (nats-server pid {found.nats.pid})" if found.nats else ""),
        f"  gateway:     {gateway}",
        f"  controller:  {where}",
        f"  agents:      {agents}",
        f"  fleet:       the scenario has {scenario.fleet.nodes} nodes, the stack "
        f"{len(found.agents)}",
        "",
        "clusters (created when missing; the echo workload)",
    ]
    lines += [
        f"  t={c.at_s / args.speed:g} s  {c.name}: {c.replicas} replicas"
        + (f" on {c.gpu_model}" if c.gpu_model else "")
        for c in scenario.clusters
    ]
    lines.append(f"traffic: {scenario.rate_per_s:g} requests/s per cluster through {gateway}")
    lines.append("")
    lines.append("faults (wall seconds)")
    for step in steps:
        victims = f" {', '.join(step['victims']) or '(none)'}" if "victims" in step else ""
        lasting = f" for {step['duration_s']:g} s" if "duration_s" in step else ""
        lines.append(f"  t={step['at_s']:g}  {step['kind']}{victims}{lasting}")
        lines.append(f"      {step['action']}")
    print("\n".join(lines))
    return 0
