"""The controllers' roster: each controller process says, once a second, who it is, whether it
leads, and how far it has applied the log, on a key of its own with a time to live.

`gpumesh controller status` reads it to show each standby's lag in events (the leader's last
position seen minus the standby's). A controller that dies leaves its key to expire: the
roster holds only the living. Like the lease (actors/leader_kv.py), a key is a subject of a
stream that keeps one message per subject, written with a per-message time to live.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec
import nats.errors
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from wire.nats_bus import NatsBus, describe, ensure_stream

from .errors import ControllerError

STREAM: Final = "GPUMESH_CONTROLLERS"
PREFIX: Final = "gpumesh.v1.controllers"
TTL_S: Final = 5.0  # a record outlives three missed reports (one a second)


class RosterEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One controller process, as it last reported itself (`gpumesh.v1.controllers.<id>`)."""

    controller_id: str
    role: Literal["leader", "standby"]
    term: int  # the term it leads in; 0 for a standby
    applied: int  # the log position its state has folded in
    head: int  # the log's last position it knew of
    log: str  # "jetstream" (standbys follow the log) or "sqlite" (they rebuild at takeover)
    follows: bool  # whether its state follows the log while it stands by
    reported_ns: int  # wall clock


_DECODE = msgspec.json.Decoder(RosterEntry)


class Roster:
    def __init__(self, bus: NatsBus, *, timeout: float = 5.0) -> None:
        self._bus = bus
        self._js = bus.jetstream(timeout=timeout)
        self._ready = False

    async def _stream(self) -> None:
        if self._ready:
            return
        config = StreamConfig(
            name=STREAM,
            description="gpumesh: the controllers alive, their roles and log positions",
            subjects=[f"{PREFIX}.*"],
            storage=StorageType.MEMORY,
            max_msgs_per_subject=1,
            discard=DiscardPolicy.OLD,
            allow_msg_ttl=True,
        )
        await ensure_stream(self._js, config, replicas=self._bus.stream_replicas)
        self._ready = True

    async def report(self, entry: RosterEntry) -> None:
        try:
            await self._stream()
            await self._js.publish(
                f"{PREFIX}.{entry.controller_id}", msgspec.json.encode(entry), msg_ttl=TTL_S
            )
        except nats.errors.Error as exc:
            raise ControllerError(f"cannot report to the roster: {describe(exc)}") from exc

    async def entries(self) -> list[RosterEntry]:
        """Every controller alive, by id."""
        try:
            await self._stream()
            info = await self._js.stream_info(STREAM, subjects_filter=f"{PREFIX}.*")
            names = sorted((info.state.subjects or {}).keys())
            found: list[RosterEntry] = []
            for subject in names:
                try:
                    msg = await self._js.get_last_msg(STREAM, subject)
                except NotFoundError:
                    continue  # expired between the listing and the read
                if msg.data:
                    found.append(_DECODE.decode(msg.data))
        except nats.errors.Error as exc:
            raise ControllerError(f"cannot read the roster: {describe(exc)}") from exc
        return found


def lag(entry: RosterEntry, leader: RosterEntry | None) -> int | None:
    """How many positions `entry` has still to apply to reach what the leader had applied when
    it last reported; None with no leader to compare with."""
    if leader is None:
        return None
    return max(0, leader.applied - entry.applied)
