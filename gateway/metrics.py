"""A minimal Prometheus registry: counters, gauges, histograms and scrape-time collectors.

No dependency on prometheus_client, and nothing here knows HTTP: the aiohttp app serves
`Registry.render()` with `CONTENT_TYPE`, the simulator reads the same objects directly.

The data path calls these on every request, so the updates are a dict lookup and a float add:

    requests = registry.counter("x_requests_total", "Requests.", ("cluster", "status"))
    requests.inc("chat", "200")              # child found by its label values, created once
    ok = requests.labels("chat", "200")      # or keep the child: ok.inc() is one float add

Label values are checked (count and type) only when a child is created, never on later
updates. Everything runs on one thread (the event loop); nothing is locked.

`render()` writes the text exposition format 0.0.4: families in registration order, then the
collectors' samples; within a family, children sorted by their label values, so the output is
deterministic.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Generic, Literal, NamedTuple, TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DEFAULT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
"""Seconds: LLM answers run from milliseconds (embeddings) to minutes (long generations)."""

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

SampleType = Literal["counter", "gauge", "untyped"]


class Sample(NamedTuple):
    """One value computed at scrape time by a collector.

    Samples that share a name form one family: its `# TYPE` and `# HELP` come from the first
    of them. `labels` is a mapping or a sequence of (name, value) pairs, written in that order.
    """

    name: str
    labels: Mapping[str, str] | Sequence[tuple[str, str]]
    value: float
    type: SampleType = "gauge"
    help: str = ""


def _check_name(name: str) -> None:
    if not _METRIC_NAME.fullmatch(name):
        raise ValueError(f"metric name {name!r}: must match [a-zA-Z_:][a-zA-Z0-9_:]*")


def _check_label_name(metric: str, label: str) -> None:
    if not _LABEL_NAME.fullmatch(label) or label.startswith("__"):
        raise ValueError(
            f"metric {metric}: label name {label!r} must match [a-zA-Z_][a-zA-Z0-9_]* "
            "and not start with __"
        )


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _num(value: float) -> str:
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(value)


def _label_text(pairs: Iterable[tuple[str, str]]) -> str:
    """`a="x",b="y"`: the inside of the braces, escaped."""
    return ",".join(f'{name}="{_escape_label(value)}"' for name, value in pairs)


# -- children: what the data path updates ---------------------------------------------------


class CounterChild:
    __slots__ = ("_labels", "value")

    def __init__(self, labels: str) -> None:
        self._labels = labels
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount


class GaugeChild:
    __slots__ = ("_labels", "value")

    def __init__(self, labels: str) -> None:
        self._labels = labels
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class HistogramChild:
    """`counts[i]` observations fell in bucket i alone (not cumulative); the last is +Inf."""

    __slots__ = ("_bounds", "_labels", "counts", "sum")

    def __init__(self, labels: str, bounds: tuple[float, ...]) -> None:
        self._labels = labels
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


ChildT = TypeVar("ChildT", CounterChild, GaugeChild, HistogramChild)


class _Family(Generic[ChildT]):
    kind: str

    def __init__(self, name: str, help: str, labels: tuple[str, ...]) -> None:
        self.name = name
        self.help = help
        self.label_names = labels
        self._children: dict[tuple[str, ...], ChildT] = {}
        if not labels:
            self._child(())  # a metric without labels exists, at zero, from the start

    def labels(self, *values: str) -> ChildT:
        """The child for these label values (created on first use; keep it to skip the lookup)."""
        try:
            return self._children[values]
        except KeyError:
            return self._child(values)

    def _child(self, values: tuple[str, ...]) -> ChildT:
        if len(values) != len(self.label_names):
            raise ValueError(
                f"metric {self.name}: {len(values)} label values for "
                f"{len(self.label_names)} labels {self.label_names}"
            )
        for value in values:
            if not isinstance(value, str):
                raise TypeError(f"metric {self.name}: label value {value!r} is not a str")
        child = self._new(_label_text(zip(self.label_names, values, strict=True)))
        self._children[values] = child
        return child

    def _new(self, labels: str) -> ChildT:
        raise NotImplementedError

    def _sorted(self) -> list[ChildT]:
        return [self._children[key] for key in sorted(self._children)]

    def _render(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {_escape_help(self.help)}")
        out.append(f"# TYPE {self.name} {self.kind}")
        for child in self._sorted():
            self._render_child(child, out)

    def _render_child(self, child: ChildT, out: list[str]) -> None:
        raise NotImplementedError


class Counter(_Family[CounterChild]):
    kind = "counter"

    def inc(self, *label_values: str, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        try:
            self._children[label_values].value += amount
        except KeyError:
            self._child(label_values).value += amount

    def _new(self, labels: str) -> CounterChild:
        return CounterChild(labels)

    def _render_child(self, child: CounterChild, out: list[str]) -> None:
        braces = f"{{{child._labels}}}" if child._labels else ""
        out.append(f"{self.name}{braces} {_num(child.value)}")


class Gauge(_Family[GaugeChild]):
    kind = "gauge"

    def set(self, value: float, *label_values: str) -> None:
        self.labels(*label_values).value = float(value)

    def inc(self, *label_values: str, amount: float = 1.0) -> None:
        self.labels(*label_values).value += amount

    def dec(self, *label_values: str, amount: float = 1.0) -> None:
        self.labels(*label_values).value -= amount

    def _new(self, labels: str) -> GaugeChild:
        return GaugeChild(labels)

    def _render_child(self, child: GaugeChild, out: list[str]) -> None:
        braces = f"{{{child._labels}}}" if child._labels else ""
        out.append(f"{self.name}{braces} {_num(child.value)}")


class Histogram(_Family[HistogramChild]):
    kind = "histogram"

    def __init__(
        self, name: str, help: str, labels: tuple[str, ...], buckets: Sequence[float]
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds and bounds[-1] == math.inf:
            bounds.pop()  # +Inf is always there
        if not bounds:
            raise ValueError(f"histogram {name}: needs at least one finite bucket")
        if any(math.isnan(b) or math.isinf(b) for b in bounds) or any(
            a >= b for a, b in pairwise(bounds)
        ):
            raise ValueError(f"histogram {name}: buckets must be finite and strictly increasing")
        self.bounds = tuple(bounds)
        self._le = [*(_escape_label(_num(b)) for b in self.bounds), "+Inf"]
        super().__init__(name, help, labels)

    def observe(self, value: float, *label_values: str) -> None:
        try:
            child = self._children[label_values]
        except KeyError:
            child = self._child(label_values)
        child.counts[bisect_left(self.bounds, value)] += 1
        child.sum += value

    def _new(self, labels: str) -> HistogramChild:
        return HistogramChild(labels, self.bounds)

    def _render_child(self, child: HistogramChild, out: list[str]) -> None:
        prefix = f"{child._labels}," if child._labels else ""
        braces = f"{{{child._labels}}}" if child._labels else ""
        cumulative = 0
        for le, count in zip(self._le, child.counts, strict=True):
            cumulative += count
            out.append(f'{self.name}_bucket{{{prefix}le="{le}"}} {cumulative}')
        out.append(f"{self.name}_sum{braces} {_num(child.sum)}")
        out.append(f"{self.name}_count{braces} {cumulative}")


# -- the registry --------------------------------------------------------------------------

ChildFamily = TypeVar("ChildFamily", Counter, Gauge, Histogram)


class Registry:
    def __init__(self) -> None:
        self._families: list[Counter | Gauge | Histogram] = []
        self._series_names: set[str] = set()  # every sample name the families write
        self._collectors: list[Callable[[], Iterable[Sample]]] = []

    def counter(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:
        self._check(name, labels, (name,))
        return self._add(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Gauge:
        self._check(name, labels, (name,))
        return self._add(Gauge(name, help, labels))

    def histogram(
        self,
        name: str,
        help: str,
        labels: tuple[str, ...] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> Histogram:
        if "le" in labels:
            raise ValueError(f"histogram {name}: `le` is reserved for the buckets")
        self._check(name, labels, (f"{name}_bucket", f"{name}_sum", f"{name}_count", name))
        return self._add(Histogram(name, help, labels, buckets))

    def collector(self, fn: Callable[[], Iterable[Sample]]) -> None:
        """`fn` is called at each scrape; its samples follow the registered families.

        Their names must not be those of registered metrics (render raises ValueError)."""
        self._collectors.append(fn)

    def render(self) -> bytes:
        out: list[str] = []
        for family in self._families:
            family._render(out)
        for fn in self._collectors:
            self._render_samples(fn(), out)
        out.append("")
        return "\n".join(out).encode()

    def _check(self, name: str, labels: tuple[str, ...], series: tuple[str, ...]) -> None:
        _check_name(name)
        for label in labels:
            _check_label_name(name, label)
        if len(set(labels)) != len(labels):
            raise ValueError(f"metric {name}: duplicate label names {labels}")
        taken = self._series_names.intersection(series)
        if taken:
            raise ValueError(f"metric {name}: {sorted(taken)[0]} is already registered")
        self._series_names.update(series)

    def _add(self, family: ChildFamily) -> ChildFamily:
        self._families.append(family)
        return family

    def _render_samples(self, samples: Iterable[Sample], out: list[str]) -> None:
        groups: dict[str, list[tuple[tuple[tuple[str, str], ...], Sample]]] = {}
        for sample in samples:
            pairs = tuple(
                sample.labels.items() if isinstance(sample.labels, Mapping) else sample.labels
            )
            groups.setdefault(sample.name, []).append((pairs, sample))
        for name, group in groups.items():
            _check_name(name)
            if name in self._series_names:
                raise ValueError(f"collector sample {name}: a registered metric has this name")
            first = group[0][1]
            if first.help:
                out.append(f"# HELP {name} {_escape_help(first.help)}")
            out.append(f"# TYPE {name} {first.type}")
            group.sort(key=lambda item: item[0])
            for pairs, sample in group:
                for label, _ in pairs:
                    _check_label_name(name, label)
                braces = f"{{{_label_text(pairs)}}}" if pairs else ""
                out.append(f"{name}{braces} {_num(sample.value)}")
