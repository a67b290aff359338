"""Secrets on real processes: `gpumesh cluster create` with a secret inline and one in a file,
a `gpumesh controller` on its SQLite log, a `gpumesh agent` with its own key. The workload's
environment has both values; its command line, the log's file, the processes' logs and the
API's answer have neither."""

from __future__ import annotations

import asyncio
import json
import shlex
import stat
import sys
from pathlib import Path

import pytest

from events.secret_store import SqliteSecretStore, reference
from gpumesh.cli import main
from tests.integration.stack import Stack, _environ, workloads

pytestmark = pytest.mark.integration

TOKEN = "hf_realProcessSECRET0123456789"
FROM_FILE = "db-password-from-a-file-4242"


async def _cli(stack: Stack, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    common = ["--nats", stack.url, "--data-dir", str(stack.root), "--log-level", "warning"]
    capsys.readouterr()
    code = await asyncio.to_thread(main, [*argv, *common])
    out, err = capsys.readouterr()
    assert code == 0, err
    return code, out


async def test_the_value_reaches_the_workloads_environment_and_nothing_else(
    tmp_path: Path, nats_server_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret_file = tmp_path / "db_password"
    secret_file.write_text(FROM_FILE + "\n")
    command = f"{shlex.quote(sys.executable)} -m gpumesh workload echo --port {{port}}"
    spec = tmp_path / "echo.toml"
    spec.write_text(
        f'name = "echo"\ncommand = "{command}"\n'
        f'secret_env = {{ HF_TOKEN = "{TOKEN}", DB_PASSWORD = "file:{secret_file}" }}\n'
    )
    async with Stack(tmp_path / "stack", agents=1, nats_binary=nats_server_binary) as stack:
        await _cli(stack, capsys, "cluster", "create", "-f", str(spec))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            _, out = await _cli(stack, capsys, "cluster", "show", "echo", "--json")
            shown = json.loads(out)
            if shown["ready"] == 1:
                break
            assert loop.time() < deadline, shown
            await asyncio.sleep(0.2)
        assert shown["spec"]["secret_env"] == {
            "HF_TOKEN": reference(TOKEN),
            "DB_PASSWORD": f"file:{secret_file}",
        }
        assert TOKEN not in out
        [workload] = workloads(stack.marker)
        environ = _environ(workload.pid).split(b"\0")
        assert f"HF_TOKEN={TOKEN}".encode() in environ
        assert f"DB_PASSWORD={FROM_FILE}".encode() in environ
        _check_command_line(workload.pid)
    _check_files(stack.root, stack.db_path)


def _check_command_line(pid: int) -> None:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert TOKEN.encode() not in cmdline and FROM_FILE.encode() not in cmdline


def _check_files(root: Path, db_path: Path) -> None:
    """Every file the stack wrote (the log, its WAL, the processes' logs, the read models)
    lacks both values; the secret store beside the log has the inline one; keys are 0600."""
    key = root / "keys" / "node-0.x25519"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    secrets = SqliteSecretStore.beside(db_path)
    assert stat.S_IMODE(secrets.path.stat().st_mode) == 0o600
    assert secrets.get_now(reference(TOKEN)) == TOKEN
    checked = 0
    for path in root.rglob("*"):
        if path.is_file() and path != secrets.path:
            data = path.read_bytes()
            assert TOKEN.encode() not in data, path
            assert FROM_FILE.encode() not in data, path
            checked += 1
    assert db_path.exists() and checked > 3
