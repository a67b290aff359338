"""Keeps the gateway's routing table current: catch up on start, then follow live.

The controller publishes the whole table on `gpumesh.v1.routing` whenever it changes and every
few seconds besides; a gateway that starts (or reconnects) asks for it once with `routing.get`,
and when no controller answers, takes the last table it published from JetStream.
Tables carry their event-log position, and the router ignores older ones, so the order in which
the answer and the live updates arrive does not matter. No request ever waits on this: requests
read the router's in-memory table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from events.contract import subjects
from events.contract.messages import ApiReply, RoutingUpdate
from runtime.env import Bus, BusError, Msg, NoResponders, RequestTimeout

from .dispatch import Dispatcher
from .router import Router

_UPDATE = msgspec.json.Decoder(RoutingUpdate)
_REPLY = msgspec.json.Decoder(ApiReply)


class RoutingFeed:
    def __init__(
        self,
        bus: Bus,
        router: Router,
        dispatcher: Dispatcher,
        log: Any,
        *,
        retry_s: float = 1.0,
        request_timeout: float = 5.0,
        routing_log: Callable[[], Awaitable[bytes | None]] | None = None,
    ) -> None:
        """`routing_log`: the last table the controller published, kept by JetStream
        (wire/routing_log.py), read when no controller answers `routing.get`."""
        self._bus = bus
        self._routing_log = routing_log
        self._router = router
        self._dispatcher = dispatcher
        self._log = log
        self._retry_s = retry_s
        self._request_timeout = request_timeout
        self.ready = asyncio.Event()  # set once a first table is in
        self.dropped = 0  # undecodable messages on the routing subject

    async def run(self) -> None:
        # After an outage, ask at once rather than wait for a re-send.
        self._bus.add_reconnect_callback(self._on_reconnect)
        try:
            while True:
                try:
                    subscription = await self._bus.subscribe(subjects.ROUTING)
                except BusError as exc:
                    self._log.warning("routing_subscribe_failed", error=str(exc))
                    await asyncio.sleep(self._retry_s)
                    continue
                try:
                    # Subscribed first, then asked: an update published in between is not lost.
                    async with asyncio.TaskGroup() as tasks:
                        tasks.create_task(self._catch_up())
                        async for msg in subscription:
                            self._apply(msg)
                except BusError as exc:
                    self._log.warning("routing_feed_lost", error=str(exc))
                    await asyncio.sleep(self._retry_s)
                finally:
                    await subscription.unsubscribe()
        finally:
            self._bus.remove_reconnect_callback(self._on_reconnect)

    async def catch_up(self) -> None:
        """Ask the controller for the table now (start-up, and after a reconnect)."""
        data = msgspec.json.encode({})
        try:
            reply = await self._bus.request(
                subjects.api("routing.get"), data, timeout=self._request_timeout
            )
        except (NoResponders, RequestTimeout):
            if not await self._from_log():
                raise
            return
        answer = _REPLY.decode(reply.data)
        if not answer.ok:
            raise BusError(f"routing.get refused: {answer.error}")
        self._install(msgspec.convert(answer.data, RoutingUpdate))

    async def _from_log(self) -> bool:
        """No controller answers: the last table it published, if the log has one. The live
        updates of the next controller replace it as soon as they come."""
        if self._routing_log is None:
            return False
        data = await self._routing_log()
        if data is None:
            return False
        update = _UPDATE.decode(data)
        if not self.ready.is_set():
            self._log.warning(
                "routing_from_log",
                detail="no controller answers; routing on the last table it published",
                position=update.position,
            )
        self._install(update)
        return True

    async def _on_reconnect(self) -> None:
        try:
            await self.catch_up()
        except (BusError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._log.info("routing_catch_up_pending", error=str(exc))

    async def _catch_up(self) -> None:
        while not self.ready.is_set():
            try:
                await self.catch_up()
            except (BusError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                # No controller yet: live updates (or the next try) will bring the table.
                self._log.info("routing_catch_up_pending", error=str(exc))
                await asyncio.sleep(self._retry_s)

    def _apply(self, msg: Msg) -> None:
        try:
            update = _UPDATE.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.dropped += 1
            self._log.warning("routing_update_dropped", error=str(exc).splitlines()[0])
            return
        self._install(update)

    def _install(self, update: RoutingUpdate) -> None:
        if self._router.apply(update):
            # Wakes the held requests too: a cold start ends with a route, or with the
            # cluster's cold_start gone (back to the queue timeout).
            self._dispatcher.notify()
            fields: dict[str, object] = {
                "routes": {c: len(r) for c, r in sorted(update.routes.items())}
            }
            if update.cold_start:
                fields["cold_start"] = dict(sorted(update.cold_start.items()))
            if update.splits:
                fields["splits"] = {
                    c: f"{s.weight}% to {s.to}" for c, s in sorted(update.splits.items())
                }
            self._log.info("routing_updated", position=update.position, **fields)
        self.ready.set()
