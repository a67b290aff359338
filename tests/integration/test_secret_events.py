"""The events integrators and gateways read on `gpumesh.v1.events.>` (the GPUMESH_EVENTS
stream, through the outbox) carry a spec's secret as its reference, never its value."""

from __future__ import annotations

import pytest

from actors.outbox import OutboxPublisher
from events.contract import subjects
from events.secret_store import reference
from tests.control.harness import fleet
from wire.nats_bus import NatsBus

from .helpers import stream_messages

pytestmark = pytest.mark.integration

FIRST = "hf_firstSECRETvalue0123456789"
SECOND = "hf_secondSECRETvalue987654321"


async def test_the_event_stream_carries_references_only(bus: NatsBus) -> None:
    async with fleet(1) as f:
        spec = {"name": "llama", "command": "serve", "secret_env": {"HF_TOKEN": FIRST}}
        assert (await f.api("cluster.create", spec)).ok
        spec["secret_env"] = {"HF_TOKEN": SECOND}
        applied = await f.api("cluster.apply", spec)
        assert applied.ok, applied.error
        published = await OutboxPublisher(f.store, bus).publish_pending()
        assert published == await f.store.head()
    messages = await stream_messages(bus.jetstream(), subjects.EVENTS_STREAM)
    cluster = [m.data for m in messages if m.subject == subjects.event("cluster/llama")]
    assert len(cluster) >= 2  # created, and the spec changed
    everything = b"".join(m.data for m in messages)
    assert FIRST.encode() not in everything and SECOND.encode() not in everything
    assert reference(FIRST).encode() in everything and reference(SECOND).encode() in everything
