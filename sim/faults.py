"""Applies a scenario's faults to a World at their virtual times, and undoes them.

When each fault starts and each of its effects ends is sim/timeline.py's FaultTimeline, the
one `gpumesh chaos` walks on wall time. Victims are drawn from the run's seed when a fault
fires, among the nodes that are healthy and powered at that moment, in sorted order, so a seed
always picks the same ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from events.contract.messages import Fault

from .network import LinkFaults
from .scenario import FaultPlan
from .timeline import End, FaultTimeline

if TYPE_CHECKING:
    from .world import SimNode, World

Undo = Callable[[], None]


class FaultRunner:
    def __init__(self, world: World) -> None:
        self.world = world
        self.rng = world.derive("faults")
        self.timeline: FaultTimeline[Undo] = FaultTimeline()
        self._background: list[asyncio.Task[None]] = []

    async def run(self, faults: Sequence[FaultPlan], *, until: float) -> None:
        world = self.world
        for step in self.timeline.steps(faults, until=until):
            await asyncio.sleep(max(0.0, step.at - world.now()))
            if isinstance(step, End):
                world.note(f"end    {step.what}")
                step.undo()
            else:
                self._apply(step.fault)
        await asyncio.sleep(max(0.0, until - world.now()))

    def end_all(self) -> None:
        """The faults stop: heal everything still in effect (liveness is judged after this)."""
        for task in self._background:
            task.cancel()
        for end in self.timeline.cut():
            self.world.note(f"end    {end.what}")
            end.undo()

    def _victims(self, fault: FaultPlan) -> list[SimNode]:
        from .world import draw_victims

        return draw_victims(
            self.world.nodes, fault.nodes, self.rng, up=lambda n: n.powered and not n.hung
        )

    def _later(self, fault: FaultPlan, what: str, undo: Undo) -> None:
        # From when it really started: virtual time can be the planned instant's float
        # neighbour, and a seed's replay must keep the ends exactly where they always were.
        self.timeline.ends_after(fault, self.world.now(), what, undo)

    def _apply(self, fault: FaultPlan) -> None:
        world = self.world
        kind = fault.kind
        if kind == "controller_crash":
            world.crash_controller()
            world.checker.fault("controller_crash", None, world.now())
            world.note("fault  controller_crash")
            self._later(fault, "controller_crash (restarted)", world.start_controller)
            return
        if kind == "nats_outage":
            world.network.outage(True)
            for node in world.nodes.values():
                node.commands.open.clear()
            world.note("fault  nats_outage")

            def back() -> None:
                world.network.outage(False)
                for node in world.nodes.values():
                    if node.powered and not node.hung and not node.partitioned:
                        node.commands.open.set()

            self._later(fault, "nats_outage", back)
            return
        if kind == "controller_partition":
            # Its NATS connection only: it keeps running, hears no heartbeat and reaches no
            # agent; agents get "no responders" and keep their leases (docs/security.md).
            world.network.isolate("controller")
            world.checker.controller_down(world.now())
            world.note("fault  controller_partition")

            def reconnect() -> None:
                world.network.reconnect("controller")
                world.checker.controller_up(world.now())

            self._later(fault, "controller_partition", reconnect)
            return
        if kind == "gateway_partition":
            # Its NATS connection only: HTTP to the nodes still goes through, on a routing
            # table that no longer changes. The nodes' fences are all that keep it safe.
            world.network.isolate("gateway")
            world.checker.gateway_cut(world.now())
            world.note("fault  gateway_partition")

            def rejoin() -> None:
                world.network.reconnect("gateway")
                world.checker.gateway_back(world.now())

            self._later(fault, "gateway_partition", rejoin)
            return
        if kind == "churn":
            self._background.append(world.spawn(self._churn(fault), "fault:churn"))
            world.note(f"fault  churn ({fault.count} nodes every {fault.period_s:g} s)")
            return
        for node in self._victims(fault):
            what = f"{kind} {node.node_id}"
            world.note(f"fault  {what}")
            world.checker.fault(kind, node, world.now(), fault.duration_s)
            self._node_fault(fault, node, what)

    def _node_fault(self, fault: FaultPlan, node: SimNode, what: str) -> None:
        world = self.world
        net = world.network
        kind = fault.kind
        if kind == "power_loss":
            world.power_off(node)
            self._later(fault, what, lambda: world.power_on(node))
        elif kind == "hang":
            node.hung = True
            net.isolate(node.node_id)
            node.commands.open.clear()

            def thaw() -> None:
                node.hung = False
                world.rejoin(node)

            self._later(fault, what, thaw)
        elif kind in ("partition", "one_way_partition"):
            node.partitioned = kind == "partition"
            if kind == "partition":
                net.isolate(node.node_id)
                node.commands.open.clear()
            else:
                net.partition([node.node_id], _others(world, node), one_way=True)

            def heal() -> None:
                node.partitioned = False
                if kind == "partition":
                    world.rejoin(node)
                else:
                    net.heal()

            self._later(fault, what, heal)
        elif kind == "flap":
            self._background.append(world.spawn(self._flap(fault, node), f"fault:{what}"))
        elif kind == "slow":
            node.slow_s = fault.latency_s
            lag = LinkFaults(latency_s=(fault.latency_s, fault.latency_s * 1.5))
            net.set_link(node.node_id, "*", lag)
            net.set_link("*", node.node_id, lag)

            def fast() -> None:
                node.slow_s = 0.0
                net.set_link(node.node_id, "*", LinkFaults())
                net.set_link("*", node.node_id, LinkFaults())

            self._later(fault, what, fast)
        elif kind in ("thermal", "ecc", "driver"):
            value = fault.value if kind == "thermal" else 1.0
            node.probe.apply_fault(Fault(kind=kind, value=value))
            self._later(fault, what, lambda: node.probe.apply_fault(Fault(kind="clear")))
        elif kind == "crash_loop":
            node.driver.exit_on_start = 1
            for workload in node.driver.running():
                workload.crash(1)

            def cured() -> None:
                node.driver.exit_on_start = None

            self._later(fault, what, cured)

    async def _flap(self, fault: FaultPlan, node: SimNode) -> None:
        world = self.world
        end = world.now() + (fault.duration_s or 60.0)
        while world.now() < end:
            node.partitioned = True
            world.network.isolate(node.node_id)
            await asyncio.sleep(fault.period_s)
            node.partitioned = False
            world.network.reconnect(node.node_id)
            await asyncio.sleep(fault.period_s)

    async def _churn(self, fault: FaultPlan) -> None:
        world = self.world
        end = world.now() + (fault.duration_s or 60.0)
        while world.now() < end:
            leaving = FaultPlan(at_s=0.0, kind="power_loss", nodes=str(fault.count))
            for node in self._victims(leaving):
                world.note(f"churn  {node.node_id} leaves")
                world.checker.fault("churn", node, world.now())
                world.power_off(node)
            for _ in range(fault.count):
                joined = world.add_node()
                world.note(f"churn  {joined.node_id} joins")
            await asyncio.sleep(fault.period_s)


def _others(world: World, node: SimNode) -> list[str]:
    return [
        "controller",
        "gateway",
        "client",
        *(n for n in sorted(world.nodes) if n != node.node_id),
    ]
