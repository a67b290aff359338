"""A deterministic, plausible fleet history: for demos, benchmarks and rebuild tests.

Nodes register and heartbeat every second; clusters are created and placed; now and then a node
overheats or drops off, its replicas fail and are re-placed at a higher epoch elsewhere, and the
node comes back. Same seed, same history, byte for byte.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Protocol

from .catalog import DomainEvent, stream_of
from .cluster import ClusterCreated, ClusterSpec, GpuRequirement
from .envelope import NewEvent, new_event
from .node import GpuInfo, GpuMetrics, NodeHealthChanged, NodeHeartbeat, NodeRegistered
from .replica import ReplicaFailed, ReplicaPlaced, ReplicaReady, ReplicaStarting, ReplicaStopped

START_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z


class Rng(Protocol):
    def random(self) -> float: ...
    def randint(self, a: int, b: int, /) -> int: ...
    def getrandbits(self, k: int, /) -> int: ...


@dataclass(frozen=True, slots=True)
class Step:
    stream: str
    event: NewEvent
    expected_version: int


def fleet_history(
    rng: Rng, *, nodes: int = 20, clusters: int = 3, replicas: int = 3, limit: int = 10_000
) -> Iterator[Step]:
    """Yield up to `limit` events, each with the expected version its append needs."""
    fleet = _Fleet(rng, [f"node-{i:05d}" for i in range(nodes)])
    for i, node_id in enumerate(fleet.node_ids):
        yield fleet.emit(_registered(i, node_id))
        if fleet.emitted >= limit:
            return
    for c in range(clusters):
        yield from fleet.create_cluster(f"cluster-{c}", c, replicas)
    second = 0
    while fleet.emitted < limit:
        second += 1
        fleet.now = START_NS + second * 1_000_000_000
        for node_id in fleet.node_ids:
            beat = yield from fleet.tick(node_id, second)
            if beat and fleet.emitted >= limit:
                return


class _Fleet:
    """The history's state as it is written: stream versions, the clock, where each replica
    is and at which epoch, and which nodes are down for how many more seconds."""

    def __init__(self, rng: Rng, node_ids: list[str]) -> None:
        self.rng = rng
        self.node_ids = node_ids
        self.versions: dict[str, int] = {}
        self.now = START_NS
        self.emitted = 0
        self.placement: dict[str, str] = {}
        self.epochs: dict[str, int] = {}
        self.down: dict[str, int] = {}  # node -> seconds until it comes back

    def emit(self, payload: DomainEvent) -> Step:
        stream = stream_of(payload)
        expected = self.versions.get(stream, 0)
        self.versions[stream] = expected + 1
        self.emitted += 1
        return Step(stream, new_event(payload, wall_ns=self.now, entropy=self.rng), expected)

    def create_cluster(self, name: str, c: int, replicas: int) -> Iterator[Step]:
        spec = ClusterSpec(
            name=name,
            replicas=replicas,
            gpu=GpuRequirement(models=("RTX4090",)),
            command="gpumesh workload echo --port {port}",
        )
        yield self.emit(ClusterCreated(spec=spec))
        for r in range(replicas):
            rid = f"{name}-{r}"
            node = self.node_ids[(c * replicas + r) % len(self.node_ids)]
            self.epochs[rid] = 1
            self.placement[rid] = node
            for payload in _start(rid, name, node, 1, 8000 + r):
                yield self.emit(payload)

    def tick(self, node_id: str, second: int) -> Generator[Step, None, bool]:
        """One node's second: it comes back, goes down, or heartbeats (then True)."""
        if node_id in self.down:
            self.down[node_id] -= 1
            if self.down[node_id] <= 0:
                del self.down[node_id]
                yield self.emit(
                    NodeHealthChanged(node_id=node_id, state="healthy", reason="recovered")
                )
            return False
        if self.rng.random() < 0.0005:
            yield from self.go_down(node_id)
            return False
        yield self.emit(self.heartbeat(node_id, second))
        return True

    def go_down(self, node_id: str) -> Iterator[Step]:
        """Offline for 5-60 s; its replicas fail and start again, an epoch up, elsewhere."""
        self.down[node_id] = self.rng.randint(5, 60)
        yield self.emit(
            NodeHealthChanged(
                node_id=node_id, state="offline", reason="missed_heartbeats", detail="3 missed"
            )
        )
        for rid in [r for r, n in self.placement.items() if n == node_id]:
            yield self.emit(
                ReplicaFailed(replica_id=rid, epoch=self.epochs[rid], reason="node_offline")
            )
            target = _pick(self.node_ids, self.down, self.placement, rid, self.rng)
            self.epochs[rid] += 1
            self.placement[rid] = target
            cluster = rid.rsplit("-", 1)[0]
            for payload in _start(rid, cluster, target, self.epochs[rid], 9000):
                yield self.emit(payload)

    def heartbeat(self, node_id: str, second: int) -> NodeHeartbeat:
        rng = self.rng
        return NodeHeartbeat(
            node_id=node_id,
            seq=second,
            gpus=tuple(
                GpuMetrics(
                    index=index,
                    temperature_c=base_c + rng.randint(0, 20),
                    utilization_pct=float(rng.randint(0, 100)),
                    memory_used_mib=8_000,
                    memory_total_mib=24_576,
                )
                for index, base_c in ((0, 55.0), (1, 50.0))
            ),
            running=tuple(
                f"{r}@{self.epochs[r]}" for r, n in self.placement.items() if n == node_id
            ),
        )


def _registered(i: int, node_id: str) -> NodeRegistered:
    regions = ("eu-west", "us-east", "ap-south")
    return NodeRegistered(
        node_id=node_id,
        hostname=f"gpu-{i}",
        address="127.0.0.1",
        region=regions[i % len(regions)],
        gpus=(
            GpuInfo(index=0, uuid=f"GPU-{i:05d}-0", model="RTX4090", vram_mib=24_576),
            GpuInfo(index=1, uuid=f"GPU-{i:05d}-1", model="RTX4090", vram_mib=24_576),
        ),
        driver_version="550.54",
        cuda_version="12.4",
        price_per_hour=0.4 + (i % 5) / 10,
    )


def _start(rid: str, cluster: str, node: str, epoch: int, port: int) -> list[DomainEvent]:
    """Place, start and ready one epoch; a replacement also records the old epoch stopped."""
    events: list[DomainEvent] = [
        ReplicaPlaced(
            replica_id=rid,
            cluster=cluster,
            node_id=node,
            gpu_indices=(0,),
            epoch=epoch,
            why="synthetic history" if epoch == 1 else "replacement",
        ),
        ReplicaStarting(replica_id=rid, epoch=epoch, port=port),
        ReplicaReady(replica_id=rid, epoch=epoch, address=f"http://127.0.0.1:{port}"),
    ]
    if epoch > 1:
        events.append(ReplicaStopped(replica_id=rid, epoch=epoch - 1))
    return events


def _pick(
    node_ids: list[str], down: dict[str, int], placement: dict[str, str], rid: str, rng: Rng
) -> str:
    candidates = [n for n in node_ids if n not in down and n != placement[rid]]
    if not candidates:
        return placement[rid]
    return candidates[rng.randint(0, len(candidates) - 1)]
