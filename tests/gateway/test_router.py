"""The routing table, passive health (ejection, panic mode) and the choice of a replica."""

from __future__ import annotations

import random
from collections import Counter
from typing import get_args

import pytest
from hypothesis import given, strategies as st

from events.contract.messages import RouteEntry, RoutingUpdate
from gateway.router import Ejection, ReplicaStats, Router, RouterConfig
from gateway.transport.base import Outcome
from tests.factories import ManualClock

NO_JITTER = RouterConfig(eject_jitter=0.0)


def entry(replica_id: str, epoch: int = 1, node_id: str = "") -> RouteEntry:
    return RouteEntry(
        replica_id=replica_id,
        node_id=node_id or f"node-{replica_id}",
        address=f"10.0.0.1:{8000 + epoch}",
        epoch=epoch,
    )


def update(
    position: int, clusters: tuple[str, ...] = (), **routes: list[RouteEntry]
) -> RoutingUpdate:
    return RoutingUpdate(
        position=position,
        routes={c: tuple(e) for c, e in routes.items()},
        clusters=clusters or tuple(sorted(routes)),
    )


def router(config: RouterConfig = NO_JITTER, seed: int = 7) -> tuple[Router, ManualClock]:
    clock = ManualClock()
    return Router(clock, random.Random(seed), config), clock


def fail(
    r: Router, route: RouteEntry, times: int, outcome: Outcome = "connect_error"
) -> list[Ejection]:
    ejections = []
    for _ in range(times):
        r.started(route)
        if (e := r.finished(route, outcome)) is not None:
            ejections.append(e)
    return ejections


def stats_of(r: Router, replica_id: str) -> ReplicaStats:
    return next(s for e, s in r.stats() if e.replica_id == replica_id)


# --- the table --------------------------------------------------------------------------


def test_an_empty_router_knows_nothing() -> None:
    r, _ = router()
    assert r.position == 0
    assert r.changed() == 0
    assert not r.known("llama")
    assert r.clusters() == []
    assert r.routes("llama") == ()
    assert r.choose("llama") is None


def test_apply_ignores_older_positions_and_reports_only_real_changes() -> None:
    r, _ = router()
    a, b = entry("llama-0"), entry("llama-1")
    assert r.apply(update(5, llama=[a, b])) is True
    assert (r.position, r.changed()) == (5, 1)
    assert r.apply(update(4, llama=[a])) is False  # older: ignored
    assert r.routes("llama") == (a, b)
    assert r.position == 5
    assert r.apply(update(9, llama=[b, a])) is False  # the periodic re-send, in another order
    assert (r.position, r.changed()) == (9, 1)
    assert r.apply(update(9, llama=[a])) is True  # same position, different table: applied
    assert r.routes("llama") == (a,)
    assert r.changed() == 2
    assert r.apply(update(10, ("llama", "mistral"), llama=[a])) is True  # a new empty cluster
    assert r.changed() == 3


def test_known_clusters_include_those_with_no_routes_and_those_only_in_routes() -> None:
    r, _ = router()
    r.apply(RoutingUpdate(position=1, routes={"b": (entry("b-0"),)}, clusters=("c", "a")))
    assert r.clusters() == ["a", "b", "c"]
    assert r.known("a") and r.known("b") and r.known("c")
    assert not r.known("d")
    assert r.choose("a") is None
    assert r.choose("b") == entry("b-0")


def test_routes_are_sorted_and_a_lower_epoch_in_the_same_table_is_superseded() -> None:
    r, _ = router()
    r.apply(update(1, llama=[entry("llama-1", 4), entry("llama-0", 2), entry("llama-1", 3)]))
    assert r.routes("llama") == (entry("llama-0", 2), entry("llama-1", 4))
    for _ in range(50):
        assert r.choose("llama") != entry("llama-1", 3)


def test_stats_survive_a_same_epoch_refresh_and_start_clean_on_a_new_epoch() -> None:
    r, _ = router()
    a, b = entry("llama-0", 1), entry("llama-1", 1)
    r.apply(update(1, llama=[a, b]))
    r.started(a)
    r.started(b)
    fail(r, b, 2)
    r.apply(update(2, llama=[a, b, entry("llama-2")]))  # a grew: a and b are unchanged
    assert stats_of(r, "llama-0") == ReplicaStats(outstanding=1, requests=1)
    assert stats_of(r, "llama-1") == ReplicaStats(
        outstanding=1, consecutive_failures=2, requests=3, failures=2
    )
    b2 = entry("llama-1", 2, node_id="elsewhere")
    r.apply(update(3, llama=[a, b2]))  # llama-1 was replaced at a new epoch
    assert stats_of(r, "llama-1") == ReplicaStats()
    # The old epoch's request ending counts against nothing.
    assert r.finished(b, "connect_error") is None
    assert stats_of(r, "llama-1") == ReplicaStats()


def test_finished_never_takes_outstanding_below_zero() -> None:
    r, _ = router()
    a = entry("llama-0")
    r.apply(update(1, llama=[a]))
    assert r.finished(a, "ok") is None
    assert stats_of(r, "llama-0").outstanding == 0


def test_stats_are_sorted_by_cluster_then_replica_and_are_copies() -> None:
    r, _ = router()
    r.apply(update(1, zeta=[entry("zeta-0")], alpha=[entry("alpha-1"), entry("alpha-0")]))
    listed = r.stats()
    assert [e.replica_id for e, _ in listed] == ["alpha-0", "alpha-1", "zeta-0"]
    listed[0][1].outstanding = 42
    assert stats_of(r, "alpha-0").outstanding == 0


# --- choosing ---------------------------------------------------------------------------


def test_choose_spreads_over_replicas_by_outstanding_requests() -> None:
    r, _ = router()
    replicas = [entry(f"llama-{i}") for i in range(4)]
    r.apply(update(1, llama=replicas))
    for _ in range(400):
        route = r.choose("llama")
        assert route is not None
        r.started(route)
    loads = [s.outstanding for _, s in r.stats()]
    assert max(loads) - min(loads) <= 2


def test_choose_never_returns_an_excluded_replica() -> None:
    r, _ = router()
    r.apply(update(1, llama=[entry("llama-0"), entry("llama-1")]))
    for _ in range(30):
        assert r.choose("llama", exclude={"llama-0"}) == entry("llama-1")
    assert r.choose("llama", exclude=["llama-0", "llama-1"]) is None


def test_choose_is_the_same_for_the_same_seed() -> None:
    def picks(seed: int) -> list[str]:
        r, _ = router(seed=seed)
        r.apply(update(1, llama=[entry(f"llama-{i}") for i in range(5)]))
        out = []
        for _ in range(50):
            route = r.choose("llama")
            assert route is not None
            out.append(route.replica_id)
        return out

    assert picks(3) == picks(3)
    assert picks(3) != picks(4)


def test_affinity_keeps_a_key_on_one_replica_and_spreads_keys() -> None:
    r, _ = router(RouterConfig(affinity="prefix", eject_jitter=0.0))
    r.apply(update(1, llama=[entry(f"llama-{i}") for i in range(4)]))
    for key in ("alpha", "beta", "gamma"):
        first = r.choose("llama", key=key)
        assert all(r.choose("llama", key=key) == first for _ in range(10))
    owners = Counter(
        getattr(r.choose("llama", key=f"user-{i}"), "replica_id", "") for i in range(400)
    )
    assert len(owners) == 4


def test_affinity_moves_a_key_off_an_ejected_replica_and_back_after_readmission() -> None:
    r, clock = router(RouterConfig(affinity="user", eject_jitter=0.0))
    r.apply(update(1, llama=[entry(f"llama-{i}") for i in range(4)]))
    home = r.choose("llama", key="user-42")
    assert home is not None
    (ejection,) = fail(r, home, 3)
    away = r.choose("llama", key="user-42")
    assert away is not None and away != home
    clock.now += ejection.duration_s + 0.001
    assert r.choose("llama", key="user-42") == home


def test_affinity_off_ignores_the_key() -> None:
    r, _ = router()
    r.apply(update(1, llama=[entry(f"llama-{i}") for i in range(4)]))
    picked = {getattr(r.choose("llama", key="same"), "replica_id", "") for _ in range(60)}
    assert len(picked) > 1


# --- passive health ---------------------------------------------------------------------


def test_a_replica_is_ejected_after_consecutive_failures() -> None:
    r, _ = router()
    a, b = entry("llama-0", 3, node_id="gpu-1"), entry("llama-1")
    r.apply(update(1, llama=[a, b]))
    assert fail(r, a, 2) == []
    assert not r.is_ejected("llama-0")
    (ejection,) = fail(r, a, 1, "first_byte_timeout")
    assert ejection == Ejection(
        cluster="llama",
        replica_id="llama-0",
        node_id="gpu-1",
        epoch=3,
        reason="first_byte_timeout",
        failures=3,
        duration_s=5.0,
    )
    assert r.is_ejected("llama-0")
    assert all(r.choose("llama") == b for _ in range(30))
    s = stats_of(r, "llama-0")
    assert (s.consecutive_failures, s.ejections, s.failures, s.ejected_until) == (0, 1, 3, 105.0)


def test_a_success_or_a_cancellation_in_between_changes_the_count_as_it_should() -> None:
    r, _ = router()
    a = entry("llama-0")
    r.apply(update(1, llama=[a]))
    fail(r, a, 2)
    r.started(a)
    r.finished(a, "ok")  # resets
    assert fail(r, a, 2) == []
    r.started(a)
    r.finished(a, "cancelled")  # the client left: neither a failure nor a success
    assert stats_of(r, "llama-0").consecutive_failures == 2
    assert len(fail(r, a, 1)) == 1


def test_repeat_ejections_double_up_to_the_cap_and_a_success_resets_them() -> None:
    r, clock = router(RouterConfig(eject_after=1, eject_base_s=5, eject_max_s=60, eject_jitter=0))
    a = entry("llama-0")
    r.apply(update(1, llama=[a]))
    durations = []
    for _ in range(7):
        (ejection,) = fail(r, a, 1)
        durations.append(ejection.duration_s)
        clock.now += ejection.duration_s
        assert not r.is_ejected("llama-0")  # re-admitted once the period is over
    assert durations == [5, 10, 20, 40, 60, 60, 60]
    r.started(a)
    r.finished(a, "ok")
    assert [e.duration_s for e in fail(r, a, 1)] == [5]


def test_jitter_spreads_ejections_within_bounds() -> None:
    config = RouterConfig(eject_after=1, eject_base_s=10, eject_max_s=10, eject_jitter=0.2)
    r, clock = router(config)
    a = entry("llama-0")
    r.apply(update(1, llama=[a]))
    durations = []
    for _ in range(50):
        (ejection,) = fail(r, a, 1)
        durations.append(ejection.duration_s)
        clock.now += ejection.duration_s
    assert all(8.0 <= d <= 12.0 for d in durations)
    assert len(set(durations)) > 40


def test_failures_while_ejected_do_not_extend_it_but_carry_over() -> None:
    r, clock = router()
    a = entry("llama-0")
    r.apply(update(1, llama=[a]))
    (first,) = fail(r, a, 3)
    assert fail(r, a, 4) == []  # stragglers: still ejected, no second ejection
    assert stats_of(r, "llama-0").ejected_until == clock.now + first.duration_s
    clock.now += first.duration_s
    (second,) = fail(r, a, 1)  # re-admitted and failing again: straight back out
    assert second.duration_s == 2 * first.duration_s


def test_panic_mode_uses_ejected_replicas_when_nothing_else_is_left() -> None:
    r, _ = router()
    a, b = entry("llama-0"), entry("llama-1")
    r.apply(update(1, llama=[a, b]))
    fail(r, a, 3)
    assert r.choose("llama") == b
    assert r.choose("llama", exclude={"llama-1"}) == a  # only an ejected one left: use it
    fail(r, b, 3)
    assert {getattr(r.choose("llama"), "replica_id", "") for _ in range(40)} == {
        "llama-0",
        "llama-1",
    }


def test_unknown_replica_or_epoch_is_ignored() -> None:
    r, _ = router()
    r.apply(update(1, llama=[entry("llama-0")]))
    stranger = entry("other-0")
    r.started(stranger)
    assert r.finished(stranger, "connect_error") is None
    assert not r.is_ejected("other-0")
    assert [e.replica_id for e, _ in r.stats()] == ["llama-0"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("eject_after", 0),
        ("eject_base_s", 0.0),
        ("eject_max_s", 1.0),
        ("eject_jitter", 1.0),
        ("eject_jitter", -0.1),
        ("affinity", "sticky"),
        ("affinity_load_factor", 0.9),
        ("vnodes", 0),
    ],
)
def test_router_config_rejects_nonsense_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"RouterConfig.{field} must be"):
        RouterConfig(**{field: value})  # type: ignore[arg-type]


# --- random sequences -------------------------------------------------------------------

REPLICAS = ("c0-0", "c0-1", "c0-2", "c1-0", "c1-1")
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)

tables = st.lists(st.tuples(st.sampled_from(REPLICAS), st.integers(1, 3)), max_size=6).map(
    lambda pairs: [entry(rid, ep) for rid, ep in pairs]
)
ops = st.one_of(
    st.tuples(st.just("apply"), st.integers(0, 3), tables),
    st.tuples(st.just("choose"), st.sampled_from(("c0", "c1")), st.sets(st.sampled_from(REPLICAS))),
    st.tuples(st.just("finish"), st.integers(0, 20), st.sampled_from(OUTCOMES)),
    st.tuples(st.just("tick"), st.floats(0, 30)),
)


def expected_routes(table: list[RouteEntry]) -> tuple[RouteEntry, ...]:
    newest: dict[str, RouteEntry] = {}
    for e in table:
        if e.replica_id not in newest or e.epoch > newest[e.replica_id].epoch:
            newest[e.replica_id] = e
    return tuple(sorted(newest.values(), key=lambda e: e.replica_id))


@given(st.lists(ops, max_size=60), st.integers(0, 2**16))
def test_random_sequences_keep_the_invariants(steps: list[tuple[object, ...]], seed: int) -> None:
    r, clock = router(RouterConfig(eject_after=2), seed=seed)
    position = 0
    in_flight: list[RouteEntry] = []
    expected: dict[str, tuple[RouteEntry, ...]] = {}
    for step in steps:
        match step:
            case ("apply", int(back), list(table)):
                # Mostly forward, sometimes a late older update that must be ignored.
                position = position + 1 if back else max(0, position - 2)
                grouped = {
                    c: [e for e in table if e.replica_id.startswith(c)] for c in ("c0", "c1")
                }
                before = r.position
                r.apply(update(position, ("c0", "c1"), **grouped))
                assert r.position == max(before, position)
                if position >= before:
                    expected = {c: expected_routes(grouped[c]) for c in grouped}
            case ("choose", str(cluster), set(excluded)):
                route = r.choose(cluster, exclude=excluded)
                allowed = [e for e in expected.get(cluster, ()) if e.replica_id not in excluded]
                if not allowed:
                    assert route is None
                    continue
                # Current table, newest epoch, not excluded, and healthy when any is.
                assert route in allowed
                healthy = [e for e in allowed if not r.is_ejected(e.replica_id)]
                if healthy:
                    assert route in healthy
                r.started(route)
                in_flight.append(route)
            case ("finish", int(index), str(outcome)) if in_flight:
                route = in_flight.pop(index % len(in_flight))
                current = route in r.routes(route.replica_id[:2])
                was_ejected = r.is_ejected(route.replica_id)
                failures = stats_of(r, route.replica_id).consecutive_failures if current else 0
                ejection = r.finished(route, outcome)  # type: ignore[arg-type]
                failed = outcome not in ("ok", "cancelled")
                should_eject = current and failed and not was_ejected and failures + 1 >= 2
                assert (ejection is not None) == should_eject
                if ejection is not None:
                    assert r.is_ejected(route.replica_id)
                    assert 5.0 * 0.8 <= ejection.duration_s <= 60.0 * 1.2
            case ("tick", float(seconds)):
                clock.now += seconds
        for c in ("c0", "c1"):
            assert r.routes(c) == expected.get(c, ())
        for e, s in r.stats():
            assert 0 <= s.outstanding <= sum(1 for f in in_flight if f == e)


def test_an_older_update_after_a_newer_one_never_changes_the_choice() -> None:
    r, _ = router()
    r.apply(update(10, llama=[entry("llama-0", 2)]))
    r.apply(update(3, llama=[entry("llama-0", 1), entry("llama-9", 1)]))
    assert {r.choose("llama") for _ in range(20)} == {entry("llama-0", 2)}
