"""docs/metrics.md names every metric the processes write, and the Grafana dashboard reads
only metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from actors.metrics import (
    ControllerCollector,
    LogMetrics,
    StaticSource,
    new_registry as controller_registry,
)
from gateway.metrics import new_registry, render
from nodeagent.metrics import AgentCollector
from projections import FleetState
from tests.actors.test_metrics import FakeClock
from tests.gateway.test_metrics import _router
from tests.nodeagent.test_metrics import FakeAgent

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\bgpumesh_(?:controller|agent|gateway)_[a-z_]+")
SUFFIXES = ("_bucket", "_sum", "_count")


def _families(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        # The parser drops a counter's _total from the family's name; the docs keep it.
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def _written() -> set[str]:
    from prometheus_client import CollectorRegistry

    from gateway.instruments import Instruments

    controller = StaticSource(
        state=FleetState(), is_leader=False, lag=1, log=LogMetrics(FakeClock(0))
    )
    names = _families(
        generate_latest(controller_registry(ControllerCollector(controller))).decode()
    )
    agent = CollectorRegistry()
    agent.register(AgentCollector(FakeAgent()))
    names |= _families(generate_latest(agent).decode())
    gateway = new_registry()
    Instruments(gateway, _router())
    names |= _families(render(gateway).decode())
    return names


def _documented() -> set[str]:
    text = (ROOT / "docs/metrics.md").read_text()
    return {m for m in NAME.findall(text) if not m.endswith(SUFFIXES)}


def test_docs_name_every_metric_and_nothing_else() -> None:
    written = _written()
    assert len(written) > 30
    documented = _documented()
    assert written - documented == set(), "written but not in docs/metrics.md"
    assert documented - written == set(), "in docs/metrics.md but nobody writes it"


def test_the_dashboard_reads_only_documented_metrics() -> None:
    dashboard = json.loads((ROOT / "docs/grafana-gpumesh.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    read = set()
    for expr in exprs:
        for name in NAME.findall(expr):
            for suffix in SUFFIXES:
                name = name.removesuffix(suffix)
            read.add(name)
    assert read - _documented() == set()
    # The panels: heartbeats/s and their lag, nodes by health, replicas by state,
    # GPU temperature, the gateway's requests and latency.
    for wanted in (
        "gpumesh_controller_heartbeats_recorded_total",
        "gpumesh_controller_heartbeat_lag_seconds",
        "gpumesh_controller_nodes",
        "gpumesh_controller_replicas",
        "gpumesh_agent_gpu_temperature_celsius",
        "gpumesh_gateway_requests_total",
        "gpumesh_gateway_request_duration_seconds",
    ):
        assert wanted in read
