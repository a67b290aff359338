"""The simulator's fault-injection switch (FoundationDB's BUGGIFY), decided by the run's seed.

Production code asks `env.buggify(site)` at a few named places (runtime.env.BUGGIFY_SITES) and
misbehaves when the answer is yes; in production the answer is always no. Here, each run turns
on a share of the sites, chosen from the seed, and an enabled site fires on a share of calls.
So one seed explores one combination of misbehaviours, and replaying the seed repeats it.
"""

from __future__ import annotations

import random
from collections import Counter

from runtime.env import BUGGIFY_SITES

SITE_SHARE = 0.25  # of the sites, on in a run
FIRE_SHARE = 0.05  # of the calls at an enabled site, misbehaving


class Buggify:
    def __init__(self, seed: int, *, enabled: bool = True) -> None:
        choose = random.Random(f"{seed}:buggify:sites")
        # A tuple, in its declared order: the draw does not depend on hash seeds.
        self.sites = tuple(s for s in BUGGIFY_SITES if enabled and choose.random() < SITE_SHARE)
        self._fire = random.Random(f"{seed}:buggify:fire")
        self.fired: Counter[str] = Counter()

    def __call__(self, site: str) -> bool:
        if site not in self.sites:
            return False
        if self._fire.random() < FIRE_SHARE:
            self.fired[site] += 1
            return True
        return False
