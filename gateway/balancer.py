"""Which replica of a cluster gets the next request: pure functions over the router's counts.

Nothing here reads a clock or owns randomness; the router passes its seeded source in, so a
simulated run picks the same replicas on every replay.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterator, Sequence

from events.contract.messages import RouteEntry
from runtime.env import RandomSource


def stable_hash(text: str) -> int:
    """64 bits that are the same in every process: builtin hash() is salted per process, so two
    gateways would disagree on where a key lives."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def power_of_two(
    candidates: Sequence[RouteEntry], outstanding: Callable[[str], int], rng: RandomSource
) -> RouteEntry:
    """The less busy of two distinct random candidates (Mitzenmacher's power of two choices).

    Two samples avoid the herd that "always the least loaded" causes when many gateways act on
    the same stale counts, and still keep the maximum load exponentially better than one.
    """
    if not candidates:
        raise ValueError("power_of_two needs at least one candidate")
    if len(candidates) == 1:
        return candidates[0]
    i = rng.randint(0, len(candidates) - 1)
    j = rng.randint(0, len(candidates) - 2)
    if j >= i:
        j += 1  # skip i, so the second draw is uniform over the others
    first, second = candidates[i], candidates[j]
    if outstanding(second.replica_id) < outstanding(first.replica_id):
        return second
    return first


class HashRing:
    """Consistent hashing: a replica's removal moves only the keys it owned.

    Each replica owns `vnodes` points so that keys spread evenly; building costs
    O(n·vnodes·log), so the router builds one per routing-table change, not per request.
    """

    __slots__ = ("_owners", "_points", "replica_ids", "vnodes")

    def __init__(self, replica_ids: Sequence[str], vnodes: int = 100) -> None:
        if vnodes < 1:
            raise ValueError(f"HashRing.vnodes must be >= 1, got {vnodes}")
        # Sorted, so that which replica wins a (rare) point collision never depends on the
        # order the table listed them in.
        self.replica_ids: tuple[str, ...] = tuple(sorted(set(replica_ids)))
        self.vnodes = vnodes
        points = sorted(
            (stable_hash(f"{rid}#{v}"), rid) for rid in self.replica_ids for v in range(vnodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [rid for _, rid in points]

    def walk(self, key: str) -> Iterator[str]:
        """Every replica id once, clockwise from the key's point: its owner first."""
        total = len(self._points)
        if total == 0:
            return
        start = bisect.bisect_left(self._points, stable_hash(key))
        seen: set[str] = set()
        for step in range(total):
            owner = self._owners[(start + step) % total]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.replica_ids):
                    return


def bounded_affinity(
    ring: HashRing,
    key: str,
    candidates: Sequence[RouteEntry],
    outstanding: Callable[[str], int],
    load_factor: float,
) -> RouteEntry:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2017).

    A key stays on its replica, where its KV cache is warm, until that replica holds more than
    `load_factor` times the mean load; then it spills to the next replica on the ring rather
    than piling onto a hot one.
    """
    if not candidates:
        raise ValueError("bounded_affinity needs at least one candidate")
    by_id = {c.replica_id: c for c in candidates}
    loads = {rid: outstanding(rid) for rid in by_id}
    # +1 counts the request being placed, so an idle cluster has capacity >= 1.
    capacity = math.ceil(load_factor * (sum(loads.values()) + 1) / len(by_id))
    for rid in ring.walk(key):
        if rid in by_id and loads[rid] < capacity:
            return by_id[rid]
    # Reached only for candidates missing from the ring or a load_factor below 1.
    return min(candidates, key=lambda c: loads[c.replica_id])
