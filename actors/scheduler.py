"""Where the next replica of a cluster goes: a pure, deterministic placement decision.

`schedule` reads views and returns a decision; it keeps no state and appends nothing. The caller
records a `Placement` as a `ReplicaPlaced` event (its `why` and `candidates` go into the event),
so a replay folds the recorded decision and never has to run the scheduler again.

The decision has two stages:

1. Filters. A node is rejected, with a one-line reason, if it is not healthy, is drained, is
   cordoned (until a time after `now_ns`, or until uncordoned), is in `avoid`, is outside
   `spec.regions` (when the spec names any), lacks one of the spec's labels, or has fewer than
   `spec.gpu.count` free GPUs of one accepted model with at least `spec.gpu.min_vram_mib`
   each. A model is accepted by its name, family or alias (`H100` takes "NVIDIA H100 80GB
   HBM3" and "NVIDIA H100 PCIe": events/gpu_names.py). A replica's GPUs are all of one model
   as NVML names it: tensor-parallel shards on mixed models run at the pace and memory of the
   weakest.
2. Ranking. The nodes left are compared lexicographically, so each rule only matters when every
   rule before it ties, and the deciding rule can be named:

   1. fewest replicas of this cluster on the node (never two on one node while another fits);
   2. fewest replicas of this cluster in the node's zone, then in its region;
   3. nearest to `spec.preferred_region`: the same region, then one with the same first
      dash-separated part ("eu-west" is near "eu-central"), then the rest;
   4. holding what the replica needs on disk: the spec's `model_files` in the node's model
      cache (the agent reports what its cache holds: nodeagent/model_cache.py), and the spec's
      `image` among the node's container images, so the engine neither downloads its weights
      nor waits for a pull; fewest of the two missing wins. A spec with neither ties here;
   5. fewest GPUs allocated as a fraction of the node's GPUs, then lowest mean utilisation;
   6. lowest price per hour.

   Nodes equal on every rule are exact ties. They are sorted by node id and one is drawn from
   `rng`, so equal idle nodes share the load across the fleet rather than always filling the
   same first one. `rng` is drawn from only then (once), so the result depends on the inputs and
   the rng's state alone, never on the order of `nodes` or `placements`.

Replicas that are failed or stopped hold nothing; every other status (a stopping replica too)
still holds its GPUs and counts towards spread. Zones are named within their region, so spread
counts zone "a" of "eu-west" and zone "a" of "us-east" apart; an empty region or zone is compared
as a name like any other.
"""

from __future__ import annotations

import datetime as dt
import heapq
import math
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter

import msgspec

from events import Candidate, ClusterSpec, GpuInfo
from events.gpu_names import matches
from projections.views import NodeView, ReplicaView
from runtime.env import RandomSource

__all__ = [
    "NoFit",
    "Placement",
    "accepts",
    "cordon_end",
    "cordoned",
    "could_host",
    "free_gpus",
    "image_ref",
    "schedule",
]

# A failed or stopped replica's process is gone, so its GPUs are free again.
RELEASED = frozenset({"failed", "stopped"})


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """The chosen node and GPUs, why they won, and the nodes considered (the best and the first
    rejected by name, the rest counted in `why`).

    `candidates` lists the accepted nodes best first, `score` counting down from the number of
    accepted nodes (the winner has the highest), then the rejected ones by node id with
    `rejected` set; at most `LISTED` of each, and `why` counts the rest when there are more.
    The ranking itself is lexicographic; `score` only records its order.
    """

    node_id: str
    gpu_indices: tuple[int, ...]
    why: str
    candidates: tuple[Candidate, ...] = ()


class NoFit(msgspec.Struct, frozen=True, kw_only=True):
    """No node can take the replica now: one line counting the rejections by cause, and the
    first `LISTED` rejected nodes (by node id) with their own reasons."""

    reason: str
    candidates: tuple[Candidate, ...] = ()


def free_gpus(node: NodeView, placements: Iterable[ReplicaView]) -> tuple[int, ...]:
    """The node's GPU indices that no live replica (of any cluster) holds, ascending."""
    taken = _taken(placements).get(node.node_id, set())
    return tuple(sorted({gpu.index for gpu in node.gpus} - taken))


def eligible_gpus(
    node: NodeView, spec: ClusterSpec, placements: Iterable[ReplicaView], *, now_ns: int = 0
) -> tuple[int, ...] | None:
    """The GPUs `node` could give one more replica of `spec` now, or None if it cannot take
    one (unhealthy, drained, cordoned at `now_ns`, region, labels, GPU model, VRAM, too few free
    GPUs). For checkers."""
    taken = _taken(placements).get(node.node_id, set())
    verdict = _filter(node, spec, taken, (), now_ns=now_ns)
    return None if isinstance(verdict, _Reject) else verdict


def cordoned(node: NodeView, now_ns: int) -> bool:
    """Whether the node's cordon holds at `now_ns` (wall clock ns): one with no end always."""
    until = node.cordoned_until_ns
    return until < 0 or now_ns < until


def cordon_end(until_ns: int) -> str:
    """A cordon's end as the operator wrote it: `2026-11-26T03:00:00Z` (UTC, to the second;
    finer when it has a fraction), or `uncordoned` for none (-1 or 0)."""
    if until_ns <= 0:
        return "uncordoned"
    seconds, ns = divmod(until_ns, 1_000_000_000)
    stamp = dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{ns:09d}".rstrip("0") + "Z" if ns else stamp + "Z"


def schedule(
    nodes: Sequence[NodeView],
    spec: ClusterSpec,
    placements: Sequence[ReplicaView],
    rng: RandomSource,
    *,
    avoid: Collection[str] = (),
    now_ns: int = 0,
) -> Placement | NoFit:
    """Choose a node and GPUs for one more replica of `spec`, or say why none fits.

    `placements` are the replicas of all clusters; failed and stopped ones are ignored. `avoid`
    names nodes this decision must not use (a hard filter: a caller that would rather place there
    than nowhere asks again without it). `now_ns`: the placement's wall clock, ns since the
    epoch; a node cordoned until a later time (or with no end) is rejected. The default, 0,
    holds every recorded cordon.
    """
    if spec.gpu.count < 0:
        # A bad spec must not crash the reconciler that calls us on every tick.
        return NoFit(reason=f"no node fits {spec.name}: gpu.count is {spec.gpu.count}, not >= 0")
    live = [p for p in placements if p.status not in RELEASED]
    taken = _taken(live)
    ours = [p for p in live if p.cluster == spec.name]
    where = {n.node_id: (n.region, n.zone) for n in nodes}
    on_node = Counter(p.node_id for p in ours)
    # A replica on a node we no longer know has no known zone, so it counts towards none.
    in_zone = Counter(where[p.node_id] for p in ours if p.node_id in where)
    in_region = Counter(where[p.node_id][0] for p in ours if p.node_id in where)

    # One pass over the fleet, at a few microseconds a node: a placement at 10,000 nodes must
    # not cost a quarter of a second (bench/scheduler.py). Rows are plain tuples, and only the
    # nodes the decision names become _Fit objects.
    need = _Need.of(spec)
    files = spec.model_files
    image = image_ref(spec.image)
    no_use: frozenset[int] = frozenset()
    rows: list[_Row] = []
    rejects: list[tuple[str, _Reject]] = []
    for node in nodes:
        node_id = node.node_id
        used = taken.get(node_id, no_use)
        verdict = _filter(node, spec, used, avoid, need, now_ns=now_ns)
        if isinstance(verdict, _Reject):
            rejects.append((node_id, verdict))
            continue
        total, busy = _count_used(node, used)
        key = (
            on_node.get(node_id, 0),  # get: a Counter's __missing__ is Python, per node
            in_zone.get((node.region, node.zone), 0),
            in_region.get(node.region, 0),
            _distance(node.region, spec.preferred_region),
            (files != "" and files not in node.cached_models)
            + (image != "" and image not in node.images),
            busy / total if total else 0.0,
            _mean_utilization(node),
            _finite_or_inf(node.price_per_hour),
        )
        rows.append((key, node_id, node, verdict, busy, total))

    if not rows:
        listed = heapq.nsmallest(LISTED, rejects, key=_reject_node)
        return NoFit(
            reason=_no_fit_reason(spec, [r for _, r in rejects]),
            candidates=tuple(Candidate(node_id=nid, rejected=r.detail) for nid, r in listed),
        )

    best = min(row[0] for row in rows)
    tied = sorted((row for row in rows if row[0] == best), key=_row_node)
    winner = rng.choice(tied) if len(tied) > 1 else tied[0]
    # The ranking is (key, node id); the winner leads it even when the draw took a later tie.
    head = heapq.nsmallest(LISTED + 1, rows, key=_ranking)
    ranked = [winner, *(row for row in head if row is not winner)][:LISTED]
    accepted = tuple(
        Candidate(node_id=row[1], score=float(len(rows) - i)) for i, row in enumerate(ranked)
    )
    listed_rejects = heapq.nsmallest(LISTED, rejects, key=_reject_node)
    rejected = tuple(Candidate(node_id=nid, rejected=r.detail) for nid, r in listed_rejects)
    runner = _fit(ranked[1]) if len(tied) == 1 and len(ranked) > 1 else None
    why = _why(spec, _fit(winner), runner, len(rows), [row[1] for row in tied], len(rejects))
    if len(rows) > len(accepted) or len(rejects) > len(rejected):
        why = _line(f"{why}; {_left_out(len(rows), len(accepted), rejects, len(rejected))}")
    return Placement(
        node_id=winner[1],
        gpu_indices=winner[3],
        why=why,
        candidates=accepted + rejected,
    )


# How many accepted and how many rejected nodes a decision lists by name. The event records
# every decision, so its size must not grow with the fleet: at 10,000 nodes a full list would
# be about 600 KB a placement, and nats-server refuses messages over 1 MiB. The `why` counts
# the rest, and a NoFit reason counts every rejection by cause.
LISTED = 20

# (key, node id, node, GPUs, GPUs in use, GPUs in all)
_Row = tuple[
    tuple[int, int, int, int, int, float, float, float], str, NodeView, tuple[int, ...], int, int
]


def _ranking(row: _Row) -> tuple[tuple[int, int, int, int, int, float, float, float], str]:
    return row[0], row[1]


_row_node = itemgetter(1)
_reject_node = itemgetter(0)


def _fit(row: _Row) -> _Fit:
    key, _, node, gpus, busy, total = row
    return _Fit(
        node=node,
        gpus=gpus,
        on_node=key[0],
        in_zone=key[1],
        in_region=key[2],
        distance=key[3],
        uncached=key[4],
        used=busy,
        total=total,
        util=key[6],
        price=key[7],
    )


def _count_used(node: NodeView, used: Collection[int]) -> tuple[int, int]:
    """The node's distinct GPU indices, and how many of them live replicas hold."""
    if len(node.gpus) == 1:
        return 1, 1 if node.gpus[0].index in used else 0
    indices = {gpu.index for gpu in node.gpus}
    return len(indices), len(indices.intersection(used))


def _left_out(
    fits: int, listed_fits: int, rejects: Sequence[tuple[str, _Reject]], listed_rejects: int
) -> str:
    parts = [f"{fits} fit, {listed_fits} listed"]
    if rejects:
        causes = _causes([r for _, r in rejects])
        parts.append(f"{len(rejects)} rejected ({causes}), {listed_rejects} listed")
    return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class _Reject:
    stage: int  # filter order, so a NoFit reason lists causes in the order they are checked
    one: str  # the cause in a NoFit summary, for one node ("has no free A100")
    many: str  # ... and for several ("have no free A100")
    detail: str  # this node's own reason, for its Candidate


@dataclass(frozen=True, slots=True)
class _Fit:
    node: NodeView
    gpus: tuple[int, ...]
    on_node: int
    in_zone: int
    in_region: int
    distance: int
    uncached: int  # of the spec's model files and image, how many the node does not hold
    used: int
    total: int
    util: float
    price: float

    @property
    def load(self) -> float:
        # Division rounds correctly, so equal fractions (1/4, 2/8) give the same float and, at
        # GPU counts, distinct fractions differ by far more than a rounding step: the float
        # orders exactly as the fraction would, at a fraction of Fraction's cost.
        return self.used / self.total if self.total else 0.0

    @property
    def key(self) -> tuple[int, int, int, int, int, float, float, float]:
        return (
            self.on_node,
            self.in_zone,
            self.in_region,
            self.distance,
            self.uncached,
            self.load,
            self.util,
            self.price,
        )


# The name of each rule in `_Fit.key`, position for position.
RULES = (
    "spread",
    "zone spread",
    "region spread",
    "region preference",
    "cache",
    "GPU load",
    "utilization",
    "price",
)


def _taken(placements: Iterable[ReplicaView]) -> dict[str, set[int]]:
    taken: dict[str, set[int]] = {}
    for p in placements:
        if p.status in RELEASED:
            continue
        if p.stages:
            # A sharded replica holds every stage's GPUs, on every node of its pipeline.
            for stage in p.stages:
                taken.setdefault(stage.node_id, set()).update(stage.gpu_indices)
        else:
            taken.setdefault(p.node_id, set()).update(p.gpu_indices)
    return taken


@dataclass(frozen=True, slots=True)
class _Need:
    """What `spec` asks of a node, worked out once per decision rather than once per node."""

    count: int
    models: tuple[str, ...]  # accepted models, spec order, no repeats; empty accepts any
    min_vram_mib: int
    labels: tuple[tuple[str, str], ...]  # sorted

    @classmethod
    def of(cls, spec: ClusterSpec) -> _Need:
        return cls(
            count=spec.gpu.count,
            models=tuple(dict.fromkeys(spec.gpu.models)),
            min_vram_mib=spec.gpu.min_vram_mib,
            labels=tuple(sorted(spec.labels.items())),
        )

    @property
    def what(self) -> str:
        return "/".join(self.models) or "GPU"

    @property
    def vram(self) -> str:
        return f" with >= {self.min_vram_mib} MiB" if self.min_vram_mib > 0 else ""


def could_host(node: NodeView, spec: ClusterSpec, *, now_ns: int = 0) -> bool:
    """Whether the node passes every filter with all its GPUs free: a node a replica of
    `spec` may be placed on some day (where a `[docker] prepull` pulls the image)."""
    return not isinstance(_filter(node, spec, (), (), now_ns=now_ns), _Reject)


def _filter(
    node: NodeView,
    spec: ClusterSpec,
    taken: Collection[int],
    avoid: Collection[str],
    need: _Need | None = None,
    *,
    now_ns: int = 0,
) -> tuple[int, ...] | _Reject:
    """The GPUs this node would give the replica, or why it cannot take it."""
    if need is None:
        need = _Need.of(spec)
    if node.health != "healthy":
        why = f" ({node.health_reason})" if node.health_reason else ""
        return _Reject(0, node.health, node.health, f"{node.health}{why}")
    if node.drained:
        return _Reject(1, "drained", "drained", "drained")
    if node.cordoned_until_ns and cordoned(node, now_ns):
        why = f": {node.cordon_reason}" if node.cordon_reason else ""
        detail = _line(f"cordoned until {cordon_end(node.cordoned_until_ns)}{why}")
        return _Reject(2, "cordoned", "cordoned", detail)
    if node.node_id in avoid:
        return _Reject(3, "avoided", "avoided", "avoided for this placement")
    if spec.regions and node.region not in spec.regions:
        # "/" as for GPU models: a NoFit summary already separates its causes with commas.
        allowed = "/".join(spec.regions)
        return _Reject(
            4,
            f"is outside regions {allowed}",
            f"are outside regions {allowed}",
            f"region {node.region or '?'} not in {allowed}",
        )
    for key, want in need.labels:
        have = node.labels.get(key)
        if have != want:
            wanted = ",".join(f"{k}={v}" for k, v in need.labels)
            detail = (
                f"label {key}={want} missing" if have is None else f"label {key}={have}, not {want}"
            )
            return _Reject(5, f"lacks labels {wanted}", f"lack labels {wanted}", detail)
    if spec.secret_env and not node.sealing_key:
        # An agent older than secret_env: it would start the workload without its secrets.
        return _Reject(
            5,
            "has no sealing key for secret_env",
            "have no sealing key for secret_env",
            "no sealing key for secret_env (an older agent)",
        )
    return _choose_gpus(node, need, taken)


def _choose_gpus(node: NodeView, need: _Need, taken: Collection[int]) -> tuple[int, ...] | _Reject:
    count = need.count
    if count == 0:
        return ()
    accepted = need.models
    gpus = _unique_by_index(node.gpus)
    of_model = [g for g in gpus if accepts(accepted, g.model)]
    if not of_model:
        what = need.what
        return _Reject(6, f"has no {what}", f"have no {what}", f"no {what} ({_inventory(gpus)})")
    big = [g for g in of_model if g.vram_mib >= need.min_vram_mib]
    if not big:
        what, vram = need.what, need.vram
        largest = max(g.vram_mib for g in of_model)
        return _Reject(
            7, f"has no {what}{vram}", f"have no {what}{vram}", f"no {what}{vram} ({largest} MiB)"
        )
    free: dict[str, list[int]] = {}
    for gpu in big:
        if gpu.index not in taken:
            free.setdefault(gpu.model, []).append(gpu.index)
    # `big` is in index order, so each model's list is already sorted.
    options = [tuple(indices[:count]) for indices in free.values() if len(indices) >= count]
    if options:
        # All models here are acceptable; the lowest indices keep a node's allocations packed.
        return min(options)
    what, vram = need.what, need.vram
    short = "no free" if count == 1 else f"< {count} free"
    if free:
        have = " + ".join(f"{len(free[m])} {m}" for m in sorted(free)) + " free"
    else:
        have = f"0 free {what}"
    one_model = " of one model" if len(free) > 1 else ""
    return _Reject(
        8,
        f"has {short} {what}{vram}",
        f"have {short} {what}{vram}",
        f"{have}{vram}, needs {count}{one_model}",
    )


def accepts(models: Sequence[str], reported: str) -> bool:
    """Whether a spec's `gpu.models` (none: any) take a GPU NVML calls `reported`: by name,
    family or alias (events/gpu_names.py), so `H100` takes "NVIDIA H100 80GB HBM3"."""
    return not models or any(matches(m, reported) for m in models)


def _unique_by_index(gpus: Sequence[GpuInfo]) -> Sequence[GpuInfo]:
    # A node that reports one index twice must not offer it twice; keep the first report.
    if len(gpus) == 1:
        return gpus
    seen: dict[int, GpuInfo] = {}
    for gpu in gpus:
        seen.setdefault(gpu.index, gpu)
    return [seen[i] for i in sorted(seen)]


def _inventory(gpus: Sequence[GpuInfo]) -> str:
    if not gpus:
        return "no GPUs"
    models = Counter(g.model for g in gpus)
    return "has " + ", ".join(f"{n}x {m}" for m, n in sorted(models.items()))


def _distance(region: str, preferred: str) -> int:
    if not preferred or region == preferred:
        return 0
    if region and region.split("-")[0] == preferred.split("-")[0]:
        return 1
    return 2


def _finite_or_inf(x: float) -> float:
    # NaN compares false both ways and would make the order depend on the input order.
    return x if math.isfinite(x) else math.inf


def _mean_utilization(node: NodeView) -> float:
    # A node that has not reported metrics yet counts as idle: it has just registered.
    if not node.metrics:
        return 0.0
    return _finite_or_inf(math.fsum(m.utilization_pct for m in node.metrics) / len(node.metrics))


def _no_fit_reason(spec: ClusterSpec, rejects: Sequence[_Reject]) -> str:
    if not rejects:
        return f"no node fits {spec.name}: no nodes"
    return _line(f"no node fits {spec.name}: {_causes(rejects)}")


def _causes(rejects: Sequence[_Reject]) -> str:
    """Rejections counted by cause, in the order the filters check them."""
    counts = Counter((r.stage, r.one, r.many) for r in rejects)
    return ", ".join(
        f"{n} {one if n == 1 else many}" for (_, one, many), n in sorted(counts.items())
    )


def _zone(region: str, zone: str) -> str:
    return f"{region or '?'}/{zone or '?'}"


def _why(
    spec: ClusterSpec,
    winner: _Fit,
    runner: _Fit | None,
    fits: int,
    tied: Sequence[str],
    rejected: int,
) -> str:
    if fits == 1:
        decision = "the only fit" + (f" ({rejected} rejected)" if rejected else "")
    elif len(tied) > 1:
        if len(tied) > TIES_NAMED:
            names = ", ".join(tied[:TIES_NAMED]) + f" and {len(tied) - TIES_NAMED} more"
        else:
            names = ", ".join(tied)
        decision = f"seeded tie-break among {names} (equal on every rule)"
    else:
        assert runner is not None  # more than one fit and no tie: there is a runner-up
        rule = next(
            i for i, (a, b) in enumerate(zip(winner.key, runner.key, strict=True)) if a != b
        )
        decision = f"wins on {RULES[rule]} ({_versus(spec, rule, winner, runner)})"
    return _line(f"{winner.node.node_id}: {decision}; {_facts(spec, winner)}")


# A tie among thousands of idle nodes names the first few (by node id) and counts the rest.
TIES_NAMED = 8


def _versus(spec: ClusterSpec, rule: int, w: _Fit, r: _Fit) -> str:
    other = r.node.node_id
    if rule == 0:
        return f"{_replicas(w.on_node, spec)} there vs {r.on_node} on {other}"
    if rule == 1:
        wz, rz = _zone(w.node.region, w.node.zone), _zone(r.node.region, r.node.zone)
        return f"{_replicas(w.in_zone, spec)} in zone {wz} vs {r.in_zone} in {rz} on {other}"
    if rule == 2:
        wr, rr = w.node.region or "?", r.node.region or "?"
        return f"{_replicas(w.in_region, spec)} in region {wr} vs {r.in_region} in {rr} on {other}"
    if rule == 3:
        return (
            f"region {w.node.region or '?'} {NEARNESS[w.distance]} preferred "
            f"{spec.preferred_region}, {r.node.region or '?'} on {other} {NEARNESS[r.distance]} it"
        )
    if rule == 4:
        mine, theirs = _held(spec, w.node), _held(spec, r.node)
        return f"{' and '.join(h for h in mine if h not in theirs)} there, not on {other}"
    if rule == 5:
        return f"{w.used}/{w.total} GPUs used vs {r.used}/{r.total} on {other}"
    if rule == 6:
        wu, ru = _apart(w.util, r.util, 0)
        return f"mean utilization {wu}% vs {ru}% on {other}"
    wp, rp = _apart(w.price, r.price, 2)
    return f"${wp}/h vs ${rp}/h on {other}"


def _apart(a: float, b: float, decimals: int) -> tuple[str, str]:
    # The rule did tell them apart, so the explanation must not print them equal.
    for places in range(decimals, 7):
        x, y = f"{a:.{places}f}", f"{b:.{places}f}"
        if x != y:
            break
    return x, y


NEARNESS = ("matches", "is near", "is far from")


def _replicas(n: int, spec: ClusterSpec) -> str:
    return f"{n} replica{'' if n == 1 else 's'} of {spec.name}"


def _facts(spec: ClusterSpec, w: _Fit) -> str:
    facts = [
        f"{_replicas(w.on_node, spec)} there, {w.in_zone} in zone "
        f"{_zone(w.node.region, w.node.zone)}, {w.in_region} in region {w.node.region or '?'}"
    ]
    if spec.preferred_region:
        facts.append(f"region {NEARNESS[w.distance]} preferred {spec.preferred_region}")
    held = _held(spec, w.node)
    if spec.model_files and spec.model_files not in w.node.cached_models:
        held.append(f"model files {spec.model_files} not cached")
    if held:
        facts.append(", ".join(held) + " there")
    facts.append(f"{w.used}/{w.total} GPUs used, util {w.util:.0f}%, ${w.price:.2f}/h")
    facts.append("GPUs " + (",".join(map(str, w.gpus)) or "none"))
    return "; ".join(facts)


def image_ref(image: str) -> str:
    """`image` as `docker image ls` lists it, REPOSITORY:TAG: Docker Hub's prefixes dropped
    (`docker.io/library/ubuntu` is `ubuntu`), a name without a tag `:latest`; "" stays "". A
    digest reference is kept as it is (the listing never matches it, so it ranks as not
    held)."""
    for hub in ("docker.io/library/", "docker.io/", "index.docker.io/"):
        if image.startswith(hub):
            image = image.removeprefix(hub)  # as the listing names Docker Hub's images
            break
    if image.startswith("library/") and image.count("/") == 1:
        image = image.removeprefix("library/")
    if not image or "@" in image or ":" in image.rsplit("/", 1)[-1]:
        return image
    return image + ":latest"


def _held(spec: ClusterSpec, node: NodeView) -> list[str]:
    held = []
    if spec.model_files and spec.model_files in node.cached_models:
        held.append(f"model files {spec.model_files} cached")
    image = image_ref(spec.image)
    if image and image in node.images:
        held.append(f"image {image} pulled")
    return held


def _line(text: str) -> str:
    # Node ids and labels come from agents; a newline in one must not split the event's line.
    return " ".join(text.splitlines())
