"""The fault-injection switch: off in production, seed-decided in the simulator."""

from __future__ import annotations

from runtime.env import BUGGIFY_SITES, never
from sim.buggify import FIRE_SHARE, Buggify


def test_production_never_misbehaves() -> None:
    assert not any(never(site) for site in BUGGIFY_SITES)


def test_the_seed_decides_which_sites_are_on_and_when_they_fire() -> None:
    def trace(seed: int) -> tuple[tuple[str, ...], list[bool]]:
        b = Buggify(seed)
        return b.sites, [b(site) for _ in range(200) for site in BUGGIFY_SITES]

    assert trace(11) == trace(11)
    runs = [Buggify(seed).sites for seed in range(200)]
    assert () in runs and any(len(s) >= 2 for s in runs)  # some runs clean, some with several
    assert set().union(*runs) == set(BUGGIFY_SITES)  # every site gets its turn
    on = next(b for b in (Buggify(seed) for seed in range(200)) if b.sites)
    site = on.sites[0]
    fired = sum(on(site) for _ in range(10_000))
    assert 0.5 * FIRE_SHARE * 10_000 < fired < 1.5 * FIRE_SHARE * 10_000
    assert on.fired[site] == fired
    assert not any(on(s) for s in BUGGIFY_SITES if s not in on.sites)


def test_disabled_turns_every_site_off() -> None:
    assert all(Buggify(seed, enabled=False).sites == () for seed in range(50))
