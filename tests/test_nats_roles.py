"""The authorization policy as data: each node's permissions reach only its own subjects."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, strategies as st

from events.contract import subjects
from gpumesh.cli import main
from gpumesh.security import identities
from gpumesh.security.roles import permissions
from sim.bus import subject_matches
from wire.nats_access import CredentialsError, SecurityLayout, load_credentials

node_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12)


def _others_subjects(node: str) -> tuple[list[str], list[str]]:
    """What another node must never publish on, and never read."""
    published_by_node = [subjects.heartbeat(node), subjects.register(node), subjects.report(node)]
    read_by_node = [
        subjects.command(node),
        subjects.tunnel(node),
        subjects.fault(node),
        subjects.links(node),
        f"_INBOX.node.{node}.abc123",
        f"$JS.API.CONSUMER.MSG.NEXT.{subjects.COMMANDS_STREAM}.node-{node}",
    ]
    return published_by_node, read_by_node


@given(node_ids, node_ids)
def test_a_node_reaches_only_its_own_subjects(a: str, b: str) -> None:
    allowed = permissions("node", a)
    assert allowed is not None
    mine_out, mine_in = _others_subjects(a)
    assert all(any(subject_matches(p, s) for p in allowed.publish) for s in mine_out)
    assert all(any(subject_matches(p, s) for p in allowed.subscribe) for s in mine_in[1:5])
    if a == b:
        return
    theirs_out, theirs_in = _others_subjects(b)
    for subject in theirs_out + theirs_in:
        assert not any(subject_matches(p, subject) for p in allowed.publish), subject
        assert not any(subject_matches(p, subject) for p in allowed.subscribe), subject


@pytest.mark.parametrize("role", ["gateway", "integrator"])
def test_gateways_and_integrators_cannot_pose_as_nodes_or_the_controller(role: str) -> None:
    allowed = permissions(role, "x")  # type: ignore[arg-type]
    assert allowed is not None
    forbidden = [
        subjects.heartbeat("n"),
        subjects.register("n"),
        subjects.report("n"),
        subjects.command("n"),
        subjects.ROUTING,
        subjects.event("node/n"),
        f"$JS.API.STREAM.DELETE.{subjects.EVENTS_STREAM}",
        f"$JS.API.STREAM.PURGE.{subjects.EVENTS_STREAM}",
    ]
    for subject in forbidden:
        assert not any(subject_matches(p, subject) for p in allowed.publish), subject


def test_a_gateway_may_report_its_load_and_nobody_else_but_the_controller() -> None:
    gateway = permissions("gateway", "gw-1")
    assert gateway is not None
    assert any(subject_matches(p, subjects.LOAD) for p in gateway.publish)
    for role in ("node", "integrator"):
        allowed = permissions(role, "x")  # type: ignore[arg-type]
        assert allowed is not None
        assert not any(subject_matches(p, subjects.LOAD) for p in allowed.publish), role


def test_an_integrator_may_only_read_from_the_control_api() -> None:
    allowed = permissions("integrator", "x")
    assert allowed is not None
    for verb in subjects.API_VERBS:
        reachable = any(subject_matches(p, subjects.api(verb)) for p in allowed.publish)
        assert reachable == (verb.endswith((".list", ".get"))), verb


def test_certs_init_issue_list_revoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "d"
    assert main(["--data-dir", str(data), "certs", "init", "--host", "ctl.example"]) == 0
    layout = SecurityLayout(data)
    assert stat.S_IMODE(layout.ca_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(layout.root.stat().st_mode) == 0o700
    assert main(["--data-dir", str(data), "node", "issue", "gpu-7"]) == 0
    creds = load_credentials(layout.creds("gpu-7"))
    assert creds.role == "node" and creds.inbox_prefix == "_INBOX.node.gpu-7"
    assert creds.seed.startswith("SU") and creds.public_key.startswith("U")
    config = layout.server_config.read_text()
    assert creds.public_key in config and creds.seed not in config
    # A second issue of the same name is refused in one line; nothing changes.
    assert main(["--data-dir", str(data), "node", "issue", "gpu-7"]) == 1
    assert "already issued" in capsys.readouterr().err
    assert main(["--data-dir", str(data), "node", "revoke", "gpu-7"]) == 0
    assert creds.public_key not in layout.server_config.read_text()
    capsys.readouterr()
    assert main(["--data-dir", str(data), "certs", "list", "--json"]) == 0
    listed = {i["name"]: i for i in json.loads(capsys.readouterr().out)}
    assert set(listed) == {"controller", "admin", "gateway", "gpu-7"}
    assert listed["gpu-7"]["revoked_at"]
    assert not listed["admin"]["revoked_at"]
    # A revoked name stays revoked.
    assert main(["--data-dir", str(data), "certs", "issue", "gpu-7", "--role", "node"]) == 1


def test_a_bad_credentials_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "x.creds.json"
    with pytest.raises(CredentialsError, match="does not exist"):
        load_credentials(path)
    path.write_text("{not json")
    with pytest.raises(CredentialsError, match="not a gpumesh credentials file"):
        load_credentials(path)
    path.write_bytes(msgspec.json.encode({"name": "x", "role": "pirate"}))
    with pytest.raises(CredentialsError, match="not a gpumesh credentials file"):
        load_credentials(path)


def test_identity_names_are_checked(tmp_path: Path) -> None:
    layout = SecurityLayout(tmp_path)
    identities.init(layout)
    with pytest.raises(identities.SecurityError, match="invalid identity name"):
        identities.issue(layout, "a.b", "node")
    with pytest.raises(identities.SecurityError, match="invalid identity name"):
        identities.issue(layout, ">", "node")


def test_a_node_may_read_the_lease_and_not_write_it() -> None:
    """A node watches the leader's renewals and reads the lease (nodeagent/agent.py, a stalled
    leader); writing the key is the controllers' alone."""
    allowed = permissions("node", "n1")
    assert allowed is not None
    read = f"$JS.API.STREAM.MSG.GET.{subjects.LEADER_STREAM}"
    assert any(subject_matches(p, read) for p in allowed.publish)
    assert any(subject_matches(p, subjects.LEADER) for p in allowed.subscribe)
    assert not any(subject_matches(p, subjects.LEADER) for p in allowed.publish)
    for other in ("DELETE", "PURGE", "UPDATE", "MSG.DELETE"):
        subject = f"$JS.API.STREAM.{other}.{subjects.LEADER_STREAM}"
        assert not any(subject_matches(p, subject) for p in allowed.publish), subject


def _secret_subjects() -> list[str]:
    """Every way to the controllers' secret bucket: its KV subjects, and the JetStream API on
    the stream under it (reads, consumers, changes)."""
    from wire.secret_kv import BUCKET, STREAM

    key = f"$KV.{BUCKET}.0123abcd"
    api = [
        f"$JS.API.STREAM.{verb}.{STREAM}"
        for verb in ("INFO", "MSG.GET", "CREATE", "UPDATE", "DELETE", "PURGE", "MSG.DELETE")
    ]
    return [
        key,
        f"$KV.{BUCKET}.>",
        f"$JS.API.DIRECT.GET.{STREAM}",
        f"$JS.API.DIRECT.GET.{STREAM}.{key}",
        f"$JS.API.CONSUMER.CREATE.{STREAM}",
        f"$JS.API.CONSUMER.CREATE.{STREAM}.c.{key}",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.c",
        f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.c",
        *api,
    ]


@pytest.mark.parametrize("role", ["node", "gateway", "integrator"])
def test_only_the_controller_roles_reach_the_secret_bucket(role: str) -> None:
    allowed = permissions(role, "x")  # type: ignore[arg-type]
    assert allowed is not None
    for subject in _secret_subjects():
        assert not any(subject_matches(p, subject) for p in allowed.publish), (role, subject)
        assert not any(subject_matches(p, subject) for p in allowed.subscribe), (role, subject)
    # The controller (and the operator's admin) reach everything: they run the control plane.
    assert permissions("controller", "controller") is None
    assert permissions("admin", "admin") is None
