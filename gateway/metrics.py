"""The gateway's Prometheus plumbing, on the `prometheus_client` library.

Nothing here knows HTTP: the aiohttp app serves `render(registry)` with `CONTENT_TYPE`.

The data path calls the metrics on every request. prometheus_client's `labels()` takes a lock
and checks the label values on each call, which was two thirds of the library's cost per
request (docs/performance.md, Gateway: the metrics registry), so the data path keeps each
child once found (`Children`): then an update is a dict hit and the library's own increment.

Everything runs on one thread (the event loop); scrapes run on it too, between requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.metrics import MetricWrapperBase

# The classic text format: what the output is (and what every Prometheus reads). The library's
# own CONTENT_TYPE_LATEST says version=1.0.0, which older servers do not know.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DEFAULT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
"""Seconds: LLM answers run from milliseconds (embeddings) to minutes (long generations)."""

M = TypeVar("M", bound=MetricWrapperBase)


def new_registry() -> CollectorRegistry:
    """A registry of our own (not the library's global one), without `_created` series: they
    double the output and no dashboard of ours reads them. That switch is the library's, for
    the whole process (a `gpumesh up` runs the controller's metrics beside the gateway's)."""
    disable_created_metrics()  # type: ignore[no-untyped-call]
    return CollectorRegistry()


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


class Children(Generic[M]):
    """`family.labels(*values)`, each child found once and kept (label values are bounded:
    clusters the routing table knows, statuses, reasons, tenants)."""

    __slots__ = ("_children", "_family")

    def __init__(self, family: M) -> None:
        self._family = family
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        try:
            return self._children[values]
        except KeyError:
            child = self._children[values] = self._family.labels(*values)
            return child

    def values(self) -> Iterable[tuple[str, ...]]:
        return self._children.keys()
