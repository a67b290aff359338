"""The NATS permissions a node needs for the stage link (nodeagent/stage_link.py), until
gpumesh/security/roles.py grants them: each node reads its own stage link subjects and
publishes only frames that name itself as the sender, to any node.

`with_stage_link_permissions()` adds them while identities are issued and nats.conf is
written, so a test (or bench/stage_link.py --secure) runs the stage link on a secured server
exactly as roles.py would, once it has these lines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import msgspec

from events.contract import stage_link as frames
from events.contract.subjects import PREFIX
from gpumesh.security import identities
from gpumesh.security.roles import Permissions, permissions
from wire.nats_access import Role


def stage_link_publish(node_id: str) -> tuple[str, ...]:
    """To any node's stage link, as `node_id`: OPEN and frames to a worker, frames to a head."""
    return (
        f"{PREFIX}.node.*.stagelink.stage.{node_id}.*",
        f"{PREFIX}.node.*.stagelink.head.{node_id}.*",
    )


def stage_link_subscribe(node_id: str) -> tuple[str, ...]:
    return (f"{frames.stagelink(node_id)}.>",)


def proposed(role: Role, name: str) -> Permissions | None:
    allowed = permissions(role, name)
    if role != "node" or allowed is None:
        return allowed
    return msgspec.structs.replace(
        allowed,
        publish=(*allowed.publish, *stage_link_publish(name)),
        subscribe=(*allowed.subscribe, *stage_link_subscribe(name)),
    )


@contextlib.contextmanager
def with_stage_link_permissions() -> Iterator[None]:
    # identities renders nats.conf from the name it imported from roles.
    with mock.patch.object(identities, "permissions", proposed):
        yield
