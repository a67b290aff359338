"""The last routing table, kept by JetStream: a gateway that starts while no controller answers
`routing.get` (it crashed, or another is taking over) routes on it instead of refusing.

The controller's routing updates are plain publishes on `gpumesh.v1.routing`; a JetStream
stream on that subject keeping one message (`max_msgs_per_subject=1`) captures each as it goes
by, with no change to the publisher. It is written by the controller's own publishes and read
with one `STREAM.MSG.GET` (the gateway's NATS permissions allow that and nothing else of
JetStream)."""

from __future__ import annotations

from typing import Final

import nats.errors
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from events.contract import subjects
from runtime.env import BusError

from .nats_bus import NatsBus, describe, ensure_stream

# A table is a few hundred bytes a replica; nats-server refuses anything over max_payload.
_MAX_TABLE_BYTES: Final = 1024 * 1024


def routing_log_config() -> StreamConfig:
    return StreamConfig(
        name=subjects.ROUTING_STREAM,
        subjects=[subjects.ROUTING],
        storage=StorageType.FILE,
        max_msgs_per_subject=1,
        max_msg_size=_MAX_TABLE_BYTES,
        discard=DiscardPolicy.OLD,
    )


async def ensure_routing_log(bus: NatsBus) -> None:
    """Create the stream (the controller's side, once, at start-up)."""
    await ensure_stream(bus.jetstream(), routing_log_config(), replicas=bus.stream_replicas)


async def last_routing_table(bus: NatsBus) -> bytes | None:
    """The last routing update the controller published, or None when there is none yet."""
    try:
        found = await bus.jetstream().get_last_msg(subjects.ROUTING_STREAM, subjects.ROUTING)
    except NotFoundError:
        return None  # no stream yet (no controller ever ran here), or nothing in it
    except nats.errors.Error as exc:
        raise BusError(f"cannot read the last routing table: {describe(exc)}") from exc
    return found.data or None
