"""The credentials of a NATS cluster's routes: what its servers prove to each other.

Clients prove who they are with NKEYs; servers joined by routes prove it with two things of
their own, neither of which any client holds:

- `route.pem` / `route-key.pem`: a certificate of the stack's CA for both TLS ends (server and
  client authentication: each server of a route verifies the other's), valid for the same
  names as the server certificate;
- `route-auth.json`: the cluster's user and a random password, presented by a server that dials
  a route and checked by the one it dials.

`gpumesh certs init` creates them with the rest; `gpumesh up --ha` creates them on first use in
a data directory made before they existed.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path

import msgspec

from wire.nats_access import SecurityLayout
from wire.nats_cluster import RouteSecurity

from . import pki

ROUTE_USER = "gpumesh-route"


class RouteAuth(msgspec.Struct, frozen=True):
    user: str
    password: str
    version: int = 1


def cert_path(layout: SecurityLayout) -> Path:
    return layout.root / "route.pem"


def key_path(layout: SecurityLayout) -> Path:
    return layout.root / "route-key.pem"


def auth_path(layout: SecurityLayout) -> Path:
    return layout.root / "route-auth.json"


def ensure(layout: SecurityLayout, hosts: Sequence[str] | None = None) -> list[str]:
    """Create what is missing of the route credentials; return what was created. Existing
    files are kept. `hosts`: the names the certificate is valid for (default: the server
    certificate's, so `certs init --host NAME` covers both)."""
    if not layout.ca_cert.exists():
        raise FileNotFoundError(f"no CA in {layout.root}: run `gpumesh certs init` first")
    created: list[str] = []
    if not cert_path(layout).exists() or not key_path(layout).exists():
        names = list(hosts) if hosts else _server_hosts(layout)
        pki.create_server_cert(
            layout.ca_cert,
            layout.ca_key,
            cert_path(layout),
            key_path(layout),
            names,
            common_name="gpumesh route",
            client_auth=True,
        )
        created.append(str(cert_path(layout)))
    if not auth_path(layout).exists():
        auth = RouteAuth(user=ROUTE_USER, password=secrets.token_hex(32))
        pki.write_private(auth_path(layout), msgspec.json.format(msgspec.json.encode(auth)))
        created.append(str(auth_path(layout)))
    return created


def _server_hosts(layout: SecurityLayout) -> list[str]:
    if layout.server_cert.exists():
        return pki.certificate_hosts(layout.server_cert)
    return list(pki.DEFAULT_HOSTS)


def route_security(layout: SecurityLayout) -> RouteSecurity:
    """The route credentials of `layout`, created first where missing."""
    ensure(layout)
    try:
        auth = msgspec.json.decode(auth_path(layout).read_bytes(), type=RouteAuth)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{auth_path(layout)} is damaged: {exc}") from None
    return RouteSecurity(
        cert_file=cert_path(layout),
        key_file=key_path(layout),
        ca_file=layout.ca_cert,
        user=auth.user,
        password=auth.password,
    )
