"""The stack's processes in chaos's hands: its nodes, what chaos stopped (and how many faults
hold each stopped), what it killed and how to start it again, and `restore`, which leaves the
stack as it was found."""

from __future__ import annotations

import asyncio
import re
import shlex
import signal
import subprocess
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from events.contract import subjects
from events.contract.messages import Fault, FaultReply

from .errors import ChaosError
from .ha import Cut, HaLayout, HaProcess, is_process, read_layout
from .kinds import IN_UP, IN_UP_HA
from .procfs import (
    Proc,
    alive,
    find_agent,
    flag,
    kill_workload,
    machine_group,
    scan,
    send_signal,
    spawn_again,
    with_flag,
    workloads_of,
)

if TYPE_CHECKING:
    from projections.views import ReplicaView
    from runtime.env import Bus, RandomSource

SPAWN_ERRORS = (OSError, subprocess.SubprocessError)  # starting a process again can fail


@dataclass
class NodeState:
    node_id: str
    agent: Proc | None  # the latest agent process seen: how to start it again
    powered: bool = True
    hung: bool = False
    gpu_fault: bool = False


STAGE = "stage"  # a fault's `nodes`: a node holding a ready pipeline's worker stage


def stage_holders(replicas: Iterable[ReplicaView]) -> list[str]:
    """The nodes that hold a worker stage (rank >= 1) of a ready sharded replica, sorted."""
    return sorted(
        {
            stage.node_id
            for replica in replicas
            if replica.status == "ready"
            for stage in replica.stages[1:]
        }
    )


def draw(nodes: dict[str, NodeState], spec: str, rng: RandomSource) -> list[NodeState]:
    """The simulator's own draw of a fault's victims (sim.world.draw_victims), so a seed picks
    what `gpumesh sim run` picks on a fleet with the same names."""
    from sim.world import draw_victims

    return draw_victims(nodes, spec, rng, up=lambda n: n.powered and not n.hung)


class Stack:
    """One stack's processes, found in /proc when the run is built."""

    def __init__(self, bus: Bus, data_dir: Path, nats_url: str) -> None:
        self.bus = bus
        self.data_dir = data_dir
        self.nats_url = nats_url
        self.found = scan(data_dir, nats_url)
        self.ha = read_layout(data_dir, nats_url)  # a stack of `gpumesh up --ha`, else None
        self.nodes = {
            node_id: NodeState(node_id, proc) for node_id, proc in sorted(self.found.agents.items())
        }
        self.controller_down: Proc | None = None
        self.restored: list[str] = []  # what restore() did
        self._stopped: dict[int, int] = {}  # pid -> how many faults hold it stopped
        self.cuts: dict[str, Cut] = {}  # controller -> its partition, held open

    def agent(self, node: NodeState) -> Proc | None:
        """The node's live agent process (found again: it may have been started again)."""
        proc = find_agent(node.node_id, self.data_dir, self.nats_url)
        if proc is not None:
            node.agent = proc
        return proc

    # -- signals -----------------------------------------------------------------------------

    def stop(self, targets: Sequence[int]) -> None:
        for pid in targets:
            self._stopped[pid] = self._stopped.get(pid, 0) + 1
            send_signal(pid, signal.SIGSTOP)

    def cont(self, targets: Sequence[int]) -> None:
        """SIGCONT what no other fault still holds stopped (a partition over a hang, say)."""
        for pid in targets:
            held = self._stopped.get(pid, 0) - 1
            if held > 0:
                self._stopped[pid] = held
                continue
            self._stopped.pop(pid, None)
            send_signal(pid, signal.SIGCONT)

    def power_off(self, node: NodeState, agent: Proc) -> int:
        """SIGKILL the agent (its machine's process group) and its workloads; how many."""
        doomed = workloads_of(agent.pid)
        send_signal(agent.pid, signal.SIGKILL, group=machine_group(agent))
        for pid in doomed:
            kill_workload(pid)
        node.powered = False
        node.agent = agent
        for pid in (agent.pid, *doomed):
            self._stopped.pop(pid, None)  # a killed process needs no SIGCONT
        return len(doomed)

    # -- starting again ----------------------------------------------------------------------

    async def power_on(self, node: NodeState) -> None:
        if node.powered or node.agent is None:
            return
        if self.ha is not None:
            node.powered = True  # `up --ha` starts its agents again itself, after 1 s
            return
        await self._spawn(node.agent, f"agent-{node.node_id}.log")
        node.powered = True

    async def _spawn(self, proc: Proc, log_name: str) -> None:
        log_path = Path(proc.stdout) if proc.stdout else self.data_dir / "logs" / log_name
        await asyncio.to_thread(spawn_again, proc, log_path, self.data_dir)

    async def join(self, known: Collection[str]) -> NodeState | None:
        """A new agent `node-N` (N after every name in `known` and here) with an existing
        agent's command line: churn's newcomer. None when there is no agent to copy."""
        template = next((n.agent for n in self.nodes.values() if n.agent is not None), None)
        if template is None:
            return None
        names = {*self.nodes, *known}
        index = 1 + max(
            (int(m[1]) for n in names if (m := re.fullmatch(r"node-(\d+)", n))), default=-1
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

    # -- the controller and NATS -------------------------------------------------------------

    def controller(self) -> tuple[Proc | None, str]:
        """The controller process a controller_crash may kill, else None and why not."""
        if self.ha is not None:
            return None, IN_UP_HA
        ctl = self.found.controller
        if ctl is not None and not alive(ctl.pid):
            ctl = scan(self.data_dir, self.nats_url).controller
        if ctl is None:
            why = (
                IN_UP
                if self.found.up is not None
                else "skipped: no `gpumesh controller` process of this stack on this machine"
            )
            return None, why
        if flag(ctl.args, "--nats") is None:
            return None, "skipped: the controller runs the stack's own NATS"
        return ctl, ""

    def kill_controller(self, ctl: Proc) -> None:
        send_signal(ctl.pid, signal.SIGKILL)
        self.controller_down = ctl
        self.found.controller = None

    async def restart_controller(self) -> None:
        if self.controller_down is not None:
            await self._spawn(self.controller_down, "controller.log")
            self.controller_down = None

    def nats_server(self) -> Proc | None:
        server = self.found.nats
        return server if server is not None and alive(server.pid) else None

    def nats_pids(self) -> list[int]:
        """The stack's nats-servers that run now: the three of `up --ha`, or the one."""
        if self.ha is not None:
            return [p.pid for p in self.ha_processes("nats-server")]
        server = self.nats_server()
        return [server.pid] if server is not None else []

    # -- `gpumesh up --ha` ---------------------------------------------------------------------

    def ha_layout(self) -> HaLayout | None:
        """up-ha.json as it is now (`up` rewrites it when it starts a process again)."""
        if self.ha is not None:
            self.ha = read_layout(self.data_dir, self.nats_url) or self.ha
        return self.ha

    def ha_processes(self, role: str) -> list[HaProcess]:
        """The processes of `role` that run now, by name, each checked against /proc."""
        layout = self.ha_layout()
        if layout is None:
            return []
        return [p for p in layout.named(role) if is_process(p, self.data_dir)]

    def ha_process(self, role: str, name: str) -> HaProcess | None:
        return next((p for p in self.ha_processes(role) if p.name == name), None)

    async def cut_off(self, controller: str) -> Cut:
        """Cut `controller` off from NATS through `up --ha`'s control socket (ha.Cut), until
        `heal`; ChaosError if it cannot be done."""
        if controller in self.cuts:
            raise ChaosError(f"controller {controller} is cut off already")
        layout = self.ha_layout()
        if layout is None or not layout.control:
            raise ChaosError("no control socket of `gpumesh up --ha` (up-ha.json names none)")
        cut = await Cut.open(layout.control, controller)
        self.cuts[controller] = cut
        return cut

    async def heal(self, controller: str) -> None:
        cut = self.cuts.pop(controller, None)
        if cut is not None:
            await cut.heal()

    async def gpu_fault(self, node: NodeState, fault: Fault) -> str:
        """Send a fake-GPU fault; "" on success, else why not."""
        from runtime.errors import BusError, NoResponders

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

    # -- the end -----------------------------------------------------------------------------

    async def restore(self) -> None:
        """Leave the stack as it was found: heal what is cut off, continue what is stopped,
        start what was killed (churn victims and faults with no end included), clear fake-GPU
        faults. Idempotent;
        what it did is added to `restored`. Call it once no fault is at work any more."""
        done = self.restored
        for controller in sorted(self.cuts):
            what = f"controller {controller} reaches NATS again (partition healed)"
            try:
                await self.heal(controller)
            except ChaosError as exc:  # the connection is closed: `up` heals it on its own
                what += f"; up did not say so: {exc}"
            done.append(what)
        for pid in sorted(self._stopped):
            send_signal(pid, signal.SIGCONT)
            done.append(f"SIGCONT {pid}")
        self._stopped.clear()
        if self.controller_down is not None:
            what = f"controller started again ({shlex.join(self.controller_down.args)})"
            try:
                await self.restart_controller()
            except SPAWN_ERRORS as exc:
                what += f" FAILED: {exc}"
            done.append(what)
        for node in self.nodes.values():
            node.hung = False
            if not node.powered and node.agent is not None:
                try:
                    await self.power_on(node)
                    done.append(f"{node.node_id}: agent started again")
                except SPAWN_ERRORS as exc:
                    done.append(f"{node.node_id}: agent NOT started again: {exc}")
        for node in self.nodes.values():
            if node.gpu_fault:
                error = await self.gpu_fault(node, Fault(kind="clear"))
                node.gpu_fault = bool(error)
                done.append(
                    f"{node.node_id}: fake GPUs cleared" + (f" FAILED: {error}" if error else "")
                )
