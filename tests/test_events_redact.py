"""Secrets and the SQLite log's own bytes: a spec's `secret_env` never reaches the file, and
`gpumesh events redact` takes out the secrets an older log holds in a spec's plain `env`
(backup kept, a report per cluster and revision, the log still folding, rebuild equal to live)."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import pytest

import projections
from events import ClusterCreated, ClusterSpecChanged
from events.secret_store import SqliteSecretStore, reference
from events.sqlite_store import SqliteEventStore
from gpumesh.cli import main
from tests.control.harness import fleet

TOKEN = "hf_OLDsecretINclear0123456789"
API_KEY = "sk-another-old-secret-4242"
NEW = "hf_NEWsecretNEVERstored987654"


def file_bytes(path: Path) -> bytes:
    """The log's file and its WAL and shared-memory files, as they are on disk."""
    found = b""
    for suffix in ("", "-wal", "-shm"):
        part = path.with_name(path.name + suffix)
        if part.exists():
            found += part.read_bytes()
    return found


async def _old_log(db: Path) -> None:
    """A log written the old way: the secrets in env, in two revisions; and one cluster with a
    secret_env, which must not reach the file at all."""
    store = await SqliteEventStore.open(db)
    try:
        async with fleet(2, store=store) as f:  # type: ignore[arg-type]
            spec = {
                "name": "llama",
                "command": "serve --port {port}",
                "env": {"HF_TOKEN": TOKEN, "LOG_LEVEL": "info"},
            }
            assert (await f.api("cluster.create", spec)).ok
            await f.until(lambda: len(f.ready("llama")) == 1, within=10, why="ready")
            spec["env"] = {**spec["env"], "openai_api_key": API_KEY}  # type: ignore[dict-item]
            applied = await f.api("cluster.apply", spec)
            assert applied.ok, applied.error
            await f.until(lambda: len(f.ready("llama")) == 1, within=20, why="rolled out")
            fresh = {"name": "new", "command": "x", "secret_env": {"HF_TOKEN": NEW}}
            assert (await f.api("cluster.create", fresh)).ok
            await asyncio.sleep(1.0)
    finally:
        await store.close()


def test_a_secret_env_never_reaches_the_file_and_redact_takes_out_the_old_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    db = data / "events.db"
    asyncio.run(_old_log(db))
    raw = file_bytes(db)
    assert TOKEN.encode() in raw and API_KEY.encode() in raw  # the old way: in clear
    assert NEW.encode() not in raw and reference(NEW).encode() in raw  # the new way

    capsys.readouterr()
    # `events tail`: the new spec's value in no form; the old log's values not in its lines.
    assert main(["--data-dir", str(data), "events", "tail", "--limit", "100000", "--json"]) == 0
    assert NEW not in capsys.readouterr().out
    assert main(["--data-dir", str(data), "events", "tail", "--type", "cluster."]) == 0
    lines = capsys.readouterr().out
    assert "HF_TOKEN" in lines and TOKEN not in lines and API_KEY not in lines

    assert main(["--data-dir", str(data), "events", "redact", "--dry-run"]) == 0
    dry = capsys.readouterr().out.splitlines()
    assert dry[0].startswith("would change: cluster llama revision 1 (position ")
    assert TOKEN.encode() in file_bytes(db)  # a dry run writes nothing

    assert main(["--data-dir", str(data), "events", "redact", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    moved = [(c["cluster"], c["revision"], c["moved"]) for c in report["changed"]]
    assert moved == [
        ("llama", 1, ["HF_TOKEN"]),
        ("llama", 2, ["HF_TOKEN", "openai_api_key"]),
    ]
    # The log holds no value any more, in any page of its files.
    raw = file_bytes(db)
    assert TOKEN.encode() not in raw and API_KEY.encode() not in raw
    assert reference(TOKEN).encode() in raw
    # The values are in the secret store beside it; the backup has the log as it was.
    secrets = SqliteSecretStore.beside(db)
    assert report["secret_store"] == str(secrets.path)
    assert secrets.get_now(reference(TOKEN)) == TOKEN
    assert secrets.get_now(reference(API_KEY)) == API_KEY
    backup = Path(report["backup"])
    assert backup.parent == data and backup.name.startswith("events.db.before-redact-")
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    assert TOKEN.encode() in backup.read_bytes()

    # A second run finds nothing; its one line says so.
    assert main(["--data-dir", str(data), "events", "redact"]) == 0
    assert capsys.readouterr().out.startswith("no stored spec of ")

    async def after() -> None:
        store = await SqliteEventStore.open(db)
        try:
            everything = await store.read_all(1, 1_000_000)
            specs = [
                e.payload.spec
                for e in everything
                if isinstance(e.payload, ClusterCreated | ClusterSpecChanged)
                and e.payload.spec.name == "llama"
            ]
            assert [s.secret_env for s in specs] == [
                {"HF_TOKEN": reference(TOKEN)},
                {"HF_TOKEN": reference(TOKEN), "openai_api_key": reference(API_KEY)},
            ]
            assert all(s.env == {"LOG_LEVEL": "info"} for s in specs)
            # A controller on the rewritten log: it folds, runs on, and rebuild equals live.
            async with fleet(2, store=store) as f:  # type: ignore[arg-type]
                await asyncio.sleep(3.0)
                assert f.state.clusters.clusters["llama"].spec == specs[-1]
                everything = await store.read_all(1, 1_000_000)
                assert projections.rebuild(everything) == f.state
        finally:
            await store.close()

    asyncio.run(after())


def test_redact_without_a_log_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--data-dir", str(tmp_path), "events", "redact"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpumesh: error: no event log at ") and err.count("\n") == 1
