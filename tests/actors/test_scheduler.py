"""The scheduler: each filter, each ranking rule, the explanations, and properties over fleets.

The property tests place replicas one after another on generated fleets, feed each placement
back in, and check every decision against a brute-force oracle written separately from the
scheduler: which nodes fit, and which of them the documented rules rank first.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence
from fractions import Fraction
from typing import Any

import msgspec
import pytest
from hypothesis import Phase, given, settings, strategies as st

from actors.scheduler import LISTED, NoFit, Placement, free_gpus, schedule
from events import (
    Candidate,
    ClusterSpec,
    GpuInfo,
    GpuMetrics,
    GpuRequirement,
    ReplicaPlaced,
)
from projections.views import NodeView, ReplicaView

# ---------------------------------------------------------------------------------------------
# Builders


def gpu(index: int, model: str = "A100", vram: int = 81920) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{model}-{index}", model=model, vram_mib=vram)


def node(
    node_id: str,
    gpus: int | Sequence[GpuInfo] = 2,
    *,
    model: str = "A100",
    vram: int = 81920,
    **fields: Any,
) -> NodeView:
    if isinstance(gpus, int):
        gpus = [gpu(i, model, vram) for i in range(gpus)]
    return NodeView(node_id=node_id, gpus=tuple(gpus), **fields)


def spec(
    name: str = "llama",
    *,
    count: int = 1,
    models: tuple[str, ...] = (),
    vram: int = 0,
    **fields: Any,
) -> ClusterSpec:
    return ClusterSpec(
        name=name, gpu=GpuRequirement(models=models, min_vram_mib=vram, count=count), **fields
    )


_ids = iter(range(10**9))


def replica(
    node_id: str,
    *gpu_indices: int,
    cluster: str = "other",
    status: Any = "placed",
) -> ReplicaView:
    return ReplicaView(
        replica_id=f"r{next(_ids)}",
        cluster=cluster,
        node_id=node_id,
        epoch=1,
        gpu_indices=gpu_indices,
        status=status,
    )


def decide(
    nodes: Sequence[NodeView],
    the_spec: ClusterSpec | None = None,
    placements: Sequence[ReplicaView] = (),
    *,
    seed: int = 0,
    avoid: Collection[str] = (),
) -> Placement | NoFit:
    return schedule(nodes, the_spec or spec(), placements, random.Random(seed), avoid=avoid)


def placed(*args: Any, **kwargs: Any) -> Placement:
    result = decide(*args, **kwargs)
    assert isinstance(result, Placement), result
    return result


def no_fit(*args: Any, **kwargs: Any) -> NoFit:
    result = decide(*args, **kwargs)
    assert isinstance(result, NoFit), result
    return result


def placed_event(result: Placement) -> ReplicaPlaced:
    """The event the cluster actor records for `result` (replica llama-0, epoch 1)."""
    return ReplicaPlaced(
        replica_id="llama-0",
        cluster="llama",
        node_id=result.node_id,
        gpu_indices=result.gpu_indices,
        epoch=1,
        why=result.why,
        candidates=result.candidates,
    )


def rejection(result: Placement | NoFit, node_id: str) -> str:
    (found,) = [c for c in result.candidates if c.node_id == node_id]
    return found.rejected


class NoDraws:
    """A random source that fails the test if the scheduler draws from it."""

    def _fail(self, *args: object) -> Any:
        raise AssertionError("the scheduler drew from rng without a tie")

    random = uniform = randint = getrandbits = choice = shuffle = _fail


# ---------------------------------------------------------------------------------------------
# Filters


@pytest.mark.parametrize("health", ["degraded", "unhealthy", "offline"])
def test_only_healthy_nodes_take_replicas(health: Any) -> None:
    sick = node("n1", health=health, health_reason="thermal")
    result = no_fit([sick])
    assert result.reason == f"no node fits llama: 1 {health}"
    assert rejection(result, "n1") == f"{health} (thermal)"
    assert placed([sick, node("n2")]).node_id == "n2"


def test_drained_nodes_take_no_replicas() -> None:
    result = no_fit([node("n1", drained=True)])
    assert result.reason == "no node fits llama: 1 drained"
    assert placed([node("n1", drained=True), node("n2", price_per_hour=9)]).node_id == "n2"


def test_avoid_is_a_hard_filter() -> None:
    nodes = [node("n1", price_per_hour=0.1), node("n2", price_per_hour=5)]
    assert placed(nodes).node_id == "n1"
    assert placed(nodes, avoid={"n1"}).node_id == "n2"
    result = no_fit(nodes, avoid=["n1", "n2"])
    assert result.reason == "no node fits llama: 2 avoided"
    assert rejection(result, "n1") == "avoided for this placement"


def test_gpu_model_must_be_accepted() -> None:
    nodes = [node("a100", model="A100"), node("h100", model="H100", price_per_hour=9)]
    assert placed(nodes, spec(models=("H100",))).node_id == "h100"
    assert placed(nodes, spec(models=("H100", "A100"))).node_id == "a100"
    assert placed(nodes, spec(models=())).node_id == "a100"  # empty accepts any
    result = no_fit(nodes, spec(models=("L4",)))
    assert result.reason == "no node fits llama: 2 have no L4"
    assert rejection(result, "a100") == "no L4 (has 2x A100)"
    assert rejection(no_fit([node("bare", 0)]), "bare") == "no GPU (no GPUs)"


def test_a_spec_model_matches_the_name_nvml_reports() -> None:
    """NVML's names against a spec's: by family (events/gpu_names.py); a replica still gets
    GPUs of one name, the SXM and PCIe H100 being different cards."""
    sxm = node("sxm", model="NVIDIA H100 80GB HBM3", price_per_hour=2)
    pcie = node("pcie", model="NVIDIA H100 PCIe", price_per_hour=1)
    rtx = node("rtx", model="NVIDIA GeForce RTX 4090")
    assert placed([sxm, pcie, rtx], spec(models=("H100",))).node_id == "pcie"
    assert placed([sxm, pcie, rtx], spec(models=("H100 SXM",))).node_id == "sxm"
    assert placed([sxm, pcie, rtx], spec(models=("RTX4090",))).node_id == "rtx"
    result = no_fit([sxm, rtx], spec(models=("A100",)))
    assert rejection(result, "sxm") == "no A100 (has 2x NVIDIA H100 80GB HBM3)"
    mixed = node("mixed", [gpu(0, "NVIDIA H100 80GB HBM3"), gpu(1, "NVIDIA H100 PCIe")])
    assert rejection(no_fit([mixed], spec(count=2, models=("H100",))), "mixed") == (
        "1 NVIDIA H100 80GB HBM3 + 1 NVIDIA H100 PCIe free, needs 2 of one model"
    )


def test_each_chosen_gpu_has_enough_vram() -> None:
    small = node("small", vram=24576)
    mixed = node("mixed", [gpu(0, vram=24576), gpu(1, vram=81920)], price_per_hour=9)
    assert placed([small, mixed], spec(vram=40960)).gpu_indices == (1,)
    assert placed([small, mixed], spec(vram=40960)).node_id == "mixed"
    assert placed([small, mixed], spec(vram=24576)).node_id == "small"  # >=, not >
    result = no_fit([small, mixed], spec(vram=40960, count=2, models=("A100",)))
    assert rejection(result, "small") == "no A100 with >= 40960 MiB (24576 MiB)"
    assert rejection(result, "mixed") == "1 A100 free with >= 40960 MiB, needs 2"
    assert result.reason == (
        "no node fits llama: 1 has no A100 with >= 40960 MiB, 1 has < 2 free A100 with >= 40960 MiB"
    )


def test_enough_free_gpus_of_one_model() -> None:
    n = node("n1", 2)
    busy = [replica("n1", 0)]
    assert placed([n], spec(count=2)).gpu_indices == (0, 1)
    result = no_fit([n], spec(count=2), busy)
    assert rejection(result, "n1") == "1 A100 free, needs 2"
    assert result.reason == "no node fits llama: 1 has < 2 free GPU"
    assert no_fit([n], spec(count=1), [*busy, replica("n1", 1)]).reason == (
        "no node fits llama: 1 has no free GPU"
    )
    # Two accepted models, one free GPU of each: a replica's GPUs are all of one model.
    mixed = node("mixed", [gpu(0, "A100"), gpu(1, "H100")])
    result = no_fit([mixed], spec(count=2, models=("A100", "H100")))
    assert rejection(result, "mixed") == "1 A100 + 1 H100 free, needs 2 of one model"


def test_required_labels_must_be_present_and_equal() -> None:
    the_spec = spec(labels={"tier": "gold", "net": "ib"})
    missing = node("missing", labels={"tier": "gold"})
    other = node("other", labels={"tier": "silver", "net": "ib"})
    extra = node("extra", labels={"tier": "gold", "net": "ib", "x": "y"}, price_per_hour=9)
    assert placed([missing, other, extra], the_spec).node_id == "extra"
    result = no_fit([missing, other], the_spec)
    assert rejection(result, "missing") == "label net=ib missing"
    assert rejection(result, "other") == "label tier=silver, not gold"
    assert result.reason == "no node fits llama: 2 lack labels net=ib,tier=gold"
    assert placed([missing], spec(labels={})).node_id == "missing"


def test_regions_are_a_hard_filter() -> None:
    # The cheapest node is in the wrong region: a preference would lose to nothing, a
    # constraint must win over price.
    cheap_us = node("cheap-us", region="us-east", price_per_hour=0.1)
    eu = node("eu", region="eu-west", price_per_hour=9)
    central = node("central", region="eu-central", price_per_hour=5)
    nowhere = node("nowhere", price_per_hour=0.1)
    the_spec = spec(regions=("eu-west", "eu-central"))
    assert placed([cheap_us, eu, central, nowhere], the_spec).node_id == "central"
    assert placed([cheap_us, eu], the_spec).node_id == "eu"
    assert placed([cheap_us, nowhere], spec(regions=())).node_id in {"cheap-us", "nowhere"}

    result = no_fit([cheap_us, nowhere], the_spec)
    assert result.reason == "no node fits llama: 2 are outside regions eu-west/eu-central"
    assert rejection(result, "cheap-us") == "region us-east not in eu-west/eu-central"
    assert rejection(result, "nowhere") == "region ? not in eu-west/eu-central"
    one = no_fit([cheap_us], spec(regions=("eu-west",)))
    assert one.reason == "no node fits llama: 1 is outside regions eu-west"


def test_region_filter_ranks_among_the_other_filters() -> None:
    # Health, drain and avoid come first; the region comes before labels and GPUs, so a
    # summary names the region for a node that fails both.
    wrong_and_unlabelled = node("n1", region="us-east", labels={})
    result = no_fit([wrong_and_unlabelled], spec(regions=("eu-west",), labels={"tier": "gold"}))
    assert rejection(result, "n1") == "region us-east not in eu-west"
    sick = node("n2", region="us-east", health="unhealthy", health_reason="ecc")
    assert rejection(no_fit([sick], spec(regions=("eu-west",))), "n2") == "unhealthy (ecc)"
    mixed = no_fit(
        [node("a", 0, region="eu-west"), node("b", region="us-east")], spec(regions=("eu-west",))
    )
    assert mixed.reason == "no node fits llama: 1 is outside regions eu-west, 1 has no GPU"


def test_preferred_region_still_ranks_within_the_allowed_regions() -> None:
    the_spec = spec(regions=("eu-west", "us-east"), preferred_region="us-east")
    nodes = [node("eu", region="eu-west"), node("us", region="us-east", price_per_hour=9)]
    result = placed(nodes, the_spec)
    assert result.node_id == "us"
    assert "region preference" in result.why


def test_failed_and_stopped_replicas_release_their_gpus() -> None:
    n = node("n1", 1)
    assert placed([n], spec(), [replica("n1", 0, status="failed")]).gpu_indices == (0,)
    assert placed([n], spec(), [replica("n1", 0, status="stopped")]).gpu_indices == (0,)
    for holding in ("pending", "placed", "starting", "ready", "stopping"):
        assert isinstance(decide([n], spec(), [replica("n1", 0, status=holding)]), NoFit)


def test_first_failing_filter_is_the_reason() -> None:
    sick_and_drained = node("n1", 0, health="offline", health_reason="", drained=True)
    assert rejection(no_fit([sick_and_drained]), "n1") == "offline"


def test_nofit_reason_counts_causes_in_filter_order() -> None:
    nodes = [
        node("n1", 1, model="RTX4090", vram=24576, health="unhealthy"),
        node("n2", 1, model="RTX4090", vram=24576, health="unhealthy"),
        node("n3", 1, model="RTX4090", vram=24576),
        node("n4", 1, model="RTX4090", vram=24576, drained=True),
    ]
    the_spec = spec(models=("RTX4090",), vram=24576)
    result = no_fit(nodes, the_spec, [replica("n3", 0)])
    assert result.reason == (
        "no node fits llama: 2 unhealthy, 1 drained, 1 has no free RTX4090 with >= 24576 MiB"
    )
    assert [c.node_id for c in result.candidates] == ["n1", "n2", "n3", "n4"]
    assert all(c.rejected and c.score == 0 for c in result.candidates)


def test_no_nodes_and_bad_specs_are_a_nofit_not_a_crash() -> None:
    assert no_fit([]).reason == "no node fits llama: no nodes"
    assert "gpu.count is -1" in no_fit([node("n1")], spec(count=-1)).reason


def test_zero_gpus_needs_no_gpu() -> None:
    result = placed([node("cpu", 0)], spec(count=0, models=("H100",), vram=99999))
    assert (result.node_id, result.gpu_indices) == ("cpu", ())


# ---------------------------------------------------------------------------------------------
# Ranking: each rule decides when the rules above it tie, and beats every rule below it


def test_spread_first_never_two_on_one_node_while_another_fits() -> None:
    # n1 wins every lower rule: zone, preferred region, load, price. n2 is the only other fit.
    n1 = node("n1", 8, region="eu-west", zone="a", price_per_hour=0.1)
    n2 = node("n2", 2, region="us-east", zone="a", price_per_hour=9)
    busy = [replica("n2", 0), replica("n1", 0, cluster="llama")]
    result = placed([n1, n2], spec(preferred_region="eu-west"), busy)
    assert result.node_id == "n2"
    assert result.why.startswith("n2: wins on spread (0 replicas of llama there vs 1 on n1)")


def test_spread_counts_only_this_clusters_replicas() -> None:
    n1 = node("n1", 4, price_per_hour=0.1)
    n2 = node("n2", 4, price_per_hour=0.2)
    busy = [replica("n1", 0, cluster="other"), replica("n2", 0, cluster="other")]
    assert placed([n1, n2], spec(), busy).node_id == "n1"  # price, not spread
    assert placed([n1, n2], spec("other"), busy[:1]).node_id == "n2"  # spread for `other`


def test_zone_spread_then_region_spread() -> None:
    held = node("held", 1, region="eu-west", zone="a")
    same_zone = node("same-zone", region="eu-west", zone="a", price_per_hour=0.1)
    other_zone = node("other-zone", region="eu-west", zone="b", price_per_hour=0.5)
    other_region = node("other-region", region="us-east", zone="c", price_per_hour=0.9)
    ours = [replica("held", 0, cluster="llama")]
    the_spec = spec(preferred_region="eu-west")

    result = placed([held, same_zone, other_zone], the_spec, ours)
    assert result.node_id == "other-zone"
    assert "wins on zone spread (0 replicas of llama in zone eu-west/b vs 1" in result.why

    # Region spread beats the preferred region, the load and the price.
    result = placed([held, same_zone, other_zone, other_region], the_spec, ours)
    assert result.node_id == "other-region"
    assert "wins on region spread (0 replicas of llama in region us-east vs 1 in eu-west" in (
        result.why
    )


def test_zones_are_named_within_their_region() -> None:
    held = node("held", 1, region="eu-west", zone="a")
    us_a = node("us-a", region="us-east", zone="a", price_per_hour=0.1)
    us_b = node("us-b", region="us-east", zone="b", price_per_hour=0.5)
    result = placed([held, us_a, us_b], spec(), [replica("held", 0, cluster="llama")])
    # Zone "a" of us-east holds no llama: the cheaper node wins.
    assert result.node_id == "us-a"
    assert "wins on price" in result.why


def test_a_replica_on_a_node_no_longer_known_counts_towards_no_zone() -> None:
    nodes = [node("n1", zone="a", price_per_hour=0.1), node("n2", zone="b", price_per_hour=0.5)]
    assert placed(nodes, spec(), [replica("gone", 0, cluster="llama")]).node_id == "n1"


def test_preferred_region_same_then_near_then_far() -> None:
    far = node("far", region="us-east", price_per_hour=0.1)
    near = node("near", region="eu-central", price_per_hour=0.5)
    same = node("same", region="eu-west", price_per_hour=0.9)
    the_spec = spec(preferred_region="eu-west")
    result = placed([far, near, same], the_spec)
    assert result.node_id == "same"
    assert "wins on region preference (region eu-west matches preferred eu-west" in result.why
    result = placed([far, near], the_spec)
    assert result.node_id == "near"
    assert "eu-central is near preferred eu-west, us-east on far is far from it" in result.why
    assert placed([far, near, same], spec(preferred_region="")).node_id == "far"
    # A region-less node is far from any preference.
    assert placed([node("nowhere"), far], spec(preferred_region="us-east")).node_id == "far"


def test_least_allocated_fraction_of_gpus() -> None:
    small = node("small", 2, price_per_hour=0.1)  # 1 of 2 used
    big = node("big", 4, price_per_hour=0.9)  # 1 of 4 used
    busy = [replica("small", 0), replica("big", 0)]
    result = placed([small, big], spec(), busy)
    assert result.node_id == "big"
    assert "wins on GPU load (1/4 GPUs used vs 1/2 on small)" in result.why


def test_equal_fractions_tie_exactly_and_fall_through_to_price() -> None:
    quarter = node("quarter", 4, price_per_hour=0.9)  # 1/4
    eighths = node("eighths", 8, price_per_hour=0.1)  # 2/8
    busy = [replica("quarter", 0), replica("eighths", 0, 1)]
    assert placed([quarter, eighths], spec(), busy).node_id == "eighths"


def test_then_lowest_mean_utilization() -> None:
    hot = node(
        "hot",
        price_per_hour=0.1,
        metrics=(GpuMetrics(index=0, utilization_pct=90), GpuMetrics(index=1, utilization_pct=70)),
    )
    cool = node("cool", price_per_hour=0.9, metrics=(GpuMetrics(index=0, utilization_pct=20),))
    result = placed([hot, cool], spec())
    assert result.node_id == "cool"
    assert "wins on utilization (mean utilization 20% vs 80% on hot)" in result.why
    # A node with no metrics yet counts as idle.
    assert placed([cool, node("fresh", price_per_hour=5)], spec()).node_id == "fresh"


def test_then_cheapest() -> None:
    result = placed([node("dear", price_per_hour=2.5), node("cheap", price_per_hour=0.4)])
    assert result.node_id == "cheap"
    assert "wins on price ($0.40/h vs $2.50/h on dear)" in result.why


def test_why_never_prints_the_deciding_values_as_equal() -> None:
    close = [node("a", price_per_hour=0.401), node("b", price_per_hour=0.4)]
    assert "wins on price ($0.400/h vs $0.401/h on a)" in placed(close).why
    warm = [
        node("a", metrics=(GpuMetrics(index=0, utilization_pct=21.04),)),
        node("b", metrics=(GpuMetrics(index=0, utilization_pct=21.02),)),
    ]
    assert "(mean utilization 21.02% vs 21.04% on a)" in placed(warm).why


def test_nan_price_ranks_last_whatever_the_input_order() -> None:
    nodes = [node("nan", price_per_hour=math.nan), node("ok", price_per_hour=3)]
    assert placed(nodes).node_id == "ok"
    assert placed(nodes[::-1]).node_id == "ok"


# ---------------------------------------------------------------------------------------------
# GPU indices


def test_lowest_free_indices() -> None:
    n = node("n1", 4)
    busy = [replica("n1", 0), replica("n1", 2, status="ready")]
    assert placed([n], spec(count=2), busy).gpu_indices == (1, 3)
    assert free_gpus(n, busy) == (1, 3)
    assert free_gpus(n, [replica("n1", 0, status="failed"), replica("n2", 1)]) == (0, 1, 2, 3)


def test_indices_are_the_nodes_own_not_positions() -> None:
    n = node("n1", [gpu(7), gpu(3), gpu(5)])
    assert placed([n], spec(count=2)).gpu_indices == (3, 5)
    assert placed([n], spec(count=2), [replica("n1", 3)]).gpu_indices == (5, 7)
    assert free_gpus(n, [replica("n1", 5)]) == (3, 7)


def test_only_matching_gpus_are_chosen() -> None:
    n = node(
        "n1",
        [gpu(0, "L4", 24576), gpu(1, "A100", 40960), gpu(2, "A100", 81920), gpu(3, "A100", 81920)],
    )
    assert placed([n], spec(models=("A100",))).gpu_indices == (1,)
    assert placed([n], spec(models=("A100",), vram=81920, count=2)).gpu_indices == (2, 3)
    assert placed([n], spec()).gpu_indices == (0,)


def test_one_model_per_replica_with_the_lowest_indices() -> None:
    n = node("n1", [gpu(0, "H100"), gpu(1, "A100"), gpu(2, "H100"), gpu(3, "A100")])
    assert placed([n], spec(count=2)).gpu_indices == (0, 2)
    assert placed([n], spec(count=2), [replica("n1", 0)]).gpu_indices == (1, 3)


# ---------------------------------------------------------------------------------------------
# Determinism and ties


def test_identical_inputs_and_seed_give_identical_results() -> None:
    nodes = [node(f"n{i}", 2, region="eu-west", zone="a") for i in range(5)]
    results = {msgspec.json.encode(decide(nodes, seed=3)) for _ in range(5)}
    assert len(results) == 1


def test_exact_ties_are_broken_by_the_seed_not_the_input_order() -> None:
    nodes = [node(f"n{i}") for i in range(4)]
    winners = set()
    for seed in range(40):
        first = placed(nodes, seed=seed)
        assert placed(nodes[::-1], seed=seed) == first
        assert first.why.startswith(f"{first.node_id}: seeded tie-break among n0, n1, n2, n3")
        winners.add(first.node_id)
    # Equal idle nodes share the load instead of always filling the same one first.
    assert len(winners) > 1


def test_no_tie_no_draw() -> None:
    nodes = [node("n1", price_per_hour=1), node("n2", price_per_hour=2)]
    result = schedule(nodes, spec(), [], NoDraws())
    assert isinstance(result, Placement) and result.node_id == "n1"
    assert isinstance(schedule([node("n1", drained=True)], spec(), [], NoDraws()), NoFit)


# ---------------------------------------------------------------------------------------------
# why and candidates


def test_candidates_rank_the_accepted_then_list_the_rejected() -> None:
    nodes = [
        node("z-sick", health="unhealthy"),
        node("b", price_per_hour=0.3),
        node("a-drained", drained=True),
        node("c", price_per_hour=0.1),
        node("d", price_per_hour=0.2),
    ]
    result = placed(nodes)
    assert result.candidates == (
        Candidate(node_id="c", score=3.0),
        Candidate(node_id="d", score=2.0),
        Candidate(node_id="b", score=1.0),
        Candidate(node_id="a-drained", rejected="drained"),
        Candidate(node_id="z-sick", rejected="unhealthy (registered)"),
    )


def test_a_large_fleet_is_listed_in_summary_and_its_event_stays_small() -> None:
    # 3,000 equal idle nodes, 1,000 more offline: every decision is recorded as an event, so it
    # must not grow with the fleet (nats-server refuses messages over 1 MiB).
    idle = [node(f"n{i:04d}", 1) for i in range(3000)]
    down = [node(f"d{i:04d}", 1, health="offline", health_reason="silent") for i in range(1000)]
    result = placed(idle + down, seed=5)
    ranked = [c for c in result.candidates if not c.rejected]
    rejected = [c for c in result.candidates if c.rejected]
    assert len(ranked) == len(rejected) == LISTED
    assert ranked[0].node_id == result.node_id and ranked[0].score == 3000.0
    assert [c.score for c in ranked] == [float(3000 - i) for i in range(LISTED)]
    others = [c.node_id for c in ranked[1:]]
    assert others == sorted(others)  # the rest of the ranking: equal keys, by node id
    assert [c.node_id for c in rejected] == [f"d{i:04d}" for i in range(LISTED)]
    assert (
        "seeded tie-break among n0000, n0001, n0002, n0003, n0004, n0005, n0006, n0007 "
        "and 2992 more (equal on every rule)" in result.why
    )
    assert result.why.endswith(
        f"; 3000 fit, {LISTED} listed; 1000 rejected (1000 offline), 20 listed"
    )
    event = placed_event(result)
    assert len(msgspec.json.encode(event)) < 4096

    nothing = no_fit(idle + down, spec(models=("B200",)))
    assert nothing.reason == "no node fits llama: 1000 offline, 3000 have no B200"
    assert [c.node_id for c in nothing.candidates] == [f"d{i:04d}" for i in range(LISTED)]
    assert len(msgspec.json.encode(nothing)) < 4096


def test_the_listed_winner_leads_even_when_the_draw_takes_a_late_tie() -> None:
    nodes = [node(f"n{i:03d}", 1) for i in range(100)]
    late = {placed(nodes, seed=seed).node_id for seed in range(30)}
    assert any(n > f"n{LISTED:03d}" for n in late)  # the draw reaches past the listed ones
    for seed in range(30):
        result = placed(nodes, seed=seed)
        assert result.candidates[0].node_id == result.node_id
        assert len({c.node_id for c in result.candidates}) == LISTED


def test_why_is_one_line_naming_the_winner_and_its_facts() -> None:
    n1 = node("node-3", 4, region="eu-west", zone="a", price_per_hour=0.4)
    n2 = node("node-4", 4, region="us-east", zone="a", price_per_hour=0.4)
    result = placed([n1, n2], spec(preferred_region="eu-west"), [replica("node-3", 0)])
    assert result.why == (
        "node-3: wins on region preference (region eu-west matches preferred eu-west, "
        "us-east on node-4 is far from it); 0 replicas of llama there, 0 in zone eu-west/a, "
        "0 in region eu-west; region matches preferred eu-west; 1/4 GPUs used, util 0%, "
        "$0.40/h; GPUs 1"
    )
    only = placed([n1, node("x", drained=True)], spec())
    assert only.why.startswith("node-3: the only fit (1 rejected); ")
    evil = placed([node("bad\nid")])
    assert "\n" not in evil.why


def test_decisions_serialise_and_fill_a_replica_placed_event() -> None:
    result = placed([node("n1"), node("n2", drained=True)])
    assert msgspec.json.decode(msgspec.json.encode(result), type=Placement) == result
    event = placed_event(result)
    assert msgspec.json.decode(msgspec.json.encode(event), type=ReplicaPlaced) == event
    nofit = no_fit([node("n2", drained=True)])
    assert msgspec.json.decode(msgspec.json.encode(nofit), type=NoFit) == nofit
    with pytest.raises(AttributeError):
        result.node_id = "x"  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Properties over generated fleets

# GPUs named as NVML names them, and as `--fake-gpus` does (A100); specs name families.
MODELS = (
    "A100",
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H100 PCIe",
    "NVIDIA GeForce RTX 4090",
    "NVIDIA L4",
)
# The oracle's own table of which family each is (events/gpu_names.py is tested on its own).
FAMILY = dict(zip(MODELS, ("A100", "H100", "H100", "RTX4090", "L4"), strict=True))
VRAMS = (16384, 24576, 40960, 81920)
REGIONS = ("", "eu-west", "eu-central", "us-east")
ZONES = ("", "a", "b")
LABELS: tuple[dict[str, str], ...] = (
    {},
    {},
    {"tier": "gold"},
    {"tier": "silver"},
    {"tier": "gold", "net": "ib"},
)
HEALTH = ("healthy",) * 15 + ("degraded", "unhealthy", "offline")
RELEASED = ("failed", "stopped")
HOLDING = ("pending", "placed", "starting", "ready", "stopping")

# Few choices per node on purpose: generation dominates the cost of an example, and a failure
# shrinks in seconds rather than minutes. Small value sets make exact ties (price, load, zone
# names) common, since ties are where ordering bugs hide.
node_shapes = st.tuples(
    st.sampled_from(range(7)),  # how many GPUs
    st.sampled_from(["dense", "dense", "sparse", "mixed"]),  # their indices and models
    st.sampled_from(MODELS),
    st.sampled_from(VRAMS),
    st.sampled_from(REGIONS),
    st.sampled_from(ZONES),
    st.sampled_from(LABELS),
    st.sampled_from([0.4, 0.4, 0.9, 2.5]),  # price
    st.sampled_from([None, None, 0.0, 10.0, 95.5]),  # utilisation of every GPU, if reported
    st.sampled_from(HEALTH),
    st.sampled_from([False] * 9 + [True]),  # drained
)


NAMES = tuple(f"node-{i:02d}" for i in range(64))


@st.composite
def fleets(draw: st.DrawFn, sizes: tuple[int, int] = (1, 12)) -> list[NodeView]:
    # Drawn as a count and a seed rather than a list, which hypothesis keeps short: most fleets
    # should have several nodes competing. The input order is not the node id order.
    count, order = draw(st.integers(*sizes)), draw(st.integers(0, 2**16))
    names = NAMES if sizes[1] > 16 else NAMES[:16]
    ids = random.Random(order).sample(names, count)
    nodes = []
    for node_id in ids:
        size, layout, model, vram, region, zone, labels, price, util, health, drained = draw(
            node_shapes
        )
        if layout == "dense":
            gpus = tuple(gpu(i, model, vram) for i in range(size))
        elif layout == "sparse":  # gaps and reporting order differ from index order
            gpus = tuple(gpu(i, model, vram) for i in reversed(range(1, 2 * size, 2)))
        else:
            gpus = tuple(
                gpu(i, draw(st.sampled_from(MODELS[:3])), draw(st.sampled_from(VRAMS[2:])))
                for i in range(size)
            )
        metrics: tuple[GpuMetrics, ...] = ()
        if util is not None:
            metrics = tuple(GpuMetrics(index=g.index, utilization_pct=util) for g in gpus)
        nodes.append(
            NodeView(
                node_id=node_id,
                region=region,
                zone=zone,
                labels=labels,
                gpus=gpus,
                price_per_hour=price,
                health=health,
                drained=drained,
                metrics=metrics,
            )
        )
    return nodes


specs = st.builds(
    spec,
    st.sampled_from(["c0", "c1", "c2"]),
    count=st.sampled_from([0, 1, 1, 1, 2, 3]),
    models=st.sampled_from([(), (), (), ("A100",), ("A100", "H100"), ("RTX4090", "L4")]),
    vram=st.sampled_from([0, 0, 0, 24576, 40960, 81920]),
    labels=st.sampled_from([{}, {}, {}, {"tier": "gold"}]),
    preferred_region=st.sampled_from(REGIONS),
    regions=st.sampled_from(
        [(), (), (), ("eu-west",), ("eu-west", "eu-central"), ("us-east", ""), ("ap-south",)]
    ),
)
cluster_specs = st.lists(specs, min_size=1, max_size=3, unique_by=lambda s: s.name)

# One step of a run: place a replica of a cluster (avoiding some nodes, with a seed), or change
# the status of an earlier replica (releasing its GPUs, or not).
places = st.tuples(
    st.just("place"),
    st.integers(0, 2),  # which cluster
    st.sampled_from([(), (), (), (), (0,), (1, 2)]),  # which nodes to avoid
    st.integers(0, 2**32),  # the scheduler's seed, and how to shuffle the inputs
    st.sampled_from(HOLDING),  # the new replica's status
)
steps = st.one_of(
    places,
    places,
    places,
    st.tuples(st.just("status"), st.integers(0, 50), st.sampled_from(RELEASED + HOLDING)),
)
# The explain phase replays a failing run thousands of times to say which parts of it matter;
# on these multi-step runs that takes minutes, while the shrunk run already shows the cause.
FLEET_SETTINGS = settings(phases=[p for p in Phase if p is not Phase.explain])

runs = st.integers(1, 20).flatmap(lambda n: st.lists(steps, min_size=n, max_size=n))


def live(placements: Sequence[ReplicaView]) -> list[ReplicaView]:
    return [p for p in placements if p.status not in RELEASED]


def gpu_options(
    n: NodeView, the_spec: ClusterSpec, placements: Sequence[ReplicaView]
) -> list[tuple[int, ...]]:
    """Every allowed choice of GPU indices for one replica on `n`, by brute force."""
    taken = {i for p in live(placements) if p.node_id == n.node_id for i in p.gpu_indices}
    need = the_spec.gpu.count
    if need == 0:
        return [()]
    usable = [
        g
        for g in n.gpus
        if (not the_spec.gpu.models or FAMILY[g.model] in the_spec.gpu.models)
        and g.vram_mib >= the_spec.gpu.min_vram_mib
        and g.index not in taken
    ]
    options = []
    for model in {g.model for g in usable}:
        indices = sorted(g.index for g in usable if g.model == model)
        if len(indices) >= need:
            options.append(tuple(indices[:need]))
    return options


def fits(
    n: NodeView,
    the_spec: ClusterSpec,
    placements: Sequence[ReplicaView],
    avoid: Collection[str],
) -> bool:
    return (
        n.health == "healthy"
        and not n.drained
        and n.node_id not in avoid
        and (not the_spec.regions or n.region in the_spec.regions)
        and all(n.labels.get(k) == v for k, v in the_spec.labels.items())
        and bool(gpu_options(n, the_spec, placements))
    )


def rank(
    n: NodeView, nodes: Sequence[NodeView], the_spec: ClusterSpec, placements: Sequence[ReplicaView]
) -> tuple[int, int, int, int, Fraction, float, float]:
    """The documented ranking key, computed naively from the views."""
    ours = [p for p in live(placements) if p.cluster == the_spec.name]
    by_id = {m.node_id: m for m in nodes}
    known = [by_id[p.node_id] for p in ours if p.node_id in by_id]
    pref = the_spec.preferred_region
    if not pref or n.region == pref:
        distance = 0
    elif n.region and n.region.split("-")[0] == pref.split("-")[0]:
        distance = 1
    else:
        distance = 2
    mine = {g.index for g in n.gpus}
    used = {i for p in live(placements) if p.node_id == n.node_id for i in p.gpu_indices} & mine
    util = [m.utilization_pct for m in n.metrics]
    return (
        sum(p.node_id == n.node_id for p in ours),
        sum((m.region, m.zone) == (n.region, n.zone) for m in known),
        sum(m.region == n.region for m in known),
        distance,
        Fraction(len(used), len(mine)) if mine else Fraction(0),
        sum(util) / len(util) if util else 0.0,
        n.price_per_hour,
    )


@given(fleets(), cluster_specs, runs)
@FLEET_SETTINGS
def test_placements_on_generated_fleets_agree_with_the_oracle(
    nodes: list[NodeView], clusters: list[ClusterSpec], run: list[tuple[Any, ...]]
) -> None:
    placements: list[ReplicaView] = []
    ids = sorted(n.node_id for n in nodes)
    by_id = {n.node_id: n for n in nodes}
    for step in run:
        if step[0] == "status":
            # A released replica stays released: its slot comes back as a new placement.
            holding = [i for i, p in enumerate(placements) if p.status not in RELEASED]
            if holding:
                i = holding[step[1] % len(holding)]
                placements[i] = msgspec.structs.replace(placements[i], status=step[2])
            continue
        _, which, avoid_picks, seed, status = step
        the_spec = clusters[which % len(clusters)]
        avoid = {ids[i % len(ids)] for i in avoid_picks}
        result = schedule(nodes, the_spec, placements, random.Random(seed), avoid=avoid)
        fitting = [n for n in nodes if fits(n, the_spec, placements, avoid)]

        # (e) Same inputs and seed, same result; the order of nodes and placements is irrelevant.
        assert schedule(nodes, the_spec, placements, random.Random(seed), avoid=avoid) == result
        shuffled_nodes, shuffled_placements = list(nodes), list(placements)
        random.Random(~seed).shuffle(shuffled_nodes)
        random.Random(~seed).shuffle(shuffled_placements)
        again = schedule(
            shuffled_nodes, the_spec, shuffled_placements, random.Random(seed), avoid=avoid
        )
        assert again == result

        # Every node is a candidate exactly once, rejected exactly when the oracle says it
        # does not fit.
        assert sorted(c.node_id for c in result.candidates) == ids
        assert {c.node_id for c in result.candidates if not c.rejected} == {
            n.node_id for n in fitting
        }

        if isinstance(result, NoFit):
            # (d) NoFit only when no node fits.
            assert fitting == [], result.reason
            assert result.reason.startswith(f"no node fits {the_spec.name}: ")
            continue
        # (d) ... and a Placement whenever one does.
        chosen = by_id[result.node_id]
        assert "\n" not in result.why and result.why.startswith(f"{chosen.node_id}: ")

        # (a) It fits: health, drain, avoid, region, labels; the right count of distinct, free
        # GPUs of the node, of one accepted model, each with enough VRAM...
        assert chosen in fitting
        gpus = {g.index: g for g in chosen.gpus}
        assert len(set(result.gpu_indices)) == len(result.gpu_indices) == the_spec.gpu.count
        assert set(result.gpu_indices) <= set(free_gpus(chosen, placements))
        assert len({gpus[i].model for i in result.gpu_indices}) <= 1
        for i in result.gpu_indices:
            assert not the_spec.gpu.models or FAMILY[gpus[i].model] in the_spec.gpu.models
            assert gpus[i].vram_mib >= the_spec.gpu.min_vram_mib
        # ... and they are the lowest such indices.
        assert result.gpu_indices == min(gpu_options(chosen, the_spec, placements))

        # (c) Never two replicas of this cluster on one node while another fitting node has
        # fewer; and, beyond spread, the winner is first under the documented ranking.
        keys = {n.node_id: rank(n, nodes, the_spec, placements) for n in fitting}
        assert keys[chosen.node_id][0] == min(k[0] for k in keys.values())
        assert keys[chosen.node_id] == min(keys.values())
        ranked = [c for c in result.candidates if not c.rejected]
        assert ranked[0].node_id == chosen.node_id
        assert [c.score for c in ranked] == [float(len(ranked) - i) for i in range(len(ranked))]

        placements.append(
            ReplicaView(
                replica_id=f"{the_spec.name}-{len(placements)}",
                cluster=the_spec.name,
                node_id=result.node_id,
                epoch=1,
                gpu_indices=result.gpu_indices,
                status=status,
            )
        )

        # (b) No GPU index is ever held twice on a node, and every held index is the node's.
        for n in nodes:
            held = [i for p in live(placements) if p.node_id == n.node_id for i in p.gpu_indices]
            assert len(held) == len(set(held)), (n.node_id, held)
            assert set(held) <= {g.index for g in n.gpus}


@given(fleets(), specs, st.integers(0, 2**32))
@FLEET_SETTINGS
def test_filling_a_fleet_spreads_before_doubling_up(
    nodes: list[NodeView], the_spec: ClusterSpec, seed: int
) -> None:
    """Placing one cluster until nothing fits: each replica goes to a fitting node with the
    fewest replicas of the cluster, and the fleet does run out of room (unless a replica needs
    no GPU)."""
    placements: list[ReplicaView] = []
    rng = random.Random(seed)
    # Each replica that needs a GPU takes at least one, so this many steps must end in a NoFit.
    limit = sum(len(n.gpus) for n in nodes) + 1 if the_spec.gpu.count else 3 * len(nodes)
    for _ in range(limit):
        fitting = [n for n in nodes if fits(n, the_spec, placements, ())]
        result = schedule(nodes, the_spec, placements, rng)
        if isinstance(result, NoFit):
            assert fitting == []
            return
        counts = {n.node_id: sum(p.node_id == n.node_id for p in placements) for n in fitting}
        assert counts[result.node_id] == min(counts.values())
        placements.append(replica(result.node_id, *result.gpu_indices, cluster=the_spec.name))
    assert the_spec.gpu.count == 0


@given(fleets(sizes=(LISTED + 1, 64)), specs, st.integers(0, 2**32), st.data())
@FLEET_SETTINGS
def test_a_fleet_larger_than_the_listing_lists_the_best_and_counts_the_rest(
    nodes: list[NodeView], the_spec: ClusterSpec, seed: int, data: st.DataObject
) -> None:
    """Past LISTED nodes a decision names the best ranked (the winner first) and the first
    rejected by node id, LISTED of each at most, and its `why` counts what it left out; the
    decision itself still agrees with the oracle."""
    ids = sorted(n.node_id for n in nodes)
    holders = data.draw(st.lists(st.sampled_from(ids), max_size=8))
    placements = [replica(h, 0, cluster=the_spec.name) for h in holders]
    result = schedule(nodes, the_spec, placements, random.Random(seed))
    fitting = [n for n in nodes if fits(n, the_spec, placements, ())]
    rejected_ids = sorted(set(ids) - {n.node_id for n in fitting})
    rejected = [c for c in result.candidates if c.rejected]
    assert [c.node_id for c in rejected] == rejected_ids[:LISTED]
    if isinstance(result, NoFit):
        assert fitting == []
        assert sum(
            int(part.split()[0]) for part in result.reason.split(": ", 1)[1].split(", ")
        ) == (len(nodes))
        return
    keys = {n.node_id: rank(n, nodes, the_spec, placements) for n in fitting}
    order = sorted(keys, key=lambda nid: (keys[nid], nid))
    assert keys[result.node_id] == keys[order[0]]
    ranked = [c for c in result.candidates if not c.rejected]
    expected = [result.node_id, *(nid for nid in order if nid != result.node_id)][:LISTED]
    assert [c.node_id for c in ranked] == expected
    assert [c.score for c in ranked] == [float(len(fitting) - i) for i in range(len(ranked))]
    if len(fitting) > LISTED or len(rejected_ids) > LISTED:
        assert f"; {len(fitting)} fit, {len(ranked)} listed" in result.why
        if rejected_ids:
            assert f"; {len(rejected_ids)} rejected (" in result.why
    else:
        assert " listed" not in result.why


def test_a_node_holding_the_model_files_wins_over_a_less_loaded_one() -> None:
    files = "meta-llama/Llama-3.1-8B-Instruct"
    busy = node("busy", 2, cached_models=("a.gguf", files), price_per_hour=0.9)
    idle = node("idle", 2, cached_models=("a.gguf",), price_per_hour=0.1)
    held = [replica("busy", 0)]  # another cluster's: busy is half used
    result = placed([busy, idle], spec(model_files=files), held)
    assert result.node_id == "busy"
    assert f"wins on cache (model files {files} cached there, not on idle)" in result.why
    assert f"model files {files} cached there" in result.why
    # Without model_files the cache is no rule: the idle node wins on load, as before.
    assert placed([busy, idle], spec(), held).node_id == "idle"
    # Spread still comes first: a second replica goes to the node without the files.
    ours = [replica("busy", 0, cluster="llama")]
    result = placed([busy, idle], spec(model_files=files), ours)
    assert result.node_id == "idle" and "model files " + files + " not cached there" in result.why


def test_region_preference_comes_before_the_cache() -> None:
    files = "x.gguf"
    cached_far = node("far", region="us-east", cached_models=(files,))
    near = node("near", region="eu-west")
    result = placed([cached_far, near], spec(preferred_region="eu-west", model_files=files))
    assert result.node_id == "near" and "wins on region preference" in result.why


def test_a_node_holding_the_image_wins_and_the_reason_says_so() -> None:
    from actors.scheduler import image_ref

    assert image_ref("vllm/vllm-openai") == "vllm/vllm-openai:latest"
    assert image_ref("localhost:5000/engine") == "localhost:5000/engine:latest"
    assert image_ref("localhost:5000/engine:2") == "localhost:5000/engine:2"
    assert image_ref("e@sha256:00") == "e@sha256:00" and image_ref("") == ""
    pulled = node("pulled", 2, images=("vllm/vllm-openai:latest",), price_per_hour=0.9)
    fresh = node("fresh", 2, price_per_hour=0.1)
    result = placed([pulled, fresh], spec(image="vllm/vllm-openai"))
    assert result.node_id == "pulled"
    assert "wins on cache (image vllm/vllm-openai:latest pulled there, not on fresh)" in (
        result.why
    )
    # Model files and image both count: the node holding both beats one holding either.
    both = node("both", 2, images=("e:1",), cached_models=("m",), price_per_hour=0.9)
    files = node("files", 2, cached_models=("m",), price_per_hour=0.1)
    result = placed([both, files], spec(image="e:1", model_files="m"))
    assert result.node_id == "both" and "image e:1 pulled there, not on files" in result.why


def test_image_names_are_compared_as_docker_lists_them() -> None:
    from actors.scheduler import image_ref

    assert image_ref("docker.io/vllm/vllm-openai:v1") == "vllm/vllm-openai:v1"
    assert image_ref("docker.io/library/ubuntu") == "ubuntu:latest"
    assert image_ref("library/ubuntu:24.04") == "ubuntu:24.04"
    assert image_ref("ghcr.io/huggingface/tei:1.5") == "ghcr.io/huggingface/tei:1.5"
