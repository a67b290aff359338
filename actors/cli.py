"""`gpumesh controller`, `gpumesh cluster ...` and `gpumesh nodes`."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from events import ClusterSpec
from events.contract import subjects
from events.contract.messages import ApiReply
from events.gpu_names import family
from wire.commandline import add_creds_argument, credentials, nats_for
from wire.errors import CommandFailed
from wire.stack import find_nats_url

from .health import HealthPolicy
from .spec import SpecError, parse_toml


def register(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    nats = argparse.ArgumentParser(add_help=False)
    nats.add_argument(
        "--nats",
        metavar="URL",
        help="NATS server or cluster to use (default: the local stack's, found "
        "through the data directory)",
    )
    add_creds_argument(nats, "admin")
    common = [*parents, nats]

    ctl = commands.add_parser(
        "controller",
        parents=list(parents),
        help="run the control plane",
        description="Run the controller: it records heartbeats, decides node health, places "
        "replicas and replaces them when nodes fail. Without --nats it starts an embedded "
        "nats-server (JetStream) in the data directory, on loopback only unless "
        "--nats-listen says where.",
    )
    ctl.add_argument("--nats", metavar="URL", help="join this NATS server instead of starting one")
    ctl.add_argument(
        "--nats-listen",
        metavar="HOST:PORT",
        help="where the embedded nats-server listens for clients (default 127.0.0.1 and a free "
        "port; HOST alone: port 4222; 0.0.0.0: every interface). Beyond loopback only with "
        "TLS and credentials (`gpumesh certs init --host NAME`)",
    )
    add_creds_argument(ctl, "controller")
    ctl.add_argument(
        "--insecure",
        action="store_true",
        help="start the embedded nats-server without TLS and credentials even when "
        "`gpumesh certs init` has run (loopback only)",
    )
    ctl.add_argument(
        "--compact-heartbeats-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="delete heartbeat events older than this (each node's latest is kept; "
        "no projection changes); default: keep them all",
    )
    ctl.add_argument(
        "--event-log",
        choices=("sqlite", "jetstream"),
        default="sqlite",
        help="where the event log of record lives: sqlite (default; one file in the data "
        "directory, so a standby controller must share the machine and the directory) or "
        "jetstream (a replicated stream on NATS: controllers on different hosts share nothing "
        "but NATS, and standbys follow the log as it is written)",
    )
    ctl.add_argument(
        "--controller-id",
        metavar="ID",
        help="this controller's name in the leader lease and its event stream (default: the "
        "host name and the process id)",
    )
    ctl.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (PORT alone: 127.0.0.1; "
        "default: none; docs/metrics.md)",
    )
    _health_args(ctl)
    ctl.set_defaults(handler=run_controller, daemon=True)
    about = ctl.add_subparsers(dest="controller_command", metavar="SUBCOMMAND")
    status = about.add_parser(
        "status",
        parents=common,
        help="who leads, since when, at which term",
        description="The controller that holds the leader lease (a JetStream key every "
        "controller campaigns for), since when, at which term, and how fresh its lease is.",
    )
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=run_controller, daemon=False)

    cluster = commands.add_parser(
        "cluster",
        parents=list(parents),
        help="create, apply, plan, list, show, scale, roll back and delete clusters",
        description="Clusters through the control API.",
    )
    verbs = cluster.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND", required=True)
    create = verbs.add_parser(
        "create",
        parents=common,
        help="create a cluster from a TOML spec",
        description="Create a cluster from a TOML spec file.",
    )
    create.add_argument("-f", "--file", required=True, type=Path, help="the spec (TOML)")
    create.add_argument("--json", action="store_true")
    _wait_args(create)
    create.set_defaults(handler=cluster_create)
    apply = verbs.add_parser(
        "apply",
        parents=common,
        help="record a new revision of a cluster's spec and roll it out",
        description="Record the spec as the cluster's next revision (or create the cluster) and "
        "replace its replicas within the spec's [rollout] max_surge and max_unavailable. "
        "An identical spec records nothing and says so.",
    )
    apply.add_argument("-f", "--file", required=True, type=Path, help="the spec (TOML)")
    apply.add_argument("--json", action="store_true")
    _wait_args(apply)
    apply.set_defaults(handler=cluster_apply)
    plan = verbs.add_parser(
        "plan",
        parents=common,
        help="the GPUs a spec's [sharding] section needs on the fleet as it is (places nothing)",
        description="Work out the smallest set of free GPUs that holds the model of the spec's "
        "[sharding] section: its stages (node, GPUs, layers), the estimated time per token, and "
        "why each alternative was rejected (docs/sharding.md). Places nothing; exits 1 when "
        "nothing fits.",
    )
    plan.add_argument("-f", "--file", required=True, type=Path, help="the spec (TOML)")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(handler=cluster_plan)
    history = verbs.add_parser(
        "history",
        parents=common,
        help="a cluster's revisions",
        description="List a cluster's revisions: number, when, why and what changed.",
    )
    history.add_argument("name")
    history.add_argument("--json", action="store_true")
    history.set_defaults(handler=cluster_history)
    rollback = verbs.add_parser(
        "rollback",
        parents=common,
        help="roll a cluster back to an earlier revision",
        description="Record an earlier revision's spec (keeping the current replica count and "
        "rollout policy) as the next revision, and roll it out.",
    )
    rollback.add_argument("name")
    rollback.add_argument(
        "--to", type=int, default=0, metavar="REV", help="the revision (default: the previous one)"
    )
    rollback.add_argument("--json", action="store_true")
    rollback.set_defaults(handler=cluster_rollback)
    canary = verbs.add_parser(
        "canary",
        parents=common,
        help="serve a new spec beside a cluster's own, with a share of its requests",
        description="Create the cluster NAME-canary with the spec (its replicas: the weight's "
        "share of the cluster's, one at least) and have gateways send it WEIGHT percent of the "
        "cluster's requests while it has a ready replica. `cluster promote` makes the spec the "
        "cluster's next revision (rolled out as `cluster apply` does); `cluster abort` removes "
        "the canary. Both delete NAME-canary.",
    )
    canary.add_argument("name")
    canary.add_argument("-f", "--file", required=True, type=Path, help="the spec (TOML)")
    canary.add_argument(
        "--weight", type=int, default=10, help="percent of the requests, 1..99 (default 10)"
    )
    canary.add_argument("--json", action="store_true")
    canary.set_defaults(handler=cluster_canary)
    for verb, what in (
        ("promote", "make the canary's spec the cluster's next revision, and end the canary"),
        ("abort", "end the canary: its cluster is deleted, the cluster keeps its spec"),
    ):
        end = verbs.add_parser(
            verb, parents=common, help=what, description=what[0].upper() + what[1:] + "."
        )
        end.add_argument("name")
        end.add_argument("--reason", default="", help="recorded with the canary's end")
        end.add_argument("--json", action="store_true")
        end.set_defaults(handler=cluster_end_canary, verb=verb)
    listing = verbs.add_parser(
        "list",
        parents=common,
        help="list clusters",
        description="List clusters with desired and ready replicas.",
    )
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=cluster_list)
    show = verbs.add_parser(
        "show",
        parents=common,
        help="one cluster and its replicas",
        description="Show a cluster, its replicas and why they are where.",
    )
    show.add_argument("name")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=cluster_show)
    scale = verbs.add_parser(
        "scale",
        parents=common,
        help="change the number of replicas",
        description="Set a cluster's desired number of replicas.",
    )
    scale.add_argument("name")
    scale.add_argument("replicas", type=int)
    scale.add_argument("--json", action="store_true")
    _wait_args(scale)
    scale.set_defaults(handler=cluster_scale)
    delete = verbs.add_parser(
        "delete",
        parents=common,
        help="delete a cluster",
        description="Delete a cluster; its replicas are stopped.",
    )
    delete.add_argument("name")
    delete.add_argument("--json", action="store_true")
    delete.set_defaults(handler=cluster_delete)

    nodes = commands.add_parser(
        "nodes",
        parents=common,
        help="list nodes and their health",
        description="List nodes: health, GPUs, last heartbeat.",
    )
    nodes.add_argument("--json", action="store_true")
    nodes.add_argument("--drain", metavar="NODE", help="drain this node (replicas migrate)")
    nodes.set_defaults(handler=list_nodes)
    node_verbs = nodes.add_subparsers(dest="node_command", metavar="SUBCOMMAND")
    for verb, text in (
        ("drain", "no new replicas on NODE; its replicas move once replacements are ready"),
        ("undrain", "NODE takes new replicas again (it must be drained)"),
        ("remove", "take an offline NODE out of the listings; its agent registering brings it "
         "back (offline nodes are removed on their own after --remove-offline-after)"),
    ):  # fmt: skip
        sub = node_verbs.add_parser(verb, parents=common, help=text, description=text + ".")
        sub.add_argument("node", metavar="NODE")
        sub.add_argument("--json", action="store_true")
        sub.set_defaults(handler=node_verb)
    text = (
        "no new replicas on NODE until TIME (or until uncordon); the replicas it runs keep serving"
    )
    cordon = node_verbs.add_parser("cordon", parents=common, help=text, description=text + ".")
    cordon.add_argument("node", metavar="NODE")
    cordon.add_argument(
        "--until",
        metavar="TIME",
        default="",
        help="an ISO 8601 time with Z or an offset (2026-11-26T03:00:00Z) or a duration from "
        "now (30m, 2h, 1d); without it the cordon lasts until uncordon",
    )
    cordon.add_argument("--reason", default="", help="why, recorded with the cordon")
    cordon.add_argument("--json", action="store_true")
    cordon.set_defaults(handler=node_cordon)
    text = "NODE takes new replicas again before its cordon ends (it must be cordoned)"
    uncordon = node_verbs.add_parser("uncordon", parents=common, help=text, description=text + ".")
    uncordon.add_argument("node", metavar="NODE")
    uncordon.add_argument("--json", action="store_true")
    uncordon.set_defaults(handler=node_verb)


def _health_args(parser: argparse.ArgumentParser) -> None:
    d = HealthPolicy()
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=d.heartbeat_interval,
        help=f"seconds between heartbeats (default {d.heartbeat_interval})",
    )
    parser.add_argument(
        "--suspect-after",
        type=int,
        default=d.suspect_after,
        help=f"missed heartbeats before suspect (default {d.suspect_after})",
    )
    parser.add_argument(
        "--offline-after",
        type=int,
        default=d.offline_after,
        help=f"missed heartbeats before offline (default {d.offline_after})",
    )
    parser.add_argument(
        "--thermal-high",
        type=float,
        default=d.thermal_high_c,
        help=f"degraded at or above this GPU temperature (default {d.thermal_high_c:g} C)",
    )
    parser.add_argument(
        "--thermal-low",
        type=float,
        default=d.thermal_low_c,
        help=f"recovered at or below this (default {d.thermal_low_c:g} C)",
    )
    parser.add_argument(
        "--remove-offline-after",
        type=float,
        default=d.remove_offline_after_s,
        metavar="SECONDS",
        help="remove a node offline this long from the fleet, recording why; 0 keeps it "
        f"listed as offline (default {d.remove_offline_after_s:g} s, a day)",
    )


def health_policy(args: argparse.Namespace) -> HealthPolicy:
    return HealthPolicy(
        heartbeat_interval=args.heartbeat_interval,
        suspect_after=args.suspect_after,
        offline_after=args.offline_after,
        thermal_high_c=args.thermal_high,
        thermal_low_c=args.thermal_low,
        remove_offline_after_s=getattr(
            args, "remove_offline_after", HealthPolicy().remove_offline_after_s
        ),
    )


# -- the controller --------------------------------------------------------------------


# A controller on the JetStream log keeps its fold here, with the position it applied: a restart
# folds only what the log gained since (actors/controller_process.py). Not named by controller
# id, which changes with each process by default.
READ_MODEL_FILE = "controller-read-model.db"


async def run_controller(args: argparse.Namespace) -> int:
    if getattr(args, "controller_command", None) == "status":
        return await controller_status(args)
    import structlog

    from runtime.real_env import LoopClock
    from runtime.shutdown import run_until_signal
    from wire.nats_access import SecurityLayout
    from wire.nats_bus import NatsBus

    from .controller import ControllerConfig
    from .controller_process import ControllerProcess, ProcessConfig
    from .metrics import LogMetrics, run_process

    args.data_dir.mkdir(parents=True, exist_ok=True)
    controller_id = args.controller_id or _default_controller_id()
    async with nats_for(
        args.data_dir, args.nats, secure=not args.insecure, listen=args.nats_listen
    ) as url:
        bus = await NatsBus.connect(
            url, name="gpumesh-controller", credentials=credentials(args, url, "controller")
        )
        try:
            config = ProcessConfig(
                controller=ControllerConfig(
                    health=health_policy(args),
                    compact_heartbeats_after=args.compact_heartbeats_after,
                    controller_id=controller_id,
                    metrics=LogMetrics(LoopClock()) if args.metrics_listen else None,
                ),
                log=args.event_log,
                events_db=args.events_db,
                read_model=(
                    args.data_dir / READ_MODEL_FILE if args.event_log == "jetstream" else None
                ),
                # Where `gpumesh certs` keeps the CA: its revocation list goes to the nodes.
                crl=None if args.insecure else SecurityLayout(args.data_dir).crl,
            )
            log = structlog.get_logger("gpumesh.leadership")
            process = ControllerProcess(bus, LoopClock(), config, log=log)
            where = (
                f"event log {args.events_db}"
                if args.event_log == "sqlite"
                else "event log on JetStream (GPUMESH_LOG), read model "
                f"{args.data_dir / READ_MODEL_FILE}"
            )
            print(
                f"controller: NATS {url}, {where}; {controller_id} leads once it holds the "
                "lease (`gpumesh controller status`)",
                file=sys.stderr,
            )
            await run_until_signal(run_process(process, args.metrics_listen))
        finally:
            await bus.close()
    return 0


def _default_controller_id() -> str:
    """This host's name and the process id, as a stream id ([A-Za-z0-9_-])."""
    import os
    import re
    import socket

    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:80] or "host"
    return f"{host}-{os.getpid()}"


async def controller_status(args: argparse.Namespace) -> int:
    """Who leads, since when, at which term (from the lease itself), and each standby's lag
    in events (from the roster: actors/roster.py)."""
    import time

    from wire.nats_bus import NatsBus

    from .leader_kv import KvLease
    from .roster import Roster, lag

    url = find_nats_url(args.data_dir, getattr(args, "nats", None))
    bus = await NatsBus.connect(
        url, name="gpumesh-cli", credentials=credentials(args, url, "admin")
    )
    try:
        found = await KvLease(bus).leader()
        entries = await Roster(bus).entries()
    finally:
        await bus.close()
    now = time.time_ns()
    leading = found[0].controller_id if found is not None else None
    leader_entry = next((e for e in entries if e.controller_id == leading), None)
    standbys = [
        {
            "controller_id": e.controller_id,
            "applied": e.applied,
            "lag": lag(e, leader_entry),
            "follows": e.follows,
            "log": e.log,
            "reported_s_ago": round((now - e.reported_ns) / 1e9, 3),
        }
        for e in entries
        if e.controller_id != leading
    ]
    lines = [
        f"standby {s['controller_id']}: "
        + (
            f"{s['lag']} events behind (applied {s['applied']})"
            if s["follows"] and s["lag"] is not None
            else (
                f"applied {s['applied']}"
                if s["follows"]
                else "rebuilds from the SQLite log when it takes over"
            )
        )
        for s in standbys
    ]
    if found is None:
        data: dict[str, Any] = {"leader": None, "standbys": standbys}
        text = (
            f"no controller holds the lease on {url} (none is running, or it runs inside "
            "`gpumesh up`, which takes none)"
        )
        return _emit(args, data, "\n".join([text, *lines]))
    record, revision = found
    data = {
        "leader": record.controller_id,
        "term": record.term or revision,
        "since_ns": record.since_ns,
        "renewed_s_ago": round((now - (record.renewed_ns or record.since_ns)) / 1e9, 3),
        "lease_revision": revision,
        "applied": leader_entry.applied if leader_entry is not None else None,
        "log": leader_entry.log if leader_entry is not None else None,
        "standbys": standbys,
    }
    led_for = round((now - record.since_ns) / 1e9, 1)
    text = (
        f"leader {record.controller_id}, term {data['term']}, leading for {led_for} s, "
        f"renewed {data['renewed_s_ago']} s ago"
    )
    return _emit(args, data, "\n".join([text, *lines]))


# -- control API clients -----------------------------------------------------------------


async def call(args: argparse.Namespace, verb: str, body: object) -> Any:
    from runtime.env import NoResponders, RequestTimeout
    from wire.nats_bus import NatsBus

    url = find_nats_url(args.data_dir, getattr(args, "nats", None))
    bus = await NatsBus.connect(
        url, name="gpumesh-cli", credentials=credentials(args, url, "admin")
    )
    try:
        raw = await bus.request(subjects.api(verb), msgspec.json.encode(body), timeout=30.0)
    except NoResponders:
        raise CommandFailed(await _why_nobody_answers(bus, url)) from None
    except RequestTimeout:
        raise CommandFailed(f"the controller on {url} did not answer within 30 s") from None
    finally:
        await bus.close()
    reply = msgspec.json.decode(raw.data, type=ApiReply)
    if not reply.ok:
        raise CommandFailed(reply.error)
    return reply.data


async def _why_nobody_answers(bus: Any, url: str) -> str:
    """Only the leader serves the control API (standbys do not subscribe, so NATS hands every
    request to the leader, whichever server the client reached). Nobody answering means no
    controller leads right now: say who is there, from the lease and the roster."""
    from runtime.errors import BusError

    from .errors import ControllerError
    from .leader_kv import KvLease
    from .roster import Roster

    try:
        found = await KvLease(bus).leader()
        standbys = [e.controller_id for e in await Roster(bus).entries() if e.role == "standby"]
    except (ControllerError, BusError):  # only the message depends on it
        found, standbys = None, []
    if found is not None:
        return (
            f"no controller is answering on {url}: {found[0].controller_id} holds the lease "
            "(term " + str(found[0].term or found[1]) + ") but is not serving yet; try again "
            "in a few seconds"
        )
    if standbys:
        return (
            f"no controller leads on {url} right now (standing by: {', '.join(standbys)}); "
            "one takes over within the lease's time to live, about 3 s: try again"
        )
    return f"no controller is answering on {url} (is `gpumesh up` or `gpumesh controller` running?)"


def _wait_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wait",
        action="store_true",
        help="return once every replica of the cluster's current revision is ready (progress "
        "on stderr as replicas are placed, start and become ready; --json prints the cluster "
        "then)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="with --wait: give up after S seconds, exit 1 saying where it stands (default 300)",
    )


_WAIT_POLL_S = 0.5


def _settled(c: dict[str, Any]) -> bool:
    """Every replica still wanted is ready at the current revision, and nothing is on its way
    in or out."""
    moving = [r for r in c["replicas"] if r["status"] in ("pending", "placed", "starting")]
    leaving = [r for r in c["replicas"] if r["status"] == "stopping"]
    current = [
        r for r in c["replicas"] if r["status"] == "ready" and r["revision"] == c["revision"]
    ]
    return not moving and not leaving and len(current) == c["desired"]


def _progress_line(c: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for r in c["replicas"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    shown = ", ".join(
        f"{status} {counts[status]}"
        for status in ("placed", "starting", "stopping", "failed")
        if counts.get(status)
    )
    line = f"{c['name']}: {c['ready']}/{c['desired']} ready"
    if shown:
        line += f" ({shown})"
    if c["unschedulable"]:
        line += f"; unschedulable: {c['unschedulable']}"
    return line


async def _wait_settled(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Poll the cluster until it settles, saying each change on stderr; CommandFailed with
    where it stands after --timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.timeout
    said = ""
    while True:
        c: dict[str, Any] = await call(args, "cluster.get", {"name": name})
        line = _progress_line(c)
        if line != said:
            print(line, file=sys.stderr, flush=True)
            said = line
        if _settled(c):
            return c
        if loop.time() >= deadline:
            raise CommandFailed(f"not settled after {args.timeout:g} s: {line}")
        await asyncio.sleep(_WAIT_POLL_S)


def _emit(args: argparse.Namespace, data: Any, text: str) -> int:
    print(msgspec.json.encode(data).decode() if args.json else text)
    return 0


def _read_spec(path: Path) -> ClusterSpec:
    try:
        return parse_toml(path.read_text(), source=str(path))
    except FileNotFoundError:
        raise CommandFailed(f"no such spec file: {path}") from None
    except SpecError as exc:
        # A TOML error names the file already (it is the parser's `source`); a field error not.
        where = f"{path}: "
        message = str(exc)
        raise CommandFailed(message if message.startswith(where) else where + message) from None


async def cluster_create(args: argparse.Namespace) -> int:
    spec = _read_spec(args.file)
    data = await call(args, "cluster.create", spec)
    if args.wait:
        data = await _wait_settled(args, spec.name)
        return _emit(args, data, f"created cluster {spec.name}: {spec.replicas} replicas ready")
    return _emit(args, data, f"created cluster {spec.name} ({spec.replicas} replicas)")


async def cluster_apply(args: argparse.Namespace) -> int:
    spec = _read_spec(args.file)
    data = await call(args, "cluster.apply", spec)
    message = data["message"]
    if args.wait:
        data = await _wait_settled(args, spec.name)
        return _emit(args, data, f"{spec.name}: {message}; revision {data['revision']} ready")
    return _emit(args, data, f"{spec.name}: {message}")


async def cluster_plan(args: argparse.Namespace) -> int:
    spec = _read_spec(args.file)
    data = await call(args, "cluster.plan", spec)
    if not data["fits"]:
        lines = [data["reason"]]
    else:
        lines = [
            f"{spec.name}: {data['gpus']} GPU{'s' if data['gpus'] != 1 else ''}, "
            f"estimated {data['token_ms']:.2f} ms per token "
            f"(compute {data['compute_ms']:.2f} + links {data['link_ms']:.2f})"
        ]
        lines.append(
            f"{'STAGE':>5}  {'NODE':16} {'GPUS':10} {'MODEL':12} {'LAYERS':9} "
            f"{'USED/VRAM MiB':>15}  {'MS':>7}"
        )
        for i, st in enumerate(data["stages"]):
            gpus = ",".join(map(str, st["gpu_indices"]))
            layers = f"{st['first_layer']}-{st['last_layer'] - 1}" if st["last_layer"] else "-"
            used = f"{st['used_mib']}/{st['vram_mib']}"
            lines.append(
                f"{i:>5}  {st['node_id']:16} {gpus:10} {st['gpu_model']:12} "
                f"{layers:9} {used:>15}  {st['compute_ms']:>7.2f}"
            )
    if data["rejected"]:
        lines.append(f"rejected ({data['rejected_total']}):")
        lines += [f"  {','.join(r['nodes'])}: {r['reason']}" for r in data["rejected"]]
        if data["rejected_total"] > len(data["rejected"]):
            lines.append(f"  ... and {data['rejected_total'] - len(data['rejected'])} more")
    _emit(args, data, "\n".join(lines))
    return 0 if data["fits"] else 1


async def cluster_history(args: argparse.Namespace) -> int:
    data = await call(args, "cluster.history", {"name": args.name})
    rows = [f"{'REVISION':>8}  {'RECORDED':20}  {'REASON':28}  CHANGE"]
    for r in data["revisions"]:
        marks = " (current)" if r["revision"] == data["revision"] else ""
        if r["revision"] == data["rolled_out"]:
            marks += " (rolled out)"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["recorded_at"] / 1e9))
        rows.append(f"{r['revision']:>8}  {when:20}  {r['reason'][:28]:28}  {r['change']}{marks}")
    return _emit(args, data, "\n".join(rows))


async def cluster_rollback(args: argparse.Namespace) -> int:
    if args.to < 0:
        raise CommandFailed(f"--to: must be a revision number (1 or more), got {args.to}")
    data = await call(args, "cluster.rollback", {"name": args.name, "to": args.to})
    return _emit(args, data, f"{args.name}: {data['message']}")


async def cluster_canary(args: argparse.Namespace) -> int:
    if not 1 <= args.weight <= 99:
        raise CommandFailed(f"--weight: must be 1..99 (percent of the requests), got {args.weight}")
    spec = _read_spec(args.file)
    body = {"name": args.name, "spec": msgspec.to_builtins(spec), "weight": args.weight}
    data = await call(args, "cluster.canary", body)
    canary = data["canary"]
    return _emit(
        args, data, f"{args.name}: canary {canary['cluster']} takes {canary['weight']}% of requests"
    )


async def cluster_end_canary(args: argparse.Namespace) -> int:
    data = await call(args, f"cluster.{args.verb}", {"name": args.name, "reason": args.reason})
    return _emit(args, data, f"{args.name}: {data['message']}")


async def cluster_list(args: argparse.Namespace) -> int:
    data = await call(args, "cluster.list", {})
    rows = [f"{'NAME':20} {'READY':>7}  UNSCHEDULABLE"]
    rows += [
        f"{c['name']:20} {c['ready']:>3}/{c['desired']:<3}  {c['unschedulable']}" for c in data
    ]
    return _emit(args, data, "\n".join(rows) if data else "no clusters")


async def cluster_show(args: argparse.Namespace) -> int:
    c = await call(args, "cluster.get", {"name": args.name})
    lines = [f"{c['name']}: {c['ready']}/{c['desired']} ready"]
    if c["unschedulable"]:
        lines.append(f"  unschedulable: {c['unschedulable']}")
    for r in c["replicas"]:
        lines.append(
            f"  {r['replica_id']:16} epoch {r['epoch']:<3} {r['status']:9} "
            f"{r['node_id']:14} {r['address'] or '-':28} {r['why']}"
        )
        for s in r.get("stages", ()):
            first, last = s["layers"]
            gpus = ",".join(map(str, s["gpu_indices"])) or "-"
            role = "head" if s["rank"] == 0 else ("worker, up" if s["up"] else "worker")
            lines.append(
                f"    stage {s['rank']}  {s['node_id']:14} GPU {gpus:5} layers "
                f"{first}-{last - 1}  ({role})"
            )
    return _emit(args, c, "\n".join(lines))


async def cluster_scale(args: argparse.Namespace) -> int:
    c = await call(args, "cluster.scale", {"name": args.name, "replicas": args.replicas})
    if args.wait:
        c = await _wait_settled(args, args.name)
        return _emit(args, c, f"scaled {args.name} to {args.replicas} replicas, all ready")
    return _emit(args, c, f"scaled {args.name} to {args.replicas} replicas")


async def cluster_delete(args: argparse.Namespace) -> int:
    data = await call(args, "cluster.delete", {"name": args.name})
    return _emit(args, data, f"deleted cluster {args.name}")


_NODE_VERB_DONE = {
    "drain": "draining",
    "undrain": "undrained",
    "remove": "removed",
    "uncordon": "uncordoned",
}


async def node_verb(args: argparse.Namespace) -> int:
    verb = args.node_command
    data = await call(args, f"node.{verb}", {"node_id": args.node})
    return _emit(args, data, f"{_NODE_VERB_DONE[verb]} {args.node}")


async def node_cordon(args: argparse.Namespace) -> int:
    from events.contract.messages import parse_until

    from .scheduler import cordon_end

    try:
        until_ns = parse_until(args.until, time.time_ns()) if args.until else 0
    except ValueError as exc:
        raise CommandFailed(str(exc).replace("until: ", "--until: ", 1)) from None
    body = {"node_id": args.node, "until_ns": until_ns, "reason": args.reason}
    data = await call(args, "node.cordon", body)
    why = f": {data['reason']}" if data.get("reason") else ""
    return _emit(args, data, f"cordoned {args.node} until {cordon_end(until_ns)}{why}")


async def list_nodes(args: argparse.Namespace) -> int:
    if args.drain:
        data = await call(args, "node.drain", {"node_id": args.drain})
        return _emit(args, data, f"draining {args.drain}")
    nodes = await call(args, "node.list", {})
    return _emit(args, with_gpu_families(nodes), nodes_table(nodes, time.time_ns()))


def with_gpu_families(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`node.list`'s nodes with each GPU's `family` beside its `model` (the name NVML
    reports): added, so `--json` readers of the fields before keep working."""
    for n in nodes:
        n["gpus"] = [{**g, "family": family(g.get("model", ""))} for g in n.get("gpus", [])]
    return nodes


def nodes_table(nodes: list[dict[str, Any]], now_ns: int) -> str:
    if not nodes:
        return "no nodes"
    head = (
        f"{'NODE':16} {'HEALTH':10} {'REASON':18} {'REGION':10} {'GPUS':>4}  {'MAX TEMP':8}  MODEL"
    )
    rows = [head]
    for n in nodes:
        temps = [g.get("temperature_c", 0.0) for g in n["metrics"]]
        hottest = f"{max(temps):.0f} C" if temps else "-"
        state = n["health"] + (" (drained)" if n["drained"] else "")
        until = n.get("cordoned_until_ns", 0)
        if until < 0 or until > now_ns:
            state += " (cordoned)"
        rows.append(
            f"{n['node_id']:16} {state:10} {n['health_reason']:18} "
            f"{n['region'] or '-':10} {len(n['gpus']):>4}  {hottest:8}  {gpu_models(n['gpus'])}"
        )
    return "\n".join(rows)


def gpu_models(gpus: list[dict[str, Any]]) -> str:
    """`2x H100 (NVIDIA H100 80GB HBM3)`: each model's family, then the name NVML reports
    where it differs; `-` for none."""
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g.get("model", "")] = counts.get(g.get("model", ""), 0) + 1
    parts = []
    for model, count in counts.items():
        short = family(model)
        raw = f" ({model})" if model != short else ""
        parts.append(f"{count}x {short}{raw}")
    return ", ".join(parts) or "-"
