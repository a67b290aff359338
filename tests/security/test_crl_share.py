"""The CA's revocation list carried to nodes over the bus (wire/crl_share.py): a list written
beside the CA reaches an agent's own file, one the CA did not sign never does, and an agent
that was away asks for it when it comes back. On the in-memory bus with real files and a real
CA; tests/integration/test_front_mtls_stack.py covers it with processes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import structlog

from events.contract import subjects
from events.contract.messages import RevocationList
from gpumesh.security import pki
from nodeagent.fencing_front import read_crl
from sim.bus import MemoryBus
from wire.crl_share import CrlFollower, CrlPublisher

LOG = structlog.get_logger("test")


def _ca(root: Path, name: str = "gpumesh CA") -> tuple[Path, Path]:
    cert, key = root / "ca.pem", root / "ca-key.pem"
    root.mkdir(parents=True, exist_ok=True)
    pki.create_ca(cert, key, common_name=name)
    return cert, key


async def _until(check: object, why: str, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():  # type: ignore[operator]  # noqa: ASYNC110 - a file appears
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _running(*jobs: object) -> AsyncIterator[None]:
    async with asyncio.TaskGroup() as tasks:
        started = [tasks.create_task(job.run()) for job in jobs]  # type: ignore[attr-defined]
        try:
            yield
        finally:
            for task in started:
                task.cancel()


def test_a_revocation_reaches_a_node_on_another_machine(tmp_path: Path) -> None:
    async def main() -> None:
        cert, key = _ca(tmp_path / "ca")
        ca_pem = cert.read_text()
        source, copy = tmp_path / "ca" / "crl.pem", tmp_path / "node" / "crl.pem"
        bus = MemoryBus()
        publisher = CrlPublisher(bus, source, LOG)
        follower = CrlFollower(bus, copy, ca_pem, LOG)
        async with _running(publisher, follower):
            pki.write_crl(cert, key, [1001], source)
            await _until(lambda: copy.exists(), "the first list arrives")
            assert read_crl(copy.read_bytes(), ca_pem) == {1001}
            pki.write_crl(cert, key, [1001, 1002], source)
            await _until(lambda: read_crl(copy.read_bytes(), ca_pem) == {1001, 1002}, "the second")
            # A list signed by another CA, on the subject, changes nothing.
            other_cert, other_key = _ca(tmp_path / "other", "another CA")
            forged = tmp_path / "forged.pem"
            pki.write_crl(other_cert, other_key, [], forged)
            assert not await follower.take(
                msgspec.json.encode(RevocationList(pem=forged.read_text()))
            )
            assert not await follower.take(b"not json")
            assert not await follower.take(msgspec.json.encode(RevocationList(pem="")))
            assert read_crl(copy.read_bytes(), ca_pem) == {1001, 1002}
            assert copy.stat().st_mode & 0o777 == 0o600

    asyncio.run(main())


def test_an_agent_that_starts_later_asks_for_the_list(tmp_path: Path) -> None:
    async def main() -> None:
        cert, key = _ca(tmp_path / "ca")
        source, copy = tmp_path / "ca" / "crl.pem", tmp_path / "node" / "crl.pem"
        pki.write_crl(cert, key, [7], source)
        bus = MemoryBus()
        publisher = CrlPublisher(bus, source, LOG)
        async with _running(publisher):
            await _until(lambda: publisher.pem != "", "the publisher reads the list")
            reply = await bus.request(subjects.CRL_GET, b"{}", timeout=1.0)
            assert msgspec.json.decode(reply.data, type=RevocationList).pem == source.read_text()
            follower = CrlFollower(bus, copy, cert.read_text(), LOG)
            async with _running(follower):
                await _until(lambda: copy.exists(), "asked at start")
            assert read_crl(copy.read_bytes(), cert.read_text()) == {7}

    asyncio.run(main())
