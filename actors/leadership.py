"""Which controller leads: a lease on one key with a time to live, taken by whoever creates the
key first, kept by renewing it at the revision it last wrote, and given up when it cannot be.

No home-made consensus: the key lives in a JetStream KV bucket (wire/leader_kv.py), whose
create-if-absent and update-at-revision are the only decisions made. A leadership is a
**term**, the revision at which the key was created: it grows with every takeover, so it can
fence what an older leader still tries to do (commands carry it; agents drop older ones).

A leader stops acting at its own expiry, a time to live after it *sent* its last successful
renewal: the server counts the key's time to live from when it stored that renewal, later, so
a leader that is paused, partitioned or slow has stopped before the key can expire on the
server and a standby can create it again. Timing comes from the injected clock, so the same
code runs on the simulator's virtual time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

from events.contract import subjects
from events.contract.messages import LeaderRecord as LeaderRecord  # re-exported: the lease value
from runtime.env import Clock

from .errors import ControllerError

# After a renewal NATS refused (not one that lost the lease), the next try comes this soon.
_RETRY_RENEWAL_S = 0.05
# One renewal attempt waits at most this long for its answer before another is sent.
_RENEWAL_ATTEMPT_S = 0.25
# One create (a campaign's attempt) waits at most this long for its answer before another is
# sent; the creates that got none are remembered, this many, in case one was stored after all.
_CREATE_ATTEMPT_S = 0.5
_UNANSWERED_KEPT = 64


class LeaseTaken(ControllerError):
    """Another controller holds the lease."""


class LeaseLost(ControllerError):
    """The lease is not at the revision this controller last wrote: someone took it over."""


class LeaseBackend(Protocol):
    """The key the lease lives on (a JetStream KV key; a dict on virtual time in tests)."""

    async def create(self, value: bytes, ttl_s: float) -> int:
        """Write the key if it is absent (or expired); its revision. LeaseTaken otherwise."""
        ...

    async def renew(self, value: bytes, revision: int, ttl_s: float) -> int:
        """Write the key if its latest revision is `revision`; the new one. LeaseLost
        otherwise (it expired and was taken, or was deleted)."""
        ...

    async def read(self) -> tuple[bytes, int] | None:
        """The key's value and revision, or None when it is absent or expired."""
        ...

    async def release(self, revision: int) -> None:
        """Delete the key if its latest revision is still `revision` (a clean hand-over)."""
        ...


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    ttl_s: float = 3.0  # the key's time to live on the server
    renew_s: float = 1.0  # a leader renews this often
    poll_s: float = 0.25  # a standby looks this often
    # A leader acts only this long after sending the last renewal that succeeded, stricter
    # than its expiry (ttl_s): an agent whose heartbeats go unanswered, and who finds the
    # lease still holding the last renewal it saw go by this long after, knows this leader
    # has stopped acting for good (nodeagent/agent.py, the stalled leader). Above renew_s by
    # what a renewal's round trip and the loop's lateness may take; a leader whose renewal
    # takes longer steps down.
    acts_s: float = subjects.LEADER_ACTS_S

    def __post_init__(self) -> None:
        if not self.renew_s < self.acts_s <= self.ttl_s:
            raise ValueError("lease timing: renew_s < acts_s <= ttl_s")


Role = Literal["standby", "leader"]

Lead = Callable[[int], Coroutine[Any, Any, None]]
"""What a leader does for its term (the controller's run); cancelled when it steps down."""


class Leadership:
    def __init__(
        self,
        backend: LeaseBackend,
        clock: Clock,
        controller_id: str,
        *,
        timing: LeaseTiming | None = None,
        log: Any = None,
    ) -> None:
        self._backend = backend
        self._clock = clock
        self.controller_id = controller_id
        self.timing = timing or LeaseTiming()
        self._log = log
        self.role: Role = "standby"
        self.term = 0
        self.terms_led = 0
        self.stepped_down: list[str] = []  # why, each time this controller gave a term up
        self._since_ns = 0
        self._expires = 0.0  # this leader's own expiry (monotonic), see holds_lease
        self._acts_until = 0.0  # the last renewal that succeeded, sent + timing.acts_s
        self.revision = 0  # the lease's revision as this leader last wrote it (0: standby)
        self._deposed = asyncio.Event()
        self._deposed_why = ""

    def holds_lease(self) -> bool:
        """True while this controller leads and its own expiry has not passed. Checked before
        every write of a term (actors/fenced_store.py): a leader paused past its lease (SIGSTOP,
        a long GC, a frozen VM) finds on waking that the monotonic clock moved past its
        expiry, and writes nothing, whichever of its tasks the loop happens to run first."""
        now = self._clock.monotonic()
        return self.role == "leader" and now < self._expires and now < self._acts_until

    def deposed(self, reason: str) -> None:
        """Something of this term found it may no longer act: step down now, not at the next
        renewal."""
        if self.role == "leader" and not self._deposed.is_set():
            self._deposed_why = reason
            self._deposed.set()

    async def run(self, lead: Lead) -> None:
        """Campaign, lead while the lease holds, step down when it does not, and campaign
        again; until cancelled, when a leader releases the key for a standby to take at once."""
        while True:
            revision = await self._campaign()
            reason = await self._lead(lead, revision)
            self.stepped_down.append(reason)
            self._say("leadership_lost", term=revision, reason=reason)

    async def _campaign(self) -> int:
        """Until this controller creates the key: its revision, the new term.

        Each create waits at most _CREATE_ATTEMPT_S for its answer, as a renewal does: one sent
        while the key's stream elects a leader (its server was lost) may get no answer at all,
        and waiting out the JetStream request's own timeout (5 s) for it kept both
        controllers from asking again long after the stream could answer. A create that got
        no answer may still have been stored; when a later one finds the key taken, the key
        is read, and if it holds one of those creates this controller leads from it."""
        unanswered: dict[int, float] = {}  # since_ns -> sent, of creates that got no answer
        slow = 0  # creates in a row that got no answer
        while True:
            now_ns = self._clock.wall_ns()
            record = LeaderRecord(
                controller_id=self.controller_id, since_ns=now_ns, renewed_ns=now_ns
            )
            sent = self._clock.monotonic()
            try:
                async with asyncio.timeout(_CREATE_ATTEMPT_S):
                    revision = await self._backend.create(
                        msgspec.json.encode(record), self.timing.ttl_s
                    )
            except LeaseTaken:
                slow = 0
                # A create older than the key's time to live is too late to lead from if it
                # was stored at all (the key then expires on its own): forgotten, so that a
                # standby does not read the key at every look.
                for since_ns, at in list(unanswered.items()):
                    if sent - at > self.timing.ttl_s:
                        del unanswered[since_ns]
                found = await self._late_create(unanswered) if unanswered else None
                if found is None:
                    await asyncio.sleep(self.timing.poll_s)
                    continue
                revision, now_ns, sent = found
            except TimeoutError:
                # No answer in time: ask again at once (a stream electing its leader answers
                # nothing; the next create may reach the new leader). This one may be stored.
                unanswered[now_ns] = sent
                while len(unanswered) > _UNANSWERED_KEPT:
                    del unanswered[next(iter(unanswered))]
                if not slow:  # once per run of unanswered creates
                    self._say("lease_create_slow", waited_s=_CREATE_ATTEMPT_S)
                slow += 1
                continue
            except ControllerError as exc:
                # NATS cannot take the write now (a new stream electing its leader, a server
                # going away): no one can lead through it either; ask again shortly.
                slow = 0
                self._say("lease_unavailable", error=str(exc))
                await asyncio.sleep(self.timing.poll_s)
                continue
            self.role, self.term, self._since_ns = "leader", revision, now_ns
            # Counted from the sending, as a renewal's: the server counts from storing it.
            self._expires = sent + self.timing.ttl_s
            self._acts_until = sent + self.timing.acts_s
            self.revision = revision
            self.terms_led += 1
            self._say("leadership_won", term=revision)
            return revision

    async def _late_create(self, unanswered: dict[int, float]) -> tuple[int, int, float] | None:
        """The key holds one of this controller's creates that got no answer: (its revision,
        since_ns, when it was sent) if this controller may still lead from it, else None.

        A term acts only until acts_s after its last write known to be stored was sent; if
        that has passed for the create found, no renewal may revive it (agents may already
        count on its holder having stopped: LeaseTiming.acts_s), so this controller deletes
        the key, which nobody has acted on, and campaigns again at once rather than wait
        for the key to expire."""
        found = await self._read_within(_CREATE_ATTEMPT_S)
        if found is None:
            return None
        value, revision = found
        try:
            record = msgspec.json.decode(value, type=LeaderRecord)
        except msgspec.DecodeError:
            return None
        sent = unanswered.get(record.since_ns)
        if record.controller_id != self.controller_id or sent is None or record.term != 0:
            return None  # another controller's, or a term already renewed
        if self._clock.monotonic() < sent + self.timing.acts_s:
            self._say("lease_create_found", term=revision)
            return revision, record.since_ns, sent
        with contextlib.suppress(ControllerError, TimeoutError):
            async with asyncio.timeout(_CREATE_ATTEMPT_S):
                await self._backend.release(revision)
        self._say("lease_create_dropped", revision=revision)
        return None

    async def _read_within(self, seconds: float) -> tuple[bytes, int] | None:
        """The key, read within `seconds`; None also when it cannot be read in time."""
        try:
            async with asyncio.timeout(max(0.0, seconds)):
                return await self._backend.read()
        except (ControllerError, TimeoutError):
            return None

    async def _lead(self, lead: Lead, revision: int) -> str:
        """Run `lead` for the term while renewing; cancel it and return why when the lease
        cannot be held (taken over, or not renewed before this controller's own expiry)."""
        timing = self.timing
        self._deposed.clear()
        task = asyncio.create_task(lead(revision), name=f"leader-term-{revision}")
        reason = ""
        unsure = False  # the last renewal attempt timed out: it may have been stored
        try:
            while not reason:
                if task.done():
                    reason = _ended(task)
                    break
                if self._deposed.is_set():
                    reason = self._deposed_why
                    break
                sent = self._clock.monotonic()
                if sent >= min(self._expires, self._acts_until):
                    # Woken past its own deadline (paused), or renewals failing: agents may
                    # already count on this leader having stopped (LeaseTiming.acts_s).
                    reason = (
                        f"no renewal succeeded within {timing.acts_s:g} s (this controller was "
                        "paused, or NATS took no renewal in time)"
                    )
                    break
                deadline = min(self._expires, self._acts_until)
                try:
                    # One attempt may take a fraction of what is left: one lost with a dying
                    # connection is asked again in time, not waited on to the deadline.
                    attempt_ends = min(deadline, sent + _RENEWAL_ATTEMPT_S)
                    async with asyncio.timeout(max(0.0, attempt_ends - sent)):
                        revision = await self._renew(revision)
                except LeaseLost:
                    adopted = await self._ours(deadline) if unsure else None
                    if adopted is None:
                        reason = "another controller holds the lease"
                        break
                    # The attempt that timed out was stored after all: go on from it, with
                    # the deadlines of the last renewal known to have succeeded.
                    revision, unsure = adopted, False
                    continue
                except TimeoutError:
                    if self._clock.monotonic() >= deadline:
                        reason = f"no renewal succeeded within {timing.acts_s:g} s"
                        break
                    unsure = True  # it may have been stored: a LeaseLost next is checked
                    self._say("lease_renew_slow", term=self.term)
                    continue
                except ControllerError as exc:  # the backend's own failures, as ours
                    # Ask again soon, not a renewal period later: the deadline (acts_s) is
                    # close, and a blip of NATS (a server restarting, a reconnection) must not
                    # cost the term.
                    self._say("lease_renew_failed", error=str(exc))
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(_RETRY_RENEWAL_S):
                            await self._deposed.wait()
                    continue
                if self._clock.monotonic() >= deadline:
                    # Woken with the answer and its deadline both due, the answer first:
                    # agents may already count on this leader having stopped.
                    reason = f"no renewal succeeded within {timing.acts_s:g} s"
                    break
                self._expires = sent + timing.ttl_s
                self._acts_until = sent + timing.acts_s
                self.revision = revision
                unsure = False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timing.renew_s):
                        await self._deposed.wait()
        except asyncio.CancelledError:
            # Stopped (SIGTERM): the work first, so that nothing of this term is still
            # writing when the key is released and a standby takes over at once.
            await _stop(task)
            await self._release(revision)
            raise
        finally:
            self.role = "standby"
            self._expires = self._acts_until = 0.0
            self.revision = 0
            await _stop(task)
        return reason

    async def _ours(self, deadline: float) -> int | None:
        """The key's revision if what it holds is this term's own record, else None; read
        before `deadline`, after which it would be of no use (the term ends there)."""
        found = await self._read_within(deadline - self._clock.monotonic())
        if found is None:
            return None
        value, revision = found
        record = msgspec.json.decode(value, type=LeaderRecord)
        mine = record.controller_id == self.controller_id and record.since_ns == self._since_ns
        return revision if mine else None

    async def _renew(self, revision: int) -> int:
        record = LeaderRecord(
            controller_id=self.controller_id,
            since_ns=self._since_ns,
            renewed_ns=self._clock.wall_ns(),
            term=self.term,
        )
        return await self._backend.renew(msgspec.json.encode(record), revision, self.timing.ttl_s)

    async def _release(self, revision: int) -> None:
        with contextlib.suppress(ControllerError, TimeoutError):
            async with asyncio.timeout(self.timing.renew_s):
                await self._backend.release(revision)
        self._say("leadership_released", term=self.term)

    def _say(self, event: str, **fields: object) -> None:
        if self._log is not None:
            self._log.info(event, controller=self.controller_id, **fields)


def _ended(task: asyncio.Task[None]) -> str:
    """Why a term's work stopped on its own: its error, in one line, when it failed."""
    if task.cancelled():
        return "the leader's work was cancelled"
    exc = task.exception()
    if exc is None:
        return "the leader's work ended"
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"the leader's work failed: {type(exc).__name__}: {exc}"


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
