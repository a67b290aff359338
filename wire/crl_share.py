"""The CA's revocation list carried to every node over NATS (docs/security.md, Revocation).

`gpumesh certs revoke` (and `node revoke`, `certs tls`) rewrites `crl.pem` beside the CA, on
the controller's machine. A node front reads its own file (`gpumesh agent --front-crl`), which
on another machine nothing updated: a revoked gateway could go on calling that node. So:

- the controller's `CrlPublisher` looks at the CA's file CRL_POLL_S seconds apart and, at start
  and whenever the file changes, publishes the list on `gpumesh.v1.security.crl`; it answers
  `gpumesh.v1.security.crl.get` with the list it holds, for an agent that (re)connects;
- an agent's `CrlFollower` asks for the list when it starts and after every reconnection, takes
  every list published, and writes one that is the CA's own (its signature checked against the
  CA the agent trusts, so a forged list on the subject changes nothing) and new to its
  `--front-crl` file, atomically; the front re-reads that file 4 times a second and cuts what
  it newly revokes.

A list is never taken back by this path: a list that fails the check, an empty answer or a
controller that is not there leave the file as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any, Final

import msgspec

from events.contract import subjects
from events.contract.messages import RevocationList
from runtime.env import Bus, BusError, Subscription

CRL_POLL_S: Final = 0.25  # the publisher's look at the CA's file, as often as a front's
ASK_TIMEOUT_S: Final = 2.0
# An agent asks again this often anyway, for a push it missed: at 10,000 nodes, 33 requests a
# second to the leader, which answers each with a file it holds in memory.
ASK_AGAIN_S: Final = 300.0
MAX_CRL_BYTES: Final = 512 * 1024  # a list of ~10,000 serials is well under


def read_crl(data: bytes, ca_pem: str) -> frozenset[int]:
    """The serials a PEM revocation list revokes, once it is shown to be the CA's own
    (ValueError otherwise: another issuer, a bad signature, not a list)."""
    from cryptography import x509  # only a front with TLS needs it

    ca = x509.load_pem_x509_certificate(ca_pem.encode())
    crl = x509.load_pem_x509_crl(data)
    if crl.issuer != ca.subject:
        raise ValueError(f"the list is {crl.issuer.rfc4514_string()}'s, not the CA's")
    public_key: Any = ca.public_key()
    if not crl.is_signature_valid(public_key):
        raise ValueError("the list's signature is not the CA's")
    return frozenset(revoked.serial_number for revoked in crl)


def digest(pem: str) -> str:
    return hashlib.sha256(pem.encode()).hexdigest()[:16]


class CrlPublisher:
    """The controller's side: the CA's list, published when it changes and given on request."""

    def __init__(self, bus: Bus, path: Path, log: Any) -> None:
        self.bus = bus
        self.path = path
        self.log = log
        self.pem = ""
        self._seen: tuple[int, int, int] | None = None

    async def run(self) -> None:
        sub = await self.bus.subscribe(subjects.CRL_GET)
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._answering(sub))
                while True:
                    if await asyncio.to_thread(self._changed):
                        await self._publish()
                    await asyncio.sleep(CRL_POLL_S)
        finally:
            await sub.unsubscribe()

    async def _answering(self, sub: Subscription) -> None:
        async for msg in sub:
            if msg.reply:
                with contextlib.suppress(BusError):
                    answer = RevocationList(pem=self.pem)
                    await self.bus.publish(msg.reply, msgspec.json.encode(answer))

    def _changed(self) -> bool:
        """Whether the file holds a list other than the one published (read it if so)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False  # no revocation yet
        except OSError as exc:
            self.log.warning("crl_unreadable", path=str(self.path), error=str(exc))
            return False
        seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            pem = self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            self.log.warning("crl_unreadable", path=str(self.path), error=str(exc))
            return False
        if pem == self.pem or len(pem) > MAX_CRL_BYTES:
            return False
        self.pem = pem
        return True

    async def _publish(self) -> None:
        data = msgspec.json.encode(RevocationList(pem=self.pem))
        try:
            await self.bus.publish(subjects.CRL, data)
        except BusError as exc:
            # Agents ask again when they reconnect, and every ASK_AGAIN_S.
            self.log.warning("crl_not_published", error=str(exc))
            return
        self.log.info("crl_published", sha256=digest(self.pem), bytes=len(self.pem))


class CrlFollower:
    """An agent's side: the CA's latest list, written to the file its front reads."""

    def __init__(self, bus: Bus, path: Path, ca_pem: str, log: Any) -> None:
        self.bus = bus
        self.path = path
        self.ca_pem = ca_pem
        self.log = log
        self._asked = asyncio.Event()

    async def run(self) -> None:
        sub = await self.bus.subscribe(subjects.CRL)
        self.bus.add_reconnect_callback(self._ask_again)
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._asking())
                async for msg in sub:
                    await self.take(msg.data)
        finally:
            self.bus.remove_reconnect_callback(self._ask_again)
            await sub.unsubscribe()

    async def _ask_again(self) -> None:
        self._asked.set()

    async def _asking(self) -> None:
        while True:
            try:
                reply = await self.bus.request(subjects.CRL_GET, b"{}", timeout=ASK_TIMEOUT_S)
            except BusError as exc:
                self.log.debug("crl_not_fetched", error=str(exc))
            else:
                await self.take(reply.data)
            self._asked.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ASK_AGAIN_S):
                    await self._asked.wait()

    async def take(self, data: bytes) -> bool:
        """Write the list in `data` if it is the CA's and not the file's already; whether it
        was written. Anything else is logged in one line and changes nothing."""
        if not data or len(data) > MAX_CRL_BYTES:
            return False
        try:
            pem = msgspec.json.decode(data, type=RevocationList).pem
        except msgspec.DecodeError as exc:
            self.log.warning("crl_undecodable", error=str(exc).splitlines()[0])
            return False
        if not pem:
            return False  # the controller has none: nothing is revoked yet
        return await asyncio.to_thread(self._write, pem)

    def _write(self, pem: str) -> bool:
        try:
            revoked = read_crl(pem.encode(), self.ca_pem)
        except ValueError as exc:
            self.log.error("crl_rejected", error=str(exc))
            return False
        with contextlib.suppress(OSError):
            if self.path.read_text() == pem:
                return False
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(pem)
            os.replace(tmp, self.path)
        except OSError as exc:
            self.log.error("crl_not_written", path=str(self.path), error=str(exc))
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        self.log.info("crl_received", sha256=digest(pem), revoked=len(revoked))
        return True
