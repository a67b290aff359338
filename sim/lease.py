"""The controllers' leader lease in a simulated run: one key with a time to live on the
simulated NATS server, on virtual time, written the way actors/leader_kv.py writes the
JetStream key (create-if-absent, renew at the revision last written, delete at a revision).

`LeaseKey` is the server's side: every write gets the next revision of the stream (a
sequence, never reused), and the key expires `ttl_s` after the server stored its last write.
`SimLease` is one controller's client, the production `LeaseBackend` protocol: a request
crosses the controller's connection (`ONE_WAY_S` each way, drawn from its own stream) and is
decided on the server when it arrives. A request sent while the connection is down, or cut by
a partition, reaches nothing: it times out after `REQUEST_TIMEOUT_S` (KvLease's JetStream
timeout), as does one whose reply finds the connection down (then the write did happen: the
client does not know). While the key's stream elects a new leader (after the NATS server that
led it died) the server answers every request with an error, as JetStream does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, TypeVar

import msgspec

from actors.errors import ControllerError
from actors.leadership import LeaseLost, LeaseTaken
from events.contract import subjects
from events.contract.messages import LeaderRecord
from runtime.env import RandomSource
from wire.lease_read import LeaseUnreadable

from .network import SERVER, SimNetwork

T = TypeVar("T")
ONE_WAY_S: Final = (0.0005, 0.002)  # a request's trip to the server, and the reply's back
REQUEST_TIMEOUT_S: Final = 5.0  # KvLease: the JetStream request's timeout


@dataclass
class _Stored:
    value: bytes
    revision: int
    expires: float


class LeaseKey:
    """The key on the simulated server (see the module docstring)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._stored: _Stored | None = None
        self._sequence = 0
        self.unavailable_until = -1.0  # the key's stream has no leader until then
        self.writes: list[tuple[float, int, bytes]] = []  # (when, revision, value), for tests

    def _current(self) -> _Stored | None:
        stored = self._stored
        if stored is not None and self._now() >= stored.expires:
            self._stored = stored = None
        return stored

    def _write(self, value: bytes, ttl_s: float) -> int:
        self._sequence += 1
        now = self._now()
        self._stored = _Stored(value, self._sequence, now + ttl_s)
        self.writes.append((now, self._sequence, value))
        return self._sequence

    def available(self) -> bool:
        return self._now() >= self.unavailable_until

    def create(self, value: bytes, ttl_s: float) -> int:
        if self._current() is not None:
            raise LeaseTaken("another controller holds it")
        return self._write(value, ttl_s)

    def renew(self, value: bytes, revision: int, ttl_s: float) -> int:
        current = self._current()
        if current is None or current.revision != revision:
            raise LeaseLost(f"the lease is no longer at revision {revision}")
        return self._write(value, ttl_s)

    def read(self) -> tuple[bytes, int] | None:
        current = self._current()
        return None if current is None else (current.value, current.revision)

    def release(self, revision: int) -> None:
        current = self._current()
        if current is not None and current.revision == revision:
            self._stored = None


class SimLease:
    """One controller's LeaseBackend over its simulated NATS connection (`endpoint`)."""

    def __init__(
        self, key: LeaseKey, network: SimNetwork, endpoint: str, rng: RandomSource
    ) -> None:
        self._key = key
        self._rng = rng
        self._network = network
        self._endpoint = endpoint
        self.severed = False  # the process is dead: nothing it sends goes anywhere

    def _reachable(self) -> bool:
        if self.severed:
            return False
        endpoint = self._network.endpoint(self._endpoint)
        return endpoint.is_connected and not self._network.cut(self._endpoint, SERVER)

    async def _call(self, decide: Callable[[], T], *, write: bytes | None = None) -> T:
        if not self._reachable():
            await asyncio.sleep(REQUEST_TIMEOUT_S)
            raise ControllerError("the lease request timed out (not connected to NATS)")
        if write is not None:
            # A write of the key is a message on its subject: plain subscribers (agents
            # watching renewals) get it as it passes the server, stored or not.
            await self._network.endpoint(self._endpoint).publish(subjects.LEADER, write)
        await asyncio.sleep(self._rng.uniform(*ONE_WAY_S))
        key = self._key
        if not key.available():
            await asyncio.sleep(self._rng.uniform(*ONE_WAY_S))
            raise ControllerError("the lease's stream has no leader (JetStream not available)")
        error: Exception | None = None
        result: T | None = None
        try:
            result = decide()
        except (LeaseTaken, LeaseLost) as exc:
            error = exc
        await asyncio.sleep(self._rng.uniform(*ONE_WAY_S))
        if not self._reachable():
            # Decided on the server, but the answer never arrives.
            await asyncio.sleep(REQUEST_TIMEOUT_S)
            raise ControllerError("the lease request timed out (the reply was lost)")
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    async def create(self, value: bytes, ttl_s: float) -> int:
        return await self._call(lambda: self._key.create(value, ttl_s), write=value)

    async def renew(self, value: bytes, revision: int, ttl_s: float) -> int:
        return await self._call(lambda: self._key.renew(value, revision, ttl_s), write=value)

    async def read(self) -> tuple[bytes, int] | None:
        return await self._call(self._key.read)

    async def release(self, revision: int) -> None:
        await self._call(lambda: self._key.release(revision))


_RECORD = msgspec.json.Decoder(LeaderRecord)


def lease_reader(
    key: LeaseKey, network: SimNetwork, endpoint: str, rng: RandomSource
) -> Callable[[], Awaitable[LeaderRecord | None]]:
    """An agent's read of the lease (wire/lease_read.py's role): the key's record, None when
    absent, LeaseUnreadable when the server cannot be reached or the stream has no leader."""
    client = SimLease(key, network, endpoint, rng)

    async def record() -> LeaderRecord | None:
        try:
            found = await client.read()
        except ControllerError as exc:
            raise LeaseUnreadable(exc.reason) from None
        return None if found is None else _RECORD.decode(found[0])

    return record
