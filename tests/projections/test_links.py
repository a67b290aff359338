"""The link view (projections/links.py): measurements folded both ways, failures ignored."""

from __future__ import annotations

from events import LinkMeasurement, NodeLinksMeasured, NodeRemoved, stream_of
from projections import fleet
from tests.strategies import commit


def test_a_measurement_is_the_link_both_ways_and_a_failure_keeps_the_last() -> None:
    log = commit(
        [
            NodeLinksMeasured(
                node_id="n1",
                endpoint="10.0.0.1:7400",
                links=(
                    LinkMeasurement(peer="n2", rtt_ms=0.4, gbps=9.5),
                    LinkMeasurement(peer="n3", error="connection refused"),
                ),
            ),
            NodeLinksMeasured(node_id="n2", links=(LinkMeasurement(peer="n1", error="timed out"),)),
        ]
    )
    state = fleet.rebuild(log)
    assert stream_of(log[0].payload) == "links/n1"  # type: ignore[arg-type]
    assert state.links.endpoints == {"n1": "10.0.0.1:7400"}
    one, other = state.links.link("n1", "n2"), state.links.link("n2", "n1")
    assert one is not None and one == other
    assert (one.rtt_ms, one.gbps, one.measured_by, one.position) == (0.4, 9.5, "n1", 1)
    assert state.links.link("n1", "n3") is None


def test_a_removed_node_takes_its_links_and_endpoint_with_it() -> None:
    state = fleet.rebuild(
        commit(
            [
                NodeLinksMeasured(
                    node_id="n1",
                    endpoint="h:1",
                    links=(LinkMeasurement(peer="n2", rtt_ms=1, gbps=1),),
                ),
                NodeLinksMeasured(
                    node_id="n3", links=(LinkMeasurement(peer="n1", rtt_ms=2, gbps=1),)
                ),
                NodeRemoved(node_id="n1"),
            ]
        )
    )
    assert state.links.endpoints == {}
    assert state.links.link("n2", "n1") is None and state.links.link("n3", "n1") is None
    assert state.links.links == {"n2": {}, "n3": {}}
