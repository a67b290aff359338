"""Failure scenarios as TOML files (sim/scenarios/*.toml): a fleet, clusters, traffic, faults.

    name = "power-outage"
    duration_s = 300            # virtual seconds of the run (faults stop by then)
    buggify = false             # true: the code's named fault sites misbehave (seed-chosen)
    settle_s = 120              # then this long with no fault: liveness is checked at the end
    controllers = 1             # 2 or more: standbys under a leader lease (sim/controllers.py)

    [fleet]
    nodes = 10
    gpus = "RTX4090:24GiB:2"    # each node's fake GPUs, MODEL:VRAM:COUNT[,...]
    regions = ["eu-west", "us-east"]

    [[clusters]]
    name = "llama"
    replicas = 3
    at_s = 0                    # when it is deployed (default: at the start)

    [clusters.autoscale]        # optional: the spec's [autoscale] section (docs/autoscaling.md)
    min = 1
    max = 6

    [traffic]
    rate_per_s = 5              # client requests per second, per cluster (0: none)
    shape = "steady"            # or "ramp", "spike", "diurnal" (TrafficShape)
    peak_per_s = 40             # ramp: the rate reached; spike: the rate during; diurnal: the peak
    at_s = 120                  # ramp, spike: when it begins (run time)
    for_s = 60                  # ramp: how long it climbs; spike: how long it lasts
    period_s = 600              # diurnal: one "day"

    [[faults]]
    at_s = 60
    kind = "power_loss"         # see FAULT_KINDS
    nodes = "30%"               # a share of the nodes, a count ("2"), or names ["node-3"]
    duration_s = 60             # how long until it ends (power back, partition healed...)

The nodes a fault hits are drawn from the run's seed at the moment it fires, so one scenario
explores different victims per seed, and a seed always picks the same ones.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import msgspec

from actors.spec import SpecError, validate_autoscale, validate_sharding
from events import AutoscaleSpec, ShardingSpec

FaultKind = Literal[
    "power_loss",  # the agent and its workloads vanish; back after duration_s (if given)
    "hang",  # the agent freezes (SIGSTOP): no heartbeats, no commands; workloads keep serving
    "partition",  # the node is cut off from NATS and from the gateway
    "one_way_partition",  # the node hears the controller but nothing it sends arrives
    "flap",  # the node's network goes down and up every `period_s`
    "slow",  # the node's links get `latency_s` of extra delay
    "thermal",  # GPUs at `value` degrees C
    "ecc",  # uncorrectable ECC errors
    "driver",  # the NVIDIA driver stops answering
    "crash_loop",  # every workload on the node exits at once, again and again
    "controller_crash",  # the controller dies; restarted after duration_s, rebuilt from the log
    "nats_outage",  # the NATS server is down for everybody
    "gateway_partition",  # the gateway loses NATS (its table goes stale) but still reaches nodes
    "controller_partition",  # the controller loses NATS; it runs on, hearing and telling nobody
    "churn",  # `count` nodes leave and `count` new ones join, every `period_s`
    "leader_crash",  # the leading controller dies (SIGKILL); restarted after duration_s, if given
    "leader_pause",  # the leading controller freezes (SIGSTOP) for duration_s, then goes on
    "nats_server_loss",  # one NATS server of 3 dies: its clients reconnect to another in 1-2 s
]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)
NODE_FAULTS = frozenset(FAULT_KINDS) - {
    "controller_crash",
    "nats_outage",
    "gateway_partition",
    "controller_partition",
    "churn",
    "leader_crash",
    "leader_pause",
    "nats_server_loss",
}


class ScenarioError(ValueError):
    """A scenario file that cannot be run: one line, `file: field: problem`."""


DEFAULT_GPUS = "RTX4090:24GiB:2"


@dataclass(frozen=True, slots=True)
class Fleet:
    nodes: int = 5
    gpus: str = DEFAULT_GPUS
    regions: tuple[str, ...] = ("eu-west",)


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    name: str
    replicas: int = 2
    gpu_model: str = ""
    gpu_count: int = 1
    at_s: float = 0.0  # when it is created (a deploy in the middle of the run)
    autoscale: AutoscaleSpec | None = None
    sharding: ShardingSpec | None = None  # the spec's [sharding]: a model placed by its memory


TrafficKind = Literal["steady", "ramp", "spike", "diurnal"]
TRAFFIC_KINDS: tuple[str, ...] = get_args(TrafficKind)


@dataclass(frozen=True, slots=True)
class TrafficShape:
    """Requests per second per cluster as a function of the run's time, so that scenarios
    drive the autoscaler: a ramp, a spike, a day's swell and ebb."""

    kind: TrafficKind = "steady"
    rate_per_s: float = 0.0  # the base rate (steady: the only one)
    peak_per_s: float = 0.0
    at_s: float = 0.0
    for_s: float = 60.0
    period_s: float = 600.0

    def rate(self, t: float) -> float:
        base, peak = self.rate_per_s, self.peak_per_s
        if self.kind == "ramp":
            if t <= self.at_s:
                return base
            return base + (peak - base) * min(1.0, (t - self.at_s) / self.for_s)
        if self.kind == "spike":
            return peak if self.at_s <= t < self.at_s + self.for_s else base
        if self.kind == "diurnal":
            # Trough at 0 and at each period's end, peak at its middle.
            swell = (1.0 - math.cos(2.0 * math.pi * t / self.period_s)) / 2.0
            return base + (peak - base) * swell
        return base

    def peak(self) -> float:
        return self.rate_per_s if self.kind == "steady" else max(self.rate_per_s, self.peak_per_s)


@dataclass(frozen=True, slots=True)
class FaultPlan:
    at_s: float
    kind: FaultKind
    nodes: str = "1"  # "30%", "2", or comma-separated names
    duration_s: float | None = None
    value: float = 0.0  # thermal: degrees C
    period_s: float = 5.0  # flap, churn
    latency_s: float = 0.5  # slow
    count: int = 1  # churn


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    duration_s: float
    settle_s: float = 120.0
    description: str = ""
    fleet: Fleet = field(default_factory=Fleet)
    clusters: tuple[ClusterPlan, ...] = ()
    rate_per_s: float = 0.0
    faults: tuple[FaultPlan, ...] = ()
    traffic: TrafficShape = field(default_factory=TrafficShape)  # rate_per_s's shape
    buggify: bool = False  # turn on a seed-chosen share of the code's fault-injection sites
    controllers: int = 1  # more than 1: standbys under the leader lease (sim/controllers.py)

    def traffic_shape(self) -> TrafficShape:
        """The shape clients send at: a scenario made in code with only `rate_per_s` is
        steady at that rate."""
        if self.traffic.kind == "steady":
            return TrafficShape(rate_per_s=self.rate_per_s)
        return self.traffic

    def with_faults(self, faults: tuple[FaultPlan, ...]) -> Scenario:
        from dataclasses import replace

        return replace(self, faults=faults)


def load(path: Path) -> Scenario:
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    try:
        return from_mapping(raw, default_name=path.stem)
    except ScenarioError as exc:
        raise ScenarioError(f"{path}: {exc}") from None


def from_mapping(raw: dict[str, Any], *, default_name: str = "scenario") -> Scenario:
    _only(raw, "", {"name", "description", "duration_s", "settle_s", "fleet", "clusters",
                    "traffic", "faults", "buggify", "controllers"})  # fmt: skip
    fleet_raw = _table(raw, "fleet")
    _only(fleet_raw, "fleet.", {"nodes", "gpus", "regions"})
    fleet = Fleet(
        nodes=_int(fleet_raw, "fleet.nodes", "nodes", 5, low=1, high=100_000),
        gpus=_str(fleet_raw, "fleet.gpus", "gpus", DEFAULT_GPUS),
        regions=tuple(_strs(fleet_raw, "fleet.regions", "regions", ["eu-west"])),
    )
    clusters = []
    for i, c in enumerate(_tables(raw, "clusters")):
        where = f"clusters[{i}]."
        _only(c, where, {"name", "replicas", "gpu_model", "gpu_count", "at_s", "autoscale",
                         "sharding"})  # fmt: skip
        name = _str(c, where + "name", "name", "")
        if not name:
            raise ScenarioError(f"{where}name: required")
        clusters.append(
            ClusterPlan(
                name=name,
                replicas=_int(c, where + "replicas", "replicas", 2, low=0, high=1000),
                gpu_model=_str(c, where + "gpu_model", "gpu_model", ""),
                gpu_count=_int(c, where + "gpu_count", "gpu_count", 1, low=1, high=16),
                at_s=_float(c, where + "at_s", "at_s", 0.0, low=0.0),
                autoscale=_autoscale(c, where),
                sharding=_sharding(c, where),
            )
        )
    names = [c.name for c in clusters]
    if len(set(names)) != len(names):
        raise ScenarioError("clusters: two clusters share a name")
    traffic = _table(raw, "traffic")
    _only(traffic, "traffic.", {"rate_per_s", "shape", "peak_per_s", "at_s", "for_s", "period_s"})
    rate = _float(traffic, "traffic.rate_per_s", "rate_per_s", 0.0, low=0.0)
    kind = traffic.get("shape", "steady")
    if kind not in TRAFFIC_KINDS:
        raise ScenarioError(
            f"traffic.shape: must be one of {', '.join(TRAFFIC_KINDS)}, got {kind!r}"
        )
    shape = TrafficShape(
        kind=kind,
        rate_per_s=rate,
        peak_per_s=_float(traffic, "traffic.peak_per_s", "peak_per_s", rate, low=0.0),
        at_s=_float(traffic, "traffic.at_s", "at_s", 0.0, low=0.0),
        for_s=_float(traffic, "traffic.for_s", "for_s", 60.0, low=0.001),
        period_s=_float(traffic, "traffic.period_s", "period_s", 600.0, low=1.0),
    )
    duration = _float(raw, "duration_s", "duration_s", 300.0, low=1.0)
    faults = tuple(
        _fault(f, f"faults[{i}].", duration) for i, f in enumerate(_tables(raw, "faults"))
    )
    return Scenario(
        name=_str(raw, "name", "name", default_name),
        description=_str(raw, "description", "description", ""),
        duration_s=duration,
        settle_s=_float(raw, "settle_s", "settle_s", 120.0, low=0.0),
        fleet=fleet,
        clusters=tuple(clusters),
        rate_per_s=shape.peak(),
        traffic=shape,
        faults=tuple(sorted(faults, key=lambda f: f.at_s)),
        buggify=_bool(raw, "buggify", False),
        controllers=_int(raw, "controllers", "controllers", 1, low=1, high=5),
    )


def _sharding(raw: dict[str, Any], where: str) -> ShardingSpec | None:
    """A cluster's `[clusters.sharding]` table: the spec's `[sharding]` section, checked by
    the spec's own rules (docs/sharding.md)."""
    if "sharding" not in raw:
        return None
    table = _table(raw, "sharding")
    if isinstance(table.get("parallelism"), list):
        table = {**table, "parallelism": tuple(table["parallelism"])}
    try:
        sharding = msgspec.convert(table, ShardingSpec)
        validate_sharding(sharding)
    except (msgspec.ValidationError, SpecError) as exc:
        raise ScenarioError(f"{where}sharding: {exc}") from None
    return sharding


def _autoscale(raw: dict[str, Any], where: str) -> AutoscaleSpec | None:
    """A cluster's `[clusters.autoscale]`, checked as `cluster create` checks the spec's."""
    table = raw.get("autoscale")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ScenarioError(f"{where}autoscale: must be a table")
    _only(table, where + "autoscale.", _AUTOSCALE_KEYS)
    try:
        spec = msgspec.convert(table, AutoscaleSpec, strict=True)
        validate_autoscale(spec)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{where}autoscale: {exc}") from None
    except SpecError as exc:
        raise ScenarioError(f"{where}{exc}") from None
    return spec


_AUTOSCALE_KEYS = {f.encode_name for f in msgspec.structs.fields(AutoscaleSpec)}


def _fault(raw: dict[str, Any], where: str, duration: float) -> FaultPlan:
    _only(raw, where, {"at_s", "kind", "nodes", "duration_s", "value", "period_s", "latency_s",
                       "count"})  # fmt: skip
    kind = raw.get("kind")
    if kind not in FAULT_KINDS:
        raise ScenarioError(f"{where}kind: must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
    at = _float(raw, where + "at_s", "at_s", 0.0, low=0.0)
    if at >= duration:
        raise ScenarioError(f"{where}at_s: {at:g} is not before duration_s {duration:g}")
    if kind == "leader_pause" and raw.get("duration_s") is None:
        raise ScenarioError(f"{where}duration_s: a pause needs one (how long it is frozen)")
    nodes = raw.get("nodes", "1")
    if isinstance(nodes, list):
        if not all(isinstance(n, str) for n in nodes):
            raise ScenarioError(f"{where}nodes: a list of node names must hold strings")
        nodes = ",".join(nodes)
    elif isinstance(nodes, int) and not isinstance(nodes, bool):
        nodes = str(nodes)
    if not isinstance(nodes, str) or not nodes:
        raise ScenarioError(f'{where}nodes: expected "30%", a count or a list of names')
    lasting = raw.get("duration_s")
    if lasting is not None and (not isinstance(lasting, int | float) or lasting <= 0):
        raise ScenarioError(f"{where}duration_s: must be a number > 0")
    return FaultPlan(
        at_s=at,
        kind=kind,
        nodes=nodes,
        duration_s=float(lasting) if lasting is not None else None,
        value=_float(raw, where + "value", "value", 0.0),
        period_s=_float(raw, where + "period_s", "period_s", 5.0, low=0.1),
        latency_s=_float(raw, where + "latency_s", "latency_s", 0.5, low=0.0),
        count=_int(raw, where + "count", "count", 1, low=1, high=10_000),
    )


def _only(raw: dict[str, Any], where: str, known: set[str]) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ScenarioError(
            f"{where}{unknown[0]}: unknown field (known: {', '.join(sorted(known))})"
        )


def _table(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ScenarioError(f"{key}: must be a table")
    return value


def _tables(raw: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ScenarioError(f"{key}: must be an array of tables ([[{key}]])")
    return value


def _str(raw: dict[str, Any], where: str, key: str, default: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str):
        raise ScenarioError(f"{where}: must be a string")
    return value


def _strs(raw: dict[str, Any], where: str, key: str, default: list[str]) -> list[str]:
    value = raw.get(key, default)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ScenarioError(f"{where}: must be a non-empty list of strings")
    return value


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ScenarioError(f"{key}: must be true or false")
    return value


def _int(raw: dict[str, Any], where: str, key: str, default: int, *, low: int, high: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ScenarioError(f"{where}: must be a whole number in {low}..{high}")
    return value


def _float(
    raw: dict[str, Any], where: str, key: str, default: float, *, low: float | None = None
) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScenarioError(f"{where}: must be a number")
    if low is not None and value < low:
        raise ScenarioError(f"{where}: must be >= {low:g}")
    return float(value)
