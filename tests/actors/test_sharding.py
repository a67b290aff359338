"""The sharding planner (actors/sharding.py): the smallest set of GPUs that holds a model."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from actors.sharding import (
    HEADROOM,
    MIB,
    NoPlan,
    ShardPlan,
    bandwidth_gbs,
    group_estimate,
    kv_cache_bytes,
    plan,
    weights_bytes,
)
from actors.spec import SpecError, parse_toml
from events import ClusterSpec, GpuInfo, GpuRequirement, ShardingSpec, StagePlacement
from events.codec import decode_payload
from projections.views import Links, LinkView, NodeView, ReplicaView

GB24, GB80 = 24564, 81559  # MiB: an RTX 4090, an H100 80GB

LLAMA70_INT4 = ShardingSpec(
    params_b=70,
    precision="int4",
    layers=80,
    context_tokens=4096,
    concurrent_sequences=1,
    kv_bytes_per_token=327680,
    parallelism=("tensor", "pipeline"),
)


def node(
    node_id: str,
    model: str = "RTX4090",
    vram: int = GB24,
    n: int = 1,
    *,
    region: str = "eu-west",
    labels: dict[str, str] | None = None,
    **kw: object,
) -> NodeView:
    gpus = tuple(
        GpuInfo(index=i, uuid=f"{node_id}-{i}", model=model, vram_mib=vram) for i in range(n)
    )
    return NodeView(node_id=node_id, region=region, labels=labels or {}, gpus=gpus, **kw)  # type: ignore[arg-type]


def spec(sharding: ShardingSpec = LLAMA70_INT4, **kw: object) -> ClusterSpec:
    return ClusterSpec(name="llama", command="c", sharding=sharding, **kw)  # type: ignore[arg-type]


def small(gib: float, **kw: object) -> ShardingSpec:
    return ShardingSpec(weights_gib=gib, layers=kw.pop("layers", 32), **kw)  # type: ignore[arg-type]


def fits(result: ShardPlan | NoPlan) -> ShardPlan:
    assert isinstance(result, ShardPlan), result
    return result


def test_one_gpu_that_holds_the_model_wins() -> None:
    p = fits(plan(spec(), [node("a"), node("h", "H100", GB80), node("b")], []))
    assert p.gpus == 1 and len(p.stages) == 1
    st0 = p.stages[0]
    assert (st0.node_id, st0.gpu_indices, st0.first_layer, st0.last_layer) == ("h", (0,), 0, 80)
    assert p.link_ms == 0 and p.token_ms == pytest.approx(10.85, abs=0.01)
    assert "one GPU on h" in p.why
    assert [r.nodes for r in p.rejected] == [("a",), ("b",)]
    assert all(r.reason.startswith("does not fit: 33.8 GiB needed") for r in p.rejected)


def test_tensor_parallel_within_a_node_before_a_split_across_nodes() -> None:
    # 33.8 GiB: two 24 GB cards on one node (tensor parallel) beat two nodes of one card.
    p = fits(plan(spec(), [node("a"), node("b"), node("t", n=4)], []))
    assert [(s.node_id, s.gpu_indices) for s in p.stages] == [("t", (0, 1))]
    assert "tensor parallel over 2 GPUs on t" in p.why and p.link_ms == 0


def test_without_tensor_a_node_of_small_cards_does_not_fit() -> None:
    only_pipeline = msgspec.structs.replace(LLAMA70_INT4, parallelism=("pipeline",))
    p = fits(plan(spec(only_pipeline), [node("t", n=4), node("u", n=1)], []))
    assert [s.node_id for s in p.stages] == ["t", "u"]
    assert all(len(s.gpu_indices) == 1 for s in p.stages)


def test_two_pipeline_stages_split_in_proportion_to_vram() -> None:
    # A 24 GiB card and a 48 GiB card on two nodes: the bigger stage takes twice the layers.
    fleet = [node("a", "RTX4090", GB24), node("b", "A6000", 2 * GB24)]
    big = ShardingSpec(weights_gib=50, layers=60, parallelism=("pipeline",))
    p = fits(plan(spec(big), fleet, []))
    assert [(s.node_id, s.first_layer, s.last_layer) for s in p.stages] == [
        ("a", 0, 20),
        ("b", 20, 60),
    ]
    for s in p.stages:
        assert s.used_mib <= s.vram_mib * HEADROOM
    assert p.link_ms == pytest.approx(16384 * 8 / 1e9 * 1e3 + 1.0, abs=1e-3)
    assert p.token_ms == pytest.approx(p.compute_ms + p.link_ms, abs=1e-3)


def test_the_worked_example_of_docs_sharding() -> None:
    p = fits(plan(spec(), [node("a"), node("b")], []))
    assert [(s.node_id, s.first_layer, s.last_layer) for s in p.stages] == [
        ("a", 0, 40),
        ("b", 40, 80),
    ]
    assert (p.compute_ms, p.link_ms, p.token_ms) == (36.054, 1.131, 37.185)
    assert p.weights_gib == 32.596 and p.kv_cache_gib == 1.25


def test_over_the_latency_bound_is_refused_with_the_estimate() -> None:
    bounded = msgspec.structs.replace(LLAMA70_INT4, max_token_latency_ms=20)
    result = plan(spec(bounded), [node("a"), node("b")], [])
    assert isinstance(result, NoPlan)
    assert "estimated 37.19 ms per token > max_token_latency_ms 20" in result.reason
    assert result.rejected[-1].nodes == ("a", "b")
    # A slow link: the links alone are over the bound.
    slow = msgspec.structs.replace(bounded, max_token_latency_ms=40, link_rtt_ms=50)
    result = plan(spec(slow), [node("a"), node("b")], [])
    assert isinstance(result, NoPlan)
    assert result.rejected[-1].reason.startswith("a link too slow: estimated 86.19 ms")
    # Within the bound, the faster one-node plan passes, the slow split is never needed.
    fast = fits(plan(spec(bounded), [node("a"), node("b"), node("h", "H100", GB80)], []))
    assert fast.stages[0].node_id == "h"


def test_a_slower_alternative_over_the_bound_gives_way_to_the_next() -> None:
    # One slow card ranks first (fewer GPUs) but is over the bound; two fast ones are not.
    model = small(20, max_token_latency_ms=10)
    fleet = [node("a", "Tesla T4", 40960), node("b", "H100", 16384, 2)]
    p = fits(plan(spec(model), fleet, []))
    assert p.stages[0].node_id == "b"
    assert p.rejected[0].nodes == ("a",) and "too slow: estimated" in p.rejected[0].reason


def test_regions_labels_and_gpu_models_filter_as_the_scheduler_does() -> None:
    fleet = [
        node("us", "H100", GB80, region="us-east"),
        node("nolabel", "H100", GB80),
        node("a100", "A100", GB80, labels={"tier": "gold"}),
        node("ok", "H100", GB80, labels={"tier": "gold"}),
    ]
    s = spec(
        regions=("eu-west",),
        labels={"tier": "gold"},
        gpu=GpuRequirement(models=("H100",)),
    )
    p = fits(plan(s, fleet, []))
    assert p.stages[0].node_id == "ok"
    reasons = {r.nodes[0]: r.reason for r in p.rejected}
    assert reasons["us"] == "region us-east not in eu-west"
    assert reasons["nolabel"] == "label tier=gold missing"
    assert reasons["a100"].startswith("no H100")


def test_gpus_held_by_replicas_are_not_free() -> None:
    held = ReplicaView(replica_id="x-1", cluster="x", node_id="h", epoch=1, gpu_indices=(0,))
    fleet = [node("h", "H100", GB80), node("a"), node("b")]
    p = fits(plan(spec(), fleet, [held]))
    assert [s.node_id for s in p.stages] == ["a", "b"]
    gone = msgspec.structs.replace(held, status="failed")
    assert fits(plan(spec(), fleet, [gone])).stages[0].node_id == "h"


def test_every_stage_of_a_placed_pipeline_holds_its_gpus() -> None:
    # A live 2-stage group on a and b (its head on a): neither node has a free GPU left.
    group = ReplicaView(
        replica_id="x-1",
        cluster="x",
        node_id="a",
        epoch=1,
        gpu_indices=(0,),
        stages=(
            StagePlacement(rank=0, node_id="a", gpu_indices=(0,), last_layer=40),
            StagePlacement(rank=1, node_id="b", gpu_indices=(0,), first_layer=40, last_layer=80),
        ),
    )
    fleet = [node("a"), node("b"), node("c"), node("d")]
    p = fits(plan(spec(), fleet, [group]))
    assert [s.node_id for s in p.stages] == ["c", "d"]


def test_nothing_fits_says_why() -> None:
    result = plan(spec(), [node("a"), node("b", health="offline")], [])
    assert isinstance(result, NoPlan)
    assert result.reason.startswith("nothing fits llama, 33.8 GiB (32.6 weights + 1.2 KV cache)")
    assert "1 node refused by the filters" in result.reason and "1 too small" in result.reason
    empty = plan(spec(), [], [])
    assert isinstance(empty, NoPlan) and "no node has a free GPU" in empty.reason
    tensor_only = msgspec.structs.replace(LLAMA70_INT4, parallelism=("tensor",))
    result = plan(spec(tensor_only), [node("a"), node("b")], [])
    assert isinstance(result, NoPlan) and "pipeline across nodes not allowed" in result.reason


def test_sizes_from_the_spec() -> None:
    assert weights_bytes(LLAMA70_INT4) == 35 * 10**9
    assert kv_cache_bytes(LLAMA70_INT4) == 4096 * 327680
    assert weights_bytes(small(2)) == 2 * 1024**3
    assert kv_cache_bytes(ShardingSpec(weights_gib=1, kv_cache_gib=0.5)) == 1024**3 // 2
    assert bandwidth_gbs("NVIDIA A100-SXM4-80GB") == 2039
    assert bandwidth_gbs("NVIDIA A10") == 600
    assert bandwidth_gbs("NVIDIA L40S") == 864 and bandwidth_gbs("NVIDIA L4") == 300
    assert bandwidth_gbs("mystery") == 500


MODELS = st.sampled_from([("RTX4090", GB24), ("RTX3090", 24576), ("A100", 40960), ("H100", GB80)])


@st.composite
def fleets(draw: st.DrawFn) -> list[NodeView]:
    out = []
    for i in range(draw(st.integers(0, 6))):
        out.extend(node(f"n{i}", m, v, draw(st.integers(1, 4))) for m, v in [draw(MODELS)])
    return out


@settings(max_examples=150, deadline=None)
@given(
    fleets(),
    st.floats(0.5, 300),
    st.integers(1, 120),
    st.sampled_from([(), ("tensor",), ("pipeline",), ("tensor", "pipeline")]),
)
def test_plans_assign_every_layer_once_within_vram(
    fleet: list[NodeView], gib: float, layers: int, ways: tuple[str, ...]
) -> None:
    s = spec(ShardingSpec(weights_gib=gib, layers=layers, parallelism=ways))
    result = plan(s, fleet, [])
    assert plan(s, list(reversed(fleet)), []) == result  # the fleet's order does not matter
    need = gib * 1024**3
    one_gpu = any(g.vram_mib * MIB * HEADROOM >= need for n in fleet for g in n.gpus)
    if isinstance(result, NoPlan):
        assert not one_gpu
        return
    assert result.gpus == sum(len(st.gpu_indices) for st in result.stages)
    first = 0
    for stage in result.stages:
        assert stage.first_layer == first and stage.last_layer > stage.first_layer
        assert stage.used_mib <= stage.vram_mib * HEADROOM + 1
        first = stage.last_layer
    assert first == layers
    nodes = [st.node_id for st in result.stages]
    assert nodes == sorted(set(nodes))
    if one_gpu:
        assert result.gpus == 1


def test_spec_section_parses_and_old_specs_decode() -> None:
    s = parse_toml(
        'name = "llama"\ncommand = "c"\nmodel = "llama-70b"\n'
        '[sharding]\nparams_b = 70\nprecision = "int4"\nlayers = 80\n'
        'parallelism = ["tensor", "pipeline"]\nkv_cache_gib = 2\nmax_token_latency_ms = 50\n'
    )
    assert s.sharding is not None and s.sharding.parallelism == ("tensor", "pipeline")
    assert s.sharding.params_b == 70.0 and s.model == "llama-70b"
    assert parse_toml('name = "x"\ncommand = "c"').sharding is None
    old = b'{"type":"cluster.created.v1","spec":{"name":"llama","command":"c"}}'
    assert decode_payload("cluster.created.v1", old).spec.sharding is None  # type: ignore[attr-defined]


BASE = 'name = "x"\ncommand = "c"\n[sharding]\n'


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("layers = 8", "sharding.weights_gib: give weights_gib, or params_b and precision"),
        ('weights_gib = 1\nparams_b = 7\nprecision = "fp16"', "sharding.weights_gib: give"),
        ("params_b = 7", "sharding.precision: params_b needs a precision"),
        ('precision = "fp16"', "sharding.params_b: params_b needs a precision"),
        ('params_b = 7\nprecision = "fp12"', "sharding.precision: 'fp12' is not one of fp32"),
        ("weights_gib = -1", "sharding.weights_gib: must be a finite number >= 0, got -1"),
        ("weights_gib = 1\nlayers = -1", "sharding.layers: must not be negative"),
        ("weights_gib = 1\ncontext_tokens = 10", "sharding.concurrent_sequences: required"),
        (
            "weights_gib = 1\nkv_cache_gib = 1\ncontext_tokens = 1\nconcurrent_sequences = 1\n"
            "kv_bytes_per_token = 1",
            "sharding.kv_cache_gib: give kv_cache_gib, or",
        ),
        ('weights_gib = 1\nparallelism = ["data"]', "sharding.parallelism: 'data' is not one"),
        ('weights_gib = 1\nparallelism = ["tensor", "tensor"]', "sharding.parallelism: 'tensor'"),
        ('weights_gib = 1\nparallelism = ["pipeline"]', "sharding.layers: required when"),
        ("weights_gib = 1\nlink_gbps = 0", "sharding.link_gbps: must be > 0"),
        ("weights_gib = 1\nlink_rtt_ms = -1", "sharding.link_rtt_ms: must be a finite"),
        ("weights_gib = 1\nmax_token_latency_ms = nan", "sharding.max_token_latency_ms: must be"),
        ("weights_gib = 1\nhidden_size = -5", "sharding.hidden_size: must not be negative"),
        ('weights_gib = "big"', "sharding.weights_gib: Expected `float`, got `str`"),
        ('weights_gib = 1\nworker_probe = "grpc"', "sharding.worker_probe: 'grpc' is not one"),
    ],
)
def test_bad_sharding_sections_name_the_field(body: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_toml(BASE + body)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_a_cordon_holds_until_its_end() -> None:
    h100 = node("h", "H100", GB80, cordoned_until_ns=1_000, cordon_reason="kernel upgrade")
    held = plan(spec(), [h100], [], now_ns=500)
    assert isinstance(held, NoPlan), held
    assert [r.reason for r in held.rejected] == [
        "cordoned until 1970-01-01T00:00:00.000001Z: kernel upgrade"
    ]
    assert fits(plan(spec(), [h100], [], now_ns=2_000)).stages[0].node_id == "h"


def links(*pairs: tuple[str, str, float, float]) -> Links:
    """A link view with (a, b, rtt_ms, gbps) measured, both ways."""
    view = Links()
    for a, b, rtt, gbps in pairs:
        link = LinkView(rtt_ms=rtt, gbps=gbps, measured_by=a)
        view.links.setdefault(a, {})[b] = link
        view.links.setdefault(b, {})[a] = link
    return view


def test_a_measured_link_replaces_the_assumed_one() -> None:
    measured = links(("a", "b", 0.2, 10.0))
    p = fits(plan(spec(), [node("a"), node("b")], [], links=measured))
    # 131,072 bits at 10 Gbit/s = 0.0131 ms, plus the 0.2 ms round trip.
    assert p.link_ms == pytest.approx(0.213, abs=1e-3)
    assert p.token_ms == pytest.approx(36.054 + 0.213, abs=1e-3)
    assert "slowest link a-b 0.21 ms (measured 0.20 ms round trip, 10 Gbit/s)" in p.why
    assumed = fits(plan(spec(), [node("a"), node("b")], []))
    assert "no link measured yet: the spec's link_gbps and link_rtt_ms assumed" in assumed.why


def test_a_fast_pair_is_preferred_over_a_slow_pair() -> None:
    # Four equal cards: by memory and node id the pair a-b would win; its link is slow.
    fleet = [node("a"), node("b"), node("c"), node("d")]
    measured = links(("a", "b", 30.0, 1.0), ("c", "d", 0.5, 10.0), ("a", "c", 30.0, 1.0))
    p = fits(plan(spec(), fleet, [], links=measured))
    # c-d's measured 0.5 ms beats the pairs whose links are assumed (1 ms) or slow (30 ms).
    assert [s.node_id for s in p.stages] == ["c", "d"]
    assert p.token_ms == pytest.approx(36.054 + 0.513, abs=1e-3)
    lost = {r.nodes: r.reason for r in p.rejected}
    assert lost[("a", "b")] == "fits, but 66.19 ms per token against 36.57"
    assert lost[("b", "c")] == "fits, but 37.19 ms per token against 36.57"


def test_the_fast_pair_wins_when_every_other_link_is_slow() -> None:
    fleet = [node("a"), node("b"), node("c"), node("d")]
    slow = [(x, y, 30.0, 1.0) for x, y in (("a", "b"), ("a", "c"), ("a", "d"), ("b", "c"))]
    measured = links(*slow, ("b", "d", 30.0, 1.0), ("c", "d", 0.5, 10.0))
    p = fits(plan(spec(), fleet, [], links=measured))
    assert [s.node_id for s in p.stages] == ["c", "d"]


def test_a_plan_too_slow_on_its_measured_links_is_refused_with_the_figures() -> None:
    bounded = msgspec.structs.replace(LLAMA70_INT4, max_token_latency_ms=50)
    fleet = [node("a"), node("b")]
    assert isinstance(plan(spec(bounded), fleet, []), ShardPlan)  # assumed: 37.19 ms fits
    measured = links(("a", "b", 20.0, 0.5))
    result = plan(spec(bounded), fleet, [], links=measured)
    assert isinstance(result, NoPlan)
    assert (
        "too slow: estimated 56.32 ms per token > max_token_latency_ms 50 "
        "(compute 36.05 ms + links 20.26 ms; slowest link a-b 20.26 ms "
        "(measured 20.00 ms round trip, 0.5 Gbit/s))"
    ) in result.reason


def test_group_estimate_of_a_placed_pipeline_with_its_links_now() -> None:
    bounded = msgspec.structs.replace(LLAMA70_INT4, max_token_latency_ms=50)
    nodes = {"a": node("a"), "b": node("b")}
    group = ReplicaView(
        replica_id="llama-0",
        cluster="llama",
        node_id="a",
        epoch=1,
        gpu_indices=(0,),
        stages=(
            StagePlacement(rank=0, node_id="a", gpu_indices=(0,), first_layer=0, last_layer=40),
            StagePlacement(rank=1, node_id="b", gpu_indices=(0,), first_layer=40, last_layer=80),
        ),
    )
    fine = group_estimate(spec(bounded), group, nodes, None)
    assert fine is not None and fine[0].token_ms == 37.185 and fine[1] == ""
    slow = group_estimate(spec(bounded), group, nodes, links(("a", "b", 20.0, 0.5)))
    assert slow is not None and slow[1].startswith("too slow: estimated 56.32 ms per token")
    one = ReplicaView(replica_id="x", cluster="llama", node_id="a", epoch=1, gpu_indices=(0,))
    assert group_estimate(spec(bounded), one, nodes, None) is None
    assert group_estimate(spec(bounded), group, {"a": node("a")}, None) is None


def test_a_pipeline_stays_in_one_region_unless_the_spec_allows_more() -> None:
    # Two 24 GB cards in each region would do; one in each does not, within a region.
    split = [node("a", region="eu-west"), node("b", region="us-east")]
    refused = plan(spec(), split, [])
    assert isinstance(refused, NoPlan)
    assert "it fits only across regions (spans regions eu-west+us-east)" in refused.reason
    assert refused.rejected[0].reason.startswith("spans regions eu-west+us-east: a pipeline")
    across = spec(msgspec.structs.replace(LLAMA70_INT4, cross_region=True))
    assert [s.node_id for s in fits(plan(across, split, [])).stages] == ["a", "b"]
    # With a pair in one region, that pair, though another region sorts first by node id.
    fleet = [*split, node("c", region="us-east"), node("d", region="ap-south")]
    assert [s.node_id for s in fits(plan(spec(), fleet, [])).stages] == ["b", "c"]
