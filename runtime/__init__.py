"""The actor runtime: actors, mailboxes, supervision, event-sourced actors, shutdown, and the
injected Env through which actors reach time, randomness, the bus and the store.

Actors reach the outside world only through `Env` (runtime/env.py); the real pieces are in
runtime/real_env.py, the simulated ones in sim/.
"""

from .actor import Actor as Actor, ActorContext as ActorContext
from .env import (
    Bus as Bus,
    Clock as Clock,
    Env as Env,
    Msg as Msg,
    NoBus as NoBus,
    RandomSource as RandomSource,
    Subscription as Subscription,
)
from .errors import (
    ActorStopped as ActorStopped,
    ActorSystemError as ActorSystemError,
    AskTimeout as AskTimeout,
    DuplicateActor as DuplicateActor,
    MailboxClosed as MailboxClosed,
    MailboxFull as MailboxFull,
    RecoveryFailed as RecoveryFailed,
    SupervisorGaveUp as SupervisorGaveUp,
    SystemNotRunning as SystemNotRunning,
)
from .event_sourced import EventSourcedActor as EventSourcedActor
from .mailbox import Mailbox as Mailbox, MailboxStats as MailboxStats
from .shutdown import (
    install_signal_handlers as install_signal_handlers,
    run_until_signal as run_until_signal,
)
from .supervision import (
    DEFAULT_POLICY as DEFAULT_POLICY,
    CrashWindow as CrashWindow,
    SupervisionPolicy as SupervisionPolicy,
)
from .system import ActorRef as ActorRef, ActorSystem as ActorSystem
