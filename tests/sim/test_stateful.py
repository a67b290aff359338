"""A Hypothesis state machine that owns the simulator: its rules deploy and scale clusters, inject
and heal faults, crash and restart the controller and advance virtual time; the simulator's
invariants are its @invariants. Then the same machine against a scheduler with a deliberately
injected bug: the suite must find it and shrink it to a handful of steps.

Everything runs on one SimEventLoop the machine owns: each rule schedules its action on the
virtual-time loop and runs it for a drawn number of virtual seconds (no real waiting). The
real controller, agents and gateway routing logic run inside `World.running()`, entered by a
long-lived task on that loop.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import projections
from sim.loop import SimEventLoop
from sim.run import quiet_logger
from sim.scenario import Fleet, Scenario
from sim.world import World
from tests.sim.planted_bugs import plant_stacking_bug

NODES = 5  # two RTX 4090s each: room for every cluster the machine can ask for, but not much
NODE_IDS = [f"node-{i}" for i in range(NODES)]
CLUSTER_NAMES = ["llama", "mixtral", "qwen"]
NODE_FAULTS = ["power_loss", "hang", "partition", "thermal", "crash_loop"]
FAULT_PARAMS: dict[str, dict[str, Any]] = {"thermal": {"value": 95.0}}
T = TypeVar("T")
CONTROLLER = "controller"  # the key of a controller outage among the faults in effect
SETTLE_S = 120.0  # teardown: after the last fault ends, every cluster is whole within this
STOP_S = 10.0  # teardown: the world's tasks end within this (virtual) time of their cancel

SCENARIO = Scenario(
    name="stateful",
    duration_s=1.0,
    settle_s=SETTLE_S,
    fleet=Fleet(nodes=NODES, gpus="RTX4090:24GiB:2"),
    rate_per_s=2.0,  # client requests per second per cluster: the routing invariants need them
)

# Few, long examples: each step runs the whole control plane for up to 30 virtual seconds. The
# share of the profile's max_examples keeps `dev`/`ci` within about 20 s and lets `deep` dig.
STEPS = 20
EXAMPLES = max(4, settings().max_examples // 3)


class SimMachine(RuleBasedStateMachine):
    """A simulated fleet driven rule by rule. `last_run` lists the steps of the latest run (the
    last run of a failing test is Hypothesis's shrunk example, replayed for its report)."""

    last_run: ClassVar[list[str]] = []
    failing_runs: ClassVar[list[int]] = []  # the step counts of runs that ended in a violation
    liveness: ClassVar[bool] = True  # teardown: end the faults, settle, judge liveness
    clusters = Bundle("clusters")

    def __init__(self) -> None:
        super().__init__()
        self.loop: SimEventLoop | None = None
        self.world: World | None = None
        self.main: asyncio.Task[None] | None = None
        self.ends: dict[str, Callable[[], None]] = {}  # node (or CONTROLLER) -> end its fault
        self.traffic: set[str] = set()
        SimMachine.last_run = []

    @property
    def controller_up(self) -> bool:
        return CONTROLLER not in self.ends

    # -- plumbing ------------------------------------------------------------------------

    def _step(self, text: str) -> None:
        SimMachine.last_run.append(text)

    def _now(self) -> float:
        assert self.loop is not None
        return self.loop.time()

    def _advance(self, seconds: float) -> None:
        assert self.loop is not None
        self.loop.run_until_complete(asyncio.sleep(seconds))
        self._check_alive()

    def _check_alive(self) -> None:
        # A production task that raised takes the whole TaskGroup down: never a silent pass.
        assert self.main is not None
        if self.main.done():
            exc = None if self.main.cancelled() else self.main.exception()
            raise AssertionError(f"the simulated world stopped: {exc!r}") from exc

    def _do(self, action: Callable[[], T]) -> T:
        """Run `action` on the virtual loop (the world reads its clock from the running loop)."""
        assert self.loop is not None

        async def call() -> T:
            return action()

        return self.loop.run_until_complete(call())

    def _inject(self, kind: str, node_id: str | None) -> None:
        world = self.world
        assert world is not None
        params = FAULT_PARAMS.get(kind, {})
        key = node_id or CONTROLLER
        self.ends[key] = self._do(lambda: world.fault(kind, node_id, **params))  # type: ignore[arg-type]

    def _end(self, key: str) -> None:
        self._do(self.ends.pop(key))

    async def _live(self, world: World, ready: asyncio.Event) -> None:
        async with world.running():
            ready.set()
            await asyncio.Event().wait()  # until teardown cancels this task

    # -- rules ---------------------------------------------------------------------------

    @initialize(seed=st.integers(0, 1000))
    def start(self, seed: int) -> None:
        self._step(f"start(seed={seed})")
        self.loop = SimEventLoop()
        self.world = World(SCENARIO, seed, log=quiet_logger())
        ready = asyncio.Event()
        self.main = self.loop.create_task(self._live(self.world, ready), name="world")
        self.loop.run_until_complete(ready.wait())
        self._advance(2.0)  # the agents register

    @rule(
        target=clusters,
        name=st.sampled_from(CLUSTER_NAMES),
        replicas=st.integers(1, 3),
        wait=st.integers(1, 10),
    )
    def create_cluster(self, name: str, replicas: int, wait: int) -> str:
        self._step(f"create_cluster({name!r}, {replicas}, wait={wait})")
        world = self.world
        assert world is not None
        # The API call runs in the background: with the controller down it waits for it.
        self._do(lambda: world.spawn(world.create_cluster(name, replicas), f"create:{name}"))
        if name not in self.traffic:
            self.traffic.add(name)
            self._do(lambda: world.start_traffic(name))
        self._advance(wait)
        return name

    @rule(name=clusters, replicas=st.integers(0, 4), wait=st.integers(1, 10))
    def scale(self, name: str, replicas: int, wait: int) -> None:
        self._step(f"scale({name!r}, {replicas}, wait={wait})")
        world = self.world
        assert world is not None
        self._do(lambda: world.spawn(world.scale(name, replicas), f"scale:{name}"))
        self._advance(wait)

    @rule(
        kind=st.sampled_from(NODE_FAULTS), node=st.sampled_from(NODE_IDS), wait=st.integers(1, 10)
    )
    def fault(self, kind: str, node: str, wait: int) -> None:
        self._step(f"fault({kind!r}, {node!r}, wait={wait})")
        if node not in self.ends:  # one fault per node at a time: each one's end is exact
            self._inject(kind, node)
        self._advance(wait)

    @precondition(lambda self: any(key != CONTROLLER for key in self.ends))
    @rule(data=st.data(), wait=st.integers(1, 10))
    def heal(self, data: st.DataObject, wait: int) -> None:
        faulted = sorted(key for key in self.ends if key != CONTROLLER)
        node = data.draw(st.sampled_from(faulted), label="node")
        self._step(f"heal({node!r}, wait={wait})")
        self._end(node)
        self._advance(wait)

    @precondition(lambda self: self.controller_up)
    @rule(wait=st.integers(1, 30))
    def crash_controller(self, wait: int) -> None:
        self._step(f"crash_controller(wait={wait})")
        self._inject("controller_crash", None)
        self._advance(wait)

    @precondition(lambda self: not self.controller_up)
    @rule(wait=st.integers(1, 10))
    def restart_controller(self, wait: int) -> None:
        self._step(f"restart_controller(wait={wait})")
        self._end(CONTROLLER)
        self._advance(wait)

    @rule(seconds=st.integers(1, 30))
    def advance(self, seconds: int) -> None:
        self._step(f"advance({seconds})")
        self._advance(seconds)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def safety(self) -> None:
        """Placement fit and spread, contiguous versions, routes to current epochs and to
        nodes that are not offline: the Checker's verdicts on every event and request so far."""
        if self.world is not None:
            assert self.world.checker.violations == [], "\n".join(self.world.timeline)

    @invariant()
    def rebuild_equals_live(self) -> None:
        world = self.world
        if world is None or not self.controller_up:
            return
        controller = world.controller
        if controller is None or not controller.ready.is_set():
            return  # still recovering: its state is being folded
        log = world.store.read_all_now()
        upto = [e for e in log if e.position <= controller.live.position]
        assert projections.rebuild(upto) == controller.live.state, "live state != rebuild"
        if world.checker.events == len(log):
            assert world.checker.state == projections.rebuild(log), "checker fold != rebuild"

    # -- the end -------------------------------------------------------------------------

    def teardown(self) -> None:
        loop, world, main = self.loop, self.world, self.main
        if loop is None or world is None or main is None:
            return
        if world.checker.violations:
            SimMachine.failing_runs.append(len(SimMachine.last_run))
        try:
            if self.liveness and not main.done() and not world.checker.violations:
                self._settle(world)
        finally:
            self._stop(loop, main)

    @staticmethod
    def _stop(loop: SimEventLoop, main: asyncio.Task[None]) -> None:
        """Cancel the world and wait for it: every task must honour the cancellation (one
        that swallows it keeps a controller or agent from ever shutting down, as the routing
        loop once did: test_world.py's test_a_cancelled_routing_loop_stops)."""
        main.cancel()
        loop.run_until_complete(asyncio.wait({main}, timeout=STOP_S))
        stuck = []
        while not main.done():  # say which tasks, then end them anyway: never simulate forever
            stuck += [t.get_name() for t in asyncio.all_tasks(loop) if t.cancelling()]
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.wait({main}, timeout=STOP_S))
        if not main.cancelled():
            main.exception()  # retrieved: _check_alive has reported it already
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        assert not stuck, f"still running {STOP_S:g} s after their cancellation: {sorted(stuck)}"

    def _settle(self, world: World) -> None:
        """Liveness: every fault ends, the controller is back; within SETTLE_S every cluster
        is whole again, no command is lost, every lasting node fault showed in the node's
        health, and a rebuild of the log equals live state."""
        assert self.loop is not None
        for key in sorted(self.ends):
            self._end(key)
        self._advance(SETTLE_S)
        self.loop.run_until_complete(world.checker.finish())
        assert world.checker.violations == [], "\n".join(world.timeline)


# No explain phase: it re-runs failing examples under a line tracer, seconds each here.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]

SimMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    phases=PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSimMachine = SimMachine.TestCase


# -- the injected bug ------------------------------------------------------------------------

_STEP_LINE = re.compile(r"^\s*(?:\w+ = )?state\.(\w+)\(", re.MULTILINE)


class SafetyMachine(SimMachine):
    """The same machine without the settling teardown: the injected bug is a safety violation,
    and the shrinker's hundreds of runs should not each simulate two more idle minutes."""

    liveness = False


def test_an_injected_scheduler_bug_is_found_and_shrunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the scheduler preferring nodes that already hold a replica of the cluster, the
    machine must fail (the Checker's spread invariant), and Hypothesis must shrink the failing
    run to 10 steps or fewer."""
    plant_stacking_bug(monkeypatch)
    SimMachine.failing_runs = []
    with pytest.raises(AssertionError) as caught:
        run_state_machine_as_test(
            SafetyMachine,
            settings=settings(
                max_examples=50,
                stateful_step_count=STEPS,
                deadline=None,
                database=None,  # a fresh search every time, not a replay of a stored failure
                derandomize=True,
                phases=PHASES,
                report_multiple_bugs=False,  # shrink the one failure, not every variant
                suppress_health_check=list(HealthCheck),
                print_blob=False,
            ),
        )
    assert "spread" in str(caught.value), caught.value
    # The last run is the shrunk example, replayed for the report.
    steps = SimMachine.last_run
    assert 1 <= len(steps) <= 10, steps
    # Hypothesis's own report of it agrees: one `state.rule(...)` line per step (between the
    # invariants' lines).
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    not_steps = {"teardown", "safety", "rebuild_equals_live"}
    reported = [name for name in _STEP_LINE.findall(notes) if name not in not_steps]
    assert len(reported) == len(steps), notes
    first = SimMachine.failing_runs[0]
    print(f"first failing run: {first} steps; shrunk to {len(steps)}: {steps}")
