"""Hypothesis strategies for domain events and committed logs.

Small universes of ids on purpose: collisions between nodes, replicas and epochs are where the
interesting interleavings live.
"""

from __future__ import annotations

from hypothesis import strategies as st

from events import (
    AutoscaleInputs,
    AutoscaleSpec,
    ClusterCreated,
    ClusterDeleted,
    ClusterScaled,
    ClusterSpec,
    ClusterSpecChanged,
    ClusterUnschedulable,
    DomainEvent,
    Envelope,
    GpuInfo,
    GpuMetrics,
    LinkMeasurement,
    NodeDrained,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeLinksMeasured,
    NodeRegistered,
    NodeRemoved,
    ReplicaFailed,
    ReplicaPlaced,
    ReplicaReady,
    ReplicaStageReady,
    ReplicaStarting,
    ReplicaStopped,
    ReplicaStopping,
    StagePlacement,
    Undecodable,
    stream_of,
    type_tag,
)

NODES = ("n0", "n1", "n2", "n3")
CLUSTERS = ("c0", "c1")
REPLICA_CLUSTER = {"c0-0": "c0", "c0-1": "c0", "c1-0": "c1", "c1-1": "c1"}
REPLICAS = tuple(REPLICA_CLUSTER)

node_ids = st.sampled_from(NODES)
cluster_names = st.sampled_from(CLUSTERS)
replica_ids = st.sampled_from(REPLICAS)
epochs = st.integers(1, 3)

metrics = st.builds(
    GpuMetrics,
    index=st.integers(0, 1),
    temperature_c=st.floats(20, 100, allow_nan=False),
    utilization_pct=st.floats(0, 100, allow_nan=False),
    ecc_uncorrected=st.integers(0, 2),
)

specs = st.builds(
    ClusterSpec,
    name=cluster_names,
    replicas=st.integers(0, 4),
    command=st.sampled_from(["", "echo {port}"]),
    autoscale=st.one_of(
        st.none(), st.builds(AutoscaleSpec, min_replicas=st.integers(0, 2), max_replicas=st.just(4))
    ),
)

node_events = st.one_of(
    st.builds(
        NodeRegistered,
        node_id=node_ids,
        region=st.sampled_from(["", "eu", "us"]),
        gpus=st.lists(
            st.builds(
                GpuInfo,
                index=st.integers(0, 1),
                uuid=st.just("GPU-x"),
                model=st.sampled_from(["RTX4090", "A100"]),
                vram_mib=st.just(24576),
            ),
            max_size=2,
        ).map(tuple),
    ),
    st.builds(
        NodeHeartbeat,
        node_id=node_ids,
        seq=st.integers(0, 1000),
        gpus=st.lists(metrics, max_size=2).map(tuple),
    ),
    st.builds(NodeHeartbeat, node_id=node_ids, seq=st.integers(0, 1000)),
    st.builds(
        NodeHealthChanged,
        node_id=node_ids,
        state=st.sampled_from(["healthy", "suspect", "degraded", "unhealthy", "offline"]),
        reason=st.sampled_from(["missed_heartbeats", "thermal", "ecc", "driver", "recovered"]),
    ),
    st.builds(NodeDrained, node_id=node_ids),
    st.builds(NodeRemoved, node_id=node_ids),
    st.builds(
        NodeLinksMeasured,
        node_id=node_ids,
        endpoint=st.sampled_from(["", "10.0.0.1:7400"]),
        links=st.lists(
            st.builds(
                LinkMeasurement,
                peer=node_ids,
                rtt_ms=st.floats(0, 500, allow_nan=False),
                gbps=st.floats(0.01, 100, allow_nan=False),
                error=st.sampled_from(["", "", "connection refused"]),
            ),
            max_size=3,
        ).map(tuple),
    ),
)

cluster_events = st.one_of(
    st.builds(ClusterCreated, spec=specs),
    st.builds(ClusterSpecChanged, spec=specs),
    st.builds(ClusterScaled, name=cluster_names, replicas=st.integers(0, 5)),
    st.builds(
        ClusterScaled,
        name=cluster_names,
        replicas=st.integers(0, 5),
        cause=st.just("autoscale: a cold start"),
        inputs=st.builds(AutoscaleInputs, held=st.integers(0, 9), wanted=st.integers(0, 5)),
    ),
    st.builds(ClusterDeleted, name=cluster_names),
    st.builds(
        ClusterUnschedulable,
        name=cluster_names,
        missing=st.integers(1, 3),
        reason=st.just("no node fits"),
    ),
)


@st.composite
def replica_events(draw: st.DrawFn) -> DomainEvent:
    rid = draw(replica_ids)
    epoch = draw(epochs)
    kind = draw(st.integers(0, 7))
    if kind == 0:
        return ReplicaPlaced(
            replica_id=rid,
            cluster=REPLICA_CLUSTER[rid],
            node_id=draw(node_ids),
            gpu_indices=(0,),
            epoch=epoch,
        )
    if kind == 6:  # a pipeline of two stages (docs/sharding.md)
        head, worker = draw(node_ids), draw(node_ids)
        return ReplicaPlaced(
            replica_id=rid,
            cluster=REPLICA_CLUSTER[rid],
            node_id=head,
            gpu_indices=(0,),
            epoch=epoch,
            stages=(
                StagePlacement(rank=0, node_id=head, gpu_indices=(0,), last_layer=8),
                StagePlacement(
                    rank=1, node_id=worker, gpu_indices=(1,), first_layer=8, last_layer=16
                ),
            ),
        )
    if kind == 7:
        return ReplicaStageReady(
            replica_id=rid, epoch=epoch, rank=1, node_id=draw(node_ids), address=f"w:{epoch}"
        )
    if kind == 1:
        return ReplicaStarting(replica_id=rid, epoch=epoch, port=8000)
    if kind == 2:
        return ReplicaReady(replica_id=rid, epoch=epoch, address=f"http://127.0.0.1:{epoch}")
    if kind == 3:
        return ReplicaFailed(replica_id=rid, epoch=epoch, reason="node_offline")
    if kind == 4:
        return ReplicaStopping(replica_id=rid, epoch=epoch)
    return ReplicaStopped(replica_id=rid, epoch=epoch, exit_code=0)


domain_events = st.one_of(node_events, node_events, cluster_events, replica_events())


def commit(
    payloads: list[DomainEvent | Undecodable], start_ns: int = 1_000_000_000
) -> list[Envelope]:
    """Lay payloads out as a committed log: per-stream versions, global positions, rising time."""
    versions: dict[str, int] = {}
    log = []
    for position, payload in enumerate(payloads, start=1):
        if isinstance(payload, Undecodable):
            stream, tag = "node/corrupt", "node.mystery.v9"
        else:
            stream, tag = stream_of(payload), type_tag(payload)
        versions[stream] = versions.get(stream, 0) + 1
        log.append(
            Envelope(
                event_id=f"id-{position}",
                stream=stream,
                version=versions[stream],
                position=position,
                type=tag,
                recorded_at=start_ns + position * 1_000_000_000,
                payload=payload,
            )
        )
    return log


undecodable = st.builds(Undecodable, raw=st.binary(max_size=8), error=st.just("DecodeError"))

logs = st.lists(
    st.one_of(domain_events, domain_events, domain_events, domain_events, undecodable),
    max_size=120,
).map(commit)
