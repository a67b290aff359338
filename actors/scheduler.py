"""Where the next replica of a cluster goes: a pure, deterministic placement decision.

`schedule` reads views and returns a decision; it keeps no state and appends nothing. The caller
records a `Placement` as a `ReplicaPlaced` event (its `why` and `candidates` go into the event),
so a replay folds the recorded decision and never has to run the scheduler again.

The decision has two stages:

1. Filters. A node is rejected, with a one-line reason, if it is not healthy, is drained, is in
   `avoid`, is outside `spec.regions` (when the spec names any), lacks one of the spec's labels,
   or has fewer than `spec.gpu.count` free GPUs of one accepted model with at least
   `spec.gpu.min_vram_mib` each. A replica's GPUs are all of one model: tensor-parallel shards
   on mixed models run at the pace and memory of the weakest.
2. Ranking. The nodes left are compared lexicographically, so each rule only matters when every
   rule before it ties, and the deciding rule can be named:

   1. fewest replicas of this cluster on the node (never two on one node while another fits);
   2. fewest replicas of this cluster in the node's zone, then in its region;
   3. nearest to `spec.preferred_region`: the same region, then one with the same first
      dash-separated part ("eu-west" is near "eu-central"), then the rest;
   4. fewest GPUs allocated as a fraction of the node's GPUs, then lowest mean utilisation;
   5. lowest price per hour.

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

import math
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import msgspec

from events import Candidate, ClusterSpec, GpuInfo
from projections.views import NodeView, ReplicaView

from .env import RandomSource

__all__ = ["NoFit", "Placement", "free_gpus", "schedule"]

# A failed or stopped replica's process is gone, so its GPUs are free again.
RELEASED = frozenset({"failed", "stopped"})

# Test-only switch: the simulator's property tests set it to "stack_replicas" to prove that they
# find a placement bug and shrink it to a short case (tests/sim/test_stateful.py). Production
# code never sets it; None means the scheduler as designed.
INJECTED_BUG: str | None = None


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """The chosen node and GPUs, why they won, and every node considered.

    `candidates` lists the accepted nodes best first, `score` counting down from the number of
    accepted nodes to 1 (the winner has the highest), then the rejected ones by node id with
    `rejected` set. The ranking itself is lexicographic; `score` only records its order.
    """

    node_id: str
    gpu_indices: tuple[int, ...]
    why: str
    candidates: tuple[Candidate, ...] = ()


class NoFit(msgspec.Struct, frozen=True, kw_only=True):
    """No node can take the replica now: one line saying why, and every node's rejection."""

    reason: str
    candidates: tuple[Candidate, ...] = ()


def free_gpus(node: NodeView, placements: Iterable[ReplicaView]) -> tuple[int, ...]:
    """The node's GPU indices that no live replica (of any cluster) holds, ascending."""
    taken = _taken(placements).get(node.node_id, set())
    return tuple(sorted({gpu.index for gpu in node.gpus} - taken))


def eligible_gpus(
    node: NodeView, spec: ClusterSpec, placements: Iterable[ReplicaView]
) -> tuple[int, ...] | None:
    """The GPUs `node` could give one more replica of `spec` now, or None if it cannot take
    one (unhealthy, drained, region, labels, GPU model, VRAM, too few free GPUs). For checkers."""
    verdict = _filter(node, spec, _taken(placements).get(node.node_id, set()), ())
    return None if isinstance(verdict, _Reject) else verdict


def schedule(
    nodes: Sequence[NodeView],
    spec: ClusterSpec,
    placements: Sequence[ReplicaView],
    rng: RandomSource,
    *,
    avoid: Collection[str] = (),
) -> Placement | NoFit:
    """Choose a node and GPUs for one more replica of `spec`, or say why none fits.

    `placements` are the replicas of all clusters; failed and stopped ones are ignored. `avoid`
    names nodes this decision must not use (a hard filter: a caller that would rather place there
    than nowhere asks again without it).
    """
    if spec.gpu.count < 0:
        # A bad spec must not crash the reconciler that calls us on every tick.
        return NoFit(reason=f"no node fits {spec.name}: gpu.count is {spec.gpu.count}, not >= 0")
    live = [p for p in placements if p.status not in RELEASED]
    taken = _taken(live)
    ours = [p for p in live if p.cluster == spec.name]
    where = {n.node_id: (n.region, n.zone) for n in nodes}
    on_node = Counter(p.node_id for p in ours)
    if INJECTED_BUG == "stack_replicas":  # the bug: prefer nodes that already hold a replica
        on_node = Counter({node: -count for node, count in on_node.items()})
    # A replica on a node we no longer know has no known zone, so it counts towards none.
    in_zone = Counter(where[p.node_id] for p in ours if p.node_id in where)
    in_region = Counter(where[p.node_id][0] for p in ours if p.node_id in where)

    fits: list[_Fit] = []
    rejects: list[tuple[str, _Reject]] = []
    for node in nodes:
        used = taken.get(node.node_id, set())
        verdict = _filter(node, spec, used, avoid)
        if isinstance(verdict, _Reject):
            rejects.append((node.node_id, verdict))
            continue
        indices = {gpu.index for gpu in node.gpus}
        fits.append(
            _Fit(
                node=node,
                gpus=verdict,
                on_node=on_node[node.node_id],
                in_zone=in_zone[(node.region, node.zone)],
                in_region=in_region[node.region],
                distance=_distance(node.region, spec.preferred_region),
                used=len(indices & used),
                total=len(indices),
                util=_mean_utilization(node),
                price=_finite_or_inf(node.price_per_hour),
            )
        )

    rejects.sort(key=lambda r: r[0])
    rejected = tuple(Candidate(node_id=nid, rejected=r.detail) for nid, r in rejects)
    if not fits:
        return NoFit(reason=_no_fit_reason(spec, [r for _, r in rejects]), candidates=rejected)

    keys = {id(f): f.key for f in fits}
    ranked = sorted(fits, key=lambda f: (keys[id(f)], f.node.node_id))
    tied = [f for f in ranked if keys[id(f)] == keys[id(ranked[0])]]
    winner = rng.choice(tied) if len(tied) > 1 else ranked[0]
    ranked = [winner, *(f for f in ranked if f is not winner)]
    accepted = tuple(
        Candidate(node_id=f.node.node_id, score=float(len(ranked) - i))
        for i, f in enumerate(ranked)
    )
    return Placement(
        node_id=winner.node.node_id,
        gpu_indices=winner.gpus,
        why=_why(spec, winner, ranked, tied, len(rejects)),
        candidates=accepted + rejected,
    )


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
    def key(self) -> tuple[int, int, int, int, float, float, float]:
        return (
            self.on_node,
            self.in_zone,
            self.in_region,
            self.distance,
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
    "GPU load",
    "utilization",
    "price",
)


def _taken(placements: Iterable[ReplicaView]) -> dict[str, set[int]]:
    taken: dict[str, set[int]] = {}
    for p in placements:
        if p.status not in RELEASED:
            taken.setdefault(p.node_id, set()).update(p.gpu_indices)
    return taken


def _filter(
    node: NodeView, spec: ClusterSpec, taken: set[int], avoid: Collection[str]
) -> tuple[int, ...] | _Reject:
    """The GPUs this node would give the replica, or why it cannot take it."""
    if node.health != "healthy":
        why = f" ({node.health_reason})" if node.health_reason else ""
        return _Reject(0, node.health, node.health, f"{node.health}{why}")
    if node.drained:
        return _Reject(1, "drained", "drained", "drained")
    if node.node_id in avoid:
        return _Reject(2, "avoided", "avoided", "avoided for this placement")
    if spec.regions and node.region not in spec.regions:
        # "/" as for GPU models: a NoFit summary already separates its causes with commas.
        allowed = "/".join(spec.regions)
        return _Reject(
            3,
            f"is outside regions {allowed}",
            f"are outside regions {allowed}",
            f"region {node.region or '?'} not in {allowed}",
        )
    for key, want in sorted(spec.labels.items()):
        have = node.labels.get(key)
        if have != want:
            wanted = ",".join(f"{k}={v}" for k, v in sorted(spec.labels.items()))
            detail = (
                f"label {key}={want} missing" if have is None else f"label {key}={have}, not {want}"
            )
            return _Reject(4, f"lacks labels {wanted}", f"lack labels {wanted}", detail)
    return _choose_gpus(node, spec, taken)


def _choose_gpus(node: NodeView, spec: ClusterSpec, taken: set[int]) -> tuple[int, ...] | _Reject:
    need = spec.gpu.count
    if need == 0:
        return ()
    accepted = tuple(dict.fromkeys(spec.gpu.models))
    what = "/".join(accepted) or "GPU"
    vram = f" with >= {spec.gpu.min_vram_mib} MiB" if spec.gpu.min_vram_mib > 0 else ""
    gpus = _unique_by_index(node.gpus)

    of_model = [g for g in gpus if not accepted or g.model in accepted]
    if not of_model:
        return _Reject(5, f"has no {what}", f"have no {what}", f"no {what} ({_inventory(gpus)})")
    big = [g for g in of_model if g.vram_mib >= spec.gpu.min_vram_mib]
    if not big:
        largest = max(g.vram_mib for g in of_model)
        return _Reject(
            6, f"has no {what}{vram}", f"have no {what}{vram}", f"no {what}{vram} ({largest} MiB)"
        )
    free: dict[str, list[int]] = {}
    for gpu in big:
        if gpu.index not in taken:
            free.setdefault(gpu.model, []).append(gpu.index)
    options = [tuple(sorted(indices)[:need]) for indices in free.values() if len(indices) >= need]
    if options:
        # All models here are acceptable; the lowest indices keep a node's allocations packed.
        return min(options)
    short = "no free" if need == 1 else f"< {need} free"
    if free:
        have = " + ".join(f"{len(free[m])} {m}" for m in sorted(free)) + " free"
    else:
        have = f"0 free {what}"
    one_model = " of one model" if len(free) > 1 else ""
    return _Reject(
        7,
        f"has {short} {what}{vram}",
        f"have {short} {what}{vram}",
        f"{have}{vram}, needs {need}{one_model}",
    )


def _unique_by_index(gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
    # A node that reports one index twice must not offer it twice; keep the first report.
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
    counts = Counter((r.stage, r.one, r.many) for r in rejects)
    parts = [f"{n} {one if n == 1 else many}" for (_, one, many), n in sorted(counts.items())]
    return _line(f"no node fits {spec.name}: " + ", ".join(parts))


def _zone(region: str, zone: str) -> str:
    return f"{region or '?'}/{zone or '?'}"


def _why(
    spec: ClusterSpec, winner: _Fit, ranked: Sequence[_Fit], tied: Sequence[_Fit], rejected: int
) -> str:
    if len(ranked) == 1:
        decision = "the only fit" + (f" ({rejected} rejected)" if rejected else "")
    elif len(tied) > 1:
        names = ", ".join(f.node.node_id for f in tied)
        decision = f"seeded tie-break among {names} (equal on every rule)"
    else:
        runner = ranked[1]
        rule = next(
            i for i, (a, b) in enumerate(zip(winner.key, runner.key, strict=True)) if a != b
        )
        decision = f"wins on {RULES[rule]} ({_versus(spec, rule, winner, runner)})"
    return _line(f"{winner.node.node_id}: {decision}; {_facts(spec, winner)}")


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
        return f"{w.used}/{w.total} GPUs used vs {r.used}/{r.total} on {other}"
    if rule == 5:
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
    facts.append(f"{w.used}/{w.total} GPUs used, util {w.util:.0f}%, ${w.price:.2f}/h")
    facts.append("GPUs " + (",".join(map(str, w.gpus)) or "none"))
    return "; ".join(facts)


def _line(text: str) -> str:
    # Node ids and labels come from agents; a newline in one must not split the event's line.
    return " ".join(text.splitlines())
