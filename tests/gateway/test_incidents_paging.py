"""Paging the incidents through a long log (gateway/ui/incidents.py WindowScan, the rule in its
module docstring): an incident belongs to the window of its first health change and is shown
with it alone, whole, however it straddles the windows' boundaries; no event is drawn twice;
and over logs whose incidents fit in a window, the windows together are `incidents()` of the
whole log. The route that pages with it: tests/gateway/test_ui_routes.py."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient
from hypothesis import given, settings, strategies as st

from events import Envelope, NodeRemoved
from events.codec import decode_envelope
from gateway.auth import KeyRing
from gateway.ui import incidents as incident_model, routes
from gateway.ui.incidents import (
    FOLLOW_WINDOWS,
    Incident,
    WindowScan,
    incidents,
    window_of,
    with_heartbeat,
)
from gateway.ui.timeline import incident_html
from tests.gateway.test_incidents import T0, Log, S, power_loss
from tests.gateway.test_ui_routes import (
    ADMIN,
    HEARTBEAT,
    KEYS,
    ScriptedController,
    bearer,
    embedded,
    serve,
)


def scan(
    envelopes: Sequence[Envelope],
    first: int,
    last: int,
    size: int,
    follow: int = FOLLOW_WINDOWS,
) -> list[Incident]:
    """What the dashboard does with the controller's pages of the log: feed it from its start
    while it wants more."""
    windows = WindowScan(first, last, size=size, follow=follow)
    for envelope in envelopes:
        if envelope.position <= windows.start:
            continue
        if not windows.wanted():
            break
        windows.feed(envelope)
    return windows.incidents()


def every_window(envelopes: Sequence[Envelope], size: int) -> list[Incident]:
    """Each window on its own, oldest first: what paging through the whole log shows."""
    if not envelopes:
        return []
    last = window_of(envelopes[-1].position, size)
    return [i for k in range(last + 1) for i in scan(envelopes, k, k, size)]


def kinds(incident: Incident) -> list[str]:
    return [m.kind for m in incident.marks]


def padded(log: Log, upto: int, node: str = "node-9") -> Log:
    """Heartbeats of a bystander until the log's next position is `upto`."""
    while len(log.envelopes) + 1 < upto:
        log.beat(float(len(log.envelopes)), node)
    return log


def later(log: Log, by: int) -> Log:
    """`log` again, after `by` heartbeats of a bystander."""
    moved = padded(Log(), by + 1)
    for envelope in log.envelopes:
        moved.at((envelope.recorded_at - T0) / S, envelope.payload)
    return moved


# -- the rule, by hand --------------------------------------------------------------------------


def test_an_incident_straddling_a_boundary_is_shown_once_whole_with_the_window_it_began_in() -> (
    None
):
    log = later(power_loss(), 11)
    (whole,) = incidents(log.envelopes)
    suspect = next(m.position for m in whole.marks if m.kind == "suspect")
    ready = max(m.position for m in whole.marks if m.kind == "ready")
    # The boundary just after the first health change: suspect ends window 1, the rest of it
    # (offline, failed, placed, ready, healthy again) lies in window 2.
    size = 20
    assert suspect == 40 and whole.ejections == 1
    assert window_of(suspect, size) == 1 and window_of(suspect + 1, size) == 2
    assert window_of(ready, size) == 2  # within the window after its own: followed whole
    assert scan(log.envelopes, 1, 1, size) == [whole]
    assert scan(log.envelopes, 2, 2, size) == []
    assert scan(log.envelopes, 0, 0, size) == []
    assert every_window(log.envelopes, size) == [whole]
    assert scan(log.envelopes, 0, 3, size) == [whole]


def test_a_health_change_of_a_node_already_down_begins_nothing_in_a_later_window() -> None:
    log = Log()
    log.placed(0, "echo-0", 1, "node-1").ready(1, "echo-0", 1).beat(2, "node-1")
    log.health(3, "node-1", "degraded", "gpu_temperature")  # position 5: window 0
    padded(log, 11)
    log.health(11, "node-1", "unhealthy", "ecc")  # position 11: window 1, still down
    log.failed(11, "echo-0", 1, "node-1", "node_unhealthy")
    log.placed(12, "echo-0", 2, "node-2").ready(13, "echo-0", 2)
    (whole,) = incidents(log.envelopes)
    assert whole.position == 5 and whole.state == "unhealthy"
    size = 10
    # Window 1's fold begins at position 0 (two windows before it): it knows node-1 is down.
    assert scan(log.envelopes, 1, 1, size) == []
    assert scan(log.envelopes, 0, 0, size) == [whole]
    assert every_window(log.envelopes, size) == [whole]


def test_replacements_are_followed_past_the_next_window_but_nothing_else_is() -> None:
    log = Log()
    log.placed(0, "echo-0", 1, "node-1").ready(1, "echo-0", 1).beat(2, "node-1")
    log.health(3, "node-1", "offline")  # position 5: window 0
    log.failed(3, "echo-0", 1, "node-1", "node_offline")
    padded(log, 30)
    # Past the window after its own (positions 11..20): its node's own events are the next
    # windows' business, its replacement is still its own.
    log.health(30, "node-1", "unhealthy", "ecc")
    log.placed(31, "echo-0", 2, "node-2")
    padded(log, 50)
    log.health(50, "node-1", "healthy", "recovered")
    log.ready(51, "echo-0", 2)
    (whole,) = incidents(log.envelopes)
    assert kinds(whole) == [
        "heartbeat", "offline", "failed", "unhealthy", "placed", "healthy", "ready",
    ]  # fmt: skip
    (shown,) = scan(log.envelopes, 0, 0, size=10)
    assert kinds(shown) == ["heartbeat", "offline", "failed", "placed", "ready"]
    assert shown.resolved and shown.recovered_ns == 0 and shown.state == "offline"
    assert shown.moves == whole.moves
    # Only FOLLOW_WINDOWS past that: then it is drawn as it stood.
    (cut,) = scan(log.envelopes, 0, 0, size=10, follow=2)
    assert kinds(cut) == ["heartbeat", "offline", "failed", "placed"] and not cut.resolved
    assert every_window(log.envelopes, 10) == [shown]


def test_a_node_down_through_two_whole_windows_that_changes_again_begins_a_new_incident() -> None:
    """The rule's one cut, as the module docstring says: such a change is judged by a fold that
    cannot know the node was down. Each part is drawn once."""
    log = Log()
    log.placed(0, "echo-0", 1, "node-1").placed(0, "echo-1", 1, "node-1")
    log.health(3, "node-1", "degraded", "gpu_temperature")  # position 3: window 0
    log.failed(3, "echo-0", 1, "node-1", "workload_exited")
    log.placed(4, "echo-0", 2, "node-2")
    padded(log, 35)
    log.health(35, "node-1", "offline")  # position 35: window 3
    log.failed(35, "echo-1", 1, "node-1", "node_offline")
    log.placed(36, "echo-1", 2, "node-2").ready(37, "echo-1", 2)
    (whole,) = incidents(log.envelopes)
    assert [m.replica_id for m in whole.moves] == ["echo-0", "echo-1"]
    first, second = every_window(log.envelopes, 10)
    assert (first.id, [m.replica_id for m in first.moves]) == ("node-1@3", ["echo-0"])
    assert (second.id, [m.replica_id for m in second.moves]) == ("node-1@35", ["echo-1"])
    assert kinds(first) == ["degraded", "failed", "placed"]
    assert kinds(second) == ["offline", "failed", "placed", "ready"]
    assert_shown_once([first, second])


def test_a_scan_stops_reading_once_its_incidents_are_over() -> None:
    log = power_loss()
    padded(log, 500)
    windows = WindowScan(1, 1, size=20)
    fed = 0
    for envelope in log.envelopes[windows.start :]:
        if not windows.wanted():
            break
        windows.feed(envelope)
        fed += 1
    # Through the window after its own (to position 60), not on to the 25 after.
    assert windows.position == 60 and fed == 60
    assert windows.limit == (1 + 2 + FOLLOW_WINDOWS) * 20


def test_ejections_lead_an_incident_from_the_window_before_its_own_at_most() -> None:
    log = Log()
    log.placed(0, "echo-0", 1, "node-1").ready(1, "echo-0", 1)
    log.ejected(2, "echo-0", 1)  # position 4: window 0
    padded(log, 12)
    log.ejected(12, "echo-0", 1)  # position 12: window 1
    padded(log, 21)
    log.health(21, "node-1", "offline")  # position 21: window 2
    log.failed(21, "echo-0", 1, "node-1", "node_offline")
    (whole,) = incidents(log.envelopes)
    assert [m.position for m in whole.marks if m.kind == "ejected"] == [4, 12]
    (shown,) = every_window(log.envelopes, size=10)
    assert [m.position for m in shown.marks if m.kind == "ejected"] == [12]


def test_a_heartbeat_read_back_on_its_own_joins_the_incident() -> None:
    log = power_loss()
    without = [e for e in log.envelopes if e.type != "node.heartbeat.v1"]
    (whole,) = incidents(log.envelopes)
    (bare,) = incidents(without)
    assert bare.last_heartbeat_ns == 0 and "heartbeat" not in kinds(bare)
    beat = next(
        e
        for e in reversed(log.envelopes)
        if e.type == "node.heartbeat.v1"
        and e.position < whole.position
        and e.stream == "heartbeat/node-1"
    )
    assert with_heartbeat(bare, beat) == whole
    assert with_heartbeat(whole, beat) == whole
    assert whole.last_heartbeat_ns == T0 + 10 * S


# -- over random logs ---------------------------------------------------------------------------

NODES = ["node-1", "node-2", "node-3"]
REPLICAS = ["a-0", "a-1", "b-0"]
STEP = st.one_of(
    st.tuples(st.just("beat"), st.sampled_from(NODES)),
    st.tuples(
        st.just("health"),
        st.sampled_from(NODES),
        st.sampled_from(["healthy", "suspect", "offline", "unhealthy", "degraded"]),
    ),
    st.tuples(st.just("placed"), st.sampled_from(REPLICAS), st.sampled_from(NODES)),
    st.tuples(
        st.just("failed"),
        st.sampled_from(REPLICAS),
        st.sampled_from(["node_offline", "node_unhealthy", "workload_exited"]),
    ),
    st.tuples(st.just("ready"), st.sampled_from(REPLICAS)),
    st.tuples(st.just("ejected"), st.sampled_from(REPLICAS)),
    st.tuples(st.just("removed"), st.sampled_from(NODES)),
)


def random_log(steps: list[tuple[str, ...]]) -> Log:
    """Any order of events, as far as the controller keeps its own rules: a replica's epochs
    only grow, and an epoch fails once (a failed epoch is over)."""
    log = Log()
    epoch: defaultdict[str, int] = defaultdict(int)
    where: defaultdict[str, str] = defaultdict(str)
    failed: set[tuple[str, int]] = set()
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
            case ("failed", replica, reason):
                if epoch[replica] and (replica, epoch[replica]) not in failed:
                    failed.add((replica, epoch[replica]))
                    log.failed(t, replica, epoch[replica], where[replica], reason)
            case ("ready", replica):
                if epoch[replica]:
                    log.ready(t, replica, epoch[replica])
            case ("ejected", replica):
                if epoch[replica]:
                    log.ejected(t, replica, epoch[replica])
            case ("removed", node):
                log.at(t, NodeRemoved(node_id=node, reason="gone"))
    return log


def assert_shown_once(shown: list[Incident]) -> None:
    ids = Counter(i.id for i in shown)
    assert all(n == 1 for n in ids.values()), ids
    # Every event drawn, in one incident at most (a last heartbeat may lead two of a node).
    drawn = Counter(m.position for i in shown for m in i.marks if m.kind != "heartbeat")
    assert all(n == 1 for n in drawn.values()), [p for p, n in drawn.items() if n > 1]


@settings(max_examples=400, deadline=None)
@given(st.lists(STEP, max_size=70), st.integers(1, 12), st.integers(0, 3))
def test_no_incident_and_no_event_is_shown_twice_across_the_windows(
    steps: list[tuple[str, ...]], size: int, follow: int
) -> None:
    log = random_log(steps)
    if not log.envelopes:
        return
    last = window_of(log.envelopes[-1].position, size)
    shown = [i for k in range(last + 1) for i in scan(log.envelopes, k, k, size, follow)]
    assert_shown_once(shown)
    for incident in shown:
        assert incident.moves
        positions = [m.position for m in incident.marks]
        assert positions == sorted(positions)
    # A scan of several windows finds what each finds alone.
    assert scan(log.envelopes, 0, last, size, follow) == shown


Lane = list[tuple[str, ...]]


@st.composite
def fleet_logs(draw: st.DrawFn) -> tuple[Log, int]:
    """Node losses of three nodes, each lane one node's in turn, interleaved at random: a lane's
    incident begins with its replica placed and ends with the node healthy again (or
    removed). Returns the log and the longest span of one incident in it."""
    lanes: dict[str, list[Lane]] = {}
    count = 0
    for node in NODES:
        blocks: list[Lane] = []
        for _ in range(draw(st.integers(0, 3))):
            count += 1
            replica = f"{node[-1]}x{count}-0"
            other = draw(st.sampled_from([n for n in NODES if n != node]))
            block: Lane = [("placed", replica, node), ("ready", replica), ("beat", node)]
            if draw(st.booleans()):
                block.append(("ejected", replica))
            block += [("health", node, "suspect")]
            if draw(st.booleans()):
                block += [("health", node, "offline"), ("failed", replica, "node_offline")]
            else:
                block += [("health", node, "unhealthy"), ("failed", replica, "node_unhealthy")]
            block += [("placed", replica, other)]
            if draw(st.booleans()):
                block.append(("ready", replica))
            block.append(draw(st.sampled_from([("health", node, "healthy"), ("removed", node)])))
            blocks.append(block)
        lanes[node] = blocks
    queues = {node: [step for block in blocks for step in block] for node, blocks in lanes.items()}
    starts = {node: [len(block) for block in blocks] for node, blocks in lanes.items()}
    steps: list[tuple[str, ...]] = []
    spans: list[int] = []
    taken = dict.fromkeys(NODES, 0)
    begun: dict[str, int] = {}
    while any(queues.values()):
        node = draw(st.sampled_from([n for n in NODES if queues[n]]))
        if node not in begun:
            begun[node] = len(steps)
        steps.append(queues[node].pop(0))
        taken[node] += 1
        if taken[node] == starts[node][0]:
            spans.append(len(steps) - begun.pop(node))
            starts[node].pop(0)
            taken[node] = 0
        if draw(st.integers(0, 4)) == 0:
            steps.append(("beat", "node-9"))
    return random_log(steps), max(spans, default=1)


@settings(max_examples=300, deadline=None)
@given(fleet_logs(), st.integers(0, 8))
def test_the_windows_together_are_the_whole_logs_incidents_when_each_fits_in_a_window(
    drawn: tuple[Log, int], extra: int
) -> None:
    log, span = drawn
    size = span + extra
    whole = incidents(log.envelopes)
    shown = every_window(log.envelopes, size)
    assert shown == whole
    assert_shown_once(shown)


# -- the route that pages with it ---------------------------------------------------------------


@pytest.fixture
def controller(monkeypatch: pytest.MonkeyPatch) -> ScriptedController:
    monkeypatch.setattr(incident_model, "WINDOW", 10)
    monkeypatch.setattr(routes, "MAX_INCIDENTS", 3)
    return ScriptedController()


@pytest.fixture
async def client(controller: ScriptedController) -> AsyncIterator[TestClient[Any, Any]]:
    client = await serve(controller, KeyRing.from_mapping(KEYS))
    try:
        yield client
    finally:
        await client.close()


def node_lost(controller: ScriptedController, node: str, replica: str, other: str) -> None:
    """A node lost with its replica, the replica moved and ready again, the node back: nine
    positions."""

    def replica_event(type_: str, **payload: Any) -> None:
        controller.commit(type_, f"replica/{replica}", replica_id=replica, **payload)

    def health(state: str, reason: str) -> None:
        controller.commit(
            "node.health_changed.v1", f"node/{node}", node_id=node, state=state, reason=reason
        )

    replica_event("replica.placed.v1", cluster="echo", node_id=node, epoch=1)
    replica_event("replica.ready.v1", epoch=1, address="http://10.0.0.1:8000")
    controller.commit(HEARTBEAT, f"heartbeat/{node}", node_id=node, seq=1)
    health("suspect", "missed_heartbeats")
    health("offline", "missed_heartbeats")
    replica_event(
        "replica.failed.v1", epoch=1, reason="node_offline", detail=f"node {node} is offline"
    )
    replica_event("replica.placed.v1", cluster="echo", node_id=other, epoch=2)
    replica_event("replica.ready.v1", epoch=2, address="http://10.0.0.2:8000")
    health("healthy", "recovered")


def quiet(controller: ScriptedController, positions: int) -> None:
    for seq in range(positions):
        controller.commit(HEARTBEAT, "heartbeat/node-0", node_id="node-0", seq=seq)


async def get(client: TestClient[Any, Any], url: str) -> dict[str, Any]:
    resp = await client.get(url, headers=bearer(ADMIN))
    assert resp.status == 200, await resp.text()
    body: dict[str, Any] = await resp.json()
    return body


async def test_older_pages_show_every_incident_of_the_log_once_back_to_its_start(
    client: TestClient[Any, Any], controller: ScriptedController
) -> None:
    quiet(controller, 3)
    for i in range(5):  # nine positions each, in windows of ten: most straddle a boundary
        node_lost(controller, f"node-{1 + i % 2}", f"echo-{i}", "node-0")
        quiet(controller, i)
    quiet(controller, 400)  # forty windows with no incident: more than one page looks through
    for i in range(5, 8):
        node_lost(controller, "node-1", f"echo-{i}", "node-0")
        quiet(controller, 2)
    envelopes = [decode_envelope(msgspec.json.encode(e)) for e in controller.log]
    whole = incidents(envelopes)
    assert len(whole) == 8 and all(i.last_heartbeat_ns for i in whole)

    pages = [await get(client, "/ui/data/incidents")]
    while pages[-1]["older"]:
        before = pages[-1]["older"]
        page = await get(client, f"/ui/data/incidents?before={before}")
        assert page["before"] == before and page["older"] < before
        pages.append(page)
    # Newest first, each once, each as the whole log draws it: its last heartbeat read back.
    assert "".join(p["html"] for p in pages) == "".join(incident_html(i) for i in whole[::-1])
    # The first page: its two windows; an older one: the first windows back that hold one,
    # three at most (MAX_INCIDENTS here), the next page then those that began before those.
    assert [p["count"] for p in pages] == [1, 2, 0, 3, 1, 1]
    cut = [i for i in whole if i.position < pages[3]["before"]][-3]
    assert pages[3]["older"] == cut.position
    first, *_ = pages
    assert first["before"] is None and first["head"] == len(controller.log)
    shown = [e for e in controller.log if e["type"] != HEARTBEAT and e["position"] > 480]
    assert (first["from_ns"], first["to_ns"]) == (
        shown[0]["recorded_at"],
        shown[-1]["recorded_at"],
    )
    empty = pages[2]  # the quiet stretch: 32 windows looked through, then a link on
    assert empty["html"] == "" and empty["older"] == pages[1]["older"] - 32 * 10

    # The page itself: drawn in the HTML, with what the script needs to link on.
    resp = await client.get(f"/ui/incidents?before={pages[3]['before']}", headers=bearer(ADMIN))
    text = await resp.text()
    data = embedded(text)["data"]
    assert data["before"] == pages[3]["before"] and data["older"] == pages[3]["older"]
    assert data["count"] == 3 and text.count('<section class="incident"') == 3


async def test_a_bad_before_is_refused(client: TestClient[Any, Any]) -> None:
    for query in ("before=0", "before=-5", "before=x"):
        for path in ("/ui/data/incidents", "/ui/incidents"):
            resp = await client.get(f"{path}?{query}", headers=bearer(ADMIN))
            assert resp.status == 400, (path, query)
            assert (await resp.json())["error"]["type"] == "invalid_request"


async def test_a_page_of_a_log_with_no_incidents_has_no_older_link(
    client: TestClient[Any, Any], controller: ScriptedController
) -> None:
    assert (await get(client, "/ui/data/incidents"))["older"] == 0  # an empty log
    quiet(controller, 15)
    page = await get(client, "/ui/data/incidents")
    assert (page["count"], page["older"], page["html"]) == (0, 0, "")
    quiet(controller, 100)
    page = await get(client, "/ui/data/incidents")
    # Head 115: windows 10 and 11 (positions 101..120) shown, older ones began at 100 or before.
    assert page["older"] == 101
    older = await get(client, "/ui/data/incidents?before=101")
    assert (older["count"], older["older"]) == (0, 0)  # back to the start: no link on
