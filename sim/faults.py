"""Applies a scenario's faults to a World at their virtual times, and undoes them.

When each fault starts and each of its effects ends is sim/timeline.py's FaultTimeline, the
one `gpumesh chaos` walks on wall time. Victims are drawn from the run's seed when a fault
fires, among the nodes that are healthy and powered at that moment, in sorted order, so a seed
always picks the same ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Final

from events.contract.messages import Fault

from .network import LinkFaults
from .scenario import FaultPlan
from .timeline import End, FaultTimeline

if TYPE_CHECKING:
    from .world import SimNode, World

Undo = Callable[[], None]

# A fault's `nodes` that names no node but a role: a node holding a worker stage of a ready
# pipeline (a sharded replica's rank >= 1, docs/sharding.md). The simulator's only.
STAGE: Final = "stage"
NATS_SERVERS: Final = 3  # nats_server_loss: the cluster's size; its clients spread over them
# A client of a dead server reconnects to another after this long (drawn per client), plus the
# network's own reconnect wait; the leader lease's stream, if the dead server led it, elects a
# new leader in the same time (it answers nothing meanwhile).
NATS_RECONNECT_S: Final = (1.0, 2.0)


class FaultRunner:
    def __init__(self, world: World) -> None:
        self.world = world
        self.rng = world.derive("faults")
        self.timeline: FaultTimeline[Undo] = FaultTimeline()
        self._background: list[asyncio.Task[None]] = []
        # nats_server_loss: which server each client is connected to, drawn when first needed
        # from a stream of its own (the other faults' victims do not move); the dead one.
        self._nats_rng = world.derive("nats-servers")
        self._server_of: dict[str, int] = {}
        self._server_down: int | None = None

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

        if fault.nodes == STAGE:
            return self._stage_victim()
        return draw_victims(
            self.world.nodes, fault.nodes, self.rng, up=lambda n: n.powered and not n.hung
        )

    def _stage_victim(self) -> list[SimNode]:
        """`nodes = "stage"`: one node that holds a worker stage (rank >= 1) of a ready
        sharded replica, as the log shows it now, drawn from the seed among them in sorted
        order; none if no pipeline is ready. Where a pipeline's stages land depends on which
        nodes the controller had heard from when it placed them, so a name in the scenario
        would miss them on some seeds."""
        world = self.world
        held = sorted(
            {
                stage.node_id
                for replica in world.checker.state.replicas.replicas.values()
                if replica.status == "ready"
                for stage in replica.stages[1:]
            }
        )
        up = [
            world.nodes[n]
            for n in held
            if n in world.nodes and world.nodes[n].powered and not world.nodes[n].hung
        ]
        if not up:
            world.note("fault  no ready pipeline stage to strike (skipped)")
            return []
        return [self.rng.choice(up)]

    def _later(self, fault: FaultPlan, what: str, undo: Undo) -> None:
        # From when it really started: virtual time can be the planned instant's float
        # neighbour, and a seed's replay must keep the ends exactly where they always were.
        self.timeline.ends_after(fault, self.world.now(), what, undo)

    def _apply(self, fault: FaultPlan) -> None:
        world = self.world
        kind = fault.kind
        if kind in ("controller_crash", "leader_crash", "leader_pause"):
            if world.controllers is not None:
                self._leader_fault(fault)
                return
            if kind == "leader_pause":
                self._pause_single(fault)
                return
            world.crash_controller()
            world.checker.fault(kind, None, world.now())
            world.note(f"fault  {kind}")
            self._later(fault, f"{kind} (restarted)", world.start_controller)
            return
        if kind == "nats_server_loss":
            self._nats_server_loss(fault)
            return
        if kind == "nats_outage":
            world.network.outage(True)
            for node in world.nodes.values():
                node.commands.open.clear()
            world.note("fault  nats_outage")

            def back() -> None:
                world.network.outage(False)
                for node in world.nodes.values():
                    if node.powered and not (node.hung or node.partitioned or node.nats_cut):
                        node.commands.open.set()

            self._later(fault, "nats_outage", back)
            return
        if kind == "controller_partition":
            # Its NATS connection only: it keeps running, hears no heartbeat and reaches no
            # agent; agents get "no responders" and keep their leases (docs/security.md).
            if world.controllers is not None:
                # The leader's: it cannot renew its lease and stops at its own expiry; a
                # standby takes over once the key expires on the server.
                leader = world.controllers.leader()
                name = leader.name if leader is not None else world.controller_names[0]
                world.cut_off(name, kind)
                if leader is not None:
                    world.checker.leader_lost(world.now())
                world.note(f"fault  controller_partition {name}")
                healed = partial(self._rejoin, name, kind)
                self._later(fault, f"controller_partition {name}", healed)
                return
            world.cut_off("controller", kind)
            world.checker.controller_down(world.now())
            world.note("fault  controller_partition")

            def reconnect() -> None:
                world.cut_ends("controller", kind)
                world.checker.controller_up(world.now())

            self._later(fault, "controller_partition", reconnect)
            return
        if kind == "gateway_partition":
            # Its NATS connection only: HTTP to the nodes still goes through, on a routing
            # table that no longer changes. The nodes' fences are all that keep it safe.
            if world.cut_off("gateway", kind):
                world.checker.gateway_cut(world.now())
            world.note("fault  gateway_partition")

            def rejoin() -> None:
                if world.cut_ends("gateway", kind):
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

    def _leader_fault(self, fault: FaultPlan) -> None:
        """leader_crash (and controller_crash) and leader_pause, with standbys: the process
        that leads now is killed, or frozen for `duration_s`."""
        world = self.world
        controllers = world.controllers
        assert controllers is not None
        kind = fault.kind
        leader = controllers.leader()
        if leader is None:
            world.note(f"fault  {kind}: no controller leads (skipped)")
            return
        world.checker.leader_lost(world.now())
        what = f"{kind} {leader.name} (term {leader.term})"
        world.note(f"fault  {what}")
        if kind == "leader_pause":
            controllers.pause(leader)
            self._later(fault, what, lambda: controllers.resume(leader))
            return
        controllers.kill(leader)
        index = leader.index

        def restart() -> None:
            controllers.start(index)

        self._later(fault, f"{what}: restarted", restart)

    def _pause_single(self, fault: FaultPlan) -> None:
        """leader_pause with no standby: the one controller freezes, then goes on."""
        from .controllers import _loop

        world = self.world
        loop = _loop()
        world.checker.controller_down(world.now())
        loop.freeze("controller")
        world.note("fault  leader_pause controller")

        def thaw() -> None:
            loop.thaw("controller")
            world.checker.controller_up(world.now())

        self._later(fault, "leader_pause controller", thaw)

    def _server(self, client: str) -> int:
        server = self._server_of.get(client)
        if server is None:
            server = self._server_of[client] = self._nats_rng.randint(0, NATS_SERVERS - 1)
        return server

    def _nats_server_loss(self, fault: FaultPlan) -> None:
        """One NATS server of NATS_SERVERS dies: every client connected to it (a seed-drawn
        share of the nodes, the gateway and the controllers) is cut off, and reconnects to
        another server NATS_RECONNECT_S later. The streams keep three copies and lose none.
        The server is back after `duration_s`; a second loss while one is down is skipped
        (two of three down is a lost quorum, not this fault)."""
        world = self.world
        rng = self._nats_rng
        if self._server_down is not None:
            world.note("fault  nats_server_loss: a server is down already (skipped)")
            return
        dead = rng.randint(0, NATS_SERVERS - 1)
        self._server_down = dead
        clients = [
            *world.controller_names,
            "gateway",
            *(n for n, node in sorted(world.nodes.items()) if node.powered),
        ]
        victims = [name for name in clients if self._server(name) == dead]
        world.note(f"fault  nats_server_loss nats-{dead} ({len(victims)} clients cut off)")
        now = world.now()
        controllers = world.controllers
        leader = controllers.leader() if controllers is not None else None
        for name in victims:
            delay = rng.uniform(*NATS_RECONNECT_S)
            # It reconnects to one of the others, and stays there.
            self._server_of[name] = (dead + 1 + rng.randint(0, NATS_SERVERS - 2)) % NATS_SERVERS
            back = replace(fault, duration_s=delay)
            what = f"nats_server_loss {name} (reconnected)"
            node = world.nodes.get(name)
            if node is not None:
                node.nats_cut = True
                world.network.isolate(name)
                node.commands.open.clear()
                self.timeline.ends_after(back, now, what, partial(self._node_back, node))
                continue
            if name == "gateway":
                if world.cut_off(name, "nats_server_loss"):
                    world.checker.gateway_cut(now)
            else:
                world.cut_off(name, "nats_server_loss")
                if controllers is None:
                    world.checker.controller_down(now)
                elif leader is not None and leader.name == name:
                    world.checker.leader_lost(now)
            self.timeline.ends_after(back, now, what, partial(self._client_back, name))
        if controllers is not None and rng.random() < 1 / NATS_SERVERS:
            # The dead server led the lease's stream: it answers nobody until a new leader is
            # elected among the other two.
            election = rng.uniform(*NATS_RECONNECT_S)
            controllers.key.unavailable_until = now + election
            world.note(f"nats_server_loss: the lease's stream elects a leader ({election:.1f} s)")

        def server_back() -> None:
            self._server_down = None

        if fault.duration_s is not None:
            self._later(fault, f"nats_server_loss nats-{dead} (back)", server_back)

    def _rejoin(self, name: str, why: str) -> None:
        self.world.cut_ends(name, why)

    def _node_back(self, node: SimNode) -> None:
        node.nats_cut = False
        self.world.rejoin(node)

    def _client_back(self, name: str) -> None:
        world = self.world
        if world.cut_ends(name, "nats_server_loss"):
            if name == "gateway":
                world.checker.gateway_back(world.now())
            elif world.controllers is None:
                world.checker.controller_up(world.now())

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
        *world.controller_names,
        "gateway",
        "client",
        *(n for n in sorted(world.nodes) if n != node.node_id),
    ]
