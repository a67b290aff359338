"""Errors raised by the actor runtime and its Bus: one root, typed fields, builtin bases where
they fit."""

from __future__ import annotations


class ActorSystemError(Exception):
    """Root of every error runtime/ raises: the actor system's own, and the Bus's."""


class ActorStopped(ActorSystemError):
    """The actor has stopped, or is stopping and takes no more messages."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"actor {name!r} is stopped")


class MailboxFull(ActorSystemError):
    """`try_send`/`try_tell` found the mailbox at capacity: back off or use the awaiting send."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        super().__init__(f"mailbox of {name!r} is full ({capacity} messages)")


class MailboxClosed(ActorSystemError):
    """The mailbox was closed by its owner: no more sends; the receiver drains what is queued."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"mailbox of {name!r} is closed")


class AskTimeout(ActorSystemError, TimeoutError):
    """No reply within the ask's timeout. Also a TimeoutError, so generic handlers catch it."""

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        super().__init__(f"actor {name!r} did not reply within {timeout} s")


class SupervisorGaveUp(ActorSystemError):
    """An actor crashed more often than its policy allows; the whole system stops."""

    def __init__(self, name: str, crashes: int, window: float) -> None:
        self.name = name
        self.crashes = crashes
        self.window = window
        super().__init__(
            f"actor {name!r} crashed {crashes} times within {window} s: supervisor gave up"
        )


class DuplicateActor(ActorSystemError, ValueError):
    """A live actor already has this name in the system."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"an actor named {name!r} is already running")


class SystemNotRunning(ActorSystemError):
    """The system is not entered yet, or is shutting down: nothing new may be spawned."""


class RecoveryFailed(ActorSystemError):
    """An event-sourced actor met a stored event it cannot fold (undecodable payload)."""

    def __init__(self, stream: str, version: int, reason: str) -> None:
        self.stream = stream
        self.version = version
        self.reason = reason
        super().__init__(f"cannot recover {stream!r} at version {version}: {reason}")


class BusError(ActorSystemError):
    """Root of the errors a Bus raises; adapters translate their driver's errors to these."""


class NoResponders(BusError):
    """A request found nobody subscribed to its subject."""

    def __init__(self, subject: str) -> None:
        self.subject = subject
        super().__init__(f"no responders on {subject}")


class RequestTimeout(BusError, TimeoutError):
    """A request got no reply in time."""

    def __init__(self, subject: str, timeout: float) -> None:
        self.subject = subject
        self.timeout = timeout
        super().__init__(f"no reply on {subject} within {timeout:g} s")
