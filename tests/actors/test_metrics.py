"""actors/metrics.py: the controller's collector over a FleetState, and what LogMetrics counts."""

from __future__ import annotations

from collections import Counter

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import projections
from actors.metrics import (
    ControllerCollector,
    LogMetrics,
    StaticSource,
    new_registry,
)
from events import ClusterSpec, DomainEvent, stream_of
from events.cluster import ClusterCreated, ClusterScaled
from events.envelope import Envelope
from events.node import NodeHealthChanged, NodeHeartbeat, NodeRegistered
from events.replica import ReplicaFailed, ReplicaPlaced, ReplicaReady
from projections import FleetState
from wire.metrics_http import parse_listen

T0 = 1_750_000_000_000_000_000
MS = 1_000_000


class FakeClock:
    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def monotonic(self) -> float:
        return self.now_ns / 1e9

    def wall_ns(self) -> int:
        return self.now_ns


class Log:
    """Envelopes as a store would commit them: positions in order, versions per stream."""

    def __init__(self) -> None:
        self.position = 0
        self.versions: Counter[str] = Counter()

    def __call__(self, payload: DomainEvent, at_ns: int) -> Envelope:
        self.position += 1
        stream = stream_of(payload)
        self.versions[stream] += 1
        return Envelope(
            event_id=f"e{self.position}",
            stream=stream,
            version=self.versions[stream],
            position=self.position,
            type=type(payload).__struct_config__.tag,  # type: ignore[arg-type]
            recorded_at=at_ns,
            payload=payload,
        )


def _fleet() -> tuple[FleetState, list[Envelope]]:
    log = Log()
    batch = [
        log(NodeRegistered(node_id="n1"), T0),
        log(NodeRegistered(node_id="n2"), T0),
        log(NodeRegistered(node_id="n3"), T0),
        log(NodeHealthChanged(node_id="n2", state="degraded", reason="thermal"), T0),
        log(NodeHealthChanged(node_id="n3", state="offline", reason="missed_heartbeats"), T0),
        log(ClusterCreated(spec=ClusterSpec(name="echo", replicas=2)), T0 + 10 * MS),
        log(
            ReplicaPlaced(replica_id="echo-0", cluster="echo", node_id="n1", epoch=1), T0 + 30 * MS
        ),
        log(
            ReplicaPlaced(replica_id="echo-1", cluster="echo", node_id="n2", epoch=1), T0 + 40 * MS
        ),
        log(ReplicaReady(replica_id="echo-0", epoch=1, address="http://n1:8000"), T0 + 50 * MS),
        log(ReplicaFailed(replica_id="echo-1", epoch=1, reason="node_unhealthy"), T0 + 60 * MS),
        log(
            ReplicaPlaced(replica_id="echo-1", cluster="echo", node_id="n1", epoch=2), T0 + 70 * MS
        ),
        log(ClusterScaled(name="echo", replicas=3, previous=2), T0 + 80 * MS),
        log(
            ReplicaPlaced(replica_id="echo-2", cluster="echo", node_id="n1", epoch=1), T0 + 95 * MS
        ),
        log(NodeHeartbeat(node_id="n1", seq=1, sent_at_ns=T0 + 90 * MS), T0 + 98 * MS),
        log(NodeHeartbeat(node_id="n2", seq=1, sent_at_ns=T0 - 1900 * MS), T0 + 98 * MS),
        log(NodeHeartbeat(node_id="n3", seq=1), T0 + 98 * MS),  # an older agent: no send time
    ]
    state = FleetState()
    for envelope in batch:
        projections.apply(state, envelope)
    return state, batch


def _scrape(source: StaticSource) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(new_registry(ControllerCollector(source))).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_fleet_gauges_come_from_the_state_at_scrape() -> None:
    state, _ = _fleet()
    samples = _scrape(StaticSource(state=state, is_leader=True, leader_term=4))
    assert samples["gpumesh_controller_nodes", (("health", "healthy"),)] == 1
    assert samples["gpumesh_controller_nodes", (("health", "degraded"),)] == 1
    assert samples["gpumesh_controller_nodes", (("health", "offline"),)] == 1
    assert samples["gpumesh_controller_nodes", (("health", "suspect"),)] == 0  # zero-filled
    assert samples["gpumesh_controller_nodes_drained", ()] == 0
    echo = (("cluster", "echo"),)
    assert samples["gpumesh_controller_replicas", (*echo, ("status", "ready"))] == 1
    assert samples["gpumesh_controller_replicas", (*echo, ("status", "placed"))] == 2
    assert samples["gpumesh_controller_replicas", (*echo, ("status", "failed"))] == 0
    assert samples["gpumesh_controller_clusters", ()] == 1
    assert samples["gpumesh_controller_routable_replicas", echo] == 1
    assert samples["gpumesh_controller_log_position", ()] == state.position
    assert samples["gpumesh_controller_leader", ()] == 1
    assert samples["gpumesh_controller_term", ()] == 4
    assert ("gpumesh_controller_standby_lag_events", ()) not in samples  # a leader has none


def test_a_standby_says_so_and_its_lag() -> None:
    samples = _scrape(StaticSource(state=FleetState(), is_leader=False, leader_term=4, lag=17))
    assert samples["gpumesh_controller_leader", ()] == 0
    assert samples["gpumesh_controller_term", ()] == 0
    assert samples["gpumesh_controller_standby_lag_events", ()] == 17
    assert samples["gpumesh_controller_nodes", (("health", "healthy"),)] == 0


def test_log_metrics_count_events_heartbeat_lag_and_placements() -> None:
    _, batch = _fleet()
    log = LogMetrics(FakeClock(T0 + 100 * MS))
    log.observe(batch)
    samples = _scrape(StaticSource(log=log, drops={"garbage": 3}))

    assert samples["gpumesh_controller_heartbeats_recorded_total", ()] == 3
    events = "gpumesh_controller_events_total"
    assert samples[events, (("family", "node"), ("type", "node.heartbeat"))] == 3
    assert samples[events, (("family", "replica"), ("type", "replica.placed"))] == 4
    assert samples[events, (("family", "cluster"), ("type", "cluster.created"))] == 1
    # Lag: 10 ms (n1) and 2 s (n2); n3 sent no time and is not observed.
    lag = "gpumesh_controller_heartbeat_lag_seconds"
    assert samples[f"{lag}_count", ()] == 2
    assert samples[f"{lag}_bucket", (("le", "0.01"),)] == 1
    assert samples[f"{lag}_bucket", (("le", "2.5"),)] == 2
    assert abs(samples[f"{lag}_sum", ()] - 2.01) < 1e-9
    placements = "gpumesh_controller_placements_total"
    assert samples[placements, (("kind", "new"),)] == 3
    assert samples[placements, (("kind", "replacement"),)] == 1
    latency = "gpumesh_controller_placement_latency_seconds"
    # New: 20 and 30 ms after the cluster's creation, 15 ms after its scale-up.
    assert samples[f"{latency}_count", (("kind", "new"),)] == 3
    assert abs(samples[f"{latency}_sum", (("kind", "new"),)] - 0.065) < 1e-9
    # The replacement: 10 ms after the replica's failure.
    assert abs(samples[f"{latency}_sum", (("kind", "replacement"),)] - 0.010) < 1e-9
    assert samples[f"{latency}_bucket", (("kind", "replacement"), ("le", "0.01"))] == 1
    assert samples["gpumesh_controller_messages_dropped_total", (("kind", "garbage"),)] == 3


def test_nothing_known_yet_still_scrapes() -> None:
    samples = _scrape(StaticSource())
    assert samples["gpumesh_controller_leader", ()] == 0
    assert not any(name.startswith("gpumesh_controller_nodes") for name, _ in samples)


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_listen("9400") == ("127.0.0.1", 9400)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("", "host:", ":9400", "127.0.0.1:x", "127.0.0.1:70000"):
        try:
            parse_listen(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} parsed")
