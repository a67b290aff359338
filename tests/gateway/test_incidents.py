"""The incident model (gateway/ui/incidents.py) over hand-written logs, a property over random
ones, and its drawing (gateway/ui/timeline.py)."""

from __future__ import annotations

import re

from hypothesis import given, settings, strategies as st

from events import (
    DomainEvent,
    Envelope,
    NodeHealthChanged,
    NodeHeartbeat,
    ReplicaFailed,
    ReplicaPlaced,
    ReplicaReady,
    ReplicaStarting,
    ReplicaSuspected,
)
from events.catalog import stream_of, type_tag
from gateway.ui.incidents import LEAD_NS, Incident, incidents
from gateway.ui.timeline import Bin, incident_html, line_chart

S = 1_000_000_000
T0 = 1_700_000_000 * S


class Log:
    """Envelopes as the store commits them: positions in order, recorded_at in seconds."""

    def __init__(self) -> None:
        self.envelopes: list[Envelope] = []

    def at(self, seconds: float, payload: DomainEvent) -> Log:
        position = len(self.envelopes) + 1
        self.envelopes.append(
            Envelope(
                event_id=f"e{position}",
                stream=stream_of(payload),
                version=1,
                position=position,
                type=type_tag(payload),
                recorded_at=T0 + round(seconds * S),
                payload=payload,
            )
        )
        return self

    def placed(self, t: float, replica: str, epoch: int, node: str) -> Log:
        cluster = replica.rsplit("-", 1)[0]
        self.at(t, ReplicaPlaced(replica_id=replica, cluster=cluster, node_id=node, epoch=epoch))
        return self

    def ready(self, t: float, replica: str, epoch: int) -> Log:
        self.at(t, ReplicaStarting(replica_id=replica, epoch=epoch))
        return self.at(t, ReplicaReady(replica_id=replica, epoch=epoch, address="http://x:1"))

    def health(self, t: float, node: str, state: str, reason: str = "missed_heartbeats") -> Log:
        return self.at(t, NodeHealthChanged(node_id=node, state=state, reason=reason))  # type: ignore[arg-type]

    def beat(self, t: float, node: str) -> Log:
        return self.at(t, NodeHeartbeat(node_id=node, seq=int(t)))

    def failed(self, t: float, replica: str, epoch: int, node: str, reason: str) -> Log:
        detail = f"node {node} is offline" if reason == "node_offline" else ""
        payload = ReplicaFailed(replica_id=replica, epoch=epoch, reason=reason, detail=detail)  # type: ignore[arg-type]
        return self.at(t, payload)

    def ejected(self, t: float, replica: str, epoch: int) -> Log:
        return self.at(
            t,
            ReplicaSuspected(
                replica_id=replica, epoch=epoch, gateway_id="gw-1", reason="connect_error"
            ),
        )


def power_loss() -> Log:
    """node-1 runs echo-0 and echo-1, loses power at t=10, is back at t=100."""
    log = Log()
    log.placed(0, "echo-0", 1, "node-1").ready(1, "echo-0", 1)
    log.placed(0, "echo-1", 1, "node-1").ready(1, "echo-1", 1)
    log.placed(0, "echo-2", 1, "node-2").ready(1, "echo-2", 1)
    for t in range(2, 11):
        log.beat(t, "node-1").beat(t, "node-2")
    log.ejected(11.5, "echo-0", 1)
    log.health(12, "node-1", "suspect")
    log.health(13, "node-1", "offline")
    log.failed(13, "echo-0", 1, "node-1", "node_offline")
    log.failed(13, "echo-1", 1, "node-1", "node_offline")
    log.placed(13, "echo-0", 2, "node-2").placed(13, "echo-1", 2, "node-3")
    log.ready(14.5, "echo-0", 2).ready(15, "echo-1", 2)
    log.health(100, "node-1", "healthy", "recovered")
    return log


def test_a_node_lost_with_its_replicas_is_one_incident_from_last_heartbeat_to_ready() -> None:
    (incident,) = incidents(power_loss().envelopes)
    assert incident.node_id == "node-1"
    assert incident.state == "offline" and incident.reason == "missed_heartbeats"
    assert incident.last_heartbeat_ns == T0 + 10 * S
    assert incident.detection_s == 2.0
    assert incident.replacement_s == 3.0  # from suspect (12) to the last ready (15)
    assert incident.resolved and incident.recovered_ns == T0 + 100 * S
    kinds = [m.kind for m in incident.marks]
    assert kinds == [
        "heartbeat", "ejected", "suspect", "offline", "failed", "failed", "placed", "placed",
        "ready", "ready", "healthy",
    ]  # fmt: skip
    moves = {m.replica_id: m for m in incident.moves}
    assert set(moves) == {"echo-0", "echo-1"}  # not echo-2, on node-2
    assert (moves["echo-0"].new_epoch, moves["echo-0"].new_node) == (2, "node-2")
    assert moves["echo-1"].ready_ns == T0 + 15 * S
    assert incident.ejections == 1
    assert incident.id == f"node-1@{incident.position}"


def test_no_incident_when_nothing_moved() -> None:
    log = Log()
    log.placed(0, "echo-0", 1, "node-1").ready(1, "echo-0", 1)
    log.health(5, "node-1", "suspect").health(6, "node-1", "healthy", "recovered")  # a blip
    log.health(9, "node-2", "offline")  # ran nothing
    log.failed(20, "echo-0", 1, "node-1", "workload_exited")  # on a healthy node
    log.placed(20, "echo-0", 2, "node-1").ready(21, "echo-0", 2)
    assert incidents(log.envelopes) == []


def test_ongoing_until_the_replacement_is_ready() -> None:
    log = Log()
    log.placed(0, "echo-0", 1, "node-1").ready(1, "echo-0", 1)
    log.health(5, "node-1", "unhealthy", "ecc")
    log.failed(5, "echo-0", 1, "node-1", "node_unhealthy").placed(5, "echo-0", 2, "node-2")
    (incident,) = incidents(log.envelopes)
    assert not incident.resolved and incident.replacement_s is None
    assert incident.detection_s is None  # no heartbeat among the envelopes
    assert incident.state == "unhealthy" and incident.reason == "ecc"
    log.ready(7, "echo-0", 2)
    (incident,) = incidents(log.envelopes)
    assert incident.resolved and incident.replacement_s == 2.0


def test_ejections_count_from_the_lead_before_and_only_the_nodes_own() -> None:
    log = Log()
    log.placed(0, "echo-0", 1, "node-1").placed(0, "echo-1", 1, "node-2")
    log.ejected(100 - LEAD_NS / S - 1, "echo-0", 1)  # too early
    log.ejected(95, "echo-0", 1).ejected(96, "echo-1", 1)  # the second: another node's
    log.health(100, "node-1", "offline")
    log.failed(100, "echo-0", 1, "node-1", "node_offline")
    log.ejected(100.5, "echo-0", 1)  # during it
    (incident,) = incidents(log.envelopes)
    ejected = [m.at_ns for m in incident.marks if m.kind == "ejected"]
    assert ejected == [T0 + 95 * S, T0 + 100_500_000_000]


def test_a_placement_older_than_the_log_given_is_found_by_the_failure_detail() -> None:
    log = Log()
    log.health(5, "node-1", "offline")
    log.failed(5, "echo-0", 3, "node-1", "node_offline").placed(5, "echo-0", 4, "node-2")
    (incident,) = incidents(log.envelopes)
    assert [(m.replica_id, m.epoch, m.cluster) for m in incident.moves] == [("echo-0", 3, "echo")]


def test_two_nodes_at_once_are_two_incidents_each_with_its_replicas() -> None:
    log = Log()
    log.placed(0, "a-0", 1, "node-1").placed(0, "b-0", 1, "node-2")
    log.health(5, "node-1", "offline").health(5, "node-2", "offline")
    log.failed(5, "a-0", 1, "node-1", "node_offline").failed(5, "b-0", 1, "node-2", "node_offline")
    first, second = incidents(log.envelopes)
    assert (first.node_id, [m.replica_id for m in first.moves]) == ("node-1", ["a-0"])
    assert (second.node_id, [m.replica_id for m in second.moves]) == ("node-2", ["b-0"])


def test_a_node_lost_again_later_is_a_second_incident() -> None:
    log = power_loss()
    log.health(200, "node-1", "offline")
    log.placed(150, "echo-3", 1, "node-1")
    log.failed(200, "echo-3", 1, "node-1", "node_offline")
    first, second = incidents(log.envelopes)
    assert first.id != second.id and [m.replica_id for m in second.moves] == ["echo-3"]


NODES = ["node-1", "node-2"]
REPLICAS = ["echo-0", "echo-1"]
STEP = st.one_of(
    st.tuples(st.just("beat"), st.sampled_from(NODES)),
    st.tuples(
        st.just("health"),
        st.sampled_from(NODES),
        st.sampled_from(["healthy", "suspect", "offline", "unhealthy", "degraded"]),
    ),
    st.tuples(st.just("placed"), st.sampled_from(REPLICAS), st.sampled_from(NODES)),
    st.tuples(st.just("failed"), st.sampled_from(REPLICAS)),
    st.tuples(st.just("ready"), st.sampled_from(REPLICAS)),
    st.tuples(st.just("ejected"), st.sampled_from(REPLICAS)),
)


def _random_log(steps: list[tuple[str, ...]]) -> Log:
    log = Log()
    epoch = dict.fromkeys(REPLICAS, 0)
    where = dict.fromkeys(REPLICAS, "node-1")
    for i, step in enumerate(steps):
        t = float(i)
        match step:
            case ("beat", node):
                log.beat(t, node)
            case ("health", node, state):
                log.health(t, node, state)
            case ("placed", replica, node):
                epoch[replica] += 1
                where[replica] = node
                log.placed(t, replica, epoch[replica], node)
            case ("failed", replica):
                log.failed(t, replica, epoch[replica], where[replica], "node_offline")
            case ("ready", replica):
                log.ready(t, replica, epoch[replica])
            case ("ejected", replica):
                log.ejected(t, replica, epoch[replica])
    return log


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=40))
def test_incidents_only_grow_as_the_log_grows(steps: list[tuple[str, ...]]) -> None:
    """What the live page relies on: an incident, once drawn, stays (with the same id), and
    more events only add to it; every mark is its node's or one of its moved replicas'."""
    log = _random_log(steps)
    before: dict[str, Incident] = {}
    for n in range(len(log.envelopes) + 1):
        now = {i.id: i for i in incidents(log.envelopes[:n])}
        assert set(before) <= set(now)
        for key, old in before.items():
            new = now[key]
            assert new.marks[: len(old.marks)] == old.marks or set(old.marks) <= set(new.marks)
            assert {m.replica_id for m in old.moves} <= {m.replica_id for m in new.moves}
        for incident in now.values():
            assert incident.moves
            moved = {m.replica_id for m in incident.moves}
            positions = [m.position for m in incident.marks]
            assert positions == sorted(positions)
            for mark in incident.marks:
                assert mark.replica_id in moved or mark.kind == "ejected" or not mark.replica_id
            incident_html(incident)  # draws whatever the fold gives
        before = now


def test_the_drawing_escapes_every_name_and_uses_no_style_attribute() -> None:
    log = power_loss()
    evil = "<script>alert(1)</script>"
    log.health(300, "node-1", "offline", "driver")
    log.placed(250, "echo-9", 1, "node-1")
    log.failed(300, "echo-9", 1, "node-1", "node_offline")
    incident = incidents(log.envelopes)[-1]
    from dataclasses import replace

    incident = replace(incident, node_id=evil, reason=evil)
    drawn = incident_html(incident, requests=[Bin(T0 + 300 * S, ok=3, failed=2, retried=1)])
    assert "<script>" not in drawn and "&lt;script&gt;" in drawn
    assert "style=" not in drawn
    assert "2 request(s) failed, 1 retried" in drawn
    assert 'class="failed-requests"' in drawn
    first = incident_html(incidents(power_loss().envelopes)[0])
    kinds = re.findall(r'data-kind="(\w+)"', first)
    assert kinds.count("failed") == 2 and kinds.count("ready") == 2 and "heartbeat" in kinds
    assert "detected in 2.00 s" in first and "replaced in 3.00 s" in first
    assert 'data-state="resolved"' in first


def test_a_line_chart_breaks_its_line_where_there_is_no_value() -> None:
    chart = line_chart(
        [("p99", "#c62828", [(0, 1.0), (10, None), (20, 3.0), (30, 2.0)])],
        x_range=(0, 30),
        x_label=lambda v: f"{v:g}",
        unit=" s",
        title="latency",
    )
    (path,) = re.findall(r' d="([^"]+)"', chart)
    assert path.count("M") == 2 and path.count("L") == 1
    assert "style=" not in chart
