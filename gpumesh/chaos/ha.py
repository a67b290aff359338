"""A stack started by `gpumesh up --ha` in chaos's hands: who runs where, who leads, and how
long until a controller leads again after a fault.

`up --ha` writes DATA_DIR/up-ha.json (gpumesh/up_ha.py) with the pid of each of its processes
(three nats-servers, two controllers, the gateway, the agents), rewritten whenever it starts one
again. Chaos reads it at each fault (a process `up` restarted has a new pid) and checks each pid
against /proc before it signals it. Who leads is the leader lease (actors/leader_kv.py), read
here without touching its stream: KvLease makes sure of the stream first, with as many copies
as the server it asks reports, which while a server is down would be two.

A controller leads again after a fault when the lease is written again: by a new term (after
the leader's crash, pause or partition), or, after the loss of a NATS server, by any write
after the fault (the leader renewing through another server, or a new term).

A partition (`controller_partition`) goes through `up`'s control socket (up-ha.json's
`control`, DATA_DIR/up-ha.sock: gpumesh/up_ha.py, ControllerLinks): `Cut.open` sends
`{"cut": NAME}` and keeps the connection open, which holds the controller's relays cut (a
blackhole); `Cut.heal` shuts its side and reads `{"ok": true, "healed": NAME}`. The cut lasts
no longer than the connection: a chaos that dies leaves no controller cut off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from .errors import ChaosError
from .procfs import alive, cmdline, flag, gpumesh_args, resolve

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext

PROCESSES_FILE = "up-ha.json"  # gpumesh/up_ha.py: PROCESSES_FILE
LEASE_TTL_S = 3.0  # actors/leadership.py: the lease's time to live
LEASE_POLL_S = 0.05
LEADS_AGAIN_WITHIN_S = 30.0  # a failover not seen by then is reported as such
CONTROL_TIMEOUT_S = 5.0  # up's control socket answers at once


@dataclass(frozen=True)
class HaProcess:
    role: str  # nats-server, controller, gateway, agent
    name: str  # nats-0, ctl-0, gw-0, node-0
    pid: int
    port: int | None = None  # a nats-server's client port
    # A controller's relays, one per nats-server: ((server name, relay port), ...)
    relays: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class HaLayout:
    """What up-ha.json says: the cluster's URLs, the gateway, the processes, and the control
    socket that cuts a controller off ("" if `up` has none)."""

    nats: str
    gateway: str
    processes: tuple[HaProcess, ...]
    control: str = ""

    def named(self, role: str) -> list[HaProcess]:
        return sorted((p for p in self.processes if p.role == role), key=lambda p: p.name)


def read_layout(data_dir: Path, nats_url: str | None = None) -> HaLayout | None:
    """up-ha.json of the stack in `data_dir`, or None (no `up --ha` there, or one of another
    NATS than `nats_url`)."""
    try:
        data = json.loads((data_dir / PROCESSES_FILE).read_text())
        layout = HaLayout(
            nats=str(data["nats"]),
            gateway=str(data.get("gateway") or ""),
            processes=tuple(
                HaProcess(
                    str(p["role"]),
                    str(p["name"]),
                    int(p["pid"]),
                    int(p["port"]) if p.get("port") is not None else None,
                    tuple(sorted((str(k), int(v)) for k, v in (p.get("relays") or {}).items())),
                )
                for p in data["processes"]
                if p.get("pid") is not None
            ),
            control=str(data.get("control") or ""),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if nats_url is not None and _urls(layout.nats) != _urls(nats_url):
        return None
    return layout


def direct_servers(ctl: HaProcess, layout: HaLayout) -> list[str]:
    """The nats-servers `ctl` is connected to directly, not through its relays: a server it
    learned from the cluster's INFO (nats-py adds the servers a cluster advertises to those it
    was given, and may reconnect to one of them). A cut of its relays does not reach those."""
    ports = peer_ports(ctl.pid)
    return [s.name for s in layout.named("nats-server") if s.port is not None and s.port in ports]


def _urls(text: str) -> set[str]:
    return {u.strip().rstrip("/") for u in text.split(",") if u.strip()}


def is_process(proc: HaProcess, data_dir: Path) -> bool:
    """Whether `proc.pid` is still the process up-ha.json names (not a pid reused since)."""
    if not alive(proc.pid):
        return False
    argv = cmdline(proc.pid)
    if proc.role == "nats-server":
        store = flag(argv, "-sd")
        return store is not None and resolve(Path(store)) == resolve(data_dir) / "nats-ha" / (
            proc.name
        )
    args = gpumesh_args(argv) or []
    if proc.role == "controller":
        return flag(args, "--controller-id") == proc.name
    return bool(args)


def peer_ports(pid: int) -> set[int]:
    """The remote ports of `pid`'s established TCP connections to 127.0.0.1 (from /proc):
    which nats-server a process is connected to."""
    import os

    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[9] in inodes and cols[3] == "01":  # ESTABLISHED
                host, _, port = cols[2].partition(":")
                if host == "0100007F":
                    ports.add(int(port, 16))
    return ports


# -- the lease ---------------------------------------------------------------------------------


class _JetStreamBus(Protocol):
    def jetstream(self, *, timeout: float = 5.0) -> JetStreamContext: ...


class LeaderRecord(msgspec.Struct, frozen=True):
    """The fields of actors.leadership.LeaderRecord that chaos reads."""

    controller_id: str
    term: int = 0


_record = msgspec.json.Decoder(LeaderRecord)


@dataclass(frozen=True)
class Lease:
    leader: str
    term: int  # the revision the lease was created at
    revision: int  # its last write


class LeaseReader:
    """The leader lease, read only (module docstring)."""

    def __init__(self, bus: object, *, timeout: float = 1.0) -> None:
        self._bus = bus
        self._timeout = timeout
        self._js: JetStreamContext | None = None

    async def read(self) -> Lease | None:
        """Who leads now; None while nobody does, or when the lease cannot be read now."""
        import nats.errors

        from actors.leader_kv import STREAM, SUBJECT

        if self._js is None:
            if not hasattr(self._bus, "jetstream"):
                return None  # a test's stand-in bus
            bus: _JetStreamBus = self._bus
            self._js = bus.jetstream(timeout=self._timeout)
        from wire.nats_bus import cancellation_kept

        try:
            with cancellation_kept():  # chaos's lease watch must end when cancelled
                found = await self._js.get_last_msg(STREAM, SUBJECT)
        except (nats.errors.Error, TimeoutError):
            return None
        if not found.data or found.seq is None:
            return None
        try:
            record = _record.decode(found.data)
        except msgspec.DecodeError:
            return None
        return Lease(record.controller_id, record.term or int(found.seq), int(found.seq))


# -- one failover ------------------------------------------------------------------------------


@dataclass
class Failover:
    """One controller-plane fault on an HA stack and what followed it."""

    kind: str
    at: float  # run seconds, the moment of the signal
    target: str  # what was signalled: "controller ctl-0 (pid 4411)"
    before: Lease | None
    renewal_counts: bool  # a NATS server's loss: the leader renewing again is leading again
    after: Lease | None = None
    leads_again_s: float | None = None
    outcome: str = "watching"
    thawed: bool = False  # leader_pause: the old leader was continued
    requests: dict[str, Any] = field(default_factory=dict)

    def seen(self, lease: Lease | None, now: float) -> bool:
        """Fold one read of the lease; True once the failover is over (one way or another)."""
        if lease is None:
            return False
        before = self.before
        if before is None or lease.term != before.term:
            self.after, self.leads_again_s = lease, round(now - self.at, 3)
            self.outcome = f"{lease.leader} leads (term {lease.term})"
            return True
        if lease.revision > before.revision and (self.renewal_counts or self.thawed):
            self.after, self.leads_again_s = lease, round(now - self.at, 3)
            self.outcome = (
                f"{lease.leader} renewed its lease (term {lease.term})"
                if self.renewal_counts
                else f"{lease.leader} kept its lease (term {lease.term}): the pause was "
                "shorter than the lease"
            )
            return True
        return False

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "at_s": round(self.at, 3),
            "target": self.target,
            "leader_before": self.before.leader if self.before else "",
            "term_before": self.before.term if self.before else 0,
            "leader_after": self.after.leader if self.after else "",
            "term_after": self.after.term if self.after else 0,
            "new_leader": bool(
                self.after and (self.before is None or self.after.term != self.before.term)
            ),
            "leads_again_s": self.leads_again_s,
            "outcome": self.outcome,
            "requests": self.requests,
        }


# -- a partition ------------------------------------------------------------------------------


class Cut:
    """One controller cut off from NATS by `up --ha`'s relays, for as long as this is open
    (module docstring)."""

    def __init__(
        self, controller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.controller = controller
        self.connections = 0  # what its relays held open when cut
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, control: str, controller: str) -> Cut:
        """Cut `controller` off; ChaosError if `up` cannot (or says no)."""
        try:
            async with asyncio.timeout(CONTROL_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(control)
                cut = cls(controller, reader, writer)
                try:
                    writer.write(json.dumps({"cut": controller}).encode() + b"\n")
                    await writer.drain()
                    answer = await cut._answer()
                except BaseException:
                    cut.drop()
                    raise
        except (OSError, TimeoutError) as exc:
            raise ChaosError(
                f"up's control socket {control}: {exc or type(exc).__name__}"
            ) from None
        if not answer.get("ok"):
            cut.drop()
            raise ChaosError(f"up's control socket refused: {answer.get('error', answer)}")
        cut.connections = int(answer.get("connections") or 0)
        return cut

    async def _answer(self) -> dict[str, Any]:
        line = await self._reader.readline()
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise ChaosError(f"up's control socket answered {line[:200]!r}")
        return answer

    async def heal(self) -> None:
        """The controller reaches NATS again: shut our side, read up's word that it healed.
        If `up` does not answer, the connection is closed anyway, which heals it as well."""
        try:
            async with asyncio.timeout(CONTROL_TIMEOUT_S):
                self._writer.write_eof()
                answer = await self._answer()
            if answer.get("healed") != self.controller:
                raise ChaosError(f"up's control socket answered {answer} to the heal")
        except (OSError, TimeoutError) as exc:
            why = str(exc) or type(exc).__name__
            raise ChaosError(f"heal {self.controller}: {why}") from None
        finally:
            self.drop()

    def drop(self) -> None:
        """Close the connection without waiting: `up` heals the cut when it sees it closed."""
        self._writer.transport.abort()


def describe_lease(lease: Lease | None) -> str:
    return f"{lease.leader} (term {lease.term})" if lease else "nobody (no lease)"
