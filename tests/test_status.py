"""`gpumesh status`: the data and the screen from a fixed set of control API answers, and the
live loop's refreshes on a bus with no stack behind it (no terminal, no NATS)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from rich.console import Console

from events.contract import subjects
from events.contract.messages import ApiReply
from gpumesh import status
from gpumesh.cli import build_parser
from runtime.env import Msg

T0 = 1_700_000_000_000_000_000  # 2023-11-14T22:13:20Z

NODES: list[dict[str, Any]] = [
    {
        "node_id": "node-0",
        "region": "eu-west",
        "health": "healthy",
        "health_reason": "registered",
        "drained": False,
        "gpus": [
            {"index": 0, "uuid": "GPU-a", "model": "RTX4090", "vram_mib": 24576},
            {"index": 1, "uuid": "GPU-b", "model": "RTX4090", "vram_mib": 24576},
        ],
        "metrics": [{"index": 0, "temperature_c": 41.0}, {"index": 1, "temperature_c": 67.4}],
    },
    {
        "node_id": "node-1",
        "region": "",
        "health": "degraded",
        "health_reason": "thermal",
        "drained": True,
        "gpus": [{"index": 0, "uuid": "GPU-c", "model": "A100", "vram_mib": 81920}],
        "metrics": [],
    },
]
CLUSTERS: list[dict[str, Any]] = [
    {
        "name": "echo",
        "desired": 2,
        "ready": 1,
        "revision": 3,
        "rolled_out": 3,
        "unschedulable": "",
        "spec": {},
        "replicas": [
            {"replica_id": "echo-0", "node_id": "node-0", "epoch": 2, "status": "ready"},
            {"replica_id": "echo-1", "node_id": "", "epoch": 1, "status": "pending"},
        ],
    },
    {
        "name": "llama",
        "desired": 1,
        "ready": 0,
        "revision": 1,
        "unschedulable": "no node has 2 free A100 GPUs",
        "replicas": [],
    },
]
EVENTS: list[dict[str, Any]] = [
    {
        "event_id": "e1",
        "stream": "node/node-1",
        "version": 4,
        "position": 41,
        "type": "node.health_changed.v1",
        "recorded_at": T0,
        "payload": {
            "type": "node.health_changed.v1",
            "node_id": "node-1",
            "health": "degraded",
            "reason": "thermal",
            "detail": "",
        },
    },
    {
        "event_id": "e2",
        "stream": "replica/echo-0",
        "version": 2,
        "position": 42,
        "type": "replica.placed.v1",
        "recorded_at": T0 + 1_000_000_000,
        "payload": {"replica_id": "echo-0", "epoch": 2, "gpu_ids": [0], "candidates": [{}, {}]},
    },
]


def _data() -> dict[str, Any]:
    return status.summarise(
        NODES, CLUSTERS, EVENTS, nats="nats://127.0.0.1:4222", taken_at_ns=T0 + 2_000_000_000
    )


def test_the_data_is_one_row_per_node_cluster_replica_and_event() -> None:
    data = _data()
    assert json.loads(msgspec.json.encode(data)) == data  # what --json prints, unchanged
    assert set(data) == {"nats", "taken_at", "error", "nodes", "clusters", "replicas", "events"}
    assert data["nodes"][0] == {
        "node_id": "node-0",
        "health": "healthy",
        "health_reason": "registered",
        "region": "eu-west",
        "gpus": 2,
        "gpu_models": ["RTX4090"],
        "max_temperature_c": 67.4,
        "drained": False,
    }
    assert data["nodes"][1]["max_temperature_c"] is None and data["nodes"][1]["drained"]
    assert data["clusters"] == [
        {"name": "echo", "ready": 1, "desired": 2, "revision": 3, "unschedulable": ""},
        {
            "name": "llama",
            "ready": 0,
            "desired": 1,
            "revision": 1,
            "unschedulable": "no node has 2 free A100 GPUs",
        },
    ]
    assert data["replicas"] == [
        {"replica_id": "echo-0", "cluster": "echo", "epoch": 2, "status": "ready",
         "node_id": "node-0"},
        {"replica_id": "echo-1", "cluster": "echo", "epoch": 1, "status": "pending",
         "node_id": ""},
    ]  # fmt: skip
    assert [(e["position"], e["type"]) for e in data["events"]] == [
        (41, "node.health_changed.v1"),
        (42, "replica.placed.v1"),
    ]
    # The payload's salient fields: no type tag, no empty field, nested lists as a count.
    assert data["events"][0]["detail"] == "node_id=node-1 health=degraded reason=thermal"
    assert data["events"][1]["detail"] == "replica_id=echo-0 epoch=2 gpu_ids=0 candidates=[2]"


def test_the_plain_screen_has_the_right_rows() -> None:
    text = status.render_text(_data())
    rows = [line.split() for line in text.splitlines()]
    assert text.startswith("gpumesh status  nats://127.0.0.1:4222  at 22:13:22 UTC\n")
    assert ["node-0", "healthy", "registered", "eu-west", "2", "RTX4090", "67", "C", "no"] in rows
    assert ["node-1", "degraded", "thermal", "-", "1", "A100", "-", "yes"] in rows
    assert ["echo", "1/2", "3", "-"] in rows
    assert ["llama", "0/1", "1", "no", "node", "has", "2", "free", "A100", "GPUs"] in rows
    assert ["echo-0", "echo", "2", "ready", "node-0"] in rows
    assert ["echo-1", "echo", "1", "pending", "-"] in rows
    assert ["41", "22:13:20", "node/node-1", "node.health_changed.v1", "node_id=node-1",
            "health=degraded", "reason=thermal"] in rows  # fmt: skip
    titles = [line for line in text.splitlines() if line and not line[0].isspace()]
    for title in ("nodes (2)", "clusters (2)", "replicas (2)", "last 2 events"):
        assert title in titles
    assert "─" not in text and "\x1b" not in text  # plain: no box drawing, no escapes


def test_the_terminal_screen_has_the_same_rows_in_colour() -> None:
    console = Console(record=True, width=160, force_terminal=True, color_system="truecolor")
    console.print(status.render(_data()))
    assert "\x1b[" in console.export_text(clear=False, styles=True)  # coloured health, readiness
    rows = [line.split() for line in console.export_text().splitlines()]
    assert ["node-1", "degraded", "thermal", "-", "1", "A100", "-", "yes"] in rows
    assert ["echo-0", "echo", "2", "ready", "node-0"] in rows


def test_an_error_and_an_empty_fleet_still_render() -> None:
    data = status.summarise([], [], [], nats="nats://x", error="no controller is answering")
    text = status.render_text(data)
    assert "error: no controller is answering" in text
    assert "nodes (0)" in text and "last 0 events" in text


def test_status_has_help_and_its_flags() -> None:
    args = build_parser().parse_args(["status", "--once", "--json", "--nats", "nats://a:1"])
    assert (args.once, args.json, args.nats, args.events) == (True, True, "nats://a:1", 10)
    assert args.handler is status.run_status
    assert not getattr(args, "daemon", False)


# -- the live loop, on a bus that answers from the fixed set ----------------------------------


class FakeBus:
    """Answers the three read verbs; an event is a call to `handler`."""

    def __init__(self) -> None:
        self.clusters: list[dict[str, Any]] = []
        self.handler: Any = None
        self.asked: list[str] = []

    async def request(self, subject: str, data: bytes, *, timeout: float) -> Msg:
        verb = subject.removeprefix(f"{subjects.PREFIX}.api.")
        self.asked.append(verb)
        body = msgspec.json.decode(data)
        if verb == "node.list":
            answer: Any = NODES
        elif verb == "cluster.list":
            answer = self.clusters
        else:
            after = body["after"]
            found = [e for e in EVENTS if e["position"] > after][: body["limit"]]
            answer = {"events": found, "next": found[-1]["position"] if found else after,
                      "head": 42}  # fmt: skip
        return Msg(subject=subject, data=msgspec.json.encode(ApiReply(ok=True, data=answer)))

    async def subscribe(self, subject: str, *, handler: Any) -> Any:
        assert subject == subjects.EVENTS_ALL
        self.handler = handler
        bus = self

        class Subscription:
            async def unsubscribe(self) -> None:
                bus.handler = None

        return Subscription()


async def test_the_live_loop_refreshes_on_an_event_not_before() -> None:
    bus = FakeBus()
    shown: list[dict[str, Any]] = []
    changed = asyncio.Event()

    def show(data: dict[str, Any]) -> None:
        shown.append(data)
        changed.set()

    source = status.StatusSource(bus, "nats://fake")
    async with asyncio.TaskGroup() as tg:
        loop = tg.create_task(status.watch(bus, source, show, debounce_s=0.01, idle_s=60))
        await asyncio.wait_for(changed.wait(), 5)
        assert [c["name"] for c in shown[-1]["clusters"]] == []
        assert [e["position"] for e in shown[-1]["events"]] == [41, 42]
        await asyncio.sleep(0.1)
        assert len(shown) == 1  # nothing happened: no refresh
        changed.clear()
        bus.clusters = CLUSTERS
        for _ in range(5):  # a burst of events: one refresh (debounced)
            bus.handler(Msg(subject=f"{subjects.PREFIX}.events.cluster.echo", data=b"{}"))
        await asyncio.wait_for(changed.wait(), 5)
        await asyncio.sleep(0.1)
        assert len(shown) == 2
        assert [c["name"] for c in shown[-1]["clusters"]] == ["echo", "llama"]
        assert [e["position"] for e in shown[-1]["events"]] == [41, 42]  # none twice
        loop.cancel()
    assert bus.handler is None  # unsubscribed on the way out


async def test_a_controller_that_stops_answering_shows_as_an_error() -> None:
    bus = FakeBus()

    async def refuse(subject: str, data: bytes, *, timeout: float) -> Msg:
        return Msg(subject=subject, data=msgspec.json.encode(ApiReply(ok=False, error="nope")))

    bus.request = refuse  # type: ignore[method-assign]
    shown: list[dict[str, Any]] = []
    source = status.StatusSource(bus, "nats://fake")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await status.watch(bus, source, shown.append, debounce_s=0.01, idle_s=0.05)
    assert shown and all(d["error"] == "nope" for d in shown)
    assert len(shown) < 10  # every idle_s, not a busy loop
