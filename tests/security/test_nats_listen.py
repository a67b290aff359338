"""Where the embedded nats-server listens: loopback unless `--nats-listen` says otherwise, and
beyond loopback only with TLS and credentials (docs/security.md, Setting it up).

These refusals happen before any server starts, so they need no nats-server; the server
listening where it is told is tested in tests/integration/test_remote_node_recipe.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumesh.cli import build_parser
from gpumesh.security import identities
from wire.commandline import nats_for
from wire.errors import CommandFailed
from wire.nats_access import SecurityLayout
from wire.nats_server import (
    NATS_PORT,
    EmbeddedNats,
    certificate_covers,
    is_loopback,
    parse_listen,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.0.0.0:4222", ("0.0.0.0", 4222)),
        ("127.0.0.2:0", ("127.0.0.2", 0)),
        ("ctl.example.org", ("ctl.example.org", NATS_PORT)),
        ("10.0.0.5", ("10.0.0.5", 4222)),
        ("[::]:4333", ("::", 4333)),
        ("[::1]", ("::1", 4222)),
        ("::1", ("::1", 4222)),
    ],
)
def test_listen_addresses_parse_as_nats_server_reads_them(
    text: str, expected: tuple[str, int]
) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [(":4222", "no host"), ("host:70000", "bad port"), ("host:x", "bad port"), ("[::1", "IPV6")],
)
def test_a_bad_listen_address_is_one_line(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as caught:
        parse_listen(text)
    assert "\n" not in str(caught.value)


def test_loopback_is_told_from_the_rest() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "localhost", "::1"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.5", "ctl.example.org"]))


def test_the_url_for_local_processes_names_loopback_when_the_server_listens_everywhere(
    tmp_path: Path,
) -> None:
    assert EmbeddedNats(tmp_path).host == "127.0.0.1"  # the default: loopback only
    everywhere = EmbeddedNats(tmp_path, host="0.0.0.0", port=4222, config_file=tmp_path / "c")
    assert everywhere.url == "tls://127.0.0.1:4222"
    assert EmbeddedNats(tmp_path, host="127.0.0.2", port=5).url == "nats://127.0.0.2:5"
    assert EmbeddedNats(tmp_path, host="::1", port=5).url == "nats://[::1]:5"


def test_both_commands_take_nats_listen_and_default_to_none() -> None:
    parser = build_parser()
    for argv in (["up"], ["controller"]):
        assert parser.parse_args(argv).nats_listen is None
        assert parser.parse_args([*argv, "--nats-listen", "0.0.0.0:4222"]).nats_listen == (
            "0.0.0.0:4222"
        )


async def _enter(
    data_dir: Path, url: str | None = None, *, secure: bool = True, listen: str | None = None
) -> str:
    async with nats_for(data_dir, url, secure=secure, listen=listen) as got:
        return got


async def test_an_unsecured_server_is_refused_beyond_loopback(tmp_path: Path) -> None:
    # No `certs init`: nothing to secure it with.
    with pytest.raises(CommandFailed, match="only with TLS and credentials"):
        await _enter(tmp_path, listen="0.0.0.0:4222")
    # `certs init` ran, but --insecure asked for no security.
    identities.init(SecurityLayout(tmp_path))
    with pytest.raises(CommandFailed, match="do not pass --insecure"):
        await _enter(tmp_path, listen="10.0.0.5:4222", secure=False)
    assert not (tmp_path / "nats").exists(), "no server was started"


async def test_one_address_must_be_in_the_certificate(tmp_path: Path) -> None:
    layout = SecurityLayout(tmp_path)
    identities.init(layout, ["127.0.0.1", "localhost", "ctl.example.org"])
    assert certificate_covers(layout.server_cert, "CTL.example.org.")
    assert certificate_covers(layout.server_cert, "127.0.0.1")
    assert not certificate_covers(layout.server_cert, "127.0.0.2")
    with pytest.raises(CommandFailed, match=r"not valid for 127\.0\.0\.2.*--host 127\.0\.0\.2"):
        await _enter(tmp_path, listen="127.0.0.2:0")


async def test_listen_and_an_external_nats_exclude_each_other(tmp_path: Path) -> None:
    with pytest.raises(CommandFailed, match="drop one of them"):
        await _enter(tmp_path, "nats://127.0.0.1:4222", listen="0.0.0.0:4222")
    with pytest.raises(CommandFailed, match="--nats-listen: bad port"):
        await _enter(tmp_path, listen="127.0.0.1:99999")
