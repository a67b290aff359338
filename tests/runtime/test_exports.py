"""The public surface: every name re-exported, and closed to subclassing where meant."""

from __future__ import annotations

import runtime
import sim
from runtime import Actor, EventSourcedActor

FINAL = {
    "ActorContext",
    "ActorRef",
    "ActorSystem",
    "Mailbox",
    "MailboxStats",
    "SupervisionPolicy",
    "CrashWindow",
}
OPEN = {"Actor", "EventSourcedActor"}


def test_public_classes_are_final_unless_meant_for_subclassing() -> None:
    for name in FINAL:
        assert getattr(getattr(runtime, name), "__final__", False), name
    for name in OPEN:
        assert not getattr(getattr(runtime, name), "__final__", False), name
    assert getattr(sim.SimEventLoop, "__final__", False)
    assert getattr(sim.SimClock, "__final__", False)


def test_only_the_documented_hooks_are_overridable() -> None:
    assert Actor.__abstractmethods__ == frozenset({"handle"})
    assert EventSourcedActor.__abstractmethods__ == frozenset(
        {"handle", "stream", "initial_state", "evolve"}
    )
    for name in ("on_start", "persist"):
        assert getattr(getattr(EventSourcedActor, name), "__final__", False), name


def test_errors_share_one_root_and_builtin_bases() -> None:
    for name in (
        "ActorStopped",
        "MailboxFull",
        "MailboxClosed",
        "AskTimeout",
        "SupervisorGaveUp",
        "DuplicateActor",
        "SystemNotRunning",
        "RecoveryFailed",
    ):
        assert issubclass(getattr(runtime, name), runtime.ActorSystemError), name
    assert issubclass(runtime.AskTimeout, TimeoutError)
    assert issubclass(runtime.DuplicateActor, ValueError)
    assert issubclass(sim.Deadlock, RuntimeError)
