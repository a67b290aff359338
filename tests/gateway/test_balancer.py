"""Power of two choices, the hash ring, and consistent hashing with bounded loads."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any, TypeVar

import pytest
from hypothesis import given, strategies as st

from events.contract.messages import RouteEntry
from gateway.balancer import HashRing, bounded_affinity, power_of_two, stable_hash

T = TypeVar("T")

IDS = tuple(f"c-{i}" for i in range(8))


def entries(ids: Sequence[str]) -> list[RouteEntry]:
    return [RouteEntry(replica_id=r, node_id=f"n-{r}", address=f"{r}:80", epoch=1) for r in ids]


class ScriptedRandom:
    """randint answers from a script: the test decides which two candidates p2c draws."""

    def __init__(self, draws: Sequence[int]) -> None:
        self.draws = list(draws)

    def randint(self, a: int, b: int, /) -> int:
        value = self.draws.pop(0)
        assert a <= value <= b
        return value

    def random(self) -> float:
        raise AssertionError("unused")

    def uniform(self, a: float, b: float, /) -> float:
        raise AssertionError("unused")

    def getrandbits(self, k: int, /) -> int:
        raise AssertionError("unused")

    def choice(self, seq: Sequence[T], /) -> T:
        raise AssertionError("unused")

    def shuffle(self, x: list[Any], /) -> None:
        raise AssertionError("unused")


# --- power of two choices ---------------------------------------------------------------


def test_p2c_with_one_candidate_returns_it_without_drawing() -> None:
    only = entries(["c-0"])
    assert power_of_two(only, lambda _: 99, ScriptedRandom([])) is only[0]


def test_p2c_with_no_candidate_is_an_error() -> None:
    with pytest.raises(ValueError):
        power_of_two([], lambda _: 0, random.Random(1))


def test_p2c_draws_two_distinct_candidates_and_breaks_ties_to_the_first() -> None:
    cands = entries(["a", "b", "c"])
    # i=0, j=1 -> index 2 (j skips i): equal loads, so the first drawn wins.
    assert power_of_two(cands, lambda _: 0, ScriptedRandom([0, 1])).replica_id == "a"
    assert power_of_two(cands, lambda _: 0, ScriptedRandom([2, 0])).replica_id == "c"
    # j >= i skips i: i=1, j=1 -> index 2.
    load = {"a": 5, "b": 5, "c": 1}
    assert power_of_two(cands, load.__getitem__, ScriptedRandom([1, 1])).replica_id == "c"


@given(
    loads=st.lists(st.integers(0, 20), min_size=2, max_size=8),
    seed=st.integers(0, 2**32),
)
def test_p2c_never_picks_the_unique_busiest(loads: list[int], seed: int) -> None:
    cands = entries([f"r{i}" for i in range(len(loads))])
    load = {c.replica_id: n for c, n in zip(cands, loads, strict=True)}
    chosen = power_of_two(cands, load.__getitem__, random.Random(seed))
    if loads.count(max(loads)) == 1:
        assert load[chosen.replica_id] < max(loads)
    if len(loads) == 2 and loads[0] != loads[1]:
        assert load[chosen.replica_id] == min(loads)


def test_p2c_spreads_equal_load_uniformly() -> None:
    rng = random.Random(1234)
    cands = entries(IDS)
    picks = Counter(power_of_two(cands, lambda _: 0, rng).replica_id for _ in range(8000))
    expected = 8000 / len(IDS)
    chi2 = sum((picks[r] - expected) ** 2 / expected for r in IDS)
    assert chi2 < 40  # 7 degrees of freedom: p < 1e-5 for a fair draw


def test_p2c_keeps_outstanding_requests_level() -> None:
    rng = random.Random(1234)
    cands = entries(IDS)
    outstanding = dict.fromkeys(IDS, 0)
    for n in range(4000):
        outstanding[power_of_two(cands, outstanding.__getitem__, rng).replica_id] += 1
        if n % 3 == 0:  # some requests finish, on a replica picked at random
            done = rng.choice([r for r in IDS if outstanding[r] > 0])
            outstanding[done] -= 1
    assert max(outstanding.values()) - min(outstanding.values()) <= 4


# --- the hash ring ----------------------------------------------------------------------


def test_stable_hash_is_pinned() -> None:
    # Gateways in different processes must agree on a key's place: a change of function (or a
    # slip to the salted builtin hash()) shows up here.
    assert stable_hash("") == 0xE4A6A0577479B2B4
    assert stable_hash("llama-0#0") == 0xBAE6E855E60C28D3


@given(ids=st.sets(st.sampled_from(IDS), min_size=1), key=st.text(max_size=20))
def test_walk_yields_every_replica_exactly_once(ids: set[str], key: str) -> None:
    walked = list(HashRing(sorted(ids), vnodes=10).walk(key))
    assert sorted(walked) == sorted(ids)


def test_empty_ring_walks_nothing() -> None:
    assert list(HashRing([]).walk("k")) == []


def test_ring_does_not_depend_on_the_order_of_ids() -> None:
    keys = [f"user-{i}" for i in range(200)]
    a, b = HashRing(list(IDS)), HashRing(list(reversed(IDS)))
    assert [next(a.walk(k)) for k in keys] == [next(b.walk(k)) for k in keys]


@given(
    ids=st.sets(st.sampled_from(IDS), min_size=2),
    keys=st.lists(st.text(max_size=12), min_size=1, max_size=40),
    data=st.data(),
)
def test_removing_a_replica_moves_only_the_keys_it_owned(
    ids: set[str], keys: list[str], data: st.DataObject
) -> None:
    gone = data.draw(st.sampled_from(sorted(ids)))
    before = HashRing(sorted(ids), vnodes=20)
    after = HashRing(sorted(ids - {gone}), vnodes=20)
    for key in keys:
        owner_walk = list(before.walk(key))
        new_owner = next(after.walk(key))
        if owner_walk[0] != gone:
            assert new_owner == owner_walk[0]
        else:  # its keys go to the next replica clockwise, not anywhere
            assert new_owner == owner_walk[1]


def test_ring_spreads_keys_roughly_evenly() -> None:
    ring = HashRing(IDS[:5], vnodes=100)
    owners = Counter(next(ring.walk(f"prefix-{i}")) for i in range(5000))
    assert set(owners) == set(IDS[:5])
    assert all(600 <= n <= 1400 for n in owners.values()), owners


# --- bounded affinity -------------------------------------------------------------------


@given(
    loads=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    key=st.text(max_size=10),
    load_factor=st.floats(1.0, 3.0),
)
def test_bounded_affinity_never_exceeds_capacity_and_prefers_the_owner(
    loads: list[int], key: str, load_factor: float
) -> None:
    cands = entries(IDS[: len(loads)])
    load = {c.replica_id: n for c, n in zip(cands, loads, strict=True)}
    ring = HashRing([c.replica_id for c in cands], vnodes=10)
    capacity = math.ceil(load_factor * (sum(loads) + 1) / len(loads))
    chosen = bounded_affinity(ring, key, cands, load.__getitem__, load_factor)
    assert load[chosen.replica_id] < capacity
    # It is the first replica clockwise with room: earlier ones are all full.
    for rid in ring.walk(key):
        if rid == chosen.replica_id:
            break
        assert load[rid] >= capacity


def test_bounded_affinity_sticks_to_one_replica_while_load_allows() -> None:
    cands = entries(IDS[:4])
    ring = HashRing([c.replica_id for c in cands], vnodes=50)
    load = dict.fromkeys(IDS[:4], 2)
    owner = next(ring.walk("system-prompt-A"))
    picks = set()
    for _ in range(20):  # each request finishes before the next: load stays level
        picks.add(bounded_affinity(ring, "system-prompt-A", cands, load.__getitem__, 1.25))
    assert {p.replica_id for p in picks} == {owner}


def test_bounded_affinity_spills_a_hot_key_and_respects_capacity_as_load_grows() -> None:
    cands = entries(IDS[:4])
    ring = HashRing([c.replica_id for c in cands], vnodes=50)
    load = dict.fromkeys(IDS[:4], 0)
    for _ in range(40):  # one hot key, nothing finishes
        capacity = math.ceil(1.25 * (sum(load.values()) + 1) / len(cands))
        chosen = bounded_affinity(ring, "hot", cands, load.__getitem__, 1.25)
        load[chosen.replica_id] += 1
        assert load[chosen.replica_id] <= capacity
    assert all(n > 0 for n in load.values())  # the hot key spilled over every replica
    assert load[next(ring.walk("hot"))] == max(load.values())


def test_bounded_affinity_only_returns_candidates() -> None:
    ring = HashRing(IDS[:4], vnodes=10)
    cands = entries(IDS[2:4])  # the others are excluded or ejected
    load = dict.fromkeys(IDS, 0)
    for i in range(50):
        chosen = bounded_affinity(ring, f"k{i}", cands, load.__getitem__, 1.25)
        assert chosen in cands
    # A candidate the ring never heard of still gets picked rather than nothing.
    stray = entries(["stray"])
    assert bounded_affinity(ring, "k", stray, lambda _: 0, 1.25) == stray[0]
