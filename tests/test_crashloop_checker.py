"""The crash loop's check that every acknowledged cluster operation has its event once, in order
(bench/_crashloop_common.py, check_ops_in_order), on logs written by hand: the case that made
`bench/crashloop.py --ha --quick` fail CI with "applied twice?" although nothing was (a scale to
the count a cluster already had records an event too), and the cases it must still catch."""

from __future__ import annotations

import pytest

from bench._crashloop_common import (
    Ledger,
    check_ops_in_order,
    ops_problems,
    outcome_unknown,
    refusal,
)
from events import ClusterCreated, ClusterDeleted, ClusterScaled, ClusterSpec, DomainEvent
from events.catalog import type_tag
from events.envelope import Envelope
from runtime.env import BusError, NoResponders, RequestTimeout
from tests.integration.stack import ApiError

Op = tuple[str, str, int]


def _log(*events: tuple[str, DomainEvent]) -> list[Envelope]:
    """Envelopes at positions 1.., each (cluster, payload), versions counted per stream."""
    out: list[Envelope] = []
    versions: dict[str, int] = {}
    for position, (name, payload) in enumerate(events, start=1):
        stream = f"cluster/{name}"
        versions[stream] = versions.get(stream, 0) + 1
        out.append(
            Envelope(
                event_id=f"e{position}",
                stream=stream,
                version=versions[stream],
                position=position,
                type=type_tag(payload),
                recorded_at=position,
                payload=payload,
            )
        )
    return out


def created(name: str, replicas: int) -> tuple[str, DomainEvent]:
    spec = ClusterSpec(name=name, model="echo", replicas=replicas)
    return name, ClusterCreated(spec=spec)


def scaled(name: str, replicas: int, previous: int) -> tuple[str, DomainEvent]:
    return name, ClusterScaled(name=name, replicas=replicas, previous=previous)


def deleted(name: str) -> tuple[str, DomainEvent]:
    return name, ClusterDeleted(name=name)


def ledger(ops: list[Op], **unanswered: int) -> Ledger:
    out = Ledger(ops=list(ops))
    out.unanswered.update(unanswered)
    return out


def test_a_scale_to_the_count_it_had_is_its_own_event_not_a_second_apply() -> None:
    # seed 139 under load (c1 of a run that the earlier checker failed with "c1: 3"): every
    # scale is recorded, those to the count the cluster had (previous == replicas) too.
    log = _log(
        created("c1", 0),
        scaled("c1", 1, 0),
        scaled("c1", 1, 1),
        scaled("c1", 1, 1),
        scaled("c1", 0, 1),
        scaled("c1", 0, 0),
    )
    ops: list[Op] = [
        ("cluster.create", "c1", 0),
        ("cluster.scale", "c1", 1),
        ("cluster.scale", "c1", 1),
        ("cluster.scale", "c1", 1),
        ("cluster.scale", "c1", 0),
        ("cluster.scale", "c1", 0),
    ]
    found = check_ops_in_order(log, ledger(ops))
    assert found == {"matched": 6, "missing": [], "unexplained_events": {}}
    assert ops_problems(found) == []


def test_an_unanswered_operations_event_before_the_last_acknowledged_one_is_not_taken() -> None:
    # A scale of c2 to 2 got no answer but was applied (position 2); c1 was created (3); then a
    # scale of c2 to 2 was acknowledged (4). Its event is 4, not 2: 2 comes before the create
    # it was sent after; 2 is the unanswered operation's.
    log = _log(created("c2", 1), scaled("c2", 2, 1), created("c1", 1), scaled("c2", 2, 2))
    ops: list[Op] = [
        ("cluster.create", "c2", 1),
        ("cluster.create", "c1", 1),
        ("cluster.scale", "c2", 2),
    ]
    assert ops_problems(check_ops_in_order(log, ledger(ops, c2=1))) == []
    # Without that unanswered operation, position 2 is one too many.
    found = check_ops_in_order(log, ledger(ops))
    assert found["missing"] == []
    assert found["unexplained_events"] == {"c2": 1}


def test_an_operation_recorded_twice_is_caught() -> None:
    log = _log(created("c0", 1), scaled("c0", 2, 1), scaled("c0", 2, 2), deleted("c0"))
    ops: list[Op] = [
        ("cluster.create", "c0", 1),
        ("cluster.scale", "c0", 2),
        ("cluster.delete", "c0", 0),
    ]
    found = check_ops_in_order(log, ledger(ops))
    assert found["unexplained_events"] == {"c0": 1}
    assert "applied twice?" in ops_problems(found)[0]
    # Another cluster's unanswered operation explains nothing here.
    assert check_ops_in_order(log, ledger(ops, c3=1))["unexplained_events"] == {"c0": 1}


def test_an_acknowledged_operation_without_its_event_is_missing() -> None:
    log = _log(created("c0", 1), scaled("c0", 0, 1))
    ops: list[Op] = [
        ("cluster.create", "c0", 1),
        ("cluster.scale", "c0", 2),  # its event says 0
    ]
    found = check_ops_in_order(log, ledger(ops, c0=1))
    assert found["missing"] == ["#1 cluster.scale c0 2 (after position 1)"]


def test_events_in_another_order_than_acknowledged_are_missing() -> None:
    # c1's create was acknowledged after c0's, but the log has it first.
    log = _log(created("c1", 1), created("c0", 1))
    ops: list[Op] = [("cluster.create", "c0", 1), ("cluster.create", "c1", 1)]
    found = check_ops_in_order(log, ledger(ops))
    assert found["missing"] == ["#1 cluster.create c1 1 (after position 2)"]


@pytest.mark.parametrize(
    ("exc", "unknown", "counted_as"),
    [
        # NATS said nobody was subscribed: the request reached no controller.
        (NoResponders("gpumesh.v1.api.cluster.scale"), False, "no responders"),
        (RequestTimeout("gpumesh.v1.api.cluster.scale", 3.0), True, "no answer"),
        (BusError("request failed: connection closed"), True, "no answer"),
        (TimeoutError(), True, "no answer"),
        (
            ApiError("cluster.scale: unknown cluster 'c1' (known: stable)"),
            False,
            "cluster.scale: unknown cluster 'c1'",
        ),
        (
            ApiError("cluster.scale: cluster 'c1' already exists"),
            False,
            "cluster.scale: cluster 'c1' already exists",
        ),
        (
            ApiError("cluster.scale: the event log failed: deposed"),
            True,
            "cluster.scale: the event log failed: deposed",
        ),
    ],
)
def test_which_failures_leave_the_outcome_unknown(
    exc: BaseException, unknown: bool, counted_as: str
) -> None:
    assert outcome_unknown(exc) is unknown
    assert refusal("cluster.scale", exc) == counted_as
