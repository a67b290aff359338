"""One request's way to a response head: pick a replica, try, maybe try another, or wait.

Only asyncio primitives and the injected clock and random source: on the simulator's
virtual-time loop the same code waits, times out and backs off without costing wall time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from events.contract.messages import RouteEntry
from runtime.env import Clock, RandomSource

from .retry import RetryPolicy
from .router import Ejection, Router
from .transport.base import FirstByteTimeout, UpstreamError

T = TypeVar("T")

# Retry-After for a cluster with no ready replica: spread, so that clients told to come back
# do not all come back in the same second.
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 5.0


class NoReadyReplica(Exception):
    """The request waited queue_timeout_s and the cluster still has no replica to try."""

    def __init__(self, cluster: str, waited_s: float, retry_after_s: float) -> None:
        super().__init__(f"cluster {cluster}: no ready replica after {waited_s:.1f} s")
        self.cluster = cluster
        self.retry_after_s = retry_after_s


class UnknownCluster(Exception):
    def __init__(self, cluster: str) -> None:
        super().__init__(f"unknown cluster {cluster}")
        self.cluster = cluster


class AttemptsExhausted(Exception):
    """Every attempt failed before a response head; `last` says how the last one did."""

    def __init__(self, last: UpstreamError, attempts: int) -> None:
        super().__init__(f"{attempts} attempt(s) failed, last: {last} ({last.outcome})")
        self.last = last
        self.attempts = attempts


def _ignore(_ejection: Ejection) -> None:
    return None


class Dispatcher:
    def __init__(
        self,
        router: Router,
        policy: RetryPolicy,
        clock: Clock,
        rng: RandomSource,
        on_ejection: Callable[[Ejection], None] = _ignore,
    ) -> None:
        self.router = router
        self.policy = policy
        self._clock = clock
        self._rng = rng
        # Public: the caller reports the ejections its own finished(route, ...) calls cause
        # (a body that broke), through the same hook.
        self.on_ejection = on_ejection
        # Replaced on every notify(): a waiter holds the event current when it last looked at
        # the table, so a change between its look and its wait still wakes it.
        self._table_changed = asyncio.Event()

    def notify(self) -> None:
        """Wake the requests waiting for a replica; call after router.apply() returned True."""
        self._table_changed.set()
        self._table_changed = asyncio.Event()

    async def run(
        self,
        cluster: str,
        attempt: Callable[[RouteEntry, float], Awaitable[T]],
        *,
        key: str = "",
        repeatable: bool = True,
    ) -> tuple[RouteEntry, T]:
        """The route that answered and what `attempt` returned for it. A request that is not
        `repeatable` is tried again only after a failure that proves it never reached a
        replica (RetryPolicy.retryable).

        The request stays outstanding on that route: the caller calls
        `router.finished(route, ...)` once the body is done, with "ok", "stream_broken" or
        "cancelled".
        """
        if not self.router.known(cluster):
            raise UnknownCluster(cluster)
        arrival = self._clock.monotonic()
        deadline = arrival + self.policy.deadline_s
        give_up_waiting = min(arrival + self.policy.queue_timeout_s, deadline)
        tried: list[RouteEntry] = []
        attempts = 0
        last: UpstreamError | None = None
        while True:
            dead = last is not None and last.outcome == "connect_error"
            route = await self._next_route(cluster, key, tried, arrival, give_up_waiting, dead)
            left = deadline - self._clock.monotonic()
            if left <= 0:
                # The wait for a replica used up the deadline: not the replica's fault, so no
                # attempt that would be bound to time out against it.
                if last is not None:
                    raise AttemptsExhausted(last, attempts) from last
                raise self._no_ready_replica(cluster, arrival)
            first_byte_timeout = min(self.policy.first_byte_timeout_s, left)
            attempts += 1
            try:
                return route, await self._attempt(route, attempt, first_byte_timeout)
            except UpstreamError as exc:
                failure = last = exc
            if route not in tried:
                tried.append(route)
            delay = self.policy.backoff(attempts, self._rng)
            if (
                not self.policy.retryable(failure, repeatable=repeatable)
                or attempts >= self.policy.max_attempts
                or self._clock.monotonic() + delay >= deadline
            ):
                raise AttemptsExhausted(failure, attempts) from failure
            await asyncio.sleep(delay)

    async def _attempt(
        self,
        route: RouteEntry,
        attempt: Callable[[RouteEntry, float], Awaitable[T]],
        first_byte_timeout: float,
    ) -> T:
        self.router.started(route)
        try:
            # The transport enforces first_byte_timeout itself; this guard holds the deadline
            # even for one that does not.
            guard = asyncio.timeout(first_byte_timeout)
            try:
                async with guard:
                    return await attempt(route, first_byte_timeout)
            except TimeoutError:
                if not guard.expired():
                    raise
                raise FirstByteTimeout(
                    route.replica_id, f"no response head within {first_byte_timeout:g} s"
                ) from None
        except UpstreamError as exc:
            ejection = self.router.finished(route, exc.outcome)
            if ejection is not None:
                self.on_ejection(ejection)
            raise
        except BaseException:
            # Cancelled (the client left) or a bug in the attempt: either way the request is no
            # longer outstanding, and neither says anything about the replica's health.
            self.router.finished(route, "cancelled")
            raise

    async def _next_route(
        self,
        cluster: str,
        key: str,
        tried: list[RouteEntry],
        arrival: float,
        give_up: float,
        dead: bool = False,
    ) -> RouteEntry:
        while True:
            changed = self._table_changed
            if not self.router.known(cluster):
                raise UnknownCluster(cluster)  # deleted while this request waited
            # Only the placements that failed are excluded: a replica replaced at a new epoch
            # (same id, maybe another node) is a new candidate.
            current = set(self.router.routes(cluster))
            exclude = [r.replica_id for r in tried if r in current]
            route = self.router.choose(cluster, key=key, exclude=exclude)
            if route is not None:
                return route
            if exclude and dead:
                # Every candidate failed once already, the last one refusing connections: its
                # node died and the controller is replacing it. Wait for the table to change
                # (within the queue timeout) before another go at a replica that just failed.
                left = give_up - self._clock.monotonic()
                if left > 0:
                    try:
                        async with asyncio.timeout(left):
                            await changed.wait()
                        continue
                    except TimeoutError:
                        pass
            if exclude and (route := self.router.choose(cluster, key=key)) is not None:
                return route  # another go beats giving up while attempts remain
            left = give_up - self._clock.monotonic()
            if left > 0:
                try:
                    async with asyncio.timeout(left):
                        await changed.wait()
                    continue
                except TimeoutError:
                    pass
            if (route := self.router.choose(cluster, key=key)) is not None:
                return route  # a change in the very tick the wait ran out
            raise self._no_ready_replica(cluster, arrival)

    def _no_ready_replica(self, cluster: str, arrival: float) -> NoReadyReplica:
        return NoReadyReplica(
            cluster,
            self._clock.monotonic() - arrival,
            self._rng.uniform(RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S),
        )
