"""The identities a stack has issued, and the nats-server configuration rendered from them.

`identities.json` is the registry (public keys, roles, revocations: no secrets); each
identity's seed goes only into its own credentials file. Every change rewrites `nats.conf`
from the registry, so the file never holds an identity the registry does not, and a running
server picks the change up on reload (SIGHUP): a revoked identity's connections are closed.

Nodes and gateways also get a TLS certificate in their credentials file, for the direct
transport's mutual TLS (a node's front serves with it, a gateway dials with it). Revoking one,
or issuing it another, puts the old certificate's serial in `crl.pem`, which fronts re-read.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import msgspec
import nkeys

from events.ids import valid_id
from wire.nats_access import (
    Credentials,
    CredentialsError,
    Role,
    SecurityLayout,
    inbox_prefix,
    load_credentials,
)

from . import pki, routes
from .roles import RESPONSE_EXPIRES, RESPONSE_MAX_MSGS, permissions

# Who runs a local stack, issued by `certs init`: the controller process, the operator's CLI,
# and a stand-alone gateway.
BUILTIN: tuple[tuple[str, Role], ...] = (
    ("controller", "controller"),
    ("admin", "admin"),
    ("gateway", "gateway"),
)


class SecurityError(Exception):
    """A one-line, user-facing failure of a security command."""


# The roles that speak HTTP to each other over the direct transport, and what their
# certificate does: a node's front serves, a gateway dials.
TLS_ROLES: tuple[Role, ...] = ("node", "gateway")


class Identity(msgspec.Struct, frozen=True):
    name: str
    role: Role
    public_key: str
    issued_at: str
    revoked_at: str = ""
    tls_serial: str = ""  # its current TLS certificate's serial (hex); "": none


class Registry(msgspec.Struct):
    identities: list[Identity] = msgspec.field(default_factory=list)
    version: int = 1
    # Serials (hex) of certificates no longer good: their identity's revoked, or replaced.
    revoked_tls: list[str] = msgspec.field(default_factory=list)

    def find(self, name: str) -> Identity | None:
        for identity in self.identities:
            if identity.name == name:
                return identity
        return None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def load_registry(layout: SecurityLayout) -> Registry:
    if not layout.identities.exists():
        return Registry()
    try:
        return msgspec.json.decode(layout.identities.read_bytes(), type=Registry)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SecurityError(f"{layout.identities} is damaged: {exc}") from None


def _save_registry(layout: SecurityLayout, registry: Registry) -> None:
    pki.write_private(layout.identities, msgspec.json.format(msgspec.json.encode(registry)))


def init(layout: SecurityLayout, hosts: Sequence[str] = pki.DEFAULT_HOSTS) -> list[str]:
    """Create what is missing (CA, server certificate, the routes' certificate and password,
    built-in identities, nats.conf) and return what was created; existing keys are never
    replaced."""
    created: list[str] = []
    layout.root.mkdir(parents=True, exist_ok=True)
    os.chmod(layout.root, 0o700)
    if not layout.ca_cert.exists():
        pki.create_ca(layout.ca_cert, layout.ca_key)
        created.append(str(layout.ca_cert))
    if not layout.server_cert.exists():
        pki.create_server_cert(
            layout.ca_cert, layout.ca_key, layout.server_cert, layout.server_key, hosts
        )
        created.append(str(layout.server_cert))
    # The routes' own certificate and password (a NATS cluster: `gpumesh up --ha`).
    created += routes.ensure(layout)  # valid for the server certificate's names
    for name, role in BUILTIN:
        if load_registry(layout).find(name) is None:
            created.append(str(issue(layout, name, role)))
    # A data directory made before gateways had certificates: its gateway gets one.
    if ensure_tls(layout, "gateway"):
        created.append(str(layout.creds("gateway")))
    if not layout.server_config.exists():
        render_server_config(layout)
        created.append(str(layout.server_config))
    if not layout.crl.exists():
        render_crl(layout)
        created.append(str(layout.crl))
    return created


def issue(
    layout: SecurityLayout,
    name: str,
    role: Role,
    *,
    out: Path | None = None,
    hosts: Sequence[str] = (),
) -> Path:
    """A new identity: its credentials file (returned), its line in the registry and in
    nats.conf. A name is issued once; a revoked name stays revoked. A node's and a gateway's
    file also holds its TLS certificate: a node's names `hosts`, the addresses its agent
    advertises (default 127.0.0.1 and localhost)."""
    if not valid_id(name):
        raise SecurityError(f"invalid identity name {name!r}: use 1-128 of [A-Za-z0-9_-]")
    if not layout.ca_cert.exists():
        raise SecurityError(f"no CA in {layout.root}: run `gpumesh certs init` first")
    if hosts and role != "node":
        raise SecurityError("addresses name a node's front: --address goes with nodes only")
    registry = load_registry(layout)
    existing = registry.find(name)
    if existing is not None:
        state = "revoked" if existing.revoked_at else "issued"
        raise SecurityError(f"identity {name!r} is already {state} ({existing.role})")
    pair = nkeys.from_seed(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    seed = pair.seed.decode()
    public_key = pair.public_key.decode()
    tls_pem, serial = _tls(layout, role, name, hosts)
    creds = Credentials(
        name=name,
        role=role,
        seed=seed,
        public_key=public_key,
        inbox_prefix=inbox_prefix(role, name),
        ca_pem=layout.ca_cert.read_text(),
        tls_pem=tls_pem,
    )
    path = out if out is not None else layout.creds(name)
    pki.write_private(path, msgspec.json.format(msgspec.json.encode(creds)))
    registry.identities.append(
        Identity(name=name, role=role, public_key=public_key, issued_at=_now(), tls_serial=serial)
    )
    _save_registry(layout, registry)
    render_server_config(layout)
    return path


def _tls(layout: SecurityLayout, role: Role, name: str, hosts: Sequence[str]) -> tuple[str, str]:
    """(key and certificate PEM, serial in hex) for a node or a gateway; ("", "") else."""
    if role not in TLS_ROLES:
        return "", ""
    if role == "node":
        pem, serial = pki.identity_cert(
            layout.ca_cert, layout.ca_key, role, name, hosts or pki.DEFAULT_HOSTS, server=True
        )
    else:
        pem, serial = pki.identity_cert(layout.ca_cert, layout.ca_key, role, name, client=True)
    return pem, f"{serial:x}"


def issue_tls(
    layout: SecurityLayout, name: str, *, hosts: Sequence[str] = (), out: Path | None = None
) -> Path:
    """A new TLS certificate for a live node or gateway, written into its credentials file
    (`out`, default the data directory's; it must hold that identity's key): for a node whose
    address changed, or a file issued before fronts had certificates. The one it replaces is
    revoked, in case a copy of it lives on elsewhere."""
    registry = load_registry(layout)
    found = registry.find(name)
    if found is None:
        raise SecurityError(f"no identity {name!r} was issued in {layout.root}")
    if found.revoked_at:
        raise SecurityError(f"identity {name!r} was revoked at {found.revoked_at}")
    if found.role not in TLS_ROLES:
        raise SecurityError(f"a {found.role} has no TLS certificate: only nodes and gateways")
    if hosts and found.role != "node":
        raise SecurityError("addresses name a node's front: --address goes with nodes only")
    path = out if out is not None else layout.creds(name)
    try:
        creds = load_credentials(path)
    except CredentialsError as exc:
        raise SecurityError(str(exc)) from None
    if creds.public_key != found.public_key:
        raise SecurityError(f"{path} holds another identity's key than {name!r}'s")
    tls_pem, serial = _tls(layout, found.role, name, hosts)
    pki.write_private(
        path,
        msgspec.json.format(msgspec.json.encode(msgspec.structs.replace(creds, tls_pem=tls_pem))),
    )
    if found.tls_serial:
        registry.revoked_tls.append(found.tls_serial)
    replaced = msgspec.structs.replace(found, tls_serial=serial)
    registry.identities = [replaced if i.name == name else i for i in registry.identities]
    _save_registry(layout, registry)
    render_crl(layout)
    return path


def ensure_tls(layout: SecurityLayout, name: str) -> bool:
    """Give a live node or gateway of the data directory its TLS certificate if its
    credentials file there has none; True if it got one."""
    found = load_registry(layout).find(name)
    if found is None or found.revoked_at or found.role not in TLS_ROLES:
        return False
    path = layout.creds(name)
    if not path.exists() or load_credentials(path).tls_pem:
        return False
    issue_tls(layout, name)
    return True


def revoke(layout: SecurityLayout, name: str) -> Identity:
    """The identity's key leaves nats.conf and its TLS certificate joins the revocation list."""
    registry = load_registry(layout)
    found = registry.find(name)
    if found is None:
        raise SecurityError(f"no identity {name!r} was issued in {layout.root}")
    if found.revoked_at:
        return found
    revoked = msgspec.structs.replace(found, revoked_at=_now())
    registry.identities = [revoked if i.name == name else i for i in registry.identities]
    if found.tls_serial:
        registry.revoked_tls.append(found.tls_serial)
    _save_registry(layout, registry)
    render_server_config(layout)
    render_crl(layout)
    layout.creds(name).unlink(missing_ok=True)
    return revoked


def render_crl(layout: SecurityLayout) -> None:
    """crl.pem from the registry: every TLS certificate revoked or replaced, signed by the CA.
    Nodes' fronts re-read it when it changes and cut the connections it revokes."""
    serials = [int(s, 16) for s in load_registry(layout).revoked_tls]
    pki.write_crl(layout.ca_cert, layout.ca_key, serials, layout.crl)


def render_server_config(layout: SecurityLayout) -> None:
    """nats.conf: TLS required of every client, and one NKEY user per live identity.

    The NATS configuration format accepts JSON, so it is written with a JSON encoder: no
    quoting mistakes, and `$JS.API...` subjects stay strings rather than variables."""
    users = []
    for identity in load_registry(layout).identities:
        if identity.revoked_at:
            continue
        user: dict[str, object] = {"nkey": identity.public_key}
        allowed = permissions(identity.role, identity.name)
        if allowed is not None:
            perms: dict[str, object] = {
                "publish": {"allow": list(allowed.publish)},
                "subscribe": {"allow": list(allowed.subscribe)},
            }
            if allowed.responses:
                perms["allow_responses"] = {"max": RESPONSE_MAX_MSGS, "expires": RESPONSE_EXPIRES}
            user["permissions"] = perms
        users.append(user)
    config = {
        "tls": {
            "cert_file": str(layout.server_cert.resolve()),
            "key_file": str(layout.server_key.resolve()),
            "ca_file": str(layout.ca_cert.resolve()),
            "timeout": 5,
        },
        "authorization": {"timeout": 5, "users": users},
    }
    header = (
        "# Written by gpumesh from identities.json; `gpumesh certs` and `gpumesh node revoke`\n"
        "# rewrite it, so edits here are lost. docs/security.md explains each permission.\n"
    )
    pki.write_private(layout.server_config, (header + json.dumps(config, indent=2)).encode())


def reload_server(pid_file: Path) -> int | None:
    """Ask the running nats-server to re-read nats.conf; its pid, or None if none runs."""
    try:
        pid = int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    # nats-server leaves its pid file behind when it stops: signal that pid only while it is
    # still a nats-server (where /proc tells), never a process that took the number since.
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        if Path("/proc/self").exists():
            return None  # no such process
    except OSError:
        pass
    else:
        if b"nats-server" not in command:
            return None
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        return None
    return pid
