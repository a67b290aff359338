"""What the dashboard's pages show, asked of the controller over the control API on NATS.

The gateway keeps no fleet state: every page and every data route asks `node.list`,
`cluster.list` and `events.list` (docs/subjects.md, "Control API"), the verbs `/api/v1` and
`gpumesh status` use. Replies are passed on as the controller encoded them (`msgspec.Raw`), so a
fleet of 1,000 nodes is not decoded and encoded again on its way to the browser.

Each snapshot carries `head`, the log position asked *before* the lists: the page follows the
event stream from there, so an event committed while the lists were read is applied again
rather than missed (every event the pages apply sets a value, so applying one twice is
harmless).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Final

import msgspec

from events.contract import subjects
from gateway.control_routes import ControlError, EventHead, EventsPage, refused, unreachable
from runtime.env import Bus, BusError

EVENTS_PAGE: Final = 1000  # events.list's most per call
FIRST_WINDOW: Final = 2_000  # positions the events page looks back first (recent_events)
MAX_LOOKBACK: Final = 170_000  # positions one backfill looks back at most: 4 windows
DEFAULT_EVENTS: Final = 500
MAX_EVENTS: Final = 2000
# Positions the incidents page reads back for a node's last heartbeat before its incident: a
# 1,000-node fleet heartbeats about 1,000 times a second, and a node is suspect after 2 s.
HEARTBEAT_LOOKBACK: Final = 21_000


class _RawReply(msgspec.Struct, frozen=True, kw_only=True):
    """An ApiReply whose `data` is kept as the controller's JSON (its tag is ignored)."""

    ok: bool
    error: str = ""
    data: msgspec.Raw = msgspec.Raw(b"null")


class _EventsReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    error: str = ""
    data: EventsPage | None = None


_raw_reply = msgspec.json.Decoder(_RawReply)
_events_reply = msgspec.json.Decoder(_EventsReply)
_event_head = msgspec.json.Decoder(EventHead)


class _StreamHead(msgspec.Struct, frozen=True):
    position: int
    stream: str


_stream_head = msgspec.json.Decoder(_StreamHead)


class Backfill(msgspec.Struct, frozen=True):
    """The last events up to `to`, oldest first, heartbeats left out. `start`: every such
    event in (start, to] is in `events`; 0 once the log's beginning was reached."""

    events: list[msgspec.Raw]
    start: int
    head: int


class ControllerClient:
    """The control API's read verbs, each one NATS request with `timeout`; failures raise the
    ControlError /api/v1 would answer with (503 no controller, 504 timeout, 502 garbage)."""

    def __init__(self, bus: Bus, *, timeout: float) -> None:
        self._bus = bus
        self._timeout = timeout

    async def _ask(self, verb: str, body: object) -> bytes:
        try:
            msg = await self._bus.request(
                subjects.api(verb), msgspec.json.encode(body), timeout=self._timeout
            )
        except BusError as exc:
            raise unreachable(exc) from None
        return msg.data

    async def raw(self, verb: str, body: object) -> bytes:
        """The verb's `data`, as the controller's JSON."""
        data = await self._ask(verb, body)
        try:
            reply = _raw_reply.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ControlError(502, "bad_reply", f"unreadable reply to {verb}: {exc}") from None
        if not reply.ok:
            raise refused(reply.error)
        return bytes(reply.data)

    async def events(
        self, after: int, limit: int = EVENTS_PAGE, *, heartbeats: bool = False
    ) -> EventsPage:
        body: dict[str, object] = {"after": after, "limit": limit}
        if heartbeats:
            body["heartbeats"] = True
        data = await self._ask("events.list", body)
        try:
            reply = _events_reply.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ControlError(
                502, "bad_reply", f"unreadable reply to events.list: {exc}"
            ) from None
        if not reply.ok or reply.data is None:
            raise refused(reply.error or "events.list answered no data")
        return reply.data

    async def head(self) -> int:
        return (await self.events(0, 1)).head

    async def fleet(self) -> bytes:
        """`{"head", "nodes", "clusters"}`: the fleet page's snapshot."""
        head = await self.head()
        nodes, clusters = await asyncio.gather(
            self.raw("node.list", {}), self.raw("cluster.list", {})
        )
        return b'{"head":%d,"nodes":%s,"clusters":%s}' % (head, nodes, clusters)

    async def clusters(self) -> bytes:
        """`{"head", "clusters"}`: the clusters page's snapshot."""
        head = await self.head()
        return b'{"head":%d,"clusters":%s}' % (head, await self.raw("cluster.list", {}))

    async def recent_events(self, to: int | None, limit: int) -> Backfill:
        """The last `limit` events at or below `to` (default: the head), heartbeats left out.

        Heartbeats are most of the log and events.list pages forward only, so this looks back
        in windows that grow fourfold (2,000 positions, then 8,000, ...), each read whole,
        until it has `limit` events, reaches the log's start, or has looked back MAX_LOOKBACK
        positions; `start` says where it stopped, for the next, older request."""
        head = await self.head()
        hi = head if to is None else max(0, min(to, head))
        windows: list[list[tuple[int, msgspec.Raw]]] = []  # newest first
        found = 0
        size = FIRST_WINDOW
        looked = 0
        while found < limit and hi > 0 and looked < MAX_LOOKBACK:
            lo = max(0, hi - size)
            window = await self._window(lo, hi)
            windows.append(window)
            found += len(window)
            looked += hi - lo
            hi = lo
            size *= 4
        events = [event for window in reversed(windows) for event in window]
        if len(events) > limit:
            events = events[-limit:]
            hi = events[0][0] - 1  # the ones left out are older: the next request asks
        return Backfill([raw for _, raw in events], hi, head)

    async def last_heartbeat(self, node_id: str, before: int) -> msgspec.Raw | None:
        """The node's last heartbeat before position `before`, or None when there is none in
        the HEARTBEAT_LOOKBACK positions before it. Heartbeats of the whole fleet are most of
        the log, so this reads back in windows that grow fourfold from one page."""
        stream = f"heartbeat/{node_id}"
        hi = before - 1
        size = EVENTS_PAGE
        looked = 0
        while hi > 0 and looked < HEARTBEAT_LOOKBACK:
            lo = max(0, hi - size)
            found: msgspec.Raw | None = None
            cursor = lo
            while cursor < hi:
                page = await self.events(cursor, heartbeats=True)
                past = False
                for raw in page.events:
                    try:
                        head = _stream_head.decode(raw)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    past = head.position > hi
                    if past:
                        break
                    if head.stream == stream:
                        found = raw
                if past or page.next <= cursor:
                    break
                cursor = page.next
            if found is not None:
                return found
            looked += hi - lo
            hi = lo
            size *= 4
        return None

    async def _window(self, lo: int, hi: int) -> list[tuple[int, msgspec.Raw]]:
        """Every event in (lo, hi] but heartbeats, with its position, in order."""
        return [event async for event in self.scan(lo, hi)]

    async def scan(self, after: int, upto: int) -> AsyncGenerator[tuple[int, msgspec.Raw]]:
        """Every event in (after, upto] but heartbeats, with its position, in order, asked one
        events.list page at a time as it is read: the incidents page folds a long stretch of
        the log this way and holds none of it."""
        cursor = after
        while cursor < upto:
            page = await self.events(cursor)
            for raw in page.events:
                position = _position(raw)
                if position > upto:
                    return
                yield position, raw
            if page.next <= cursor:
                return
            cursor = page.next


def _position(raw: msgspec.Raw) -> int:
    try:
        return _event_head.decode(raw).position
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ControlError(502, "bad_reply", f"unreadable event in events.list: {exc}") from None
