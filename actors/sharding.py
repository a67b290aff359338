"""The smallest set of GPUs that holds a model: a pure, deterministic plan (docs/sharding.md).

`plan` reads the spec's `[sharding]` section and the fleet as it is (node views, and the
replicas of every cluster, whose GPUs are taken) and returns either a `ShardPlan` (its stages:
node, GPUs, layer range, memory per GPU; the estimated time per token) or a `NoPlan` saying
why nothing fits. Either way it lists the alternatives it rejected and why: a node the
scheduler's filters refuse (health, drain, region, labels, GPU model or VRAM, no free GPU), a
set of GPUs too small, a plan over `max_token_latency_ms`. It places nothing.

The rules, in order:

1. A node passes the scheduler's own filters (`actors.scheduler`), with the same reasons.
2. One node beats any split across nodes: a plan on one node has no network in a token's path.
   On a node, the fewest GPUs of one model that hold the model win: one GPU, else a
   tensor-parallel group of 2, 4 or 8 (only where `parallelism` allows "tensor"), then the
   lowest estimated time per token, then the node id.
3. Otherwise, where `parallelism` allows "pipeline": the fewest stages (one per node, ordered
   by node id), then the fewest GPUs. Each stage is one node's GPUs of one model (a
   tensor-parallel group if "tensor" is allowed too). Layers are split in proportion to each
   stage's usable VRAM, in whole layers, every layer once, no stage over its VRAM.
4. A plan whose estimated time per token exceeds `max_token_latency_ms` is rejected with its
   estimate, and the next alternative is tried.

Memory: weights + KV cache, spread evenly over the layers (the embeddings counted in the
weights, so a layer is `(weights + kv) / layers`); a GPU may be filled to `HEADROOM` of its
VRAM, the rest left for activations, the CUDA context and fragmentation.

Time per token (one decode step, memory-bandwidth bound): each stage reads its share of the
weights and of the KV budget once per step, at its GPUs' memory bandwidth (`BANDWIDTH_GBS` by
model name, `DEFAULT_BANDWIDTH_GBS` for the rest), the tensor-parallel GPUs of a stage in
parallel; the stages run one after another; each boundary between stages adds the activations
of the step (`hidden_size` x 2 bytes x sequences) over the link's throughput plus its round
trip: the link as measured (the fleet's link view, projections/links.py) where it has been,
else the spec's `link_gbps` and `link_rtt_ms`; the slowest boundary counts for every one.
Among pipelines of as many stages and GPUs, the lowest estimate wins, then the most usable
memory.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from events import Candidate, ClusterSpec, GpuRequirement, ShardingSpec, StagePlacement
from projections.views import Links, NodeView, ReplicaView

# The scheduler's filters and its view of taken GPUs, reused so that a plan and a placement
# refuse the same nodes for the same reasons.
from .scheduler import (
    NoFit,
    Placement,
    _filter,
    _Need,
    _Reject,
    _taken,
    _unique_by_index,
    accepts,
)

__all__ = [
    "BANDWIDTH_GBS",
    "BYTES_PER_PARAM",
    "DEFAULT_BANDWIDTH_GBS",
    "DEFAULT_HIDDEN_SIZE",
    "HEADROOM",
    "PARALLELISM",
    "NoPlan",
    "Rejected",
    "ShardPlan",
    "Stage",
    "bandwidth_gbs",
    "group_estimate",
    "kv_cache_bytes",
    "place_group",
    "plan",
    "weights_bytes",
]

GIB = 1024**3
MIB = 1024**2

PARALLELISM = ("tensor", "pipeline")

# Bytes per parameter at each precision a spec may name (4-bit formats at half a byte; their
# scales and zero points are left to the headroom).
BYTES_PER_PARAM = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "q8": 1.0,
    "int4": 0.5,
    "q4": 0.5,
    "nf4": 0.5,
}

# A GPU may be filled to this fraction of its VRAM (as the integer ratio, for exact checks).
HEADROOM_NUM, HEADROOM_DEN = 9, 10
HEADROOM = HEADROOM_NUM / HEADROOM_DEN

# The activation width when the spec gives none: Llama-2/3 70B's; smaller models have less.
DEFAULT_HIDDEN_SIZE = 8192
ACTIVATION_BYTES = 2  # fp16/bf16 per element

# Memory bandwidth, GB/s, by a substring of the GPU model name (lower case, letters and
# digits only), first match wins: longer names before the names they contain.
BANDWIDTH_GBS: tuple[tuple[str, float], ...] = (
    ("h200", 4800.0),
    ("h100pcie", 2000.0),
    ("h100", 3350.0),
    ("mi300", 5300.0),
    ("a100", 2039.0),
    ("l40", 864.0),
    ("a6000", 768.0),
    ("4090", 1008.0),
    ("3090", 936.0),
    ("a10", 600.0),
    ("t4", 320.0),
    ("l4", 300.0),
)
DEFAULT_BANDWIDTH_GBS = 500.0

TENSOR_DEGREES = (1, 2, 4, 8)  # GPUs in a tensor-parallel group: they must divide the heads
MAX_STAGES = 8
LISTED = 20  # rejected alternatives listed by name; the rest are counted
# A pipeline search over at most this many eligible nodes tries every selection (up to
# MAX_SELECTIONS of them), so that measured links can rank them; over a larger fleet it keeps
# to the nodes with the most memory of each size (`_selections`).
ENUMERATE_NODES = 16
MAX_SELECTIONS = 4096


class Stage(msgspec.Struct, frozen=True, kw_only=True):
    """One pipeline stage: a node's GPUs (a tensor-parallel group when more than one)."""

    node_id: str
    gpu_model: str
    gpu_indices: tuple[int, ...]
    first_layer: int
    last_layer: int  # exclusive: the stage holds layers [first_layer, last_layer)
    vram_mib: int  # each GPU's (the smallest of the group)
    used_mib: int  # each GPU's share of the weights and the KV cache
    compute_ms: float  # this stage's part of a token's time


class Rejected(msgspec.Struct, frozen=True, kw_only=True):
    nodes: tuple[str, ...]
    gpus: int  # GPUs the alternative would use; 0 for a node the filters refuse
    reason: str


class ShardPlan(msgspec.Struct, frozen=True, kw_only=True):
    cluster: str
    gpus: int
    stages: tuple[Stage, ...]
    layers: int
    weights_gib: float
    kv_cache_gib: float
    token_ms: float  # estimated time per token: compute_ms + link_ms
    compute_ms: float
    link_ms: float
    why: str
    rejected: tuple[Rejected, ...] = ()
    rejected_total: int = 0  # all rejected alternatives; `rejected` lists the first LISTED


class NoPlan(msgspec.Struct, frozen=True, kw_only=True):
    cluster: str
    reason: str
    rejected: tuple[Rejected, ...] = ()
    rejected_total: int = 0


def place_group(
    spec: ClusterSpec,
    nodes: Sequence[NodeView],
    placements: Sequence[ReplicaView],
    *,
    avoid: Collection[str] = (),
    now_ns: int = 0,
    links: Links | None = None,
    because: str = "",
) -> tuple[Placement | NoFit, tuple[StagePlacement, ...]]:
    """A placement of one replica of a `[sharding]` spec by its plan: the head's node and GPUs
    (a one-node plan's only ones) and, for a pipeline, every stage in rank order; or NoFit with
    the plan's reason. The alternatives the plan rejected are the placement's candidates.
    `avoid`: nodes it must not use (the scheduler's hard filter). `links`: the fleet's
    measured links. `because`: why it is placed, put before the plan's `why`."""
    found = plan(spec, nodes, placements, avoid=avoid, now_ns=now_ns, links=links)
    candidates = tuple(
        Candidate(node_id="+".join(r.nodes) or "-", rejected=r.reason) for r in found.rejected
    )
    if isinstance(found, NoPlan):
        return NoFit(reason=found.reason, candidates=candidates), ()
    head = found.stages[0]
    why = f"{because}; {found.why}" if because else found.why
    placement = Placement(
        node_id=head.node_id, gpu_indices=head.gpu_indices, why=why, candidates=candidates
    )
    if len(found.stages) == 1:
        return placement, ()
    stages = tuple(
        StagePlacement(
            rank=rank,
            node_id=st.node_id,
            gpu_indices=st.gpu_indices,
            first_layer=st.first_layer,
            last_layer=st.last_layer,
        )
        for rank, st in enumerate(found.stages)
    )
    return placement, stages


def group_estimate(
    spec: ClusterSpec,
    replica: ReplicaView,
    nodes: Mapping[str, NodeView],
    links: Links | None,
) -> tuple[ShardPlan, str] | None:
    """A placed pipeline's plan estimated again with the links as they are now measured, and
    why it is over the spec's `max_token_latency_ms` ('' while within); None for a replica of
    one stage, or one whose stages' nodes or GPUs are not known."""
    s = spec.sharding
    if s is None or len(replica.stages) < 2:
        return None
    weights, kv = weights_bytes(s), kv_cache_bytes(s)
    ctx = _Ctx(spec, s, weights + kv, weights, kv, s.layers, [], links)
    groups: list[_Unit] = []
    split: list[int] = []
    for stage in sorted(replica.stages, key=lambda st: st.rank):
        node = nodes.get(stage.node_id)
        gpus = [g for g in node.gpus if g.index in stage.gpu_indices] if node else []
        if not gpus or stage.last_layer <= stage.first_layer:
            return None
        vram = min(g.vram_mib for g in gpus)
        groups.append(_Unit(stage.node_id, gpus[0].model, stage.gpu_indices, vram))
        split.append(stage.last_layer - stage.first_layer)
    if sum(split) != ctx.layers:
        return None
    estimate = _make_plan(ctx, groups, split)
    return estimate, _over_bound(ctx, estimate)


def weights_bytes(s: ShardingSpec) -> int:
    if s.weights_gib > 0:
        return math.ceil(s.weights_gib * GIB)
    return math.ceil(s.params_b * 1e9 * BYTES_PER_PARAM.get(s.precision, 2.0))


def kv_cache_bytes(s: ShardingSpec) -> int:
    if s.kv_cache_gib > 0:
        return math.ceil(s.kv_cache_gib * GIB)
    return s.context_tokens * s.concurrent_sequences * s.kv_bytes_per_token


def bandwidth_gbs(model: str) -> float:
    name = "".join(c for c in model.lower() if c.isalnum())
    for key, gbs in BANDWIDTH_GBS:
        if key in name:
            return gbs
    return DEFAULT_BANDWIDTH_GBS


@dataclass(frozen=True, slots=True)
class _Unit:
    """A node's GPUs of one model that a stage could use."""

    node_id: str
    model: str
    indices: tuple[int, ...]
    vram_mib: int  # the smallest of them

    @property
    def count(self) -> int:
        return len(self.indices)

    @property
    def cap(self) -> int:
        """Bytes the group may hold, all GPUs together, within the headroom."""
        return self.count * self.vram_mib * MIB * HEADROOM_NUM // HEADROOM_DEN


# What a stage link over the overlay adds (sharding.stage_links = "overlay"): the agents carry
# it through the NATS server, measured on loopback (bench/stage_link.py, 2026-11-26: a 1-byte
# round trip 0.24 ms against 0.02 ms direct, 0.27 ms with TLS; a 64 MiB push at 2.7-3.8
# Gbit/s, bounded by the agents' CPU). Added to the link's round trip, and its bandwidth
# capped, at every boundary.
OVERLAY_RTT_MS = 0.25
OVERLAY_GBPS = 3.0


@dataclass(frozen=True, slots=True)
class _Hop:
    """One boundary between consecutive stages: its link's figures and the time a token's
    activations take over it."""

    a: str
    b: str
    ms: float
    rtt_ms: float
    gbps: float
    measured: bool
    overlay: bool = False

    def describe(self) -> str:
        how = "measured" if self.measured else "assumed"
        over = (
            f", over the overlay +{OVERLAY_RTT_MS:g} ms and at most {OVERLAY_GBPS:g} Gbit/s"
            if self.overlay
            else ""
        )
        return (
            f"{self.a}-{self.b} {self.ms:.2f} ms ({how} {self.rtt_ms:.2f} ms round trip, "
            f"{self.gbps:g} Gbit/s{over})"
        )


@dataclass(slots=True)
class _Ctx:
    spec: ClusterSpec
    s: ShardingSpec
    need: int  # bytes: weights + KV cache
    weights: int
    kv: int
    layers: int
    rejected: list[Rejected]
    links: Links | None = None

    def hop(self, a: str, b: str) -> _Hop:
        """The boundary between stages on `a` and `b`: the link as measured, else assumed."""
        hidden = self.s.hidden_size or DEFAULT_HIDDEN_SIZE
        batch = max(1, self.s.concurrent_sequences)
        bits = hidden * ACTIVATION_BYTES * batch * 8
        seen = self.links.link(a, b) if self.links is not None else None
        if seen is not None and seen.gbps > 0:
            rtt, gbps, measured = seen.rtt_ms, seen.gbps, True
        else:
            rtt, gbps, measured = self.s.link_rtt_ms, self.s.link_gbps, False
        overlay = self.s.stage_links == "overlay"
        if overlay:
            rtt, gbps = rtt + OVERLAY_RTT_MS, min(gbps, OVERLAY_GBPS)
        ms = bits / (gbps * 1e9) * 1e3 + rtt
        return _Hop(a, b, ms, rtt, gbps, measured, overlay)


def plan(
    spec: ClusterSpec,
    nodes: Sequence[NodeView],
    placements: Sequence[ReplicaView],
    *,
    avoid: Collection[str] = (),
    now_ns: int = 0,
    links: Links | None = None,
) -> ShardPlan | NoPlan:
    """Plan one replica of `spec` on the fleet as it is; `spec.sharding` must be set.
    `now_ns`: the wall clock, for cordons that end (0: every recorded cordon holds). `avoid`:
    nodes it must not use, refused as the scheduler refuses them. `links`: the fleet's link
    view; a pair it has not measured is taken at the spec's `link_gbps` and `link_rtt_ms`."""
    s = spec.sharding
    if s is None:
        return NoPlan(cluster=spec.name, reason=f"{spec.name} has no [sharding] section")
    weights, kv = weights_bytes(s), kv_cache_bytes(s)
    ctx = _Ctx(spec, s, weights + kv, weights, kv, s.layers, [], links)
    units = _units(ctx, nodes, placements, now_ns, avoid)
    found = _one_node(ctx, units)
    if found is None and "pipeline" in s.parallelism and s.layers >= 2:
        where = {node.node_id: node.region for node in nodes}
        found = _pipeline_in_a_region(ctx, units, where) if not s.cross_region else None
        if found is None:
            found = _pipeline(ctx, units)
            if found is not None and not s.cross_region:
                # It fits only across regions: say so, and place nothing.
                spans = "+".join(sorted({where.get(st.node_id, "") for st in found.stages}))
                ctx.rejected.insert(
                    0,
                    _rejected(
                        found,
                        f"spans regions {spans}: a pipeline stays in one region unless "
                        "sharding.cross_region = true",
                    ),
                )
                found = None
    total = len(ctx.rejected)
    listed = tuple(ctx.rejected[:LISTED])
    if found is None:
        return NoPlan(
            cluster=spec.name, reason=_no_plan_reason(ctx, units), rejected=listed,
            rejected_total=total,
        )  # fmt: skip
    return msgspec.structs.replace(found, rejected=listed, rejected_total=total)


def _pipeline_in_a_region(
    ctx: _Ctx, units: dict[str, list[_Unit]], where: dict[str, str]
) -> ShardPlan | None:
    """The best pipeline whose stages share a region: per region, `_pipeline` on its nodes;
    then the fewest stages, GPUs, the lowest estimate and the node ids, as within one."""
    by_region: dict[str, dict[str, list[_Unit]]] = {}
    for node_id, node_units in sorted(units.items()):
        by_region.setdefault(where.get(node_id, ""), {})[node_id] = node_units
    if len(by_region) == 1:
        return _pipeline(ctx, units)
    found = [p for _, sub in sorted(by_region.items()) if (p := _pipeline(ctx, sub)) is not None]
    if not found:
        return None
    return min(
        found,
        key=lambda p: (len(p.stages), p.gpus, p.token_ms, [s.node_id for s in p.stages]),
    )


def _units(
    ctx: _Ctx,
    nodes: Sequence[NodeView],
    placements: Sequence[ReplicaView],
    now_ns: int,
    avoid: Collection[str] = (),
) -> dict[str, list[_Unit]]:
    """Per eligible node (by id), its free GPUs of each accepted model, all of them; the
    nodes the scheduler's filters refuse go to `ctx.rejected` with the scheduler's reason."""
    spec = ctx.spec
    taken = _taken(placements)
    need = _Need.of(msgspec.structs.replace(spec, gpu=_one_gpu(spec.gpu)))
    units: dict[str, list[_Unit]] = {}
    for node in sorted(nodes, key=lambda n: n.node_id):
        used = taken.get(node.node_id, set())
        verdict = _filter(node, spec, used, avoid, need, now_ns=now_ns)
        if isinstance(verdict, _Reject):
            ctx.rejected.append(Rejected(nodes=(node.node_id,), gpus=0, reason=verdict.detail))
            continue
        by_model: dict[str, list[tuple[int, int]]] = {}
        for gpu in _unique_by_index(node.gpus):
            ok_model = accepts(need.models, gpu.model)
            if ok_model and gpu.vram_mib >= need.min_vram_mib and gpu.index not in used:
                by_model.setdefault(gpu.model, []).append((gpu.index, gpu.vram_mib))
        units[node.node_id] = [
            _Unit(node.node_id, model, tuple(i for i, _ in gpus), min(v for _, v in gpus))
            for model, gpus in sorted(by_model.items())
        ]
    return units


def _one_gpu(gpu: GpuRequirement) -> GpuRequirement:
    return msgspec.structs.replace(gpu, count=1)


def _degrees(ctx: _Ctx, free: int) -> list[int]:
    allowed = TENSOR_DEGREES if "tensor" in ctx.s.parallelism else (1,)
    return [d for d in allowed if d <= free]


def _group(unit: _Unit, d: int) -> _Unit:
    # The lowest indices keep a node's allocations packed, as the scheduler does.
    return _Unit(unit.node_id, unit.model, unit.indices[:d], unit.vram_mib)


def _one_node(ctx: _Ctx, units: dict[str, list[_Unit]]) -> ShardPlan | None:
    fits: list[tuple[int, float, str, str, ShardPlan]] = []
    for node_id, node_units in units.items():
        for unit in node_units:
            groups = [_group(unit, d) for d in _degrees(ctx, unit.count)]
            fitting = [g for g in groups if g.cap >= ctx.need]
            if not fitting:
                biggest = groups[-1]
                ctx.rejected.append(
                    Rejected(
                        nodes=(node_id,),
                        gpus=biggest.count,
                        reason=f"does not fit: {_gib(ctx.need)} GiB needed, "
                        f"{_gib(biggest.cap)} GiB usable on {_gpus(biggest)}",
                    )
                )
                continue
            group = fitting[0]
            candidate = _make_plan(ctx, [group], [ctx.layers])
            fits.append((group.count, candidate.token_ms, node_id, unit.model, candidate))
    fits.sort(key=lambda f: f[:4])
    return _first_within_bound(ctx, [f[4] for f in fits])


def _first_within_bound(ctx: _Ctx, candidates: Sequence[ShardPlan]) -> ShardPlan | None:
    """The first candidate within `max_token_latency_ms`; the others are recorded."""
    chosen: ShardPlan | None = None
    for candidate in candidates:
        if chosen is not None:
            ctx.rejected.append(_lost_to(candidate, chosen))
            continue
        over = _over_bound(ctx, candidate)
        if over:
            ctx.rejected.append(_rejected(candidate, over))
        else:
            chosen = candidate
    return chosen


def _over_bound(ctx: _Ctx, p: ShardPlan) -> str:
    bound = ctx.s.max_token_latency_ms
    if bound <= 0 or p.token_ms <= bound:
        return ""
    slow = "a link too slow: " if p.link_ms > p.compute_ms else "too slow: "
    slowest = _slowest(_hops(ctx, p.stages))
    link = f"; slowest link {slowest.describe()}" if slowest is not None else ""
    return (
        f"{slow}estimated {p.token_ms:.2f} ms per token > max_token_latency_ms {bound:g} "
        f"(compute {p.compute_ms:.2f} ms + links {p.link_ms:.2f} ms{link})"
    )


def _lost_to(p: ShardPlan, winner: ShardPlan) -> Rejected:
    if p.gpus != winner.gpus:
        why = f"fits, but on {p.gpus} GPUs against {winner.gpus}"
    else:
        why = f"fits, but {p.token_ms:.2f} ms per token against {winner.token_ms:.2f}"
    return _rejected(p, why)


def _rejected(p: ShardPlan, reason: str) -> Rejected:
    return Rejected(nodes=tuple(st.node_id for st in p.stages), gpus=p.gpus, reason=reason)


def _pipeline(ctx: _Ctx, units: dict[str, list[_Unit]]) -> ShardPlan | None:
    groups_by_node = {
        node_id: [_group(u, d) for u in node_units for d in _degrees(ctx, u.count)]
        for node_id, node_units in units.items()
    }
    most = min(MAX_STAGES, ctx.layers, len(groups_by_node))
    for k in range(2, most + 1):
        ranked: list[tuple[int, float, int, tuple[str, ...], int, ShardPlan]] = []
        for i, groups in enumerate(_selections(ctx, groups_by_node, k)):
            names = tuple(g.node_id for g in groups)
            split = _split(ctx, groups)
            if isinstance(split, str):
                count = sum(g.count for g in groups)
                ctx.rejected.append(Rejected(nodes=names, gpus=count, reason=split))
                continue
            p = _make_plan(ctx, groups, split)
            ranked.append((p.gpus, p.token_ms, -sum(g.cap for g in groups), names, i, p))
        # The fewest GPUs, then the lowest estimate (measured links count here), then the
        # most usable memory, then the node ids.
        ranked.sort(key=lambda r: r[:5])
        found = _first_within_bound(ctx, [r[5] for r in ranked])
        if found is not None:
            return found
    return None


def _selections(ctx: _Ctx, groups_by_node: dict[str, list[_Unit]], k: int) -> list[list[_Unit]]:
    """For `k` stages on `k` nodes, the selections that hold the model, stages by node id:
    every one (up to MAX_SELECTIONS tried) where at most ENUMERATE_NODES nodes are eligible,
    so that the estimate with measured links can rank them; else `_most_memory`'s."""
    if len(groups_by_node) > ENUMERATE_NODES:
        return _most_memory(ctx, groups_by_node, k)
    found: list[list[_Unit]] = []
    tried = 0
    for names in itertools.combinations(sorted(groups_by_node), k):
        for choice in itertools.product(*(groups_by_node[n] for n in names)):
            tried += 1
            if sum(g.cap for g in choice) >= ctx.need:
                found.append(list(choice))
            if tried >= MAX_SELECTIONS:
                return found
    return found


def _most_memory(ctx: _Ctx, groups_by_node: dict[str, list[_Unit]], k: int) -> list[list[_Unit]]:
    """For `k` stages on `k` nodes: per total GPU count, ascending, the selection with the
    most usable memory that holds the model, stages by node id.

    Only the `k` largest groups of each size can be in such a selection (any other group of
    that size is beaten by one of them on a node the other stages leave free), so the search
    runs over those nodes alone, whatever the fleet's size."""
    pool: set[str] = set()
    for d in TENSOR_DEGREES:
        sized = sorted(
            (g for groups in groups_by_node.values() for g in groups if g.count == d),
            key=lambda g: (-g.cap, g.node_id, g.model),
        )
        nodes: list[str] = []
        for g in sized:
            if g.node_id not in nodes:
                nodes.append(g.node_id)
                if len(nodes) == k:
                    break
        pool.update(nodes)
    # (stages, GPUs) -> (usable bytes, groups); nodes in id order, a strictly better one wins.
    best: dict[tuple[int, int], tuple[int, tuple[_Unit, ...]]] = {(0, 0): (0, ())}
    for node_id in sorted(pool):
        for (j, count), (cap, chosen) in sorted(best.items()):
            if j == k:
                continue
            for group in groups_by_node[node_id]:
                key = (j + 1, count + group.count)
                value = cap + group.cap
                if key not in best or value > best[key][0]:
                    best[key] = (value, (*chosen, group))
    return [
        list(chosen) for (j, _), (cap, chosen) in sorted(best.items()) if j == k and cap >= ctx.need
    ]


def _split(ctx: _Ctx, groups: Sequence[_Unit]) -> list[int] | str:
    """Whole layers per stage in proportion to usable memory, each within its memory, or why
    not. Exact integer arithmetic: a layer takes `need / layers` bytes."""
    layers, need = ctx.layers, ctx.need
    caps = [g.cap for g in groups]
    total = sum(caps)
    most = [cap * layers // need for cap in caps]  # layers each stage can hold
    if sum(most) < layers:
        return (
            f"does not fit in whole layers: {layers} layers of {_gib(need / layers)} GiB, "
            f"the stages hold {sum(most)}"
        )
    share = [min(cap * layers // total, m) for cap, m in zip(caps, most, strict=True)]
    while sum(share) < layers:
        # The stage furthest below its proportional share that can take one more layer.
        room = [i for i in range(len(groups)) if share[i] < most[i]]
        i = max(room, key=lambda i: (layers * caps[i] - share[i] * total, -i))
        share[i] += 1
    if min(share) == 0:
        empty = groups[share.index(0)].node_id
        return f"stage on {empty} would hold no layer (fewer stages suffice)"
    return share


def _make_plan(ctx: _Ctx, groups: Sequence[_Unit], split: Sequence[int]) -> ShardPlan:
    layers = ctx.layers
    stages: list[Stage] = []
    first = 0
    for group, n in zip(groups, split, strict=True):
        held = ctx.need * n / layers if layers else float(ctx.need)
        seconds = held / (group.count * bandwidth_gbs(group.model) * 1e9)
        stages.append(
            Stage(
                node_id=group.node_id,
                gpu_model=group.model,
                gpu_indices=group.indices,
                first_layer=first,
                last_layer=first + n,
                vram_mib=group.vram_mib,
                used_mib=math.ceil(held / group.count / MIB),
                compute_ms=round(seconds * 1e3, 3),
            )
        )
        first += n
    compute = sum(st.compute_ms for st in stages)
    hops = _hops(ctx, stages)
    # Every boundary taken at the slowest one's time: the docs' formula, (stages - 1) x t_l.
    link = max((h.ms for h in hops), default=0.0) * len(hops)
    gpus = sum(g.count for g in groups)
    plan = ShardPlan(
        cluster=ctx.spec.name,
        gpus=gpus,
        stages=tuple(stages),
        layers=layers,
        weights_gib=round(ctx.weights / GIB, 3),
        kv_cache_gib=round(ctx.kv / GIB, 3),
        token_ms=round(compute + link, 3),
        compute_ms=round(compute, 3),
        link_ms=round(link, 3),
        why="",
    )
    return msgspec.structs.replace(plan, why=_why(ctx, plan, hops))


def _hops(ctx: _Ctx, stages: Sequence[Stage]) -> list[_Hop]:
    return [ctx.hop(a.node_id, b.node_id) for a, b in itertools.pairwise(stages)]


def _slowest(hops: Sequence[_Hop]) -> _Hop | None:
    """The slowest boundary (the first of equals, in rank order)."""
    slowest: _Hop | None = None
    for h in hops:
        if slowest is None or h.ms > slowest.ms:
            slowest = h
    return slowest


def _links_note(hops: Sequence[_Hop]) -> str:
    slowest = _slowest(hops)
    if slowest is None:
        return ""
    assumed = sum(not h.measured for h in hops)
    note = f"; slowest link {slowest.describe()}"
    if assumed == len(hops):
        note += ", no link measured yet: the spec's link_gbps and link_rtt_ms assumed"
    elif assumed:
        note += f", {assumed} of {len(hops)} links not measured yet: assumed from the spec"
    return note


def _why(ctx: _Ctx, p: ShardPlan, hops: Sequence[_Hop] = ()) -> str:
    held = f"{_gib(ctx.need)} GiB ({_gib(ctx.weights)} weights + {_gib(ctx.kv)} KV cache)"
    if len(p.stages) == 1:
        st = p.stages[0]
        how = "one GPU" if p.gpus == 1 else f"tensor parallel over {p.gpus} GPUs"
        where = f"{how} on {st.node_id} ({st.gpu_model} {','.join(map(str, st.gpu_indices))})"
    else:
        parts = [
            f"{st.node_id} {st.gpu_model} x{len(st.gpu_indices)} layers "
            f"{st.first_layer}-{st.last_layer - 1}"
            for st in p.stages
        ]
        where = f"{len(p.stages)} pipeline stages: " + ", ".join(parts)
    return (
        f"{held} on {where}; estimated {p.token_ms:.2f} ms per token "
        f"(compute {p.compute_ms:.2f} ms + links {p.link_ms:.2f} ms){_links_note(hops)}"
    )


def _no_plan_reason(ctx: _Ctx, units: dict[str, list[_Unit]]) -> str:
    held = f"{_gib(ctx.need)} GiB ({_gib(ctx.weights)} weights + {_gib(ctx.kv)} KV cache)"
    parts = []
    filtered = sum(1 for r in ctx.rejected if r.gpus == 0)
    if filtered:
        parts.append(f"{filtered} node{'s' if filtered != 1 else ''} refused by the filters")
    if not units:
        parts.append("no node has a free GPU that passes them")
    small = sum(1 for r in ctx.rejected if r.reason.startswith("does not fit"))
    if small:
        parts.append(f"{small} too small")
    slow = [r.reason for r in ctx.rejected if "ms per token >" in r.reason]
    if slow:
        parts.append(f"{len(slow)} over the latency bound (first: {slow[0]})")
    if "pipeline" not in ctx.s.parallelism and len(units) > 1:
        parts.append("pipeline across nodes not allowed")
    spans = [r.reason for r in ctx.rejected if r.reason.startswith("spans regions")]
    if spans:
        parts.append(f"it fits only across regions ({spans[0].split(':')[0]})")
    return f"nothing fits {ctx.spec.name}, {held}: " + ("; ".join(parts) or "no nodes")


def _gpus(g: _Unit) -> str:
    return f"{g.count} {g.model}" + (f" ({g.vram_mib} MiB)" if g.count == 1 else " GPUs")


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"
