"""When `cluster create|scale|apply --wait` returns: every replica still wanted ready at the
cluster's current revision, nothing on its way in or out (actors/cli.py)."""

from __future__ import annotations

from typing import Any

from actors.cli import _progress_line, _settled


def cluster(*replicas: tuple[str, int], desired: int = 2, revision: int = 2) -> dict[str, Any]:
    rows = [
        {"replica_id": f"r{i}", "status": status, "revision": rev}
        for i, (status, rev) in enumerate(replicas)
    ]
    ready = sum(1 for status, _ in replicas if status == "ready")
    return {
        "name": "llama",
        "desired": desired,
        "ready": ready,
        "revision": revision,
        "unschedulable": "",
        "replicas": rows,
    }


def test_settled_only_when_every_wanted_replica_is_ready_at_the_current_revision() -> None:
    assert _settled(cluster(("ready", 2), ("ready", 2)))
    assert _settled(cluster(("ready", 2), ("ready", 2), ("stopped", 1), ("failed", 1)))
    assert not _settled(cluster(("ready", 2), ("starting", 2)))
    assert not _settled(cluster(("ready", 2), ("ready", 1)))  # a rollout under way
    assert not _settled(cluster(("ready", 2), ("ready", 2), ("stopping", 1)))  # still leaving
    assert not _settled(cluster(("ready", 2), desired=2))


def test_the_progress_line_counts_what_is_on_its_way() -> None:
    c = cluster(("ready", 2), ("starting", 2), ("stopping", 1))
    c["unschedulable"] = "no node fits llama: 1 drained"
    assert _progress_line(c) == (
        "llama: 1/2 ready (starting 1, stopping 1); unschedulable: no node fits llama: 1 drained"
    )
