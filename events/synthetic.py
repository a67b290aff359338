"""A deterministic, plausible fleet history: for demos, benchmarks and rebuild tests.

Nodes register and heartbeat every second; clusters are created and placed; now and then a node
overheats or drops off, its replicas fail and are re-placed at a higher epoch elsewhere, and the
node comes back. Same seed, same history, byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    versions: dict[str, int] = {}
    now = START_NS
    emitted = 0

    def emit(payload: DomainEvent) -> Step:
        nonlocal emitted
        stream = stream_of(payload)
        expected = versions.get(stream, 0)
        versions[stream] = expected + 1
        emitted += 1
        return Step(stream, new_event(payload, wall_ns=now, entropy=rng), expected)

    node_ids = [f"node-{i:05d}" for i in range(nodes)]
    regions = ("eu-west", "us-east", "ap-south")
    for i, node_id in enumerate(node_ids):
        yield emit(
            NodeRegistered(
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
        )
        if emitted >= limit:
            return
    placement: dict[str, str] = {}
    epochs: dict[str, int] = {}
    for c in range(clusters):
        name = f"cluster-{c}"
        spec = ClusterSpec(
            name=name,
            replicas=replicas,
            gpu=GpuRequirement(models=("RTX4090",)),
            command="gpumesh workload echo --port {port}",
        )
        yield emit(ClusterCreated(spec=spec))
        for r in range(replicas):
            rid = f"{name}-{r}"
            node = node_ids[(c * replicas + r) % nodes]
            epochs[rid] = 1
            placement[rid] = node
            for payload in _start(rid, name, node, 1, 8000 + r):
                yield emit(payload)
    down: dict[str, int] = {}  # node -> seconds until it comes back
    second = 0
    while emitted < limit:
        second += 1
        now = START_NS + second * 1_000_000_000
        for node_id in node_ids:
            if node_id in down:
                down[node_id] -= 1
                if down[node_id] <= 0:
                    del down[node_id]
                    yield emit(
                        NodeHealthChanged(node_id=node_id, state="healthy", reason="recovered")
                    )
                continue
            if rng.random() < 0.0005:
                down[node_id] = rng.randint(5, 60)
                yield emit(
                    NodeHealthChanged(
                        node_id=node_id,
                        state="offline",
                        reason="missed_heartbeats",
                        detail="3 missed",
                    )
                )
                for rid in [r for r, n in placement.items() if n == node_id]:
                    yield emit(
                        ReplicaFailed(replica_id=rid, epoch=epochs[rid], reason="node_offline")
                    )
                    target = _pick(node_ids, down, placement, rid, rng)
                    epochs[rid] += 1
                    placement[rid] = target
                    cluster = rid.rsplit("-", 1)[0]
                    for payload in _start(rid, cluster, target, epochs[rid], 9000):
                        yield emit(payload)
                continue
            yield emit(
                NodeHeartbeat(
                    node_id=node_id,
                    seq=second,
                    gpus=(
                        GpuMetrics(
                            index=0,
                            temperature_c=55.0 + rng.randint(0, 20),
                            utilization_pct=float(rng.randint(0, 100)),
                            memory_used_mib=8_000,
                            memory_total_mib=24_576,
                        ),
                        GpuMetrics(
                            index=1,
                            temperature_c=50.0 + rng.randint(0, 20),
                            utilization_pct=float(rng.randint(0, 100)),
                            memory_used_mib=8_000,
                            memory_total_mib=24_576,
                        ),
                    ),
                    running=tuple(f"{r}@{epochs[r]}" for r, n in placement.items() if n == node_id),
                )
            )
            if emitted >= limit:
                return


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
