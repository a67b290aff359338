"""A scenario's faults applied to the real stack at their wall times, and undone.

When each fault starts and each of its effects ends is the simulator's own FaultTimeline
(sim/timeline.py), walked in the scenario's seconds and slept on in wall seconds (divided by
--speed), so an end and a fault the scenario puts at one instant come in the simulator's order
whatever the wall clock's drift. What each kind does here is KIND_ACTIONS (gpumesh/chaos/kinds.py).

The faults that keep working after they start (flap, crash_loop, churn) are tasks of the run's
TaskGroup: one that fails fails the run, with its error.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Literal

from events.contract.messages import Fault
from sim.scenario import FaultPlan
from sim.timeline import End, FaultTimeline

from .errors import ChaosError
from .ha import (
    LEADS_AGAIN_WITHIN_S,
    LEASE_POLL_S,
    Failover,
    LeaseReader,
    describe_lease,
    direct_servers,
    peer_ports,
)
from .kinds import (
    CANNOT_PARTITION,
    CRASH_LOOP_EVERY_S,
    HA_KINDS,
    NEEDS_HA,
    NETWORK_ONLY,
    NO_CONTROL,
    RESTARTS,
)
from .procfs import Proc, kill_workload, send_signal, workloads_of
from .stack import SPAWN_ERRORS, STAGE, NodeState, draw, stage_holders

if TYPE_CHECKING:
    from .run import ChaosRun

Undo = Callable[[], Awaitable[None]]


class RealFaults:
    def __init__(self, run: ChaosRun) -> None:
        self.run = run
        self.stack = run.stack
        self.rng = run.derive("faults")
        self.timeline: FaultTimeline[Undo] = FaultTimeline()
        self._background: list[asyncio.Task[None]] = []
        # gpumesh up --ha: the lease, the failovers watched, which NATS server dies (the
        # simulator draws it from a stream of its own, sim/faults.py)
        self.lease = LeaseReader(run.bus)
        self.failovers: list[Failover] = []
        self._watches: list[asyncio.Task[None]] = []
        self._nats_rng = run.derive("nats-servers")

    async def play(self, faults: Sequence[FaultPlan], *, until: float) -> None:
        """Apply `faults` and end their effects on schedule, up to `until` (the scenario's
        seconds); a fault that cannot be applied is noted and the run goes on."""
        run = self.run
        for step in self.timeline.steps(faults, until=until):
            await run.sleep_until(run.at(step.at))
            if isinstance(step, End):
                await self._end(step.what, step.undo)
                continue
            try:
                await self._apply(step.fault)
            except SPAWN_ERRORS as exc:  # a run goes on, and still prints its summary
                run.note(f"fault  {step.fault.kind} FAILED: {exc}")
        await run.sleep_until(run.at(until))

    async def end_all(self) -> None:
        """The faults stop: end everything still in effect (liveness is judged after this)."""
        await self._stop_background()
        for end in self.timeline.cut():
            await self._end(end.what, end.undo)

    def abandon(self) -> None:
        """Forget the ends still due: Stack.restore undoes everything at once."""
        self.timeline.cut()

    async def _end(self, what: str, undo: Undo) -> None:
        self.run.note(f"end    {what}")
        try:
            await undo()
        except SPAWN_ERRORS as exc:  # restore() tries again at the end of the run
            self.run.note(f"end    {what} FAILED: {exc}")

    def _later(self, fault: FaultPlan, what: str, undo: Undo) -> None:
        # From the fault's planned time, as on virtual time (see the module's docstring).
        self.timeline.ends_after(fault, fault.at_s, what, undo)

    def _keep_going(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = self.run.spawn(work, name)
        self._background.append(task)
        return task

    async def _stop_background(self) -> None:
        for task in self._background:
            task.cancel()
        if self._background:
            # They are the TaskGroup's: one that failed has failed the run already.
            await asyncio.wait(self._background)
        self._background.clear()

    def victims(self, fault: FaultPlan) -> list[NodeState]:
        if fault.nodes == STAGE:
            # A node holding a ready pipeline's worker stage, as the simulator's "stage" draws.
            held = stage_holders(self.run.checker.state.replicas.replicas.values())
            up = [
                self.stack.nodes[n]
                for n in held
                if n in self.stack.nodes and self.stack.nodes[n].powered
            ]
            if not up:
                self.run.note("fault  no ready pipeline stage to strike (skipped)")
                return []
            return [self.rng.choice(up)]
        return draw(self.stack.nodes, fault.nodes, self.rng)

    # -- each kind -----------------------------------------------------------------------------

    async def _apply(self, fault: FaultPlan) -> None:
        run = self.run
        # The checker snapshots the victims' replicas: let it see the log as it is now.
        await run.catch_up_quietly(timeout=1.0)
        kind = fault.kind
        if kind == "controller_crash":
            self._controller_crash(fault)
        elif kind == "nats_outage":
            self._nats_outage(fault)
        elif kind == "gateway_partition":
            run.note(f"skip   {kind}: {NETWORK_ONLY}")
        elif kind == "controller_partition" and self.stack.ha is None:
            run.note(f"skip   {kind}: {CANNOT_PARTITION}")
        elif kind in HA_KINDS and self.stack.ha is None:
            run.note(f"skip   {kind}: {NEEDS_HA}")
        elif kind in ("leader_crash", "leader_pause"):
            await self._leader_fault(fault)
        elif kind == "controller_partition":
            await self._controller_partition(fault)
        elif kind == "nats_server_loss":
            await self._nats_server_loss()
        elif kind == "churn":
            self._keep_going(self._churn(fault), "chaos:churn")
            run.note(f"fault  churn ({fault.count} nodes every {fault.period_s:g} s)")
        else:
            for node in self.victims(fault):
                await self._node_fault(fault, node, f"{kind} {node.node_id}")

    async def _node_fault(self, fault: FaultPlan, node: NodeState, what: str) -> None:
        kind = fault.kind
        if kind in ("one_way_partition", "slow"):
            self.run.note(f"skip   {what}: {NETWORK_ONLY}")
            return
        if kind in ("thermal", "ecc", "driver"):
            await self._gpu_fault(fault, kind, node, what)
            return
        agent = self.stack.agent(node) if node.powered else None
        if agent is None:
            self.run.note(f"skip   {what}: no agent process of {node.node_id} is running")
            return
        self.run.struck(kind, node)
        if kind == "power_loss":
            self._power_loss(fault, node, agent, what)
        elif kind in ("hang", "partition"):
            self._freeze(fault, node, agent, what)
        elif kind == "flap":
            self.run.note(f"fault  {what}: SIGSTOP/SIGCONT every {self.run.at(fault.period_s):g} s")
            self._keep_going(self._flap(fault, agent), f"chaos:{what}")
        elif kind == "crash_loop":
            self.run.note(f"fault  {what}: SIGKILL its workloads every {CRASH_LOOP_EVERY_S:g} s")
            task = self._keep_going(self._crash_loop(agent), f"chaos:{what}")

            async def cured() -> None:
                task.cancel()
                await asyncio.wait([task])

            self._later(fault, what, cured)

    async def _gpu_fault(
        self,
        fault: FaultPlan,
        kind: Literal["thermal", "ecc", "driver"],
        node: NodeState,
        what: str,
    ) -> None:
        value = fault.value if kind == "thermal" else 1.0
        at = self.run.stamp()
        error = await self.stack.gpu_fault(node, Fault(kind=kind, value=value))
        if error:
            self.run.note(f"skip   {what}: {error}")
            return
        self.run.struck(kind, node, at)
        node.gpu_fault = True
        shown = f" {value:g}" if kind == "thermal" else ""
        self.run.note(f"fault  {what}: fake GPUs {kind}{shown}")

        async def clear() -> None:
            if not await self.stack.gpu_fault(node, Fault(kind="clear")):
                node.gpu_fault = False

        self._later(fault, what, clear)

    def _power_loss(self, fault: FaultPlan, node: NodeState, agent: Proc, what: str) -> None:
        killed = self.stack.power_off(node, agent)
        back = f" ({RESTARTS})" if self.stack.ha is not None else ""
        self.run.note(f"fault  {what}: SIGKILL agent {agent.pid} and {killed} workload(s){back}")

        async def power_on() -> None:
            await self.stack.power_on(node)

        self._later(fault, what, power_on)

    def _freeze(self, fault: FaultPlan, node: NodeState, agent: Proc, what: str) -> None:
        """hang: the agent alone; partition: the agent and its workloads (nothing answers)."""
        stack = self.stack
        if fault.kind == "hang":
            node.hung = True
            frozen = [agent.pid]
            self.run.note(f"fault  {what}: SIGSTOP agent {agent.pid}")
        else:
            frozen = [agent.pid, *workloads_of(agent.pid)]
            self.run.note(
                f"fault  {what}: SIGSTOP agent {agent.pid} and {len(frozen) - 1} workload(s)"
            )
        stack.stop(frozen)

        async def thaw() -> None:
            if fault.kind == "hang":
                node.hung = False
            stack.cont(frozen)

        self._later(fault, what, thaw)

    async def _flap(self, fault: FaultPlan, agent: Proc) -> None:
        run = self.run
        end = run.now() + run.at(fault.duration_s or 60.0)
        period = run.at(fault.period_s)
        while run.now() < end:
            frozen = [agent.pid, *workloads_of(agent.pid)]
            self.stack.stop(frozen)
            try:
                await asyncio.sleep(period)
            finally:
                self.stack.cont(frozen)
            await asyncio.sleep(period)

    async def _crash_loop(self, agent: Proc) -> None:
        while True:
            for pid in workloads_of(agent.pid):
                kill_workload(pid)
            await asyncio.sleep(CRASH_LOOP_EVERY_S)

    async def _churn(self, fault: FaultPlan) -> None:
        run = self.run
        end = run.now() + run.at(fault.duration_s or 60.0)
        while run.now() < end:
            leaving = FaultPlan(at_s=0.0, kind="power_loss", nodes=str(fault.count))
            for node in self.victims(leaving):
                agent = self.stack.agent(node)
                run.note(f"churn  {node.node_id} leaves")
                run.struck("churn", node)
                if agent is not None:
                    self.stack.power_off(node, agent)
            for _ in range(fault.count):
                joined = await self.stack.join(run.checker.state.nodes.nodes)
                if joined is None:
                    run.note("churn  no agent to copy: nobody joins")
                else:
                    run.note(f"churn  {joined.node_id} joins")
            await asyncio.sleep(run.at(fault.period_s))

    def _controller_crash(self, fault: FaultPlan) -> None:
        ctl, why = self.stack.controller()
        if ctl is None:
            self.run.note(f"skip   controller_crash: {why}")
            return
        self.stack.kill_controller(ctl)
        self.run.note(f"fault  controller_crash: SIGKILL controller {ctl.pid}")

        async def restart() -> None:
            await self.stack.restart_controller()

        self._later(fault, "controller_crash (restarted)", restart)

    def _nats_outage(self, fault: FaultPlan) -> None:
        servers = self.stack.nats_pids()
        if not servers:
            self.run.note("skip   nats_outage: no nats-server of this stack on this machine")
            return
        self.stack.stop(servers)
        self.run.note(f"fault  nats_outage: SIGSTOP nats-server {', '.join(map(str, servers))}")

        async def back() -> None:
            self.stack.cont(servers)

        self._later(fault, "nats_outage", back)

    # -- gpumesh up --ha -----------------------------------------------------------------------

    async def _leader_fault(self, fault: FaultPlan) -> None:
        """leader_crash: SIGKILL the controller that leads (up --ha starts it again);
        leader_pause: SIGSTOP it, SIGCONT after duration_s."""
        run, kind = self.run, fault.kind
        lease = await self.lease.read()
        if lease is None:
            run.note(f"skip   {kind}: no controller leads now (the lease is not held)")
            return
        ctl = self.stack.ha_process("controller", lease.leader)
        if ctl is None:
            run.note(f"skip   {kind}: no process of controller {lease.leader} runs now")
            return
        what = f"{kind} {describe_lease(lease)}"
        failover = Failover(
            kind, run.now(), f"controller {ctl.name} (pid {ctl.pid})", lease, renewal_counts=False
        )
        if kind == "leader_crash":
            send_signal(ctl.pid, signal.SIGKILL)
            run.note(f"fault  {what}: SIGKILL controller {ctl.pid} ({RESTARTS})")
        else:
            self.stack.stop([ctl.pid])
            run.note(f"fault  {what}: SIGSTOP controller {ctl.pid}")

            async def thaw() -> None:
                self.stack.cont([ctl.pid])
                failover.thawed = True

            self._later(fault, f"{what}: SIGCONT {ctl.pid}", thaw)
        self._watch(failover)

    async def _controller_partition(self, fault: FaultPlan) -> None:
        """Cut the controller that leads off from NATS (up's relays: a blackhole), and heal
        after duration_s; measured as leader_pause is: until a controller leads in a new term."""
        run, stack = self.run, self.stack
        layout = stack.ha_layout()
        if layout is None or not layout.control:
            run.note(f"skip   controller_partition: {NO_CONTROL}")
            return
        lease = await self.lease.read()
        if lease is None:
            run.note("skip   controller_partition: no controller leads now (the lease is not held)")
            return
        ctl = stack.ha_process("controller", lease.leader)
        if ctl is None:
            run.note(f"skip   controller_partition: no process of controller {lease.leader} runs")
            return
        what = f"controller_partition {describe_lease(lease)}"
        failover = Failover(
            "controller_partition",
            run.now(),
            f"controller {ctl.name} (pid {ctl.pid})",
            lease,
            renewal_counts=False,
        )
        try:
            cut = await stack.cut_off(ctl.name)
        except ChaosError as exc:
            run.note(f"skip   controller_partition: {exc}")
            return
        relays = ", ".join(f"{server} :{port}" for server, port in ctl.relays)
        run.note(
            f"fault  {what}: its relays to NATS ({relays}) carry nothing, both ways; "
            f"{cut.connections} connection(s) held open"
        )
        direct = direct_servers(ctl, layout)
        if direct:
            # nats-py added the servers the cluster advertises to the relays it was given, and
            # moved to one of them at some reconnection: the relays do not carry that one.
            run.note(
                f"WARN   controller_partition: {ctl.name} is also connected to nats-server "
                f"{', '.join(direct)} directly (learned from the cluster's INFO): not cut"
            )

        async def heal() -> None:
            try:
                await stack.heal(ctl.name)
            except ChaosError as exc:  # the connection is closed: `up` heals it on its own
                run.note(f"end    {what}: up did not confirm the heal: {exc}")
            failover.thawed = True

        self._later(fault, f"{what}: healed", heal)
        self._watch(failover)

    async def _nats_server_loss(self) -> None:
        """SIGKILL one of the three nats-servers, drawn as the simulator draws it."""
        run = self.run
        servers = self.stack.ha_processes("nats-server")
        if len(servers) < 3:
            # As in the simulator: two of three down is a lost quorum, not this fault.
            run.note("skip   nats_server_loss: a server is down already")
            return
        dead = servers[self._nats_rng.randint(0, len(servers) - 1)]
        lease = await self.lease.read()
        leader = self.stack.ha_process("controller", lease.leader) if lease else None
        on_it = ""
        if leader is not None and dead.port is not None:
            # Directly, or through its relay to that server (up --ha: ControllerLinks).
            ports = {dead.port, *(port for name, port in leader.relays if name == dead.name)}
            on = bool(ports & peer_ports(leader.pid))
            on_it = f", {'connected' if on else 'not connected'} to it"
        failover = Failover(
            "nats_server_loss",
            run.now(),
            f"nats-server {dead.name} (pid {dead.pid})",
            lease,
            renewal_counts=True,
        )
        send_signal(dead.pid, signal.SIGKILL)
        run.note(
            f"fault  nats_server_loss {dead.name}: SIGKILL nats-server {dead.pid} ({RESTARTS}); "
            f"{describe_lease(lease)} leads{on_it}"
        )
        self._watch(failover)

    def _watch(self, failover: Failover) -> None:
        self.failovers.append(failover)
        task = self.run.spawn(self._leads_again(failover), f"chaos:{failover.kind}:lease")
        self._watches.append(task)

    async def _leads_again(self, failover: Failover) -> None:
        """Read the lease every LEASE_POLL_S until a controller leads again (Failover.seen)."""
        run = self.run
        try:
            while run.now() - failover.at < LEADS_AGAIN_WITHIN_S:
                if failover.seen(await self.lease.read(), run.now()):
                    run.note(
                        f"lease  {failover.kind}: {failover.outcome}, "
                        f"{failover.leads_again_s:.3f} s after the fault"
                    )
                    return
                await asyncio.sleep(LEASE_POLL_S)
            failover.outcome = f"no controller led again within {LEADS_AGAIN_WITHIN_S:g} s"
            run.note(f"lease  {failover.kind}: {failover.outcome}")
        except asyncio.CancelledError:
            failover.outcome = "the run ended before a controller led again"
            raise

    async def stop_watches(self) -> None:
        """The run is over: stop watching the lease (an unfinished failover says so)."""
        for task in self._watches:
            task.cancel()
        if self._watches:
            await asyncio.wait(self._watches)
        self._watches.clear()
