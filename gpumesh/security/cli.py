"""`gpumesh certs ...` and `gpumesh node issue|revoke`: the stack's CA and identities."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

import msgspec

from wire.nats_access import Role, SecurityLayout

from . import identities, pki

NODE_HELP = (
    "issue and revoke node credentials. A node's credentials let it publish only its own "
    "heartbeats and reports and read only its own commands (docs/security.md)."
)


def register(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    certs = commands.add_parser(
        "certs",
        parents=list(parents),
        help="the stack's CA, TLS certificate and NATS identities",
        description="Create and inspect the CA, the nats-server's TLS certificate and the "
        "per-process NKEY identities kept in DATA_DIR/security. `gpumesh up` runs "
        "`certs init` itself; run it by hand to add host names or to issue credentials for "
        "gateways and integrators on other machines.",
    )
    verbs = certs.add_subparsers(dest="verb", required=True, metavar="VERB")
    init = verbs.add_parser(
        "init",
        parents=list(parents),
        help="create the CA, the server certificate and the built-in identities",
        description="Create what is missing in DATA_DIR/security: the CA, nats-server's TLS "
        "certificate, the controller, admin and gateway identities, and nats.conf. Existing "
        "keys are kept.",
    )
    init.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name or address clients will dial, for the server certificate "
        "(repeatable; 127.0.0.1 and localhost are always in it). It names the server, it does "
        "not move it: the embedded nats-server listens beyond loopback only with "
        "`gpumesh controller --nats-listen HOST:PORT`",
    )
    init.set_defaults(handler=run_init)
    listing = verbs.add_parser(
        "list", parents=list(parents), help="list the issued identities and their roles"
    )
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=run_list)
    issue = verbs.add_parser(
        "issue",
        parents=list(parents),
        help="issue credentials for a gateway, integrator, admin or node",
        description="Write one credentials file (the identity's NKEY seed, its role and the "
        "CA; for a gateway or a node also its TLS certificate, for the direct transport's "
        "mutual TLS): copy it to the machine that will use it and pass it as --nats-creds.",
    )
    issue.add_argument("name", help="the identity's name ([A-Za-z0-9_-])")
    issue.add_argument("--role", required=True, choices=get_args(Role))
    issue.add_argument("--out", type=Path, metavar="FILE", help="where to write the file")
    _address_argument(issue)
    issue.set_defaults(handler=run_issue)
    tls = verbs.add_parser(
        "tls",
        parents=list(parents),
        help="give a node or gateway a new TLS certificate (a node's new address)",
        description="Write a new TLS certificate into a node's or a gateway's credentials "
        "file: for a node whose --address changed, or a file issued before nodes' fronts "
        "took certificates. The certificate it replaces is revoked (crl.pem).",
    )
    tls.add_argument("name", help="the node's or gateway's name")
    tls.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="the credentials file to update (default: the data directory's); it must be "
        "that identity's",
    )
    _address_argument(tls)
    tls.set_defaults(handler=run_tls)
    revoke = verbs.add_parser(
        "revoke",
        parents=list(parents),
        help="revoke an identity and cut its connections",
        description="Remove the identity's key from nats.conf and reload the running "
        "nats-servers (its NATS connections close), and put its TLS certificate in crl.pem: "
        "nodes' fronts that read it (those of this data directory's agents, and every node "
        "given a copy as --front-crl) close a revoked gateway's connections within a second.",
    )
    revoke.add_argument("name")
    revoke.set_defaults(handler=run_revoke)

    node = commands.add_parser("node", parents=list(parents), help=NODE_HELP, description=NODE_HELP)
    node_verbs = node.add_subparsers(dest="verb", required=True, metavar="VERB")
    node_issue = node_verbs.add_parser(
        "issue",
        parents=list(parents),
        help="issue a node's credentials",
        description="Write the node's credentials file; start its agent with "
        "`gpumesh agent --node-id ID --nats tls://HOST:PORT --nats-creds FILE`.",
    )
    node_issue.add_argument("name", metavar="NODE_ID")
    node_issue.add_argument("--out", type=Path, metavar="FILE", help="where to write the file")
    _address_argument(node_issue)
    node_issue.set_defaults(handler=run_issue, role="node")
    node_revoke = node_verbs.add_parser(
        "revoke",
        parents=list(parents),
        help="revoke a node: the server closes its connections and refuses it from now on",
        description="Remove the node's key from nats.conf and make the running nats-server "
        "reload it: the node's connections are closed at once and it cannot connect again. "
        "The controller then sees its heartbeats stop, marks it offline and replaces its "
        "replicas elsewhere.",
    )
    node_revoke.add_argument("name", metavar="NODE_ID")
    node_revoke.set_defaults(handler=run_revoke)


def _address_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        action="append",
        default=[],
        metavar="HOST",
        help="for a node: an address or name gateways dial its front at, the agent's "
        "--address (repeatable; default 127.0.0.1 and localhost)",
    )


def _fail(message: str) -> int:
    print(f"gpumesh: error: {message}", file=sys.stderr)
    return 1


async def run_init(args: argparse.Namespace) -> int:
    layout = SecurityLayout(args.data_dir)
    hosts = [*pki.DEFAULT_HOSTS, *args.host]
    try:
        created = identities.init(layout, hosts)
    except identities.SecurityError as exc:
        return _fail(str(exc))
    if not created:
        print(f"nothing to do: {layout.root} is complete")
        extra = set(args.host) - set(pki.certificate_hosts(layout.server_cert))
        if extra:
            return _fail(
                f"the server certificate does not cover {', '.join(sorted(extra))}: delete "
                f"{layout.server_cert} and run `gpumesh certs init` again with every --host"
            )
        return 0
    for path in created:
        print(f"created {path}")
    print(f"the embedded nats-server now requires TLS and credentials ({layout.server_config})")
    if args.host:
        print(
            "it listens on loopback only until started with --nats-listen: "
            "`gpumesh controller --nats-listen 0.0.0.0:4222` for nodes on other machines"
        )
    return 0


async def run_list(args: argparse.Namespace) -> int:
    layout = SecurityLayout(args.data_dir)
    try:
        registry = identities.load_registry(layout)
    except identities.SecurityError as exc:
        return _fail(str(exc))
    if args.json:
        print(msgspec.json.encode(registry.identities).decode())
        return 0
    if not registry.identities:
        print(f"no identities in {layout.root} (run `gpumesh certs init`)")
        return 0
    print(f"{'NAME':<24} {'ROLE':<11} {'ISSUED':<26} REVOKED")
    for i in registry.identities:
        print(f"{i.name:<24} {i.role:<11} {i.issued_at:<26} {i.revoked_at or '-'}")
    return 0


async def run_issue(args: argparse.Namespace) -> int:
    layout = SecurityLayout(args.data_dir)
    try:
        path = identities.issue(layout, args.name, args.role, out=args.out, hosts=args.address)
    except identities.SecurityError as exc:
        return _fail(str(exc))
    print(f"issued {args.role} '{args.name}': {path} (secret: keep it on that machine only)")
    _say_front(args.role, args.address)
    _reload(layout, args.data_dir)
    return 0


async def run_tls(args: argparse.Namespace) -> int:
    layout = SecurityLayout(args.data_dir)
    try:
        path = identities.issue_tls(layout, args.name, hosts=args.address, out=args.out)
    except identities.SecurityError as exc:
        return _fail(str(exc))
    found = identities.load_registry(layout).find(args.name)
    role = found.role if found is not None else "node"
    print(f"new TLS certificate for {role} '{args.name}' in {path}; the old one is revoked")
    _say_front(role, args.address)
    return 0


def _say_front(role: str, addresses: Sequence[str]) -> None:
    if role == "node":
        where = ", ".join(addresses or pki.DEFAULT_HOSTS)
        print(f"its front's certificate names {where}: start its agent with --address one of them")


async def run_revoke(args: argparse.Namespace) -> int:
    layout = SecurityLayout(args.data_dir)
    try:
        revoked = identities.revoke(layout, args.name)
    except identities.SecurityError as exc:
        return _fail(str(exc))
    print(f"revoked {revoked.role} '{revoked.name}' at {revoked.revoked_at}")
    if revoked.tls_serial:
        print(
            f"its TLS certificate is in {layout.crl}: nodes' fronts reading it (this data "
            "directory's agents; copy it to other nodes' --front-crl) drop it within a second"
        )
    _reload(layout, args.data_dir)
    return 0


def _reload(layout: SecurityLayout, data_dir: Path) -> None:
    """Every embedded nats-server of the data directory re-reads nats.conf: the one of
    `gpumesh up`/`controller`, and the three of `gpumesh up --ha` (each includes it)."""
    from gpumesh.up_ha import NATS_DIR

    pid_files = [data_dir / "nats" / "nats-server.pid"]
    pid_files += sorted((data_dir / NATS_DIR).glob("nats-*/nats-server.pid"))
    pids = [pid for f in pid_files if (pid := identities.reload_server(f)) is not None]
    if not pids:
        print("no embedded nats-server is running here: the change applies when it starts")
    else:
        which = ", ".join(str(pid) for pid in pids)
        print(f"nats-server (pid {which}) reloaded {layout.server_config}")
