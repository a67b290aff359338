"""What both modes of bench/crashloop.py share (a helper, not a benchmark): the ledger of what
the controller acknowledged and the workload saw committed, and the workload of control API
operations that fills it."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from runtime.env import BusError, NoResponders
from tests.integration.stack import ApiError, Stack, echo_spec

OPS_TIMEOUT_S = 3.0
CLUSTER_NAMES = tuple(f"c{i}" for i in range(4))


@dataclass
class Ledger:
    """What the controller acknowledged, and what the workload saw committed."""

    ops: list[tuple[str, str, int]] = field(default_factory=list)  # (verb, cluster, replicas)
    # Per cluster, the operations sent but neither acknowledged nor refused with a clear no:
    # each may or may not have been applied (outcome_unknown).
    unanswered: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    seen_events: dict[str, int] = field(default_factory=dict)  # event id -> position
    kills: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)
    head: int = 0  # the highest log position the workload has seen
    # Every operation sent, in order: (sent_ns, answered_ns, verb, cluster, replicas, outcome),
    # outcome "ok", "no answer" or the error; written beside the logs by --ha --keep.
    trail: list[tuple[int, int, str, str, int, str]] = field(default_factory=list)


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
        sent_ns = time.time_ns()
        outcome = "ok"
        try:
            await stack.api(verb, body, timeout=OPS_TIMEOUT_S)
        except (ApiError, BusError, TimeoutError, OSError) as exc:
            outcome = str(exc) if isinstance(exc, ApiError) else f"no answer: {exc!r}"
            ledger.refused[refusal(verb, exc)] += 1
            if outcome_unknown(exc):
                ledger.unanswered[name] += 1
        else:
            ledger.ops.append((verb, name, replicas))
        ledger.trail.append((sent_ns, time.time_ns(), verb, name, replicas, outcome))
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


def refusal(verb: str, exc: BaseException) -> str:
    """How the ledger counts a failed operation."""
    if isinstance(exc, NoResponders):
        return "no responders"
    if isinstance(exc, ApiError):
        return f"{verb}: " + str(exc).split(":", 1)[-1].split("(")[0].strip()
    return "no answer"


def outcome_unknown(exc: BaseException) -> bool:
    """Whether an operation that failed with `exc` may have been applied all the same."""
    if isinstance(exc, NoResponders):
        # NATS answered that no subscriber had the subject (no controller led): the request
        # was delivered to none, so none applied it.
        return False
    if isinstance(exc, ApiError):
        # A clear no is not applied; any other error comes from inside the controller (its
        # term ended, the store or NATS failed) after it may have recorded the operation.
        return not any(clear in str(exc) for clear in _CLEAR_NOES)
    return True  # no answer in time (controller or NATS down): it may have been applied


_OP_EVENTS = {
    "cluster.create": "cluster.created.v1",
    "cluster.scale": "cluster.scaled.v1",
    "cluster.delete": "cluster.deleted.v1",
}


def check_ops_in_order(log: list[Any], ledger: Ledger) -> dict[str, Any]:
    """Every acknowledged operation has its event, once, in the order it was acknowledged.

    `log`: the log's envelopes in position order. The acknowledged operations are taken in the
    order acknowledged, and each is matched to the earliest event of its cluster (c0..c3)
    after its cluster's previous match that it explains: a create to a `cluster.created` at
    its replica count, a delete to a `cluster.deleted`, a scale to a `cluster.scaled` at its
    count. That event must also lie after the previous acknowledged operation's, whatever its
    cluster: the workload sends the next operation only once the last was answered, so the
    order of the log is the order of acknowledgement; an operation with no such event is
    missing. An event passed over on the way, or left after a cluster's last match, must be
    the work of an operation whose outcome is unknown (ledger.unanswered): more such events
    than those operations on that cluster is an operation applied twice.

    Why so (an earlier version reported operations applied twice that were not, in CI at
    seed 139 "c1: 3, c3: 2"): it matched a scale to the count the cluster already had to no
    event, but ClusterActor records a `cluster.scaled` for every scale, the same count
    included (previous == replicas), so each such event was left over and counted against
    the unanswered operations. Run by hand, dozens of operations answered "no responders"
    while no controller led, all counted as unanswered then (see outcome_unknown), hid them;
    on a loaded machine a change of leader cost one timeout instead, and they showed. A scale
    now always takes an event, and, since an unanswered operation's event at the same count
    may come first, the floor keeps it from taking an event before the previous acknowledged
    operation's (which would have left its own over, and broken the order)."""
    by_cluster: dict[str, list[Any]] = {}
    for e in log:
        name = e.stream.removeprefix("cluster/")
        if name in CLUSTER_NAMES and e.type in _OP_EVENTS.values():
            by_cluster.setdefault(name, []).append(e)
    missing: list[str] = []
    at = dict.fromkeys(CLUSTER_NAMES, 0)  # per cluster, the next event not yet matched
    floor = 0  # the position of the previous acknowledged operation's event
    matched: Counter[str] = Counter()  # per cluster
    for index, (verb, name, replicas) in enumerate(ledger.ops):
        events = by_cluster.get(name, [])
        found = next(
            (
                i
                for i in range(at[name], len(events))
                if events[i].position > floor
                and events[i].type == _OP_EVENTS[verb]
                and _count(events[i]) in (None, replicas)
            ),
            None,
        )
        if found is None:
            missing.append(f"#{index} {verb} {name} {replicas} (after position {floor})")
            continue
        at[name], floor = found + 1, events[found].position
        matched[name] += 1
    unexplained: dict[str, int] = {}
    for name in CLUSTER_NAMES:
        left = len(by_cluster.get(name, [])) - matched[name]  # passed over or after the last
        if left > ledger.unanswered[name]:
            unexplained[name] = left - ledger.unanswered[name]
    return {"matched": matched.total(), "missing": missing, "unexplained_events": unexplained}


def _count(e: Any) -> int | None:
    if e.type == "cluster.created.v1":
        return int(e.payload.spec.replicas)
    if e.type == "cluster.scaled.v1":
        return int(e.payload.replicas)
    return None


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
    return problems
