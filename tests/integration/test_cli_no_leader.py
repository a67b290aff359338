"""When no controller answers the control API, the CLI says why from the lease and the roster
(actors/cli.py): a leader not serving yet, standbys about to take over, or nobody at all."""

from __future__ import annotations

import msgspec
import pytest

from actors.cli import _why_nobody_answers
from actors.leader_kv import KvLease
from actors.leadership import LeaderRecord
from actors.roster import Roster, RosterEntry
from wire.nats_bus import NatsBus

pytestmark = pytest.mark.integration


async def test_the_cli_names_who_is_there_when_nobody_answers(bus: NatsBus) -> None:
    assert "is `gpumesh up` or `gpumesh controller` running?" in await _why_nobody_answers(
        bus, "nats://x"
    )
    await Roster(bus).report(
        RosterEntry(
            controller_id="standby-9",
            role="standby",
            term=0,
            applied=10,
            head=10,
            log="jetstream",
            follows=True,
            reported_ns=1,
        )
    )
    said = await _why_nobody_answers(bus, "nats://x")
    assert "no controller leads" in said and "standby-9" in said
    record = LeaderRecord(controller_id="c-1", since_ns=1)
    revision = await KvLease(bus).create(msgspec.json.encode(record), 5.0)
    said = await _why_nobody_answers(bus, "nats://x")
    assert "c-1 holds the lease" in said and f"term {revision}" in said
