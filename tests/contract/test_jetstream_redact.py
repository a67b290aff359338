"""`gpumesh events redact` on a JetStream log (events/jetstream_store/redact.py), against a real
nats-server: the secrets a spec holds in its env leave the stream, every event keeps its
position (gaps from compaction included), a rebuild equals the state with references, the
backup holds the stream as it was and writes it back whole, and a second run changes nothing."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import pytest

import projections
from events import (
    ANY,
    NO_STREAM,
    ClusterCreated,
    ClusterSpec,
    ClusterSpecChanged,
    NodeHeartbeat,
    NodeRegistered,
)
from events.errors import StoreIOError
from events.jetstream_store.redact import (
    read_backup,
    read_stream,
    redact_jetstream,
    restore_jetstream,
)
from events.secret_store import reference
from tests.contract.jetstream import connect, fresh_options, opened
from tests.factories import EventMaker

pytestmark = pytest.mark.integration

TOKEN = "hf_OLDsecretINjetstream0123"
API_KEY = "sk-another-old-one-in-jetstream"


async def _old_log(options: object) -> list[tuple[int, str]]:
    """A log written the old way: secrets in env in two revisions, heartbeats compacted in
    between (gaps in the positions); (position, event id) of what remains."""
    make = EventMaker(step_ns=1_000_000_000)
    spec = ClusterSpec(name="llama", command="serve", env={"HF_TOKEN": TOKEN, "LOG": "info"})
    async with opened(options) as store:  # type: ignore[arg-type]
        await store.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
        beats = [make(NodeHeartbeat(node_id="a", seq=i)) for i in range(5)]
        await store.append("heartbeat/a", beats, NO_STREAM)
        await store.append("cluster/llama", [make(ClusterCreated(spec=spec))], NO_STREAM)
        assert await store.compact_heartbeats(make.now_ns + 1) == 4
        changed = ClusterSpec(
            name="llama",
            command="serve",
            env={"HF_TOKEN": TOKEN, "LOG": "debug", "openai_api_key": API_KEY},
        )
        await store.append("cluster/llama", [make(ClusterSpecChanged(spec=changed, revision=2))], 1)
        await store.append("heartbeat/a", [make(NodeHeartbeat(node_id="a", seq=9))], ANY)
        return [(e.position, e.event_id) for e in await store.read_all(1, 1000)]


async def test_redact_rewrites_the_stream_keeping_every_position(tmp_path: Path) -> None:
    options = fresh_options()
    before = await _old_log(options)
    assert [p for p, _ in before] == [1, 6, 7, 8, 9]  # 2-5: heartbeats compacted away
    nc = await connect()
    stored: dict[str, str] = {}

    async def keep(ref: str, value: str) -> None:
        stored[ref] = value

    try:
        original = await read_stream(nc, options)
        dry = await redact_jetstream(
            nc, options, backup_dir=tmp_path, stamp="T", store_value=keep, dry_run=True
        )
        assert [(c.cluster, c.revision, c.position) for c in dry.changes] == [
            ("llama", 1, 7),
            ("llama", 2, 8),
        ]
        assert dry.backup is None and stored == {}
        report = await redact_jetstream(
            nc, options, backup_dir=tmp_path, stamp="T", store_value=keep, progress=lambda _: None
        )
        assert [c.moved for c in report.changes] == [("HF_TOKEN",), ("HF_TOKEN", "openai_api_key")]
        assert stored == {reference(TOKEN): TOKEN, reference(API_KEY): API_KEY}
        # The backup is the stream as it was, readable by its owner only.
        assert report.backup is not None
        assert stat.S_IMODE(report.backup.stat().st_mode) == 0o600
        assert TOKEN.encode() in b"".join(m.body() for m in read_backup(report.backup))
        # No message of the stream holds a value any more; every event where it was.
        after = await read_stream(nc, options)
        assert [m.seq for m in after] == [m.seq for m in original] == [1, 6, 7, 8, 9]
        for m in after:
            assert TOKEN.encode() not in m.body() and API_KEY.encode() not in m.body()
            assert m.subject == next(o.subject for o in original if o.seq == m.seq)
    finally:
        await nc.close()
    async with opened(options) as store:
        events = await store.read_all(1, 1000)
        assert [(e.position, e.event_id) for e in events] == before
        state = projections.rebuild(events)
        spec = state.clusters.clusters["llama"].spec
        assert spec is not None and "HF_TOKEN" not in spec.env
        assert spec.secret_env == {
            "HF_TOKEN": reference(TOKEN),
            "openai_api_key": reference(API_KEY),
        }
        assert spec.env == {"LOG": "debug"}
        # The log takes appends again where it stood.
        make = EventMaker(step_ns=1_000_000_000, start_ns=2_000_000_000_000_000_000)
        assert await store.append("node/a", [make(NodeRegistered(node_id="a"))], 1) == [10]
    nc = await connect()
    try:
        again = await redact_jetstream(
            nc, options, backup_dir=tmp_path, stamp="U", store_value=keep, progress=lambda _: None
        )
        assert again.changes == [] and again.backup is None
        # The backup writes the stream back as it was before (the append above is not in it).
        assert report.backup is not None
        restored = await restore_jetstream(nc, options, report.backup, progress=lambda _: None)
        assert restored == 5
        back = await read_stream(nc, options)
        assert [(m.seq, m.subject, base64.b64decode(m.data)) for m in back] == [
            (m.seq, m.subject, base64.b64decode(m.data)) for m in original
        ]
    finally:
        await nc.close()


async def test_a_backup_that_cannot_be_written_changes_nothing(tmp_path: Path) -> None:
    options = fresh_options()
    before = await _old_log(options)
    nc = await connect()
    try:
        original = await read_stream(nc, options)
        with pytest.raises(StoreIOError, match=r"cannot write the backup .*nothing was changed"):
            await redact_jetstream(
                nc,
                options,
                backup_dir=tmp_path / "no-such-dir",
                stamp="T",
                store_value=lambda ref, value: None,
                progress=lambda _: None,
            )
        assert await read_stream(nc, options) == original
    finally:
        await nc.close()
    async with opened(options) as store:
        assert [(e.position, e.event_id) for e in await store.read_all(1, 1000)] == before
