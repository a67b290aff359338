"""Secrets never reach the log in clear (issue 22, part 3), on virtual time: the real controller
and the real node agent (FakeDriver), a cluster whose spec carries a secret inline and one in a
file on the node. The value reaches the workload's environment and nothing else: not the log,
not the command on the queue, not the API's views, not the events an integrator reads."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

import projections
from actors.controller import Controller
from actors.secret_keeper import SecretsUnavailable
from events import ClusterCreated, ClusterSpecChanged, MemoryEventStore, ReplicaFailed
from events.codec import encode_envelope
from events.contract import subjects
from events.contract.messages import ApiReply, Command, StartReplica
from events.secret_store import MemorySecretStore, reference
from nodeagent.agent import Agent
from nodeagent.config import AgentConfig
from nodeagent.gpu import FakeGpuProbe
from nodeagent.workload.fake import FakeDriver
from projections.views import NodeView
from runtime.env import Env
from sim import run_simulation, sim_env
from sim.bus import MemoryBus
from sim.commands import MemoryCommandQueue
from wire.sealing import NodeKey, deterministic_ephemeral

TOKEN = "hf_sEcReTvAlUe0123456789abcdefXYZ"
OTHER = "another-secret-value-42"


class RecordingQueue(MemoryCommandQueue):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, Command]] = []

    async def send(self, node_id: str, command: Command) -> None:
        self.log.append((node_id, command))
        await super().send(node_id, command)

    def sent(self, node_id: str) -> list[Command]:
        return [c for n, c in self.log if n == node_id]


@dataclass
class World:
    env: Env
    bus: MemoryBus
    commands: RecordingQueue
    store: MemoryEventStore
    secrets: MemorySecretStore
    controller: Controller
    drivers: dict[str, FakeDriver]
    tasks: asyncio.TaskGroup

    async def api(self, verb: str, body: object = None) -> ApiReply:
        data = msgspec.json.encode(body) if body is not None else b"{}"
        reply = await self.bus.request(subjects.api(verb), data, timeout=30.0)
        return msgspec.json.decode(reply.data, type=ApiReply)

    async def api_raw(self, verb: str, body: object = None) -> bytes:
        data = msgspec.json.encode(body) if body is not None else b"{}"
        return (await self.bus.request(subjects.api(verb), data, timeout=30.0)).data

    async def until(self, what: object, *, within: float, why: str) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not what():  # type: ignore[operator]
            if loop.time() - start > within:
                raise AssertionError(f"not within {within} s: {why}")
            await asyncio.sleep(0.05)

    def start_agent(self, node_id: str, *, key: bool = True) -> None:
        driver = FakeDriver()
        self.drivers[node_id] = driver
        private = X25519PrivateKey.from_private_bytes(random.Random(node_id).randbytes(32))
        agent = Agent(
            sim_env(3, bus=self.bus),
            self.commands,
            FakeGpuProbe.parse("RTX4090:24GiB:1", node_id=node_id),
            driver,
            AgentConfig(node_id=node_id),
            key=NodeKey(private) if key else None,
        )
        self.tasks.create_task(agent.run(), name=f"agent {node_id}")

    def ready(self, cluster: str) -> list[str]:
        state = self.controller.live.state
        return sorted(
            r.replica_id
            for r in state.replicas.replicas.values()
            if r.cluster == cluster and r.status == "ready"
        )

    def log_bytes(self) -> bytes:
        return b"\n".join(encode_envelope(e) for e in self.store.read_all_now())


@asynccontextmanager
async def world(*node_ids: str, keyless: tuple[str, ...] = ()) -> AsyncIterator[World]:
    bus = MemoryBus()
    commands = RecordingQueue()
    store = MemoryEventStore()
    secrets = MemorySecretStore()
    env = sim_env(1, store, bus=bus)
    ephemeral = deterministic_ephemeral(random.Random(5).randbytes)
    controller = Controller(env, commands, secrets=secrets, ephemeral=ephemeral)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(controller.run())
        await controller.ready.wait()
        w = World(env, bus, commands, store, secrets, controller, {}, tg)
        for node_id in node_ids:
            w.start_agent(node_id, key=node_id not in keyless)
        await w.until(
            lambda: len(controller.live.state.nodes.nodes) == len(node_ids),
            within=10,
            why="every node registers",
        )
        try:
            yield w
        finally:
            for t in list(asyncio.all_tasks()):
                if t is not asyncio.current_task() and t.get_name().startswith("agent "):
                    t.cancel()
            task.cancel()


def test_the_value_reaches_the_workload_and_nothing_else(tmp_path: Path) -> None:
    db_file = tmp_path / "db_password"
    db_file.write_text(OTHER + "\n")
    spec = {
        "name": "llama",
        "replicas": 1,
        "command": "serve --port {port}",
        "env": {"LOG_LEVEL": "info"},
        "secret_env": {"HF_TOKEN": TOKEN, "DB_PASSWORD": f"file:{db_file}"},
    }

    async def main() -> None:
        async with world("n0") as w:
            created = await w.api("cluster.create", spec)
            assert created.ok, created.error
            await w.until(lambda: w.ready("llama") != [], within=20, why="ready")
            # The workload got both values, in its environment (the spec its driver ran).
            [workload] = w.drivers["n0"].running()
            assert workload.spec.secret_env == {"HF_TOKEN": TOKEN, "DB_PASSWORD": OTHER}
            assert workload.spec.env == {"LOG_LEVEL": "info"}
            # The log holds the reference and the file's path, never a value.
            ref = reference(TOKEN)
            [recorded] = [
                e.payload.spec
                for e in w.store.read_all_now()
                if isinstance(e.payload, ClusterCreated)
            ]
            assert recorded.secret_env == {"HF_TOKEN": ref, "DB_PASSWORD": f"file:{db_file}"}
            log = w.log_bytes()
            assert TOKEN.encode() not in log and OTHER.encode() not in log
            assert ref.encode() in log
            # The controller's store has it, by digest.
            assert w.secrets.values == {ref: TOKEN}
            # The command on the queue carries the reference and a sealed box, not the value.
            sent = [c for c in w.commands.sent("n0") if isinstance(c, StartReplica)]
            assert sent and all(c.secrets is not None for c in sent)
            wire = b"".join(msgspec.json.encode(c) for c in sent)
            assert TOKEN.encode() not in wire and OTHER.encode() not in wire
            # The API's views: the reference only.
            for verb, body in [
                ("cluster.get", {"name": "llama"}),
                ("cluster.list", None),
                ("cluster.history", {"name": "llama"}),
                ("events.list", {"after": 0, "limit": 1000}),
            ]:
                raw = await w.api_raw(verb, body)
                assert msgspec.json.decode(raw, type=ApiReply).ok, verb
                assert TOKEN.encode() not in raw and OTHER.encode() not in raw, verb
            view = (await w.api("cluster.get", {"name": "llama"})).data
            assert view["spec"]["secret_env"]["HF_TOKEN"] == ref

            # Applying the same spec again (the value inline) is no change: same reference.
            again = await w.api("cluster.apply", spec)
            assert again.ok, again.error
            changed = [
                e for e in w.store.read_all_now() if isinstance(e.payload, ClusterSpecChanged)
            ]
            assert [c.payload.spec.secret_env["HF_TOKEN"] for c in changed] in ([], [ref])
            assert projections.rebuild(w.store.read_all_now()) == w.controller.live.state

    run_simulation(main())


def test_a_node_without_a_key_is_not_chosen_and_a_failed_send_says_why() -> None:
    spec = {
        "name": "llama",
        "replicas": 1,
        "command": "serve --port {port}",
        "secret_env": {"HF_TOKEN": TOKEN},
    }

    async def main() -> None:
        async with world("old", keyless=("old",)) as w:
            assert (await w.api("cluster.create", spec)).ok
            await w.until(
                lambda: w.controller.live.state.clusters.clusters["llama"].unschedulable != "",
                within=10,
                why="no node may take it",
            )
            why = w.controller.live.state.clusters.clusters["llama"].unschedulable
            assert why.endswith("1 has no sealing key for secret_env"), why
            assert w.drivers["old"].running() == []
            assert TOKEN.encode() not in w.log_bytes()

            # Should one be chosen anyway (it came back as an older agent after a placement
            # was decided), nothing is sent to it: the replica fails with the reason.
            spec_now = w.controller.live.state.clusters.clusters["llama"].spec
            with pytest.raises(SecretsUnavailable) as refused:
                await w.controller.secrets.seal_for("old", "llama-0", 9, spec_now)
            assert refused.value.reason == (
                "node old has no sealing key (an agent older than secret_env): the secrets "
                "HF_TOKEN cannot be sent to it"
            )

    run_simulation(main())


def test_a_reference_the_store_lacks_and_a_relative_file_are_refused() -> None:
    async def main() -> None:
        async with world("n0") as w:
            base = {"name": "a", "command": "serve --port {port}"}
            missing = await w.api(
                "cluster.create", {**base, "secret_env": {"T": reference("never stored")}}
            )
            assert not missing.ok
            assert missing.error.startswith("secret_env.T: the controller's secret store has no")
            relative = await w.api("cluster.create", {**base, "secret_env": {"T": "file:rel"}})
            assert relative.error == "secret_env.T: a file reference needs an absolute path"
            both = await w.api(
                "cluster.create", {**base, "env": {"T": "x"}, "secret_env": {"T": "y"}}
            )
            assert both.error == "secret_env.T: also in env (give it in one of them)"
            for reply in (missing, relative, both):
                assert "never stored" not in reply.error

    run_simulation(main())


def test_a_missing_file_fails_the_replica_in_one_line() -> None:
    spec = {
        "name": "llama",
        "command": "serve --port {port}",
        "secret_env": {"HF_TOKEN": "file:/nonexistent/gpumesh/hf_token"},
    }

    async def main() -> None:
        async with world("n0") as w:
            assert (await w.api("cluster.create", spec)).ok

            def failed() -> list[str]:
                return [
                    e.payload.detail
                    for e in w.store.read_all_now()
                    if isinstance(e.payload, ReplicaFailed)
                ]

            await w.until(lambda: failed() != [], within=20, why="the replica fails")
            # Restarted with back-off like any failed start (the file may appear), then failed.
            detail = failed()[0]
            assert "start failed: secret_env.HF_TOKEN: cannot read /nonexistent/gpumesh/" in detail
            assert "\n" not in detail
            assert w.drivers["n0"].running() == []

    run_simulation(main())


def test_a_replica_whose_secrets_cannot_go_fails_unsent_with_the_reason() -> None:
    """The race the scheduler's filter cannot see (the node came back as an older agent after
    the placement was decided): nothing is sent, and the replica fails with the reason."""
    spec = {"name": "llama", "command": "serve", "secret_env": {"HF_TOKEN": TOKEN}}

    async def main() -> None:
        async with world("n0") as w:
            keeper = w.controller.secrets
            lookup = keeper._node
            calls = 0

            def once_gone(node_id: str) -> NodeView | None:
                nonlocal calls
                calls += 1
                return None if calls == 1 else lookup(node_id)  # then it registers again

            keeper._node = once_gone
            assert (await w.api("cluster.create", spec)).ok

            def failed() -> list[ReplicaFailed]:
                return [
                    e.payload
                    for e in w.store.read_all_now()
                    if isinstance(e.payload, ReplicaFailed)
                ]

            await w.until(lambda: failed() != [], within=10, why="the replica fails")
            first = failed()[0]
            assert first.reason == "start_failed"
            assert first.detail == (
                "node n0 has no sealing key (an agent older than secret_env): the secrets "
                "HF_TOKEN cannot be sent to it"
            )
            # Nothing went for that epoch; the next placement (a new epoch) went, and runs.
            starts = [c for c in w.commands.sent("n0") if isinstance(c, StartReplica)]
            assert first.epoch not in [c.epoch for c in starts]
            await w.until(lambda: w.ready("llama") != [], within=20, why="placed again")
            [workload] = w.drivers["n0"].running()
            assert workload.spec.secret_env == {"HF_TOKEN": TOKEN}

    run_simulation(main())


def test_a_value_the_store_lacks_makes_the_cluster_unschedulable_not_a_loop() -> None:
    """A log restored without its secret store: placing would fail at once each time, so the
    placement says why and places nothing, rather than failing replica after replica."""
    spec = {"name": "llama", "replicas": 0, "command": "serve", "secret_env": {"HF_TOKEN": TOKEN}}

    async def main() -> None:
        async with world("n0") as w:
            assert (await w.api("cluster.create", spec)).ok
            w.secrets.values.clear()  # lost, and a controller that never saw it
            w.controller.secrets._held.clear()
            assert (await w.api("cluster.scale", {"name": "llama", "replicas": 1})).ok
            clusters = w.controller.live.state.clusters.clusters
            await w.until(lambda: clusters["llama"].unschedulable != "", within=10, why="says")
            assert clusters["llama"].unschedulable.startswith(
                "secret_env.HF_TOKEN: the controller's secret store has no value for secret:"
            )
            await asyncio.sleep(10.0)
            assert not any(isinstance(e.payload, ReplicaFailed) for e in w.store.read_all_now())
            assert w.drivers["n0"].running() == []
            # Given the value again (apply with it), the replica is placed and runs.
            applied = await w.api("cluster.apply", {**spec, "replicas": 1})
            assert applied.ok, applied.error
            await w.until(lambda: w.ready("llama") != [], within=20, why="placed")

    run_simulation(main())
