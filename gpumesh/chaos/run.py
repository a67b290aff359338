"""One scenario against the real stack, on wall time: `ChaosRun`.

The run deploys the scenario's clusters and sends its traffic as the simulator's clients do
(sim/clients.py), applies its faults on the simulator's timeline (faults.py, sim/timeline.py),
follows the event log and folds it with the simulator's Checker, and judges liveness with the
simulator's rule (sim/liveness.py). Its tasks live in one TaskGroup: a task that fails (a bug
in the traffic, a fault's coroutine, the log's follower) ends the run at once, and its error is
in the result (`crashed`) and the printed report; the run is then not ok.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import math
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec

from events import Envelope
from events.contract import subjects
from events.contract.messages import ApiReply, EventsRequest
from sim.clients import TRAFFIC_AFTER_S, cluster_spec, shaped_traffic
from sim.env import SeededStreams
from sim.invariants import Checker, Violation
from sim.liveness import short_in, unplaced_groups
from sim.run import RunResult, percentiles, request_summary
from sim.scenario import Scenario
from sim.world import RequestLog

from .errors import ChaosError
from .faults import RealFaults
from .gateway import AFTER_FIRST_BYTE, Client, GatewayClient
from .stack import NodeState, Stack

if TYPE_CHECKING:
    from runtime.env import Bus

EVENTS_POLL_S = 0.25
NOT_REACHED = "the run did not reach the end of the settle"
# What a real run checks (docs/chaos.md): at each event of the log, and after the settle.
INVARIANTS_CHECKED = (
    "contiguous_versions",
    "spread",
    "placement_fits",
    "no_partial_group_serving",
    "no_gpu_held_twice",
    "liveness",
    "group_serving_or_unschedulable",
)


@dataclass
class ChaosResult(RunResult):
    """The simulator's RunResult, and what only a real run has."""

    interrupted: bool = False
    crashed: list[dict[str, str]] = field(default_factory=list)  # {"task", "error"}
    # gpumesh up --ha: one per leader_crash, leader_pause, nats_server_loss (ha.Failover)
    failovers: list[dict[str, Any]] = field(default_factory=list)
    invariants_checked: list[str] = field(default_factory=lambda: list(INVARIANTS_CHECKED))

    @property
    def ok(self) -> bool:
        return not self.violations and not self.crashed


class _Page(msgspec.Struct):
    events: list[Envelope]
    next: int
    head: int


class _PageReply(msgspec.Struct):
    ok: bool
    error: str = ""
    data: _Page | None = None


_page_reply = msgspec.json.Decoder(_PageReply)


def describe(exc: BaseException) -> str:
    """`Type: message`, for each exception at the leaves of a group (a TaskGroup's)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


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
        client: Client | None = None,
    ) -> None:
        self.scenario = scenario
        self.seed = seed
        self.bus = bus
        self.nats_url = nats_url
        self.speed = speed
        self.derive = SeededStreams(seed)
        self.echo = echo or (lambda line: None)
        self.client: Client = client or GatewayClient(gateway, api_key)
        full = (scenario.duration_s + scenario.settle_s) / speed
        self.end = min(full, cap) if cap is not None else full
        self.fault_end = min(scenario.duration_s / speed, self.end)
        self.judged = self.end >= full  # liveness is judged only after the whole settle
        self.stack = Stack(bus, data_dir, nats_url)
        self.faults = RealFaults(self)
        self.timeline: list[str] = []
        self.requests: dict[str, RequestLog] = {}
        self.outcomes: list[tuple[float, str]] = []  # (sent at, "" or how it failed), each
        self.checker: Checker = Checker(cast(Any, self))  # it calls back only note()
        self.interrupted = False
        self.ended_at: float | None = None
        self.crashes: list[tuple[str, BaseException]] = []  # (task, what it raised)
        self._tasks: asyncio.TaskGroup | None = None
        self._loop_t0 = 0.0
        self.start_ns = time.time_ns()
        self._history = True  # folding the log as it was before the run
        self._stopping = False  # the run's faults and settle are over: its loops end
        self._cursor = 0
        self._last = 0
        self._run_events = 0
        self._digest = hashlib.sha256()

    @property
    def nodes(self) -> dict[str, NodeState]:
        return self.stack.nodes

    @property
    def restored(self) -> list[str]:
        return self.stack.restored

    @property
    def traffic(self) -> bool:
        return self.scenario.rate_per_s > 0 and bool(self.scenario.clusters)

    # -- clock and timeline ----------------------------------------------------------------

    def now(self) -> float:
        if not self._loop_t0:
            return 0.0
        return asyncio.get_running_loop().time() - self._loop_t0

    def at(self, scenario_s: float) -> float:
        return scenario_s / self.speed

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t - self.now()))

    def stamp(self) -> float:
        """The current wall time in the checker's frame (seconds since the start)."""
        return (time.time_ns() - self.start_ns) / 1e9

    def note(self, text: str) -> None:
        if self._history:
            return  # a violation in the history before the run: not this run's
        line = f"{self.now():9.3f}  {text}"
        self.timeline.append(line)
        self.echo(line)

    def struck(self, kind: str, node: NodeState, at: float | None = None) -> None:
        """Tell the checker a fault struck `node` (now, or at `at`): detection runs from it."""
        self.checker.fault(kind, node, self.stamp() if at is None else at)

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

    async def catch_up_quietly(self, *, timeout: float) -> None:
        """catch_up, if the controller and NATS answer now (they may be a fault's victims)."""
        from runtime.errors import BusError

        with contextlib.suppress(BusError, ChaosError, msgspec.DecodeError):
            await self.catch_up(timeout=timeout)

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
        # The flag as well as the cancel: a cancel lost in a request (wire/nats_bus.py
        # cancellation_kept says where) must not keep the run's TaskGroup waiting.
        while not self._stopping:
            await self.catch_up_quietly(timeout=2.0)
            await asyncio.sleep(EVENTS_POLL_S)

    # -- preparing ---------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Check the gateway, fold the log so far, and start the clock."""
        from runtime.errors import NoResponders

        if self.traffic:
            await self.client.check()
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
        await self.client.close()

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Deploys, traffic and faults on schedule, then the settle and the liveness check. A
        task that fails ends the run: its error is in `crashes`, and liveness is not judged."""
        scenario = self.scenario
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                jobs = [
                    self.spawn(self._follow(), "chaos:events"),
                    self.spawn(self._create_clusters(), "chaos:deploys"),
                ]
                if self.traffic:
                    jobs += [
                        self.spawn(self._traffic(c.name, c.at_s), f"chaos:traffic:{c.name}")
                        for c in scenario.clusters
                    ]
                await self._guarded("chaos:faults", self._faults_then_settle())
                await self.faults.stop_watches()
                self._stopping = True
                for job in jobs:
                    job.cancel()
        except* Exception as group:
            self._crashed_in(group)
        finally:
            self._tasks = None
        if self.crashes:
            await self.finish(judge=False, why="the run failed")
        else:
            await self.finish(judge=self.judged)

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A task of the run: its failure fails the run (see `run`)."""
        if self._tasks is None:
            work.close()
            raise RuntimeError(f"{name}: the run is not running")
        return self._tasks.create_task(self._guarded(name, work), name=name)

    async def _guarded(self, name: str, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception as exc:
            self._crash(name, exc)
            raise

    def _crash(self, name: str, exc: BaseException) -> None:
        self.crashes.append((name, exc))
        self.note(f"FAILED {name}: {describe(exc)}")

    def _crashed_in(self, group: BaseExceptionGroup[Exception]) -> None:
        # _guarded records every task's error by name as it leaves the task; anything else
        # (there should be nothing) is still the run's failure.
        seen = {id(exc) for _, exc in self.crashes}
        for exc in group.exceptions:
            if id(exc) not in seen:
                self._crash("chaos", exc)

    async def _faults_then_settle(self) -> None:
        scenario = self.scenario
        faults = list(
            itertools.takewhile(lambda f: self.at(f.at_s) < self.fault_end, scenario.faults)
        )
        # The timeline counts in the scenario's seconds; --duration may stop the faults early.
        cut = self.end < scenario.duration_s / self.speed
        until = self.end * self.speed if cut else scenario.duration_s
        await self.faults.play(faults, until=until)
        self.note(f"faults over; settling {scenario.settle_s / self.speed:g} s")
        await self.faults.end_all()
        await self.sleep_until(self.end)

    async def finish(self, *, judge: bool, why: str = NOT_REACHED) -> None:
        """Read the log to its head and, if `judge`, check liveness as the simulator does."""
        self.ended_at = self.now()
        await self.catch_up_quietly(timeout=5.0)
        if not judge:
            self.note(f"liveness not judged: {why}")
            return
        settle_s = self.scenario.settle_s / self.speed
        for invariant, shorts in (
            ("liveness", short_in(self.checker.state, settle_s=settle_s)),
            (
                "group_serving_or_unschedulable",
                unplaced_groups(self.checker.state, settle_s=settle_s),
            ),
        ):
            for short in shorts:
                self.checker.violations.append(
                    Violation(round(self.stamp(), 6), invariant, short.detail)
                )
                self.note(f"VIOLATION {invariant}: {short.detail}")

    async def restore(self) -> None:
        """Leave the stack as it was found (Stack.restore), once `run` has returned."""
        self.faults.abandon()
        await self.stack.restore()

    # -- clusters and traffic ------------------------------------------------------------------

    async def _create_clusters(self) -> None:
        python = shlex.quote(sys.executable)
        command = f"{python} -m gpumesh workload echo --port {{port}} --model {{model}}"
        for plan in sorted(self.scenario.clusters, key=lambda c: c.at_s):
            await self.sleep_until(self.at(plan.at_s))
            if plan.name in self.checker.state.clusters.clusters:
                have = self.checker.state.clusters.clusters[plan.name].spec.replicas
                self.note(f"cluster {plan.name} exists ({have} replicas): left as it is")
                continue
            spec = cluster_spec(plan, command)
            reply = await self._api("cluster.create", spec, timeout=30.0)
            error = f" ({reply.error})" if reply.error else ""
            self.note(f"cluster {plan.name} created ({plan.replicas} replicas): {reply.ok}{error}")

    async def _api(self, verb: str, body: object, *, timeout: float) -> ApiReply:
        from runtime.errors import BusError

        try:
            raw = await self.bus.request(
                subjects.api(verb), msgspec.json.encode(body), timeout=timeout
            )
            return msgspec.json.decode(raw.data, type=ApiReply)
        except (BusError, msgspec.DecodeError) as exc:
            return ApiReply(ok=False, error=f"{verb}: {exc}")

    async def _traffic(self, cluster: str, start: float) -> None:
        log = self.requests.setdefault(cluster, RequestLog())
        await self.sleep_until(self.at(start + TRAFFIC_AFTER_S))

        def request() -> Coroutine[Any, Any, None]:
            log.sent += 1
            return self._request(cluster, log)

        rng = self.derive(f"traffic:{cluster}")
        await shaped_traffic(rng, self.scenario.traffic_shape(), self.now, request)

    async def _request(self, cluster: str, log: RequestLog) -> None:
        sent = self.now()
        kind = await self.client.send(cluster)
        self.outcomes.append((sent, kind))
        if not kind:
            log.ok += 1
        else:
            log.failed[kind] = log.failed.get(kind, 0) + 1

    # -- the result ------------------------------------------------------------------------------

    def result(self) -> ChaosResult:
        availability, failed = request_summary(self.requests)
        timings = self.checker.timings
        return ChaosResult(
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
            interrupted=self.interrupted,
            crashed=[{"task": name, "error": describe(exc)} for name, exc in self.crashes],
            failovers=self._failovers(),
        )

    def _failovers(self) -> list[dict[str, Any]]:
        """Each failover, with the requests sent from its fault until the next one (or the
        end of the run) that ended: how many, and how those that failed failed."""
        failovers = self.faults.failovers
        out = []
        for i, failover in enumerate(failovers):
            until = failovers[i + 1].at if i + 1 < len(failovers) else math.inf
            window = [kind for sent, kind in self.outcomes if failover.at <= sent < until]
            failed = Counter(kind for kind in window if kind)
            # When the failed ones were sent, in seconds after the fault: [first, last].
            when = [sent - failover.at for sent, kind in self.outcomes if kind and
                    failover.at <= sent < until]  # fmt: skip
            after = sum(n for kind, n in failed.items() if kind.endswith(AFTER_FIRST_BYTE))
            failover.requests = {
                "sent": len(window),
                "failed": sum(failed.values()),
                "failed_before_first_byte": sum(failed.values()) - after,
                "failed_by_kind": dict(sorted(failed.items())),
                "failed_sent_s": [round(min(when), 3), round(max(when), 3)] if when else [],
            }
            out.append(failover.to_json())
        return out
