"""`gpumesh events redact --event-log jetstream` as an operator runs it: a real nats-server
holding a log written the old way on the stack's stream (GPUMESH_LOG), the report, the values
in the controllers' secret bucket, and `--restore` from the backup it names."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nats
import pytest

from events import NO_STREAM, ClusterCreated, ClusterSpec
from events.jetstream_store import JetStreamEventStore, JetStreamOptions
from events.secret_store import reference
from gpumesh.cli import main
from tests.factories import EventMaker
from wire.nats_bus import NatsBus
from wire.nats_server import EmbeddedNats
from wire.secret_kv import JetStreamSecretStore

pytestmark = pytest.mark.integration

TOKEN = "hf_cliSECRETinJETSTREAM42"


def test_the_operator_redacts_a_jetstream_log_and_can_restore_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = EmbeddedNats(tmp_path / "nats")

    async def write_old_log() -> None:
        await server.start()
        store = await JetStreamEventStore.connect(server.url, JetStreamOptions())
        try:
            spec = ClusterSpec(name="llama", command="serve", env={"HF_TOKEN": TOKEN})
            make = EventMaker()
            await store.append("cluster/llama", [make(ClusterCreated(spec=spec))], NO_STREAM)
        finally:
            await store.close()

    async def stored_value() -> str | None:
        bus = await NatsBus.connect(server.url, name="check")
        try:
            return await JetStreamSecretStore(bus).get(reference(TOKEN))
        finally:
            await bus.close()

    async def log_holds_token() -> bool:
        nc = await nats.connect(server.url)
        try:
            msg = await nc.jetstream().get_msg("GPUMESH_LOG", seq=1)
            return TOKEN.encode() in (msg.data or b"")
        finally:
            await nc.close()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(write_old_log())
        data = tmp_path / "data"
        base = ["--data-dir", str(data), "events", "redact", "--event-log", "jetstream"]
        base += ["--nats", server.url]
        assert main([*base, "--json"]) == 0
        out = capsys.readouterr().out
        report = json.loads(out.splitlines()[-1])
        assert [(c["cluster"], c["moved"]) for c in report["changed"]] == [("llama", ["HF_TOKEN"])]
        backup = Path(report["backup"])
        assert backup.parent == data and backup.name.startswith("GPUMESH_LOG.before-redact-")
        assert loop.run_until_complete(stored_value()) == TOKEN
        assert not loop.run_until_complete(log_holds_token())
        assert main(base) == 0
        assert "no stored spec" in capsys.readouterr().out
        assert main([*base, "--restore", str(backup)]) == 0
        assert "restored 1 messages" in capsys.readouterr().out
        assert loop.run_until_complete(log_holds_token())
    finally:
        loop.run_until_complete(server.stop())
        loop.close()
