"""What both modes of bench/crashloop.py share (a helper, not a benchmark): the ledger of what
the controller acknowledged and the workload saw committed, and the workload of control API
operations that fills it."""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from runtime.env import BusError
from tests.integration.stack import ApiError, Stack, echo_spec

OPS_TIMEOUT_S = 3.0
CLUSTER_NAMES = tuple(f"c{i}" for i in range(4))


@dataclass
class Ledger:
    """What the controller acknowledged, and what the workload saw committed."""

    ops: list[tuple[str, str, int]] = field(default_factory=list)  # (verb, cluster, replicas)
    # Per cluster, the operations sent but neither acknowledged nor refused with a clear no:
    # each may or may not have been applied.
    unanswered: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    seen_events: dict[str, int] = field(default_factory=dict)  # event id -> position
    kills: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)
    head: int = 0  # the highest log position the workload has seen


def say(text: str) -> None:
    print(f"crashloop: {text}", file=sys.stderr, flush=True)


async def operations(stack: Stack, rng: random.Random, ledger: Ledger, stop: asyncio.Event) -> None:
    """Control API operations without pause (cluster create, scale, delete on c0..c3, chosen by
    `rng`), one at a time; each acknowledged one goes into the ledger, in order. Between them,
    a page of `events.list` near the head: the events seen committed."""
    while not stop.is_set():
        name = rng.choice(CLUSTER_NAMES)
        verb = rng.choice(["cluster.create", "cluster.scale", "cluster.scale", "cluster.delete"])
        replicas = rng.randint(0, 2)
        body: Any = {"name": name, "replicas": replicas}
        if verb == "cluster.create":
            body = {**echo_spec(replicas, name=name)}
        elif verb == "cluster.delete":
            body = {"name": name}
        try:
            await stack.api(verb, body, timeout=OPS_TIMEOUT_S)
        except ApiError as exc:
            reason = str(exc).split(":", 1)[-1].split("(")[0].strip()
            ledger.refused[f"{verb}: " + reason] += 1
            if not any(clear in str(exc) for clear in _CLEAR_NOES):
                # Not a clear no but a failure inside the controller (its term ended, the
                # store or NATS failed) after it may have recorded the operation: its outcome
                # is unknown, as an unanswered one's.
                ledger.unanswered[name] += 1
        except (BusError, TimeoutError, OSError):
            ledger.refused["no answer"] += 1  # controller or NATS down: not acknowledged
            ledger.unanswered[name] += 1
        else:
            ledger.ops.append((verb, name, replicas))
        try:
            after = max(0, ledger.head - 30)
            page = await stack.api("events.list", {"after": after, "limit": 30}, timeout=3.0)
        except (ApiError, BusError, TimeoutError, OSError):
            pass
        else:
            ledger.head = max(ledger.head, int(page["head"]))
            for event in page["events"]:
                ledger.seen_events[event["event_id"]] = event["position"]
        await asyncio.sleep(rng.uniform(0.02, 0.15))


# Refusals that say the operation was not applied (the controller checked before writing).
_CLEAR_NOES = ("unknown cluster", "already exists")

_OP_EVENTS = {
    "cluster.create": "cluster.created.v1",
    "cluster.scale": "cluster.scaled.v1",
    "cluster.delete": "cluster.deleted.v1",
}


def check_ops_in_order(log: list[Any], ledger: Ledger) -> dict[str, Any]:
    """Every acknowledged operation has its event, once, in the order it was acknowledged.

    `log`: the log's envelopes in position order. Per cluster the workload uses (c0..c3), each
    acknowledged operation is matched to the earliest event at or after the previous match that
    it explains: a create to a `cluster.created` at its replica count, a delete to a
    `cluster.deleted`, a scale to a `cluster.scaled` at its count, or to no event when the
    cluster already had that count there
    (the controller records none then). An event passed over on the way, or left after the
    last match, must be the work of an operation that got no answer (sent, then the controller
    or NATS died): more such events than unanswered operations on that cluster is an operation
    applied twice. Across clusters, the matched events' positions must rise in the order the
    operations were acknowledged (the workload sends the next only after an answer)."""
    by_cluster: dict[str, list[Any]] = {}
    for e in log:
        name = e.stream.removeprefix("cluster/")
        if name in CLUSTER_NAMES and e.type in _OP_EVENTS.values():
            by_cluster.setdefault(name, []).append(e)
    missing: list[str] = []
    unexplained: dict[str, int] = {}
    matched: list[tuple[int, int]] = []  # (op index, position)
    for name in CLUSTER_NAMES:
        events = by_cluster.get(name, [])
        exists, desired, at, skipped = False, -1, 0, 0
        for index, (verb, op_name, replicas) in enumerate(ledger.ops):
            if op_name != name:
                continue
            found = False
            while at <= len(events):
                if verb == "cluster.scale" and exists and desired == replicas:
                    found = True  # the count it already had: no event
                    break
                if at == len(events):
                    break
                e = events[at]
                if e.type == _OP_EVENTS[verb] and _count(e) in (None, replicas):
                    matched.append((index, e.position))
                    exists, desired = _fold(e, exists, desired)
                    at, found = at + 1, True
                    break
                exists, desired = _fold(e, exists, desired)
                skipped += 1
                at += 1
            if not found:
                missing.append(f"#{index} {verb} {name} {replicas}")
        skipped += len(events) - at
        if skipped > ledger.unanswered[name]:
            unexplained[name] = skipped - ledger.unanswered[name]
    ordered = sorted(matched)
    out_of_order = [
        f"op #{i} at position {p} after op #{j} at {q}"
        for (j, q), (i, p) in itertools.pairwise(ordered)
        if p <= q
    ]
    return {
        "matched": len(matched),
        "no_event_needed": len(ledger.ops) - len(matched) - len(missing),
        "missing": missing,
        "unexplained_events": unexplained,
        "out_of_order": out_of_order,
    }


def _count(e: Any) -> int | None:
    if e.type == "cluster.created.v1":
        return int(e.payload.spec.replicas)
    if e.type == "cluster.scaled.v1":
        return int(e.payload.replicas)
    return None


def _fold(e: Any, exists: bool, desired: int) -> tuple[bool, int]:
    if e.type == "cluster.deleted.v1":
        return False, -1
    count = _count(e)
    return True, desired if count is None else count


def ops_problems(found: dict[str, Any]) -> list[str]:
    problems = []
    if found["missing"]:
        problems.append(
            f"{len(found['missing'])} acknowledged operations have no event in order: "
            f"{found['missing'][:3]}"
        )
    if found["unexplained_events"]:
        problems.append(
            f"cluster events no unanswered operation explains (applied twice?): "
            f"{found['unexplained_events']}"
        )
    if found["out_of_order"]:
        problems.append(f"acknowledged operations out of order: {found['out_of_order'][:3]}")
    return problems
