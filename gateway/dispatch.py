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
from .transport.base import BrokenWhileHeld, FirstByteTimeout, Outcome, UpstreamError

T = TypeVar("T")

# Retry-After for a cluster with no ready replica: spread, so that clients told to come back
# do not all come back in the same second.
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 5.0


class DispatchError(Exception):
    """Why a request gets no answer from a replica, as its client is to be told.

    `status`, `code` and `message` are the reply (OpenAI's error shape; docs/gateway.md,
    "Status codes of the inference routes") and `retry_after_s`, when set, its Retry-After.
    Two things only the request knows are added where the error becomes a reply
    (gateway/proxy.py, `refuse`): the models its key may see, when `lists_known`, and why it
    was not repeated, when `not_repeated`. Each kind keeps what it reports in fields of its
    own; str() is the line for a log.

    Raised from inside an attempt (by the caller's `attempt` or `settle`), it ends the request
    there, and `outcome` says how that attempt counts against its replica.
    """

    retry_after_s: float | None = None
    lists_known = False
    not_repeated = False
    outcome: Outcome = "cancelled"

    def __init__(self, status: int, code: str, message: str, log: str = "") -> None:
        super().__init__(log or message)
        self.status = status
        self.code = code
        self.message = message


class UnknownCluster(DispatchError):
    """No live cluster has this name (or none this caller may know of: `lists_known` False)."""

    def __init__(self, cluster: str, *, lists_known: bool = True) -> None:
        message = f"The model `{cluster}` does not exist"
        super().__init__(404, "model_not_found", message, f"unknown cluster {cluster}")
        self.cluster = cluster
        self.lists_known = lists_known


class NoReadyReplica(DispatchError):
    """The request waited queue_timeout_s and the cluster still has no replica to try."""

    retry_after_s: float  # always: drawn, so that clients told to come back spread out

    def __init__(self, cluster: str, waited_s: float, retry_after_s: float) -> None:
        super().__init__(
            503,
            "no_ready_replica",
            f"cluster {cluster!r} has no ready replica",
            f"cluster {cluster}: no ready replica after {waited_s:.1f} s",
        )
        self.cluster = cluster
        self.waited_s = waited_s
        self.retry_after_s = retry_after_s


class AttemptsExhausted(DispatchError):
    """Every attempt failed before an answer could begin; `last` says how the last one did.

    502, with `last`'s outcome as the code; 504 if it timed out. A body that broke while held
    back (BrokenWhileHeld) is a `reset`: the client never saw it begin."""

    def __init__(
        self, last: UpstreamError, attempts: int, cluster: str = "", *, repeatable: bool = True
    ) -> None:
        if not isinstance(last, BrokenWhileHeld):
            code = last.outcome
            message = (
                f"no replica of {cluster!r} answered after {attempts} attempt(s); last: {last}"
            )
        elif repeatable:
            code, message = "reset", f"every answer broke off before its end; last: {last}"
        else:
            code, message = "reset", f"the answer broke off before its end ({last})"
        status = 504 if isinstance(last, FirstByteTimeout) else 502
        log = f"{attempts} attempt(s) failed, last: {last} ({last.outcome})"
        super().__init__(status, code, message, log)
        self.last = last
        self.attempts = attempts
        self.cluster = cluster
        self.not_repeated = not repeatable and not last.never_delivered


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
        # (an answer that broke off on its way to the client), through the same hook.
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
        settle: Callable[[RouteEntry, T], Awaitable[None]] | None = None,
    ) -> tuple[RouteEntry, T]:
        """The route that answered and what `attempt` returned for it. A request that is not
        `repeatable` is tried again only after a failure that proves it never reached a
        replica (RetryPolicy.retryable).

        `settle`, if given, runs once `attempt` has returned, outside its first-byte timeout:
        what must still succeed before the caller passes the answer on (the proxy reads a
        non-streaming body whole). An UpstreamError from it is an attempt's failure like any
        other: it counts against the route and is retried on the policy's terms.

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
                    raise AttemptsExhausted(
                        last, attempts, cluster, repeatable=repeatable
                    ) from last
                raise self._no_ready_replica(cluster, arrival)
            first_byte_timeout = min(self.policy.first_byte_timeout_s, left)
            attempts += 1
            try:
                return route, await self._attempt(route, attempt, settle, first_byte_timeout)
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
                raise AttemptsExhausted(
                    failure, attempts, cluster, repeatable=repeatable
                ) from failure
            await asyncio.sleep(delay)

    async def _attempt(
        self,
        route: RouteEntry,
        attempt: Callable[[RouteEntry, float], Awaitable[T]],
        settle: Callable[[RouteEntry, T], Awaitable[None]] | None,
        first_byte_timeout: float,
    ) -> T:
        self.router.started(route)
        try:
            # The transport enforces first_byte_timeout itself; this guard holds the deadline
            # even for one that does not.
            guard = asyncio.timeout(first_byte_timeout)
            try:
                async with guard:
                    result = await attempt(route, first_byte_timeout)
            except TimeoutError:
                if not guard.expired():
                    raise
                raise FirstByteTimeout(
                    route.replica_id, f"no response head within {first_byte_timeout:g} s"
                ) from None
            if settle is not None:
                await settle(route, result)
            return result
        except (UpstreamError, DispatchError) as exc:
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
